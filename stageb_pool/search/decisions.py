"""What each iteration decided and why (its ``rule_search_iterations.jsonl`` row and terminal
line) and the summary's ``why`` sentence, so that "0 edits accepted" tells a gate that rejected
real candidates from a proposer that gave nothing usable or a judge that cannot separate the labels.
"""

from __future__ import annotations

import re
from collections import Counter

from ..artifact_rows import IterationRow
from ..stageb.text import short
from .summary import brief


# Specifics after these marks (a quoted word, a target, a rule key) are dropped, so that
# rejections count by kind: "duplicate of existing rule G3" -> "duplicate of existing rule".
_SPECIFICS = re.compile(r"[:'\"]| [GS]\d")


def reason_kind(reason: str) -> str:
    return _SPECIFICS.split(reason, maxsplit=1)[0].strip() or reason


def iteration_row(outcome, mission: str) -> IterationRow:
    evaluated = outcome.candidates
    best = _best(outcome)
    if outcome.applied is not None:
        decision = "accepted"
    else:
        decision = "rejected" if evaluated else "no_candidates"
    reasons = [f"{_name(c)}: {_verdict(c)}" for c in evaluated]
    if not evaluated:
        reasons = _why_nothing(outcome)
    return IterationRow(
        iteration=outcome.iteration, mission=mission, guidance_step=outcome.guidance.step,
        guidance_hash=outcome.guidance.hash, proposer_calls=len(outcome.proposers),
        proposer_parsed=sum(a.parsed for a in outcome.proposers),
        candidates_proposed=len(outcome.rejections) + len(evaluated),
        candidates_rejected=dict(sorted(Counter(reason_kind(r) for r in outcome.rejections).items())),
        candidates_evaluated=len(evaluated), decision=decision,
        accepted_candidate=outcome.applied.candidate.candidate_id if outcome.applied is not None else None,
        reasons=reasons,
        baseline={"train": brief(outcome.base_metrics), "eval": brief(outcome.eval_base_metrics)},
        best_candidate=None if best is None else {
            "candidate_id": best.candidate.candidate_id, "train": brief(best.train_metrics),
            "eval": brief(best.eval_metrics), "relative_error_reduction": best.gate.relative_error_reduction,
            "reason": best.reason},
        guidance_step_after=outcome.new_guidance.step,
    )


def _best(outcome):
    if outcome.applied is not None:
        return outcome.applied
    # max() keeps the first of equal values: the earliest wins ties, as the gate's choice.
    return max(outcome.candidates, key=lambda c: c.gate.relative_error_reduction, default=None)


def _verdict(c) -> str:
    return "accepted" if c.applied else c.reason or "passed the gate, but another candidate had a larger RER"


def _name(c) -> str:
    return f"cand{c.index} {short(c.candidate.candidate_id, 60)}"


def _why_nothing(outcome) -> list[str]:
    """Why no candidate reached the A/B test: the proposer's part, then the ablation's."""
    answer = outcome.proposer
    if not outcome.pool_keys or outcome.base_metrics.n == 0:
        return ["every train ticket was dropped as overlength"]
    if answer is None:
        why = ["no proposer call: the baseline got every train ticket right"]
    elif not answer.parsed:
        why = [f"proposer answer unusable: {answer.error}"]
    elif answer.operations == 0:
        why = ["the proposer answer held no operation"]
    else:
        why = [f"all {answer.operations} proposer operation(s) rejected: "
               + ", ".join(f"{n} {kind}" for kind, n in Counter(map(reason_kind, outcome.rejections)).items())]
    if outcome.ablation_note:
        why.append(outcome.ablation_note)
    return why


def iteration_line(row: IterationRow) -> str:
    """One terminal line, e.g. ``iteration 2: proposer answer parsed; 2 proposed, ...``."""
    if row.proposer_calls == 0:
        proposer = "no proposer call"
    else:
        proposer = "proposer answer parsed" if row.proposer_parsed else "proposer answer unusable"
    parts = [f"{row.candidates_proposed} proposed"]
    rejected = sum(row.candidates_rejected.values())
    if rejected:
        kinds = ", ".join(f"{n} {k}" if n > 1 else k for k, n in row.candidates_rejected.items())
        parts.append(f"{rejected} rejected ({short(kinds, 120)})")
    acc = f"train acc {_acc(row.baseline.get('train'))}"
    if row.decision == "no_candidates":
        return f"iteration {row.iteration}: {proposer}; {', '.join(parts)}: no candidates ({'; '.join(row.reasons)}); {acc}"
    best = row.best_candidate or {}
    if row.decision == "accepted":
        verdict = f"accepted {short(row.accepted_candidate or '', 60)} (RER {best.get('relative_error_reduction', 0):.3f})"
    else:
        verdict = f"rejected ({best.get('reason')})"
    parts.append(f"{row.candidates_evaluated} evaluated: {verdict}")
    return f"iteration {row.iteration}: {proposer}; {', '.join(parts)}; {acc} -> {_acc(best.get('train'))}"


def _acc(metrics: dict | None) -> str:
    return f"{metrics['acc']:.3f}" if metrics else "-"


def run_sentence(rows: list[dict], *, edits: int, stop_reason: str | None, headroom: dict | None = None) -> str:
    """The summary's ``why``; ``rows`` are read back from the artifact so a resumed run counts them all."""
    n = len(rows)
    evaluated = sum(r["candidates_evaluated"] for r in rows)
    parsed = sum(r["proposer_parsed"] for r in rows)
    calls = sum(r["proposer_calls"] for r in rows)
    proposer = f"{parsed} of {calls} proposer answers parsed"
    if edits:
        accepted = [r for r in rows if r["decision"] == "accepted"]
        names = ", ".join(f"{short(r['accepted_candidate'], 50)} (iteration {r['iteration']}, RER "
                          f"{r['best_candidate']['relative_error_reduction']:.3f})" for r in accepted)
        return (f"{edits} edit(s) accepted in {n} iteration(s) because they passed the gate on the A/B rollouts: "
                f"{names}; {evaluated} candidate(s) evaluated, {proposer}.")
    if evaluated:
        best = max((r["best_candidate"] for r in rows if r["best_candidate"]),
                   key=lambda b: b["relative_error_reduction"])
        reason = best.get("reason") or ""
        if not reason.startswith("RER"):  # the RER passed; another condition failed
            reason = f"RER {best['relative_error_reduction']:.3f} but {reason}"
        why = (f"no edit accepted in {n} iteration(s): none of the {evaluated} A/B-evaluated candidate(s) "
               f"passed the gate (best: {reason}); {proposer}")
    else:
        why = f"no edit accepted in {n} iteration(s): no candidate reached the A/B test ({proposer})"
    if headroom and headroom.get("separates") is False:
        why += (f"; the judge cannot separate the labels (AUC {_auc(headroom)}), so no rule was expected "
                "to help")
    elif headroom and headroom.get("separates") is None:  # the sample held one label only
        why += "; the judge headroom was not measured (its AUC needs tickets of both labels)"
    if stop_reason == "early_stop":
        why += "; stopped early"
    return why[0].upper() + why[1:] + "."


def _auc(headroom: dict) -> str:
    auc = headroom.get("auc")
    return f"{auc:.2f}" if isinstance(auc, (int, float)) else "n/a"
