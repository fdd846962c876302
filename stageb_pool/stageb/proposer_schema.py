"""The JSON schema a constrained proposer answer is held to (``rule_search.constrain_proposer``).

Built from the current guidance and the profile's verdict words, so the grammar itself rules
out what the validation filters would reject for form alone (an unknown op, a target that is
not an existing rule's signature, removing or merging G0, too many operations, a rule that
does not conclude with a verdict word, an over-long string); what a rule *says* is still
judged by ``rule_text``. A merge that names one rule twice passes the grammar (llguidance
implements no ``uniqueItems``); the candidate validation rejects it.

Without the schema, small models rarely produce a usable answer (docs/performance.md).
"""

from __future__ import annotations

from .guidance import LEARNABLE_KEY
from .rule_text import normalize_signature
from .text import regex_literal

# A rule is one sentence, its rationale another: long enough for any real rule (the shipped
# seed rules are under 120 characters), short enough that two operations fit a few hundred
# tokens even for a model that runs every string to its limit.
TEXT_MAX_CHARS = 160
RATIONALE_MAX_CHARS = 120
# Compact JSON (llguidance's option): no token is spent on indentation or line breaks.
_COMPACT = {"whitespace_flexible": False}


def _line(max_chars: int, *, banned: str = "{}", ending: str = "") -> dict:
    """A JSON string of one line of at most ``max_chars`` characters (``ending`` included,
    a regex of its own length) that starts with no space and holds none of ``banned``."""
    free = f"[^\\n\\r{banned}]"
    return {"type": "string", "pattern": f"^[^\\s{banned}]{free}{{0,{max_chars - 1}}}{ending}$"}


# A rule holds no braces (a pasted summary object), '=' (key=value chains), '_' (field names
# and image_1 references) or angle brackets (markup): the prompt forbids them, the filters
# reject most of them, and a small model copies them from the examples.
_RULE_BANNED = "{}=_<>"


def verdict_ending(vocab) -> str:
    """A rule concludes with its verdict, as the proposer prompt asks ("If <condition>, judge
    fail."): one of the profile's verdict words as a word of its own (after a space for
    Latin words, so never "refail"), then an optional full stop."""
    words = "|".join((" " if w[:1].isascii() else "") + regex_literal(w) for w in (vocab.pass_text, vocab.fail_text))
    return f"({words})[.。]?"


def _operation(op: str, fields: dict) -> dict:
    properties = {"op": {"const": op}, **fields, "rationale": _line(RATIONALE_MAX_CHARS)}
    return {"type": "object", "properties": properties, "required": list(properties),
            "additionalProperties": False}


def proposer_schema(guidance, vocab, *, max_operations: int) -> dict:
    """The schema of ``{"operations": [...]}`` with 1 to ``max_operations`` entries, each one
    of the operations the guidance allows (docs/formats.md; an operation without a possible
    target is left out). Property order is the order the model writes them in."""
    experiences = dict(getattr(guidance, "experiences", guidance))
    learnable = sorted(k for k in experiences if LEARNABLE_KEY.match(k))
    signatures = {k: normalize_signature(experiences[k]) for k in learnable}
    updatable = _unique(signatures[k] for k in learnable)
    removable = _unique(signatures[k] for k in learnable if k != "G0")
    text = _line(TEXT_MAX_CHARS, banned=_RULE_BANNED, ending=verdict_ending(vocab))
    choices = [_operation("upsert", {"text": text})]
    if updatable:
        choices.append(_operation("update", {"target_signature": {"enum": updatable}, "text": text}))
    if len(removable) >= 2:
        targets = {"type": "array", "items": {"enum": removable}, "minItems": 2, "maxItems": len(removable)}
        choices.append(_operation("merge", {"target_signatures": targets, "text": text}))
    if removable:
        choices.append(_operation("remove", {"target_signature": {"enum": removable}}))
    operations = {"type": "array", "items": {"anyOf": choices}, "minItems": 1, "maxItems": max(1, max_operations)}
    return {"type": "object", "properties": {"operations": operations}, "required": ["operations"],
            "additionalProperties": False, "x-guidance": _COMPACT}


def _unique(values) -> list[str]:
    return [v for v in dict.fromkeys(values) if v]
