"""The JSON schema a constrained proposer answer is held to: what validation would reject for
form alone, built from the guidance and verdict words (docs/performance.md). A merge naming one
rule twice passes (llguidance has no ``uniqueItems``); validation rejects it."""

from __future__ import annotations

from .guidance import LEARNABLE_KEY
from .rule_text import normalize_signature
from .text import regex_literal

# One sentence each: above the shipped seed rules (< 120 characters), yet two operations fit a
# few hundred tokens even when a model runs every string to its limit.
TEXT_MAX_CHARS = 160
RATIONALE_MAX_CHARS = 120
# Compact JSON (llguidance's option): no token is spent on indentation or line breaks.
_COMPACT = {"whitespace_flexible": False}


def _line(max_chars: int, *, banned: str = "{}", ending: str = "") -> dict:
    """One line of at most ``max_chars`` (``ending`` included), no leading space, no ``banned``."""
    free = f"[^\\n\\r{banned}]"
    return {"type": "string", "pattern": f"^[^\\s{banned}]{free}{{0,{max_chars - 1}}}{ending}$"}


# Braces, '=', '_' and angle brackets are what a small model copies from the examples (summary
# objects, key=value chains, image_1, markup); the prompt forbids them.
_RULE_BANNED = "{}=_<>"


def verdict_ending(vocab) -> str:
    """A verdict word of its own (after a space for Latin words: never "refail"), optional full stop."""
    words = "|".join((" " if w[:1].isascii() else "") + regex_literal(w) for w in (vocab.pass_text, vocab.fail_text))
    return f"({words})[.。]?"


def _operation(op: str, fields: dict) -> dict:
    properties = {"op": {"const": op}, **fields, "rationale": _line(RATIONALE_MAX_CHARS)}
    return {"type": "object", "properties": properties, "required": list(properties),
            "additionalProperties": False}


def proposer_schema(guidance, vocab, *, max_operations: int) -> dict:
    """1 to ``max_operations`` of the operations the guidance allows, properties in writing order."""
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
