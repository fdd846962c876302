"""One run of a validated plan (``plan.RunPlan``), start to finish. The run directory's refusals
come before anything on disk is touched and its lock is the first write (``run_owner.RunDir``)."""

from __future__ import annotations

import functools
import logging
import time
from pathlib import Path

import msgspec

from .. import artifacts
from ..engine.registry import engine_agreement, engine_factory_for
from ..pool import Inline, Pool, Ray
from ..search import rundir
from ..search.audit import AuditSettings, run_audit
from ..search.fileio import write_json, write_jsonl
from ..search.guidance_store import GuidanceStore
from ..search.headroom import HeadroomSettings, run_headroom, summary_entry
from ..search.rollout import RolloutRunner
from ..search.rule_search import RuleSearch, check_resume
from ..search.rundir import RunJson
from ..search.run_owner import RunDir
from ..search.settings import RunIdentity, SearchSettings
from ..stageb.hashing import content_hash, tickets_hash
from .outputs import distillation_file
from .progress import Progress, pool_items_per_rank
from .report_process import ReportJob
from .plan import DeviceRequest, RunInputs, RunPlan, plan_run

log = logging.getLogger("stageb_pool")


def run_job(config, gpus: str, *, audit: bool = False, resume: bool = False, overwrite: bool = False,
            debug: bool = False, engine_factory=None, argv: list[str] | None = None,
            config_path: str | None = None, ray_address: str | None = None, wait: bool | float = False,
            report_jobs: list | None = None) -> int:
    """``run_plan`` of a loaded config (tests, benchmarks), planned as the CLI plans it.
    ``config_path`` is one of the inputs no output may overwrite."""
    plan = plan_run(config, audit=audit, config_path=config_path,
                    devices=DeviceRequest(gpus, ray_address=ray_address, debug=debug),
                    check_prompts=engine_factory is None)  # the model's own tokenizer renders the prompts
    return run_plan(plan, resume=resume, overwrite=overwrite, wait=wait, engine_factory=engine_factory,
                    argv=argv, report_jobs=report_jobs)


def run_plan(plan: RunPlan, *, resume: bool = False, overwrite: bool = False, wait: bool | float = False,
             engine_factory=None, argv: list[str] | None = None, report_jobs: list | None = None) -> int:
    """Run the audit or rule search of ``plan``; return 0 on success. Exceptions propagate (the
    CLI maps InputError -> 2, PoolError -> 1, KeyboardInterrupt -> 130).
    ``engine_factory`` (a test seam) replaces the model engine; ``argv`` goes to run.json
    (default: sys.argv); ``wait``: ``--wait [SECONDS]``. report.html is rendered by a child
    process while the pool closes and waited for here, or, given ``report_jobs`` (a list),
    its ``ReportJob`` is appended there for the caller to wait for (a benchmark)."""
    started = time.monotonic()
    config, inputs = plan.config, plan.inputs
    store = GuidanceStore(plan.run_dir, inputs.mission, config.guidance.retention)
    identity = plan.identity() if config.mode == "search" else None
    resume_check = None if identity is None else functools.partial(
        check_resume, tickets=inputs.tickets, settings=search_settings(config, inputs), identity=identity, store=store)
    run = RunDir(plan.run_dir, overwrite=overwrite, resume=resume, run_json=run_json(plan, argv=argv),
                 seed_guidance=store.document(inputs.seed_guidance), distillation_file=distillation_file(config),
                 resume_check=resume_check)
    with run.lock(wait=wait):
        run.start()
        return _run_locked(plan, run, store, identity, engine_factory=engine_factory, report_jobs=report_jobs,
                           started=started)


def run_json(plan: RunPlan, *, argv: list[str] | None) -> RunJson:
    """run.json's facts of ``plan``; the provenance hashes the judged ticket set."""
    config, inputs = plan.config, plan.inputs
    return RunJson(config=config, devices=plan.devices, debug=isinstance(plan.backend, Inline),
                   started_at=rundir.utc_now(), argv=argv,
                   model_path=config.model.path, chunk_size=config.runner.chunk_size,
                   profile_hash=content_hash(inputs.profile),
                   tickets_hash=tickets_hash(sorted(inputs.tickets, key=lambda t: t.key)))


def _run_locked(plan: RunPlan, run: RunDir, store: GuidanceStore, identity: RunIdentity | None, *,
                engine_factory, report_jobs: list | None, started: float) -> int:
    """``run_plan`` once its run directory has started."""
    config, inputs, run_dir, devices = plan.config, plan.inputs, plan.run_dir, plan.devices
    factory = engine_factory or engine_factory_for(config.model, inputs.model)
    ray = isinstance(plan.backend, Ray)
    report = ReportJob(run_dir)
    try:
        pool = Pool(factory, devices, backend=plan.backend, task_timeout=config.pool.task_timeout,
                    start_timeout=config.pool.start_timeout, max_restarts=config.pool.max_restarts,
                    stall_warning=config.pool.stall_warning, engine_agreement=engine_agreement(ray))
    except BaseException:
        report.cancel()
        raise
    try:
        progress = Progress(log=log, stats_fn=pool_items_per_rank(pool))
        info = pool.worker_info[0] if pool.worker_info else {}
        runner = RolloutRunner(pool, inputs.profile, chunk_size=config.runner.chunk_size,
                               progress=progress, save_rollouts=config.output.save_rollouts,
                               engine_key=content_hash(msgspec.to_builtins(info, enc_hook=str)))
        run.record_workers(info)
        log.info("%s run of %d tickets (mission %s) on %d worker(s) -> %s",
                 config.mode, len(inputs.tickets), inputs.mission, pool.size, run_dir)
        if ray:
            nodes = {where.get("node_ip") for where in pool.placement}
            log.info("Ray placed the %d workers on %d node(s): %s", pool.size, len(nodes), ", ".join(sorted(nodes)))
        headroom, headroom_started = None, time.monotonic()
        if config.headroom.enabled:
            # Under the seed guidance, also on --resume: the check is about the judge, and the
            # file stays the same whether or not the run was interrupted.
            headroom = summary_entry(run_headroom(runner, tickets=inputs.tickets,
                                                  guidance=dict(inputs.seed_guidance.experiences),
                                                  settings=headroom_settings(config), run_dir=run_dir, log=log))
            report.prepare()  # its histogram
        headroom_s = round(time.monotonic() - headroom_started, 3)
        if config.mode == "audit":
            # The seed guidance, just written; a resumed audit keeps the file it finds.
            guidance = store.load() if run.resume else inputs.seed_guidance
            summary = run_audit(runner, tickets=inputs.tickets, guidance=guidance,
                                settings=audit_settings(config, inputs), run_dir=run_dir, log=log,
                                headroom=headroom)
        else:
            summary = RuleSearch(runner=runner, store=store, run_dir=run_dir, tickets=inputs.tickets,
                                 seed_guidance=inputs.seed_guidance, settings=search_settings(config, inputs),
                                 identity=identity, resume=run.resume_point, log=log, headroom=headroom,
                                 speculate=config.runner.speculate, on_commit=report.prepare).run()
        summary = {**summary, "timing": {**(summary.get("timing") or {}), "headroom_s": headroom_s}}
        write_summary(run_dir, summary, runner=runner, pool=pool, started=started)
        write_jsonl(run_dir / artifacts.TIMELINE.name, timeline_rows(pool))
    except BaseException:
        report.cancel()
        close_after_failure(pool)
        raise
    report.render()
    try:
        pool.close()
    finally:
        if report_jobs is None:
            report.wait()
        else:
            report_jobs.append(report)
    return 0


def close_after_failure(pool) -> None:
    """An error of the close (the zygote died with the workers) is only logged, never raised in place of the run's."""
    try:
        pool.close()
    except Exception as err:  # noqa: BLE001 - reported, and the run's own error goes on
        log.warning("closing the pool after the failure: %s: %s", type(err).__name__, err)


def search_settings(config, inputs: RunInputs) -> SearchSettings:
    return SearchSettings(seed=config.seed, mission=inputs.mission, epochs=config.runner.epochs,
                          rule_search=config.rule_search, distill=config.stage_b_distillation,
                          proposer_system=inputs.proposer_system)


def headroom_settings(config) -> HeadroomSettings:
    """The judge-headroom check's values (its prompts are the train rollouts': their cap)."""
    return HeadroomSettings(seed=config.seed, tickets=config.headroom.tickets, min_auc=config.headroom.min_auc,
                            max_prompt_tokens=config.rule_search.train_sampler.max_prompt_tokens)


def audit_settings(config, inputs: RunInputs) -> AuditSettings:
    """The plain values the audit reads, from the resolved config and the ingest report."""
    return AuditSettings(seed=config.seed, mission=inputs.mission, sampler=config.rule_search.train_sampler,
                         logging_steps=config.runner.logging_steps,
                         hard_case_limit=max(200, 8 * config.rule_search.reflect_size),
                         n_skipped_lines=len(inputs.ingest.skipped), n_excluded=inputs.ingest.excluded,
                         distill=config.stage_b_distillation)


def write_summary(run_dir, summary: dict, *, runner, pool, started: float) -> None:
    """Add the volatile ``timing`` and ``workers`` objects and write ``summary.json``."""
    summary = dict(summary)
    timing = dict(summary.get("timing") or {})
    timing.setdefault("wall_s", round(time.monotonic() - started, 3))
    timing.setdefault("rollout_s", round(runner.rollout_seconds, 3))
    summary["timing"] = timing
    summary["workers"] = worker_throughput(pool, runner.tickets_by_rank)
    path = Path(run_dir) / artifacts.SUMMARY.name
    write_json(path, summary)
    log.info("summary written to %s", path)


def timeline_rows(pool) -> list[dict]:
    """``pool_timeline.jsonl``'s rows: every completed task, in start order."""
    rows = [{"rank": rank, "device": pool.devices[rank].name, "method": method, "label": label,
             "start_s": round(start, 3), "end_s": round(end, 3)}
            for rank, method, label, start, end in pool.stats.intervals]
    return sorted(rows, key=lambda r: (r["start_s"], r["rank"]))


def worker_throughput(pool, tickets_by_rank: dict[int, int] | None = None) -> dict:
    """``summary.json``'s volatile ``workers``: per worker, its work, speed and restarts."""
    items, busy = pool.stats.items, pool.stats.busy_s  # per rank
    out = {}
    for rank, device in enumerate(pool.devices):
        n, s = items[rank], busy[rank]
        tickets = (tickets_by_rank or {}).get(rank, 0)
        out[device.name] = {"items": n, "busy_s": round(float(s), 3), "rollout_tickets": tickets,
                            "tickets_per_s": round(tickets / s, 3) if s > 0 else None,
                            "restarts": pool.stats.restarts_by_rank[rank]}
    return out
