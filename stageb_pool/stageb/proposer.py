"""The rule proposer's pure parts (upstream 3.4 step 5-7 and 3.5): examples, prompt,
candidates validated from the answer, ablation removes. Unlike upstream, targets resolve here
with a logged reason (not a silent skip later), and reflection ids are hashes, not ``uuid4``."""

from __future__ import annotations

import hashlib
from typing import Iterable, Mapping, Sequence

import msgspec

from .answer_json import extract_json  # noqa: F401 - the proposer's API: callers parse answers here
from .guidance import LEARNABLE_KEY, OPERATIONS, SCAFFOLD_KEY, Operation
from .rule_text import copied_identifier, normalize_signature, text_problem
from .text import CJK_CHAR

def confidently_wrong(stats: Mapping | Iterable) -> list:
    """Tickets whose majority differs from GT, by ``(hard_wrong, difficulty)`` descending, ties
    in the given order: the proposer's examples and the audit's and search's hard cases."""
    rows = list(stats.values()) if isinstance(stats, Mapping) else list(stats)
    wrong = [s for s in rows if s.majority is not None and s.majority != s.gt_label]
    wrong.sort(key=lambda s: (s.hard_wrong, s.difficulty), reverse=True)
    return wrong


def select_examples(stats: Mapping | Iterable, tickets_by_key: Mapping, reflect_size: int) -> list[tuple]:
    """The ``reflect_size`` most confidently wrong tickets as ``(TicketStats, Ticket)`` pairs."""
    picked = [(s, tickets_by_key[s.key]) for s in confidently_wrong(stats) if s.key in tickets_by_key]
    return picked[:max(0, int(reflect_size))]


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
    words = f"{getattr(vocab, 'pass_text', '')}{getattr(vocab, 'fail_text', '')}"
    return "zh" if CJK_CHAR.search(words) else "en"


def _experiences(guidance) -> dict[str, str]:
    return dict(getattr(guidance, "experiences", guidance))


def render_example(number: int, stats, ticket, lang: str = "zh") -> str:
    """One ``样本{n}`` block: the ticket, GT, baseline vote and raw summaries."""
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
    """The user message is ``user_head``, ``examples`` and ``user_tail`` joined by blank lines;
    the worker drops examples from the end until it fits its token budget."""

    system: str
    user_head: str
    examples: list[str]
    user_tail: str


def build_proposer_prompt(system_prompt: str, mission: str, guidance, examples: Sequence, *,
                          lang: str = "zh") -> ProposerPrompt:
    """``examples`` are ``(TicketStats, Ticket)`` pairs (``select_examples``)."""
    blocks = [render_example(i, stats, ticket, lang=lang) for i, (stats, ticket) in enumerate(examples, start=1)]
    return ProposerPrompt(system=system_prompt, user_head=render_head(mission, guidance, lang), examples=blocks,
                          user_tail=_TEXTS[lang]["close"])


class Candidate(msgspec.Struct):
    """One validated edit; ``signature`` is the target's for ``remove``, as in upstream rows."""

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
    """12 hex digits of sha256 over the parts, e.g. ``(guidance_hash, iteration, candidate_id)``."""
    return hashlib.sha256("/".join(str(p) for p in parts).encode()).hexdigest()[:12]


def rejected_signatures(rejected_ids: Iterable[str]) -> set[str]:
    """The last ``:``-part of rejected upsert/update/merge ids (a signature never holds ``:``)."""
    out = set()
    for cid in rejected_ids:
        op, _, rest = str(cid).strip().partition(":")
        if op in ("upsert", "update", "merge") and rest:
            out.add(rest.rsplit(":", 1)[-1])
    return out - {""}


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
    """(key, merged_from), or why not."""
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
        # A merge naming a rule twice is refused, never read as the merge of the distinct ones.
        if key in keys:
            return f"merge names rule {key} twice"
        keys.append(key)
    return keys[0], keys[1:]  # at least 2 distinct keys: _entry_targets asks for 2 targets


def _entry_targets(op: str, entry: dict):
    """(target_signature, target_signatures), or why not."""
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
    def __init__(self):
        self.signatures: set[str] = set()
        self.ids: set[str] = set()


def _check_entry(entry, ctx: dict, seen: _Seen, evidence: Sequence[str]) -> Candidate | str:
    """A Candidate, or why the entry is rejected (upstream's checks in upstream's order)."""
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
    # Our own checks, after upstream's so an entry upstream rejects keeps its reason.
    if signature and signature in ctx["rejected_signatures"]:
        return "repeats a rule text rejected earlier in the run"
    if text:
        copied = copied_identifier(text, ticket_keys=evidence, examples_text=ctx["examples_text"])
        if copied:
            return copied
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
    examples_text: str = "",
) -> tuple[list[Candidate], list[dict]]:
    """``(accepted, rejections)``: at most ``limit`` accepted (later entries unexamined), rejections
    ``{"index", "op", "text", "reason"}``; a malformed top level raises ValueError."""
    entries = _operations_list(obj)
    exp = _experiences(guidance)
    ctx = {
        "scaffold": {k: v for k, v in exp.items() if k.startswith("S")},
        "lookup": {normalize_signature(v): k for k, v in exp.items()},
        "existing": {normalize_signature(v): k for k, v in sorted(exp.items(), reverse=True)},
        "rejected": {str(i).strip() for i in rejected_ids},
        "rejected_signatures": rejected_signatures(rejected_ids),
        "examples_text": examples_text,
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
    """``remove`` candidates for G1+, lowest confidence first (no metadata: 1.0, so learned
    rules before seed rules), then key; skips ``rejected_ids`` (include this iteration's)."""
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
        scored.append((1.0 if meta is None else meta.confidence, key, sig, cid))
    scored.sort(key=lambda item: (item[0], item[1]))
    return [
        Candidate(candidate_id=cid, op="remove", text=None, rationale="ablation_candidate", signature=sig,
                  target_signature=sig, target_signatures=[], source="ablation",
                  operation=Operation(op="remove", key=key, rationale="ablation_candidate"))
        for _, key, sig, cid in scored[:limit]
    ]
