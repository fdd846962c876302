"""The rows of a run's artifacts: one msgspec Struct per file (``artifacts.py`` names the file).

A Struct's field order is its row's JSON key order, so a row's bytes follow from its values;
rows read back (a resume's checks, the report) are decoded into the same Struct, so a
wrong-shaped row is an error naming its file, line and field. A ``... | UnsetType`` field is
left out of a row when unset. The builders live with their writers; this module imports
nothing of the package, so every layer that reads or writes a run can import it.
"""

from __future__ import annotations

import msgspec
from msgspec import UNSET, UnsetType


class HardCaseRow(msgspec.Struct):
    """``rule_search_hard_cases.jsonl`` (the audit's with ``sampler: "baseline"``)."""

    timestamp: str
    iteration: int
    mission: str
    sampler: str
    ticket_key: str
    gt_label: str
    majority_pred: str | None
    majority_reason: str | None
    pass_count: int
    fail_count: int
    invalid_count: int
    total_samples: int
    agreement: float
    difficulty: float
    hard_wrong: float
    verdict_samples: list[str | None]
    reason_samples: list[str | None]
    reason_counts: list[dict]
    rank: int
    guidance_hash: str


class RolloutRow(msgspec.Struct):
    """``rollouts/<name>.jsonl``: one generated candidate text (no volatile field)."""

    ticket_key: str
    decode_index: int
    sample_index: int
    text: str
    prompt_tokens: int
    completion_tokens: int
    finish_reason: str
    token_ids: list[int] | None
    guidance_hash: str


class CandidateRowHead(msgspec.Struct):
    """The fields that open both candidate files' rows (each row type's own fields follow)."""

    timestamp: str
    iteration: int
    candidate_index: int
    mission: str
    signature: str
    candidate_id: str
    op: str
    target_signature: str | None
    target_signatures: list[str] | None  # null unless a merge, as upstream


class CandidateRow(CandidateRowHead):
    """``rule_candidates.jsonl``: one evaluated candidate. ``base_*`` are on the whole train
    pool, ``cand_*`` on the tickets baseline and candidate share (as upstream); with an eval
    rollout, ``eval_*`` are on the eval tickets both judged, else ``eval_base_*`` on all."""

    text: str | None
    rationale: str | None
    source: str
    train_n: int
    base_acc: float
    base_false_release_rate: float
    base_false_block_rate: float
    cand_acc: float
    cand_false_release_rate: float
    cand_false_block_rate: float
    eval_n: int
    eval_base_acc: float | None
    eval_base_false_release_rate: float | None
    eval_base_false_block_rate: float | None
    eval_cand_acc: float | None
    eval_cand_false_release_rate: float | None
    eval_cand_false_block_rate: float | None
    decision: str
    applied: bool
    reason: str | None
    n_common: int
    relative_error_reduction: float
    changed_fraction: float
    bootstrap_prob: float
    base_fp_rate: float
    cand_fp_rate: float
    d_fp_rate: float
    d_acc: float
    eval_acc_drop: float | None
    regression_count: int
    base_guidance_hash: str
    cand_guidance_hash: str
    reflection_id: str


class RegressionRow(CandidateRowHead):
    """``rule_search_candidate_regressions.jsonl``: a candidate's base-correct -> candidate-wrong
    tickets (``regression_count`` is the full count, ``regressions`` at most 50)."""

    decision: str
    regression_count: int
    regressions: list[dict]
    base_guidance_hash: str
    cand_guidance_hash: str


class BenchmarkRow(msgspec.Struct):
    """``benchmarks.jsonl``: one applied edit (``after_*`` on the common train tickets)."""

    timestamp: str
    iteration: int
    mission: str
    accepted_key: str | None
    signature: str
    candidate_id: str
    op: str
    target_signature: str | None
    target_signatures: list[str]  # the stored list, [] unless a merge, as upstream
    text: str | None
    rationale: str | None
    train_n: int
    base_acc: float
    base_fn_rate: float
    base_fp_rate: float
    base_fn_over_tp: float | None
    base_fp_over_tp: float | None
    after_acc: float
    after_fn_rate: float
    after_fp_rate: float
    after_fn_over_tp: float | None
    after_fp_over_tp: float | None
    eval_n: int
    eval_base_acc: float | None
    eval_after_acc: float | None
    eval_acc_drop: float | None
    relative_error_reduction: float
    changed_fraction: float
    bootstrap_prob: float
    guidance_step_before: int
    guidance_step_after: int
    reflect_ticket_keys: list[str]
    reflection_id: str
    base_guidance_hash: str
    guidance_hash: str


class ProposerFailureRow(msgspec.Struct):
    """``reflection_cache/rule_search_proposer_failures.jsonl``, by ``stage``: an overlength
    prompt (``"prompt"``), a call that raised (``"generate"``), an unparseable answer
    (``"parse"``, with the raw answer's ends), a rejected entry (``"validate"``: ``index``,
    ``op``, ``text``) or an edit that cannot apply (``"preview"``: ``candidate_id``)."""

    timestamp: str
    iteration: int
    mission: str
    examples: int
    prompt_tokens: int | None
    error: str
    stage: str
    index: int | UnsetType = UNSET
    op: str | None | UnsetType = UNSET
    text: str | None | UnsetType = UNSET
    candidate_id: str | UnsetType = UNSET
    raw_response_prefix: str | UnsetType = UNSET
    raw_response_suffix: str | UnsetType = UNSET


class ProposerAnswerRow(msgspec.Struct, kw_only=True):
    """``reflection_cache/proposer_answers.jsonl``: one proposer call, its answer whole.
    ``parsed``: it held a JSON operation list (``operations`` entries); else ``error`` says
    why. Token counts and the finish reason are null when the call never generated."""

    iteration: int
    mission: str
    examples_used: int = 0
    prompt_tokens: int | None = None
    completion_tokens: int | None = None
    finish_reason: str | None = None
    constrained: bool
    parsed: bool
    operations: int = 0
    error: str | None = None
    text: str | None = None
    call: int | UnsetType = UNSET  # which of the iteration's proposer calls (only with proposer_calls > 1)


class DistillRow(msgspec.Struct):
    """``distill_chatml.jsonl``: one ticket as a ChatML conversation."""

    ticket_key: str
    group_id: str
    mission: str
    label: str
    messages: list[dict[str, str]]


class IterationRow(msgspec.Struct):
    """``rule_search_iterations.jsonl``: one completed iteration; ``candidates_proposed`` =
    the rejected ones + ``candidates_evaluated``."""

    iteration: int
    mission: str
    guidance_step: int
    guidance_hash: str
    proposer_calls: int
    proposer_parsed: int
    candidates_proposed: int
    candidates_rejected: dict[str, int]  # reason kind -> count (never A/B-tested)
    candidates_evaluated: int  # A/B rollouts done
    decision: str  # accepted | rejected | no_candidates
    accepted_candidate: str | None
    reasons: list[str]
    baseline: dict  # {"train": metrics, "eval": metrics | null}
    best_candidate: dict | None  # the applied one, else the largest RER (earliest on ties), with its gate reason
    guidance_step_after: int


class AuditMetricsDoc(msgspec.Struct):
    """``baseline_metrics.json``: the audit's metrics on every judged ticket (``np``/``ng``
    repeat ``fn``/``fp`` under upstream's names)."""

    timestamp: str
    mission: str
    mode: str
    guidance_hash: str
    n_total: int
    n_used: int
    n_dropped_overlength: int
    n_skipped_lines: int
    n_excluded: int
    acc: float
    fn: int
    fp: int
    tp: int
    tn: int
    fn_rate: float
    fp_rate: float
    np: int
    ng: int
    generations: int


class TicketStatsRow(msgspec.Struct):
    """``baseline_ticket_stats.jsonl``: one judged ticket (upstream fields + difficulty, guidance_hash)."""

    ticket_key: str
    gt_label: str
    majority_pred: str | None
    agreement: float
    difficulty: float
    hard_wrong: float
    pass_count: int
    fail_count: int
    invalid_count: int
    total_samples: int
    n_images: int
    guidance_hash: str


class CaseRow(msgspec.Struct):
    """``baseline_wrong/np/ng_cases.jsonl``: a ticket the audit got wrong."""

    ticket_key: str
    group_id: str
    mission: str
    gt_label: str
    majority_pred: str | None
    agreement: float
    hard_wrong: float
    verdict_samples: list[str | None]
    reason_samples: list[str | None]
    per_image: dict
    guidance_hash: str


class AuditStepRow(msgspec.Struct):
    """``baseline_metrics_steps.jsonl``: the metrics over the first ``n_done`` tickets of the
    run order; ``elapsed_sec`` (volatile) is when their chunks were all in."""

    timestamp: str
    label: str
    batch_index: int
    total_batches: int
    n_total: int
    n_done: int
    n_used: int
    n_dropped_overlength: int
    acc: float
    fn: int
    fp: int
    tp: int
    fn_rate: float
    fp_rate: float
    elapsed_sec: float
    guidance_hash: str
