"""The functions that build the rule search's rows (their records: ``artifact_rows.py``).

The hard-case and rollout rows are shared with the baseline audit (``audit.py``, which builds
its ``baseline_*`` rows itself).
"""

from __future__ import annotations

from typing import Any

from ..artifact_rows import (BenchmarkRow, CandidateRow, HardCaseRow, ProposerFailureRow, RegressionRow,
                             RolloutRow)
from ..stageb import verdicts
from ..stageb.proposer import confidently_wrong
from .rundir import utc_timestamp

RAW_CHARS = 400  # the proposer answer's prefix and suffix kept in a failure row (upstream)
_BENCH_METRICS = ("acc", "fn_rate", "fp_rate", "fn_over_tp", "fp_over_tp")


def hard_case_rows(stats: dict, *, iteration: int, sampler: str, limit: int, mission: str,
                   guidance_hash: str, now: str | None = None) -> list[HardCaseRow]:
    """The confidently wrong tickets (``proposer.confidently_wrong``: valid majority != GT,
    most confident first, ticket order on ties), cut to ``limit``, ranked from 1."""
    now = utc_timestamp() if now is None else now
    return [
        HardCaseRow(
            timestamp=now, iteration=iteration, mission=mission, sampler=sampler, ticket_key=s.key,
            gt_label=s.gt_label, majority_pred=s.majority, majority_reason=verdicts.majority_reason(s),
            pass_count=s.pass_count, fail_count=s.fail_count, invalid_count=s.invalid_count,
            total_samples=s.total_samples, agreement=s.agreement, difficulty=s.difficulty,
            hard_wrong=s.hard_wrong, verdict_samples=list(s.verdicts), reason_samples=list(s.reasons),
            reason_counts=verdicts.reason_counts(s), rank=rank, guidance_hash=guidance_hash,
        )
        for rank, s in enumerate(confidently_wrong(stats)[:limit], start=1)
    ]


def rollout_rows(result) -> list[RolloutRow]:
    """Every candidate text of a RolloutResult: tickets sorted by key, then decode and sample."""
    rows = []
    for key in sorted(result.rollouts):
        rollout = result.rollouts[key]
        rows += [RolloutRow(ticket_key=key, decode_index=sample.decode_index, sample_index=sample.sample_index,
                            text=sample.text, prompt_tokens=rollout.prompt_tokens,
                            completion_tokens=sample.completion_tokens, finish_reason=sample.finish_reason,
                            token_ids=sample.token_ids, guidance_hash=result.guidance_hash)
                 for sample in rollout.samples]
    return rows


def _identity(candidate, *, null_targets: bool = True) -> dict[str, Any]:
    """The fields that name a candidate, as upstream's rows spell them: ``target_signatures``
    is null unless the candidate is a merge (``null_targets``; benchmarks.jsonl keeps ``[]``)."""
    targets = list(candidate.target_signatures or [])
    return {"signature": candidate.signature, "candidate_id": candidate.candidate_id, "op": candidate.op,
            "target_signature": candidate.target_signature,
            "target_signatures": targets if targets or not null_targets else None}


def candidate_rows(outcome, mission: str) -> list[CandidateRow]:
    """One row per evaluated candidate of an IterationOutcome, in candidate order."""
    base = outcome.base_metrics
    rows = []
    for c in outcome.candidates:
        gr, cm, ec = c.gate, c.train_metrics, c.eval_metrics
        ev = c.eval_base_metrics or outcome.eval_base_metrics
        rows.append(CandidateRow(
            timestamp=utc_timestamp(), iteration=outcome.iteration, candidate_index=c.index, mission=mission,
            **_identity(c.candidate), text=c.candidate.text, rationale=c.candidate.rationale,
            source=c.candidate.source, train_n=base.n, base_acc=base.acc,
            base_false_release_rate=base.false_release_rate, base_false_block_rate=base.false_block_rate,
            cand_acc=cm.acc, cand_false_release_rate=cm.false_release_rate,
            cand_false_block_rate=cm.false_block_rate,
            eval_n=ev.n if ev else 0, eval_base_acc=ev.acc if ev else None,
            eval_base_false_release_rate=ev.false_release_rate if ev else None,
            eval_base_false_block_rate=ev.false_block_rate if ev else None,
            eval_cand_acc=ec.acc if ec else None,
            eval_cand_false_release_rate=ec.false_release_rate if ec else None,
            eval_cand_false_block_rate=ec.false_block_rate if ec else None,
            decision=c.decision, applied=c.applied, reason=c.reason, n_common=gr.n_common,
            relative_error_reduction=gr.relative_error_reduction, changed_fraction=gr.changed_fraction,
            bootstrap_prob=gr.bootstrap_prob, base_fp_rate=gr.base_fp_rate, cand_fp_rate=gr.cand_fp_rate,
            d_fp_rate=gr.d_fp_rate, d_acc=gr.d_acc, eval_acc_drop=c.eval_acc_drop,
            regression_count=gr.regression_count, base_guidance_hash=outcome.guidance.hash,
            cand_guidance_hash=c.guidance.hash, reflection_id=c.reflection_id,
        ))
    return rows


def regression_rows(outcome, mission: str) -> list[RegressionRow]:
    return [
        RegressionRow(
            timestamp=utc_timestamp(), iteration=outcome.iteration, candidate_index=c.index, mission=mission,
            **_identity(c.candidate), decision=c.decision, regression_count=c.gate.regression_count,
            regressions=list(c.gate.regressions), base_guidance_hash=outcome.guidance.hash,
            cand_guidance_hash=c.guidance.hash,
        )
        for c in outcome.candidates if c.gate.regression_count
    ]


def benchmark_row(outcome, mission: str) -> BenchmarkRow:
    """The row of the applied edit of an IterationOutcome (which must have one)."""
    c, g = outcome.applied, outcome.guidance
    base, after, ev = outcome.base_metrics, c.train_metrics, c.eval_base_metrics or outcome.eval_base_metrics
    new_keys = [k for k in c.guidance.experiences if k not in g.experiences]
    return BenchmarkRow(
        timestamp=utc_timestamp(), iteration=outcome.iteration, mission=mission,
        accepted_key=new_keys[0] if c.candidate.op == "upsert" and new_keys else None,
        **_identity(c.candidate, null_targets=False), text=c.candidate.text, rationale=c.candidate.rationale,
        train_n=base.n,
        **{f"base_{k}": getattr(base, k) for k in _BENCH_METRICS},
        **{f"after_{k}": getattr(after, k) for k in _BENCH_METRICS},
        eval_n=ev.n if ev else 0, eval_base_acc=ev.acc if ev else None,
        eval_after_acc=c.eval_metrics.acc if c.eval_metrics else None, eval_acc_drop=c.eval_acc_drop,
        relative_error_reduction=c.gate.relative_error_reduction, changed_fraction=c.gate.changed_fraction,
        bootstrap_prob=c.gate.bootstrap_prob, guidance_step_before=g.step, guidance_step_after=c.guidance.step,
        reflect_ticket_keys=list(outcome.example_keys), reflection_id=c.reflection_id,
        base_guidance_hash=g.hash, guidance_hash=c.guidance.hash,
    )


def failure_row(*, iteration: int, mission: str, examples: int, prompt_tokens: int | None, error: str,
                stage: str, raw: str | None = None, **entry) -> ProposerFailureRow:
    """A proposer failure; ``raw`` (the answer) keeps its first and last ``RAW_CHARS``
    characters; ``entry`` is ``index``/``op``/``text`` or ``candidate_id``."""
    ends = {} if raw is None else {"raw_response_prefix": raw[:RAW_CHARS], "raw_response_suffix": raw[-RAW_CHARS:]}
    return ProposerFailureRow(timestamp=utc_timestamp(), iteration=iteration, mission=mission, examples=examples,
                              prompt_tokens=prompt_tokens, error=error, stage=stage, **entry, **ends)
