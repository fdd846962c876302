"""The rule proposer's pure parts (upstream 3.4 step 5-7 and 3.5).

* :func:`select_examples` picks the most confidently wrong tickets of a baseline rollout;
* :func:`build_proposer_prompt` turns them into a :class:`ProposerPrompt` (system text,
  user head, examples, user tail), sent as a chat request whose examples the worker drops
  from the end until the prompt fits its token budget;
* :func:`extract_json` finds the first parseable JSON in the answer;
* :func:`parse_candidates` applies every validation filter and names the reason of each
  rejection; :func:`ablation_candidates` fills up with ``remove`` candidates.

Differences from upstream, on purpose:

* Traditional -> Simplified Chinese conversion is skipped (``zhconv`` is not a
  dependency; upstream also ran without it when it was not installed).
* The Stage-A leak filter catches ``image1``-style text (upstream's ``image\\d`` pattern
  was a raw string matching a literal backslash) and ``复核`` in object chains.
* Target resolution (update/remove/merge) happens here with a logged reason instead of
  a silent skip during evaluation; every rejection is returned as a row.
* English word lists sit next to the Chinese ones so the generic profile is filtered too;
  the binary-outcome check uses the verdict words of the profile's vocabulary.
* Reflection ids are a hash of their inputs, not ``uuid4``.
"""

from __future__ import annotations

import hashlib
import json
import re
from typing import Iterable, Mapping, Sequence

import msgspec

from .guidance import LEARNABLE_KEY, OPERATIONS, SCAFFOLD_KEY, Operation
from .summaries import extract_summary_json
from .text import CJK_CHAR, normalize_spaces

# --------------------------------------------------------------------------- text normalisation

_SIGNATURE_PUNCT = re.compile(r"[，,。.!！？;；:：\-—_()（）\[\]{}<>《》“”\"'·~]")


def normalize_signature(text: str | None) -> str:
    """The identity of a rule text for de-duplication and targeting (upstream 3.5):
    spaces normalised, lower-cased, 如果/当 -> 若, 就 -> 则, punctuation -> space,
    spaces normalised again, stripped."""
    value = normalize_spaces(text or "").lower()
    value = value.replace("如果", "若").replace("当", "若").replace("就", "则")
    value = _SIGNATURE_PUNCT.sub(" ", value)
    return normalize_spaces(value).strip()


def _check_form(text: str) -> str:
    """Form used by the word-list filters: spaces normalised, lower-cased, ``_``/``-`` as spaces."""
    value = normalize_spaces(text or "").lower().replace("_", " ").replace("-", " ")
    return normalize_spaces(value)


# --------------------------------------------------------------------------- example selection

def confidently_wrong(stats: Mapping | Iterable) -> list:
    """The tickets whose valid majority differs from GT, most confidently wrong first.

    Sorted by ``(hard_wrong, difficulty)`` descending; the sort is stable, so ties keep
    the given (pool or run) order. The one definition behind the proposer's examples and
    the hard-case rows of the audit and the rule search.
    """
    rows = list(stats.values()) if isinstance(stats, Mapping) else list(stats)
    wrong = [s for s in rows if s.majority is not None and s.majority != s.gt_label]
    wrong.sort(key=lambda s: (s.hard_wrong, s.difficulty), reverse=True)
    return wrong


def select_examples(stats: Mapping | Iterable, tickets_by_key: Mapping, reflect_size: int) -> list[tuple]:
    """The ``reflect_size`` most confidently wrong tickets (:func:`confidently_wrong`) as
    ``(TicketStats, Ticket)`` pairs. Keys without a ticket in ``tickets_by_key`` are skipped.
    """
    picked = [(s, tickets_by_key[s.key]) for s in confidently_wrong(stats) if s.key in tickets_by_key]
    return picked[:max(0, int(reflect_size))]


# --------------------------------------------------------------------------- request

_TEXTS = {
    "zh": {
        "mission": "任务",
        "intro": "以下为用于提出候选规则的错例样本（仅供提案，不用于最终评估）：",
        "sample": "样本",
        "close": "请基于上述错例样本提出候选规则。只输出 JSON。",
    },
    "en": {
        "mission": "Mission",
        "intro": "The mismatch samples below are for proposing candidate rules only (not for final evaluation):",
        "sample": "Sample ",
        "close": "Propose candidate rules based on the mismatch samples above. Output JSON only.",
    },
}


def proposer_language(vocab) -> str:
    """``"zh"`` when the profile's verdict words are Chinese, else ``"en"``."""
    words = f"{getattr(vocab, 'pass_text', '')}{getattr(vocab, 'fail_text', '')}"
    return "zh" if CJK_CHAR.search(words) else "en"


def _experiences(guidance) -> dict[str, str]:
    return dict(getattr(guidance, "experiences", guidance))


def _pair(example) -> tuple:
    """(stats, ticket) from a pair in either order."""
    a, b = example
    return (b, a) if hasattr(a, "per_image") else (a, b)


def render_example(number: int, stats, ticket, lang: str = "zh") -> str:
    """One ``样本{n}`` block: the ticket, GT, baseline vote and raw summaries by image number."""
    t = _TEXTS[lang]
    lines = [
        f"{t['sample']}{number}: ticket_key={ticket.key}; gt_label={ticket.label}; "
        f"baseline_majority={stats.majority}; agreement={stats.agreement:.3f}; difficulty={stats.difficulty:.3f}",
        "stage_a_summaries:",
    ]
    for key in sorted(ticket.per_image):  # upstream's string order: image_10 before image_2
        lines.append(f"  - {key}: {ticket.per_image[key]}")
    return "\n".join(lines)


def render_head(mission: str, guidance, lang: str = "zh") -> str:
    """Mission, G0, the scaffold block, the modifiable rules with their signatures, intro."""
    t = _TEXTS[lang]
    exp = _experiences(guidance)
    lines = [f"{t['mission']}: {mission}", f"G0: {exp.get('G0', '')}"]
    scaffold = [f"[{k}]. {v}" for k, v in sorted(exp.items()) if k.startswith("S")]
    rules = [f"[{k}] signature={normalize_signature(v)} | {v}" for k, v in sorted(exp.items())
             if k.startswith("G") and k != "G0"]
    if scaffold:
        lines += ["", "SCAFFOLD (S*):", *scaffold]
    if rules:
        lines += ["", "EXISTING_RULES (modifiable G*, G0 is non-removable):", *rules]
    lines += ["", t["intro"]]
    return "\n".join(lines)


class ProposerPrompt(msgspec.Struct, frozen=True):
    """The proposer's messages: ``system``, and a user message that is ``user_head``, the
    ``examples`` and ``user_tail`` joined with blank lines (upstream 3.5)."""

    system: str
    user_head: str
    examples: list[str]
    user_tail: str


def build_proposer_prompt(system_prompt: str, mission: str, guidance, examples: Sequence, *,
                          lang: str = "zh") -> ProposerPrompt:
    """The proposer prompt (upstream 3.5 user message), examples as separate strings.

    ``examples`` are ``(TicketStats, Ticket)`` pairs from :func:`select_examples` (either
    order). Joined with blank lines, head + examples + tail is upstream's user message.
    ``lang="en"`` translates the labels of the user message for English profiles.
    """
    blocks = [render_example(i, *_pair(ex), lang=lang) for i, ex in enumerate(examples, start=1)]
    return ProposerPrompt(system=system_prompt, user_head=render_head(mission, guidance, lang), examples=blocks,
                          user_tail=_TEXTS[lang]["close"])


# --------------------------------------------------------------------------- JSON extraction

_FENCE = re.compile(r"```(?:json)?\s*([\s\S]*?)\s*```", re.IGNORECASE)


def _balanced_span(text: str, start: int) -> str | None:
    """The bracket-balanced span opening at ``start`` (strings and escapes respected)."""
    stack = [text[start]]
    in_string = escape = False
    for i in range(start + 1, len(text)):
        ch = text[i]
        if in_string:
            if escape:
                escape = False
            elif ch == "\\":
                escape = True
            elif ch == '"':
                in_string = False
        elif ch == '"':
            in_string = True
        elif ch in "{[":
            stack.append(ch)
        elif ch in "}]":
            if (stack[-1] == "{") != (ch == "}"):
                return None
            stack.pop()
            if not stack:
                return text[start:i + 1]
    return None


def _openers(text: str, limit: int) -> list[int]:
    return [i for i, ch in enumerate(text) if ch in "{["][:limit]


def json_candidates(text: str) -> list[str]:
    """Upstream's candidate spans in order: fenced blocks, balanced spans from the first six
    openers, the widest ``{...}`` and ``[...]`` spans, the whole text; de-duplicated."""
    raw = normalize_spaces(text or "").strip()
    spans: list[str] = []
    for m in _FENCE.finditer(raw):
        block = m.group(1).strip()
        if not block:
            continue
        found = next((s for s in (_balanced_span(block, i) for i in _openers(block, 3)) if s), None)
        spans.append(found or block)
    spans += [s for s in (_balanced_span(raw, i) for i in _openers(raw, 6)) if s]
    for open_, close in ("{}", "[]"):
        if open_ in raw and close in raw and raw.find(open_) < raw.rfind(close):
            spans.append(raw[raw.find(open_):raw.rfind(close) + 1])
    if raw[:1] + raw[-1:] in ("{}", "[]"):
        spans.append(raw)
    return list(dict.fromkeys(s.strip() for s in spans if s.strip()))


def extract_json(text: str | None) -> object:
    """The first candidate span that ``json.loads`` accepts; ValueError says why none did."""
    if not text or not text.strip():
        raise ValueError("empty response")
    spans = json_candidates(text)
    if not spans:
        raise ValueError("no JSON object or array in the response")
    last = None
    for span in spans:
        try:
            return json.loads(span)
        except ValueError as err:
            last = err
    raise ValueError(f"no valid JSON in the response ({len(spans)} candidate spans; last error: {last})")


# --------------------------------------------------------------------------- validation filters

THIRD_STATE = (
    "复核", "人工复核", "第三态", "待定", "证据不足", "不应直接", "不建议直接", "不得直接", "佐证",
    "需进一步", "需要进一步", "进一步确认", "不写不通过", "通过但",
    "review needed", "needs review", "need review", "manual review", "human review", "further confirmation",
    "further verification", "further review", "uncertain", "undetermined", "to be determined", "third state",
    "insufficient evidence", "pass but", "should not directly",
)
HEDGED_NEGATION = (
    "不应判定为", "不应判断为", "不应判为", "不建议判定为", "不建议判断为", "不建议判为",
    "不要判定为", "不要判断为", "不得判定为", "不得判断为",
    "should not be judged", "should not be determined", "should not be marked", "should not be rated",
    "should not judge", "not recommended to judge", "do not judge", "must not be judged", "must not judge",
    "do not directly",
)
_LEAK_MARKERS = ("image_", "备注:", "标签/", "类别=", "remark:", "label/", "category=")
_OBJECT_CHAIN = (
    "显示完整", "只显示部分", "完整", "部分", "符合要求", "不符合要求", "符合", "不符合", "合格", "不合格",
    "无法判断", "复核", "complete", "partial", "compliant", "non compliant", "qualified", "unqualified",
    "cannot judge",
)
_IMAGE_REF = re.compile(r"image\s*_?\s*\d")
SCAFFOLD_ANCHORS = (
    "全局图", "局部图", "证据", "覆盖", "缺失", "必须", "不得", "禁止", "无法确认", "只显示部分", "显示完整",
    "可见性=部分", "可见性=完整", "关键点",
    "global view", "close up", "evidence", "coverage", "missing", "must", "forbidden", "cannot confirm",
    "partially visible", "fully visible", "key point",
)
_BRAND = ("brand", "品牌")
_EXTRA_FAIL = ("判不通过", "不能通过", "cannot pass", "not pass", "does not pass")


def _is_json_object(text: str) -> bool:
    if not text.startswith("{"):
        return False
    try:
        return isinstance(json.loads(text), dict)
    except (ValueError, RecursionError):
        return False


def is_stage_a_leak(text: str) -> bool:
    """Pasted Stage-A summary text: a summary object anywhere in the text (a header line
    before it, inside a sentence, on the last line, or a ``统计=[...]`` assignment: what the
    prompt's summary parser would read as one), any JSON object, ``标签/``, an image
    reference (``image_3``, ``image3``, ``Image 3``), or ``/``-joined object chains."""
    stripped = (text or "").strip()
    if extract_summary_json(stripped) is not None or _is_json_object(stripped):
        return True
    lowered = stripped.lower()
    if "标签/" in lowered or "image_" in lowered or _IMAGE_REF.search(lowered):
        return True
    slashes = lowered.count("/")
    chain = any(word in lowered.replace("-", " ") for word in _OBJECT_CHAIN)
    marked = any(marker in lowered for marker in _LEAK_MARKERS)
    return (slashes >= 2 and chain) or (marked and slashes >= 1 and chain)


def _first_hit(text: str, words: Iterable[str]) -> str | None:
    form = _check_form(text)
    return next((w for w in words if w in form), None)


def _has_word(form: str, word: str) -> bool:
    """Substring for CJK words; for Latin words the match must start a word (pass, passes)."""
    word = word.lower()
    if CJK_CHAR.search(word):
        return word in form
    return re.search(rf"(?<![a-z]){re.escape(word)}", form) is not None


def _verdict_words(vocab) -> tuple[list[str], list[str]]:
    if vocab is None:  # no profile given: accept either language
        return ["通过", "pass"], ["不通过", "fail"]
    return [vocab.pass_text], [vocab.fail_text]


def _polarity(text: str, vocab) -> tuple[bool, bool]:
    """(concludes fail, concludes pass) of a rule text."""
    form = _check_form(text)
    pass_words, fail_words = _verdict_words(vocab)
    fail_terms = [w.lower() for w in fail_words] + list(_EXTRA_FAIL)
    says_fail = any(_has_word(form, w) for w in fail_terms)
    for term in sorted(fail_terms, key=len, reverse=True):
        form = form.replace(term, " ")
    says_pass = any(_has_word(form, w) for w in pass_words)
    return says_fail, says_pass


def is_binary(text: str, vocab=None) -> bool:
    """The rule concludes with a verdict word of the profile (通过/不通过 or pass/fail)."""
    form = _check_form(text)
    pass_words, fail_words = _verdict_words(vocab)
    return any(_has_word(form, w) for w in pass_words + fail_words)


def scaffold_conflict(text: str, scaffold: Mapping[str, str], vocab=None) -> str | None:
    """The key of a scaffold rule that shares an anchor word with ``text`` but concludes
    only the opposite verdict (scaffold fail vs candidate pass-only, or the reverse)."""
    form = _check_form(text)
    anchors = {a for a in SCAFFOLD_ANCHORS if a in form}
    if not anchors:
        return None
    c_fail, c_pass = _polarity(text, vocab)
    for key, s_text in sorted(scaffold.items()):
        s_form = _check_form(s_text)
        if not any(a in s_form for a in anchors):
            continue
        s_fail, s_pass = _polarity(s_text, vocab)
        if (s_fail and c_pass and not c_fail) or (s_pass and c_fail and not c_pass):
            return key
    return None


def text_problem(text: str, *, scaffold: Mapping[str, str], vocab=None, dimension: str | None = None) -> str | None:
    """The first filter a rule text fails (upstream order), or None."""
    if is_stage_a_leak(text):
        return "Stage-A summary leak"
    hit = _first_hit(text, THIRD_STATE)
    if hit:
        return f"third-state wording {hit!r}"
    hit = _first_hit(text, HEDGED_NEGATION)
    if hit:
        return f"hedged negation {hit!r}"
    if not is_binary(text, vocab):
        pass_words, fail_words = _verdict_words(vocab)
        return f"no binary outcome (needs {'/'.join(pass_words + fail_words)})"
    key = scaffold_conflict(text, scaffold, vocab)
    if key:
        return f"conflicts with scaffold {key}"
    if dimension and any(b in _check_form(dimension) for b in _BRAND):
        return "brand dimension"
    return None


# --------------------------------------------------------------------------- candidates

class Candidate(msgspec.Struct):
    """One validated edit. ``signature`` is the rule text's signature (the target's for
    ``remove``, as in upstream rows); ``operation`` has the resolved keys."""

    candidate_id: str
    op: str
    text: str | None
    rationale: str | None
    signature: str
    target_signature: str | None
    target_signatures: list[str]
    source: str  # "proposer" | "ablation"
    operation: Operation


def candidate_id(op: str, signature: str, target: str | None = None, targets: Sequence[str] = ()) -> str:
    """``upsert:{sig}``, ``update:{t}:{sig}``, ``remove:{t}``, ``merge:{t1,t2}:{sig}``."""
    if op == "upsert":
        return f"upsert:{signature}"
    if op == "update":
        return f"update:{target}:{signature}"
    if op == "remove":
        return f"remove:{target}"
    return f"merge:{','.join(targets)}:{signature}"


def reflection_id(*parts) -> str:
    """12 hex digits of sha256 over the parts, e.g. ``(guidance_hash, iteration, candidate_id)``:
    deterministic, unlike upstream's uuid4."""
    return hashlib.sha256("/".join(str(p) for p in parts).encode()).hexdigest()[:12]


def _operations_list(obj) -> list:
    if not isinstance(obj, dict):
        raise ValueError(f"the proposer must return a JSON object, got {type(obj).__name__}")
    ops, rules = obj.get("operations"), obj.get("rules")
    if ops is not None and rules is not None:
        raise ValueError("the proposer returned both 'operations' and 'rules'")
    entries = ops if ops is not None else rules
    name = "operations" if ops is not None else "rules"
    if entries is None:
        raise ValueError("the proposer JSON has neither 'operations' nor 'rules'")
    if not isinstance(entries, list):
        raise ValueError(f"'{name}' must be a list")
    return entries


def _clean(value) -> str:
    return str(value).strip() if value is not None else ""


def _resolve(op: str, target: str, targets: list[str], lookup: dict[str, str]):
    """(key, merged_from) or a rejection reason string."""
    if op in ("update", "remove"):
        key = lookup.get(target)
        if key is None:
            return f"target signature not found: {target!r}"
        if SCAFFOLD_KEY.match(key):
            return f"target {key} is a read-only scaffold rule"
        if op == "remove" and key == "G0":
            return "G0 cannot be removed"
        if not LEARNABLE_KEY.match(key):
            return f"target {key} is not a learnable rule"
        return key, []
    keys: list[str] = []
    for sig in targets:
        key = lookup.get(sig)
        if key is None:
            return f"merge target signature not found: {sig!r}"
        if key == "G0" or not LEARNABLE_KEY.match(key):
            return f"merge target {key} cannot be merged"
        if key not in keys:
            keys.append(key)
    if len(keys) < 2:
        return "merge needs at least 2 distinct rules"
    return keys[0], keys[1:]


def _entry_targets(op: str, entry: dict):
    """(target_signature, target_signatures) or a rejection reason string."""
    if op in ("update", "remove"):
        target = normalize_signature(_clean(entry.get("target_signature")))
        return (target, []) if target else "missing target_signature"
    if op == "merge":
        raw = entry.get("target_signatures")
        if not isinstance(raw, list):
            return "merge needs a target_signatures list"
        targets = [t for t in (normalize_signature(_clean(x)) for x in raw if x is not None) if t]
        return (None, targets) if len(targets) >= 2 else "merge needs at least 2 target_signatures"
    return None, []


class _Seen:
    """What earlier entries of the same response already claimed."""

    def __init__(self):
        self.signatures: set[str] = set()
        self.ids: set[str] = set()


def _check_entry(entry, ctx: dict, seen: _Seen, evidence: Sequence[str]) -> Candidate | str:
    """One proposer entry -> a Candidate, or the reason it is rejected (upstream order)."""
    if not isinstance(entry, dict):
        return "entry is not an object"
    op = _clean(entry.get("op")).lower() if entry.get("op") is not None else "upsert"
    if op not in OPERATIONS:
        return f"unknown op {op!r}"
    targets = _entry_targets(op, entry)
    if isinstance(targets, str):
        return targets
    target, target_list = targets
    text = _clean(entry.get("text"))
    signature = ""
    if op != "remove":
        if not text:
            return "missing text"
        problem = text_problem(text, scaffold=ctx["scaffold"], vocab=ctx["vocab"],
                               dimension=_clean(entry.get("dimension")))
        if problem:
            return problem
        signature = normalize_signature(text)
        if not signature:
            return "empty signature"
        if signature in ctx["existing"]:
            return f"duplicate of existing rule {ctx['existing'][signature]}"
        if signature in seen.signatures:
            return "duplicate signature within the response"
        seen.signatures.add(signature)
    resolved = _resolve(op, target, target_list, ctx["lookup"]) if op != "upsert" else (None, [])
    if isinstance(resolved, str):
        return resolved
    key, merged_from = resolved
    cid = candidate_id(op, signature, target, target_list)
    if cid in ctx["rejected"]:
        return "previously rejected candidate"
    if cid in seen.ids:
        return "duplicate candidate"
    seen.ids.add(cid)
    rationale = _clean(entry.get("rationale")) or None
    return Candidate(
        candidate_id=cid, op=op, text=text or None, rationale=rationale,
        signature=signature if op != "remove" else target, target_signature=target,
        target_signatures=target_list, source="proposer",
        operation=Operation(op=op, key=key, text=text or None, rationale=rationale, evidence=list(evidence),
                            merged_from=list(merged_from)),
    )


def parse_candidates(
    obj, guidance, *, vocab=None, rejected_ids: Iterable[str] = (), limit: int = 3, evidence: Sequence[str] = (),
) -> tuple[list[Candidate], list[dict]]:
    """Validate the proposer's JSON (upstream 3.5) into at most ``limit`` candidates.

    Returns ``(accepted, rejections)``; each rejection is ``{"index", "op", "text",
    "reason"}`` for ``rule_search_proposer_failures.jsonl``. Entries after the limit is
    reached are not examined. A malformed top level (not an object, both ``operations``
    and ``rules``, not a list) raises ValueError. ``vocab`` is the profile's
    ``VerdictVocab`` (None accepts 通过/不通过 and pass/fail); ``evidence`` (the example
    ticket keys) goes into each operation.
    """
    entries = _operations_list(obj)
    exp = _experiences(guidance)
    ctx = {
        "scaffold": {k: v for k, v in exp.items() if k.startswith("S")},
        "lookup": {normalize_signature(v): k for k, v in exp.items()},
        "existing": {normalize_signature(v): k for k, v in sorted(exp.items(), reverse=True)},
        "rejected": {str(i).strip() for i in rejected_ids},
        "vocab": vocab,
    }
    seen = _Seen()
    accepted: list[Candidate] = []
    rejections: list[dict] = []
    for index, entry in enumerate(entries):
        if len(accepted) >= limit:
            break
        result = _check_entry(entry, ctx, seen, evidence)
        if isinstance(result, Candidate):
            accepted.append(result)
            continue
        fields = entry if isinstance(entry, dict) else {}
        op = fields.get("op")
        rejections.append({"index": index, "op": _clean(op) if op is not None else None,
                           "text": _clean(fields.get("text")) or None, "reason": result})
    return accepted, rejections


def ablation_candidates(guidance, *, rejected_ids: Iterable[str] = (), limit: int = 3) -> list[Candidate]:
    """``remove`` candidates for the learnable rules G1+ (never G0 or S*), lowest metadata
    confidence first (no metadata = 1.0, so learned rules go before seed rules), then key;
    ids in ``rejected_ids`` (pass the ids already proposed this iteration too) skipped."""
    if limit <= 0:
        return []
    exp = _experiences(guidance)
    metadata = getattr(guidance, "metadata", {}) or {}
    rejected = {str(i).strip() for i in rejected_ids}
    scored = []
    for key, text in exp.items():
        if key == "G0" or not LEARNABLE_KEY.match(key):
            continue
        sig = normalize_signature(text)
        cid = candidate_id("remove", "", sig)
        if not sig or cid in rejected:
            continue
        meta = metadata.get(key)
        if meta is None:
            confidence = 1.0
        elif isinstance(meta, dict):
            confidence = float(meta.get("confidence", 1.0))
        else:
            confidence = float(meta.confidence)
        scored.append((confidence, key, sig, cid))
    scored.sort(key=lambda item: (item[0], item[1]))
    return [
        Candidate(candidate_id=cid, op="remove", text=None, rationale="ablation_candidate", signature=sig,
                  target_signature=sig, target_signatures=[], source="ablation",
                  operation=Operation(op="remove", key=key, rationale="ablation_candidate"))
        for _, key, sig, cid in scored[:limit]
    ]
