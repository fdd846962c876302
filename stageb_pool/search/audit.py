"""The baseline audit (upstream "jump reflection"): every ticket once under the current
guidance with the train sampler, no learning. Writes the ``baseline_*`` artifacts, the
hard cases (``sampler="baseline"``, iteration 1) and, with ``output.save_rollouts``, every
candidate text. Only the parent writes; every row carries the guidance hash.

Every artifact is computed from the final results in ticket order, never from arrival
order, so it is byte-identical for any worker count (``timestamp``/``elapsed_sec`` aside).
"""

from __future__ import annotations

from pathlib import Path

from ..stageb import verdicts
from ..stageb.proposer import confidently_wrong
from .fileio import write_json, write_jsonl
from .rollout import RolloutResult, RolloutSpec
from .rundir import HARD_CASES, artifact, rollouts_path, utc_timestamp

BASELINE_METRICS = "baseline_metrics.json"
BASELINE_TICKET_STATS = "baseline_ticket_stats.jsonl"
BASELINE_WRONG = "baseline_wrong_cases.jsonl"
BASELINE_NP = "baseline_np_cases.jsonl"
BASELINE_NG = "baseline_ng_cases.jsonl"
BASELINE_STEPS = "baseline_metrics_steps.jsonl"


def run_audit(ctx) -> dict:
    """Roll out every ticket once under the run's guidance and write the audit artifacts.
    Returns the summary (what ``summary.json`` holds, timing aside)."""
    config = ctx.config
    guidance = ctx.guidance_repo.load()
    spec = RolloutSpec(
        name="audit",
        seed_key=f"{config.seed}/audit",
        tickets=list(ctx.tickets),
        guidance=dict(guidance.experiences),
        sampler=config.rule_search.train_sampler,
    )
    ctx.log.info("audit: %d tickets, guidance step %d (%s)", len(spec.tickets), guidance.step, guidance.hash)
    result = ctx.runner.run(spec)
    skipped = len(ctx.ingest.skipped) if ctx.ingest is not None else 0
    excluded = ctx.ingest.excluded if ctx.ingest is not None else 0
    written = write_audit_artifacts(
        ctx.run_dir, result, spec.tickets,
        mission=ctx.mission,
        logging_steps=config.runner.logging_steps,
        chunk_size=ctx.runner.chunk_size,
        hard_case_limit=max(200, 8 * config.rule_search.reflect_size),
        n_skipped_lines=skipped,
        n_excluded=excluded,
        save_rollouts=ctx.runner.save_rollouts,
    )
    metrics = written["metrics"]
    ctx.log.info(
        "audit: acc %.4f on %d tickets (%d dropped), fn %d, fp %d",
        metrics["acc"], metrics["n_used"], metrics["n_dropped_overlength"], metrics["fn"], metrics["fp"],
    )
    return {
        "mode": "audit",
        "mission": ctx.mission,
        "guidance_hash": result.guidance_hash,
        "guidance_step": guidance.step,
        "n_total": metrics["n_total"],
        "n_used": metrics["n_used"],
        "n_dropped_overlength": metrics["n_dropped_overlength"],
        "n_skipped_lines": skipped,
        "n_excluded": excluded,
        "metrics": {k: metrics[k] for k in ("acc", "tp", "fp", "fn", "tn", "fn_rate", "fp_rate")},
        "generations_done": ctx.runner.generations_done,
        "generations_saved": ctx.runner.generations_saved,
        "artifacts": written["files"],
    }


def write_audit_artifacts(run_dir, result: RolloutResult, tickets, *, mission: str, logging_steps: int,
                          chunk_size: int, hard_case_limit: int, n_skipped_lines: int = 0, n_excluded: int = 0,
                          save_rollouts: bool = False) -> dict:
    """Write every audit artifact for ``result`` (the rollout of ``tickets``, in run order)."""
    now = utc_timestamp()
    ghash = result.guidance_hash
    by_key = {t.key: t for t in tickets}
    stats = result.stats  # ticket order, dropped excluded
    m = verdicts.compute_metrics(stats)
    metrics = {
        "timestamp": now,
        "mission": mission,
        "mode": "audit",
        "guidance_hash": ghash,
        "n_total": len(tickets),
        "n_used": len(stats),
        "n_dropped_overlength": len(result.dropped),
        "n_skipped_lines": n_skipped_lines,
        "n_excluded": n_excluded,
        "acc": m.acc,
        "fn": m.fn,
        "fp": m.fp,
        "tp": m.tp,
        "tn": m.tn,
        "fn_rate": m.fn_rate,
        "fp_rate": m.fp_rate,
        "np": m.fn,
        "ng": m.fp,
        "generations": result.generations + result.cached_generations,
    }
    files = {}

    def put(name, rows=None, doc=None):
        path = artifact(run_dir, name)
        write_json(path, doc) if doc is not None else write_jsonl(path, rows)
        files[name] = len(rows) if rows is not None else 1

    put(BASELINE_METRICS, doc=metrics)
    ordered = [stats[k] for k in sorted(stats)]
    put(BASELINE_TICKET_STATS, [ticket_stats_row(s, by_key[s.key], ghash) for s in ordered])
    wrong = [s for s in ordered if not s.correct]
    put(BASELINE_WRONG, [case_row(s, by_key[s.key], mission, ghash, reasons=3) for s in wrong])
    put(BASELINE_NP, [case_row(s, by_key[s.key], mission, ghash, reasons=5) for s in wrong if s.gt_label == "pass"])
    put(BASELINE_NG, [case_row(s, by_key[s.key], mission, ghash, reasons=5) for s in wrong if s.gt_label == "fail"])
    put(BASELINE_STEPS, step_rows(result, tickets, logging_steps=logging_steps, chunk_size=chunk_size,
                                  label="audit", now=now))
    put(HARD_CASES, hard_case_rows(stats, iteration=1, sampler="baseline", limit=hard_case_limit,
                                   mission=mission, guidance_hash=ghash, now=now))
    if save_rollouts:
        name = str(rollouts_path(run_dir, "audit").relative_to(Path(run_dir)))
        put(name, rollout_rows(result))
    return {"metrics": metrics, "files": files}


def ticket_stats_row(s: verdicts.TicketStats, ticket, guidance_hash: str) -> dict:
    """``baseline_ticket_stats.jsonl`` row (upstream fields + difficulty, guidance_hash)."""
    return {
        "ticket_key": s.key,
        "gt_label": s.gt_label,
        "majority_pred": s.majority,
        "agreement": s.agreement,
        "difficulty": s.difficulty,
        "hard_wrong": s.hard_wrong,
        "pass_count": s.pass_count,
        "fail_count": s.fail_count,
        "invalid_count": s.invalid_count,
        "total_samples": s.total_samples,
        "n_images": len(ticket.per_image),
        "guidance_hash": guidance_hash,
    }


def case_row(s: verdicts.TicketStats, ticket, mission: str, guidance_hash: str, *, reasons: int) -> dict:
    """``baseline_wrong/np/ng_cases.jsonl`` row; ``reason_samples`` keeps the first
    ``reasons`` (3 for wrong cases, 5 for np/ng, as upstream)."""
    return {
        "ticket_key": s.key,
        "group_id": ticket.group_id,
        "mission": mission,
        "gt_label": s.gt_label,
        "majority_pred": s.majority,
        "agreement": s.agreement,
        "hard_wrong": s.hard_wrong,
        "verdict_samples": list(s.verdicts),
        "reason_samples": list(s.reasons[:reasons]),
        "per_image": dict(ticket.per_image),
        "guidance_hash": guidance_hash,
    }


def hard_case_rows(stats: dict, *, iteration: int, sampler: str, limit: int, mission: str,
                   guidance_hash: str, now: str | None = None, with_reasons: bool = True) -> list[dict]:
    """``rule_search_hard_cases.jsonl`` rows: the confidently wrong tickets (valid majority
    != GT, most confident first, ticket order on ties; ``proposer.confidently_wrong``), cut
    to ``limit``, ranked from 1."""
    now = utc_timestamp() if now is None else now
    wrong = confidently_wrong(stats)
    rows = []
    for rank, s in enumerate(wrong[:limit], start=1):
        rows.append({
            "timestamp": now,
            "iteration": iteration,
            "mission": mission,
            "sampler": sampler,
            "ticket_key": s.key,
            "gt_label": s.gt_label,
            "majority_pred": s.majority,
            "majority_reason": verdicts.majority_reason(s),
            "pass_count": s.pass_count,
            "fail_count": s.fail_count,
            "invalid_count": s.invalid_count,
            "total_samples": s.total_samples,
            "agreement": s.agreement,
            "difficulty": s.difficulty,
            "hard_wrong": s.hard_wrong,
            "verdict_samples": list(s.verdicts),
            "reason_samples": list(s.reasons) if with_reasons else [],
            "reason_counts": verdicts.reason_counts(s),
            "rank": rank,
            "guidance_hash": guidance_hash,
        })
    return rows


def step_rows(result: RolloutResult, tickets, *, logging_steps: int, chunk_size: int, label: str,
              now: str) -> list[dict]:
    """``baseline_metrics_steps.jsonl``: metrics over the first k tickets of the run order,
    for k = logging_steps, 2*logging_steps, ..., n. Computed from the final results, so
    deterministic; ``elapsed_sec`` (volatile) is when the chunks holding those k tickets
    were all in."""
    n = len(tickets)
    step = max(1, logging_steps)
    bounds = list(range(step, n, step)) + [n] if n else []
    rows = []
    for index, k in enumerate(bounds, start=1):
        head = tickets[:k]
        used = [result.stats[t.key] for t in head if t.key in result.stats]
        m = verdicts.compute_metrics(used)
        chunks = result.chunk_done_s[: -(-k // chunk_size)]
        rows.append({
            "timestamp": now,
            "label": label,
            "batch_index": index,
            "total_batches": len(bounds),
            "n_total": k,
            "n_used": len(used),
            "n_dropped_overlength": k - len(used),
            "acc": m.acc,
            "fn": m.fn,
            "fp": m.fp,
            "tp": m.tp,
            "fn_rate": m.fn_rate,
            "fp_rate": m.fp_rate,
            "elapsed_sec": round(max(chunks, default=0.0), 3),
            "guidance_hash": result.guidance_hash,
        })
    return rows


def rollout_rows(result: RolloutResult) -> list[dict]:
    """``rollouts/<id>.jsonl``: one row per candidate, tickets sorted by key, then decode
    and sample index."""
    rows = []
    for key in sorted(result.rollouts):
        rollout = result.rollouts[key]
        for sample in rollout.samples:
            rows.append({
                "ticket_key": key,
                "decode_index": sample.decode_index,
                "sample_index": sample.sample_index,
                "text": sample.text,
                "prompt_tokens": rollout.prompt_tokens,
                "completion_tokens": sample.completion_tokens,
                "finish_reason": sample.finish_reason,
                "token_ids": sample.token_ids,
                "guidance_hash": result.guidance_hash,
            })
    return rows
