"""The baseline audit (upstream "jump reflection"; its files: docs/artifacts.md, "Baseline
audit"): every ticket once under the run's guidance, no learning. Every row is computed from
the final results in ticket order, never arrival order, so the files are byte-identical for
any worker count (``timestamp``/``elapsed_sec`` aside).
"""

from __future__ import annotations

from pathlib import Path

import msgspec

from .. import artifacts
from ..artifact_rows import AuditMetricsDoc, AuditStepRow, CaseRow, TicketStatsRow
from ..engine.records import SamplerConfig
from ..stageb import verdicts
from .distill import export_distillation
from .fileio import write_json, write_jsonl
from .recorder import Recorder
from .rollout import RolloutResult, rollout_spec
from .rows import hard_case_rows, rollout_rows
from .rundir import utc_timestamp
from .settings import DistillConfig

STEPS_LABEL = "jump_reflection baseline"  # upstream's label, which scripts may filter on


class AuditSettings(msgspec.Struct, frozen=True, kw_only=True):
    seed: int
    mission: str
    sampler: SamplerConfig  # rule_search.train_sampler
    logging_steps: int
    hard_case_limit: int  # max(200, 8 * reflect_size), as upstream
    n_skipped_lines: int = 0  # counted by the ingest, reported as they are
    n_excluded: int = 0
    distill: DistillConfig | None = None  # None: no export


def run_audit(runner, *, tickets: list, guidance, settings: AuditSettings, run_dir, log,
              headroom: dict | None = None) -> dict:
    """Roll out ``tickets`` (in run order) once under ``guidance`` and write the audit's files;
    returns ``summary.json`` less timing. ``headroom``: the headroom check's entry (None: not run)."""
    spec = rollout_spec("audit", f"{settings.seed}/audit", tickets, guidance, settings.sampler)
    log.info("audit: %d tickets, guidance step %d (%s)", len(spec.tickets), guidance.step, guidance.hash)
    result = runner.run(spec)
    metrics, files = write_audit_artifacts(run_dir, result, spec.tickets, settings, chunk_size=runner.chunk_size,
                                           save_rollouts=runner.save_rollouts)
    log.info("audit: acc %.4f on %d tickets (%d dropped), fn %d, fp %d",
             metrics.acc, metrics.n_used, metrics.n_dropped_overlength, metrics.fn, metrics.fp)
    distillation = None
    if settings.distill is not None:
        distillation = export_distillation(Recorder(run_dir, runner), tickets=spec.tickets, guidance=guidance,
                                           settings=settings.distill, train_sampler=settings.sampler,
                                           seed=settings.seed, log=log)
    return {
        "mode": "audit",
        "mission": settings.mission,
        "guidance_hash": result.guidance_hash,
        "guidance_step": guidance.step,
        "n_total": metrics.n_total,
        "n_used": metrics.n_used,
        "n_dropped_overlength": metrics.n_dropped_overlength,
        "n_skipped_lines": settings.n_skipped_lines,
        "n_excluded": settings.n_excluded,
        "metrics": {k: getattr(metrics, k) for k in ("acc", "tp", "fp", "fn", "tn", "fn_rate", "fp_rate")},
        "distillation": distillation,
        "judge_headroom": headroom,
        "generations_done": runner.run_done,
        "generations_saved": runner.run_saved,
        "artifacts": files,
    }


def write_audit_artifacts(run_dir, result: RolloutResult, tickets, settings: AuditSettings, *, chunk_size: int,
                          save_rollouts: bool) -> tuple[AuditMetricsDoc, dict[str, int]]:
    """Write every audit artifact for ``result`` (the rollout of ``tickets``, in run order);
    returns the metrics and the rows written per file."""
    now, mission = utc_timestamp(), settings.mission
    ghash = result.guidance_hash
    by_key = {t.key: t for t in tickets}
    stats = result.stats  # ticket order, dropped excluded
    m = verdicts.compute_metrics(stats)
    metrics = AuditMetricsDoc(
        timestamp=now, mission=mission, mode="audit", guidance_hash=ghash, n_total=len(tickets), n_used=len(stats),
        n_dropped_overlength=len(result.dropped), n_skipped_lines=settings.n_skipped_lines,
        n_excluded=settings.n_excluded, acc=m.acc, fn=m.fn, fp=m.fp, tp=m.tp, tn=m.tn, fn_rate=m.fn_rate, fp_rate=m.fp_rate, np=m.fn, ng=m.fp,
        generations=result.generations + result.cached_generations)
    files = {}

    def put(name, rows=None, doc=None):
        path = Path(run_dir) / name
        write_json(path, doc) if doc is not None else write_jsonl(path, rows)
        files[name] = len(rows) if rows is not None else 1

    put(artifacts.BASELINE_METRICS.name, doc=metrics)
    ordered = [stats[k] for k in sorted(stats)]
    put(artifacts.BASELINE_TICKET_STATS.name, [ticket_stats_row(s, by_key[s.key], ghash) for s in ordered])
    wrong = [s for s in ordered if not s.correct]
    cases = {artifacts.BASELINE_WRONG: (wrong, 3),
             artifacts.BASELINE_NP: ([s for s in wrong if s.gt_label == "pass"], 5),
             artifacts.BASELINE_NG: ([s for s in wrong if s.gt_label == "fail"], 5)}
    for entry, (chosen, reasons) in cases.items():
        put(entry.name, [case_row(s, by_key[s.key], mission, ghash, reasons=reasons) for s in chosen])
    put(artifacts.BASELINE_STEPS.name, step_rows(result, tickets, logging_steps=settings.logging_steps,
                                                 chunk_size=chunk_size, label=STEPS_LABEL, now=now))
    put(artifacts.HARD_CASES.name, hard_case_rows(stats, iteration=1, sampler="baseline", mission=mission,
                                                  limit=settings.hard_case_limit, guidance_hash=ghash, now=now))
    if save_rollouts:
        put(artifacts.rollouts_name("audit"), rollout_rows(result))
    return metrics, files


def ticket_stats_row(s: verdicts.TicketStats, ticket, guidance_hash: str) -> TicketStatsRow:
    return TicketStatsRow(
        ticket_key=s.key, gt_label=s.gt_label, majority_pred=s.majority, agreement=s.agreement,
        difficulty=s.difficulty, hard_wrong=s.hard_wrong, pass_count=s.pass_count, fail_count=s.fail_count,
        invalid_count=s.invalid_count, total_samples=s.total_samples, n_images=len(ticket.per_image),
        guidance_hash=guidance_hash)


def case_row(s: verdicts.TicketStats, ticket, mission: str, guidance_hash: str, *, reasons: int) -> CaseRow:
    """``reason_samples`` keeps the first ``reasons`` (3 for wrong cases, 5 for np/ng, as upstream)."""
    return CaseRow(
        ticket_key=s.key, group_id=ticket.group_id, mission=mission, gt_label=s.gt_label, majority_pred=s.majority,
        agreement=s.agreement, hard_wrong=s.hard_wrong, verdict_samples=list(s.verdicts),
        reason_samples=list(s.reasons[:reasons]), per_image=dict(ticket.per_image), guidance_hash=guidance_hash)


def step_rows(result: RolloutResult, tickets, *, logging_steps: int, chunk_size: int, label: str,
              now: str) -> list[AuditStepRow]:
    """``baseline_metrics_steps.jsonl``: metrics over the first k = logging_steps, 2*logging_steps,
    ..., n tickets of the run order; ``elapsed_sec`` (volatile) is when their chunks were all in."""
    n = len(tickets)
    step = max(1, logging_steps)
    bounds = list(range(step, n, step)) + [n] if n else []
    rows = []
    for index, k in enumerate(bounds, start=1):
        head = tickets[:k]
        used = [result.stats[t.key] for t in head if t.key in result.stats]
        m = verdicts.compute_metrics(used)
        chunks = result.chunk_done_s[: -(-k // chunk_size)]
        rows.append(AuditStepRow(
            timestamp=now, label=label, batch_index=index, total_batches=len(bounds), n_total=n, n_done=k,
            n_used=len(used), n_dropped_overlength=k - len(used), acc=m.acc, fn=m.fn, fp=m.fp, tp=m.tp,
            fn_rate=m.fn_rate, fp_rate=m.fp_rate, elapsed_sec=round(max(chunks, default=0.0), 3),
            guidance_hash=result.guidance_hash))
    return rows
