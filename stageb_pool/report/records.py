"""The report's read-side records: the shape of every file row the page draws from.

These are the report's own (the layer rule: ``report/`` imports nothing of ``search/``,
which writes the files) and they ask only for what the page shows. Every field may be
absent, since a run of an earlier version lacks fields; a field that is present must have
its documented type (docs/artifacts.md), so that what a crafted or damaged file holds is
found while it is decoded, with its file and line, and never later as a traceback. The
few fields a row cannot do without (the iteration a candidate belongs to, the worker a
timeline interval ran on) are required.

Numbers are ``int | float``: a number is shown as the file holds it (``1`` and ``1.0`` are
written differently), so the page of a real run keeps its bytes.
"""

from __future__ import annotations

import msgspec

Num = int | float


class Record(msgspec.Struct, frozen=True, kw_only=True):
    """Unknown fields are ignored: a run of a later version adds fields."""


class Metrics(Record):
    n: int | None = None
    acc: Num | None = None
    fp_rate: Num | None = None
    fn_rate: Num | None = None


class Splits(Record):
    train: Metrics | None = None
    eval: Metrics | None = None


class AuditMetrics(Record):
    """``baseline_metrics.json``, or the audit's ``metrics`` in ``summary.json``."""

    n_used: int | None = None
    n_dropped_overlength: int | None = None
    acc: Num | None = None
    fp_rate: Num | None = None
    fn_rate: Num | None = None
    tp: int | None = None
    fn: int | None = None
    fp: int | None = None
    tn: int | None = None


class WorkerStats(Record):
    items: int | None = None
    busy_s: Num | None = None
    rollout_tickets: int | None = None
    tickets_per_s: Num | None = None


class Summary(Record):
    """``summary.json``: search and audit fields together (each mode writes its own)."""

    mode: str | None = None
    mission: str | None = None
    iterations: int | None = None
    stop_reason: str | None = None
    edits_accepted: int | None = None
    baseline: Splits | None = None
    final: Splits | None = None
    metrics: AuditMetrics | None = None
    n_used: int | None = None
    n_dropped_overlength: int | None = None
    workers: dict[str, WorkerStats] | None = None
    # seconds, counts, "resumed": shown as they are; "speculation": its counts
    timing: dict[str, Num | bool | str | None | dict[str, Num | None]] | None = None
    generations_done: int | None = None
    generations_saved: int | None = None


class RunConfig(Record):
    mode: str | None = None


class Invocation(Record):
    started_at: str | None = None
    workers: int | None = None
    gpus: str | None = None


class Tool(Record):
    name: str | None = None
    version: str | None = None


class RunInfo(Record):
    """``run.json``."""

    config: RunConfig | None = None
    invocation: Invocation | None = None
    tool: Tool | None = None


class GuidanceSection(Record):
    step: int | None = None
    experiences: dict[str, str] | None = None


Guidance = dict[str, GuidanceSection]  # guidance.json and snapshots/guidance-step*.json: mission -> section


class BestCandidate(Record):
    candidate_id: str | None = None
    relative_error_reduction: Num | None = None


class Iteration(Record):
    """A row of ``rule_search_iterations.jsonl``."""

    iteration: int
    guidance_step: int | None = None
    proposer_calls: int | None = None
    proposer_parsed: int | None = None
    candidates_proposed: int | None = None
    candidates_rejected: dict[str, int] | None = None
    candidates_evaluated: int | None = None
    decision: str | None = None
    accepted_candidate: str | None = None
    reasons: list[str] | None = None
    baseline: Splits | None = None
    best_candidate: BestCandidate | None = None


class Candidate(Record):
    """A row of ``rule_candidates.jsonl``."""

    iteration: int
    candidate_id: str | None = None
    op: str | None = None
    text: str | None = None
    source: str | None = None
    base_acc: Num | None = None
    cand_acc: Num | None = None
    base_fp_rate: Num | None = None
    eval_base_acc: Num | None = None
    d_acc: Num | None = 0  # absent in a run that wrote none: shown as +0.000, as before; null: "–"
    d_fp_rate: Num | None = 0
    relative_error_reduction: Num | None = None
    changed_fraction: Num | None = None
    bootstrap_prob: Num | None = None
    eval_acc_drop: Num | None = None
    decision: str | None = None
    applied: bool | None = None
    reason: str | None = None


class Benchmark(Record):
    """A row of ``benchmarks.jsonl`` (an accepted edit)."""

    iteration: int
    op: str | None = None
    candidate_id: str | None = None
    guidance_step_before: int | None = None
    guidance_step_after: int | None = None
    relative_error_reduction: Num | None = None
    base_acc: Num | None = None
    after_acc: Num | None = None
    accepted_key: str | None = None
    target_signature: str | None = None
    text: str | None = None
    rationale: str | None = None


class ProposerAnswer(Record):
    """A row of ``reflection_cache/proposer_answers.jsonl``."""

    iteration: int | None = None
    parsed: bool | None = None
    finish_reason: str | None = None
    prompt_tokens: int | None = None
    completion_tokens: int | None = None
    examples_used: int | None = None
    constrained: bool | None = None
    error: str | None = None
    text: str | None = None


class ProposerFailure(Record):
    """A row of ``reflection_cache/rule_search_proposer_failures.jsonl``."""

    iteration: int | None = None
    stage: str = "?"
    error: str | None = None


class HardCase(Record):
    """A row of ``rule_search_hard_cases.jsonl``."""

    iteration: int
    sampler: str | None = None
    rank: int | None = None
    ticket_key: str | None = None
    gt_label: str | None = None
    majority_pred: str | None = None
    agreement: Num | None = None
    hard_wrong: Num | None = None
    majority_reason: str | None = None


class AuditStep(Record):
    """A row of ``baseline_metrics_steps.jsonl``."""

    n_done: int
    acc: Num | None = None
    fp_rate: Num | None = None
    fn_rate: Num | None = None


class HeadroomTicket(Record):
    label: str | None = None
    p_pass: Num | None = None


class LabelCounts(Record):
    pass_: int | None = msgspec.field(default=None, name="pass")
    fail: int | None = None


class Headroom(Record):
    """``judge_headroom.json``."""

    auc: Num | None = None
    min_auc: Num | None = None
    separates: bool | None = None
    tickets: int | None = None
    pass_share: Num | None = None
    labels: LabelCounts | None = None
    mean_p_pass: Num | None = None
    message: str | None = None
    per_ticket: list[HeadroomTicket] | None = None


class TimelineRow(Record):
    """A row of ``pool_timeline.jsonl``."""

    rank: int
    device: str
    start_s: Num
    end_s: Num
    method: str | None = None
    label: str | None = None
