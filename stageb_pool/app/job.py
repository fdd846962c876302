"""One run, start to finish: validate every input, prepare the run directory, start the
pool, run the audit or the rule search, write the summary, close the pool.

Order matters: ALL input validation (tickets, exclusions, prompt profile, model path, seed
guidance, run directory refusal) happens before anything on disk is touched or any worker
is forked, so bad input costs nothing and damages nothing.
"""

from __future__ import annotations

import logging
import random
import time
from dataclasses import dataclass, field
from pathlib import Path

import msgspec

from ..engine import models
from ..pool import Device, DeviceSpecError, Pool, parse_gpus
from ..search import rundir
from ..search import state as state_mod
from ..search.fileio import write_json
from ..search.guidance_store import GuidanceRepository
from ..search.rollout import RolloutRunner
from ..stageb import guidance as guidance_mod
from ..stageb import prompts
from ..stageb import tickets as tickets_mod
from ..stageb.errors import InputError
from ..stageb.hashing import content_hash, tickets_hash
from .config import with_mode
from .progress import Progress, pool_items_per_rank

log = logging.getLogger("stageb_pool")


@dataclass
class RunContext:
    """Everything the audit and the rule search need; the parent owns all of it.

    Beyond the contract: ``ingest`` (the IngestReport: skipped lines, exclusions),
    ``devices``, ``debug`` and ``started`` (monotonic start time)."""

    config: object
    mission: str
    tickets: list  # after the filter, in run order (shuffled with random.Random(seed))
    profile: object
    guidance_repo: object
    run_dir: Path
    runner: RolloutRunner
    pool: object
    log: logging.Logger
    resume: bool = False
    ingest: object = None
    devices: list = field(default_factory=list)
    debug: bool = False
    started: float = 0.0
    proposer_system: str | None = None


class _Inputs(msgspec.Struct):
    mission: str
    ingest: object
    tickets: list
    profile: object
    model_path: str
    seed_guidance: object
    proposer_system: str | None  # the proposer's system prompt (search mode only)


def load_inputs(config) -> _Inputs:
    """Read and validate every input file; raises InputError with a location on bad input."""
    exclude = tickets_mod.load_exclusions(
        config.ticket_filter.exclude_ticket_keys, config.ticket_filter.exclude_ticket_keys_path
    )

    ingest = tickets_mod.load_tickets(config.stage_a_paths, on_bad_line=config.ingest.on_bad_line,
                                      exclude_keys=exclude)
    # The mission (from the tickets) picks the profile's domain, and the profile may ask
    # for upstream's BBU summary clean-up (bbu_rru), applied to the tickets already loaded.
    mission = ingest.tickets[0].mission
    profile = prompts.load_profile(config.prompt.profile, mission=mission, domain=config.prompt.domain_for(mission))
    if profile.options.bbu_cleanup:
        ingest = msgspec.structs.replace(ingest, tickets=tickets_mod.bbu_clean_tickets(ingest.tickets))
    model_path = models.check_model_path(config.model.path)
    seed_guidance = guidance_mod.load_guidance(config.guidance.path, mission)
    proposer_system = None
    if config.mode == "search":
        proposer_system = prompts.load_proposer_prompt(config.prompt.profile, config.rule_search.proposer_prompt_path)
    run_order = list(ingest.tickets)
    random.Random(config.seed).shuffle(run_order)  # upstream run order (3.1 step 7)
    return _Inputs(mission, ingest, run_order, profile, model_path, seed_guidance, proposer_system)


def resolve_devices(spec) -> list[Device]:
    """The devices of a ``--gpus`` spec; a bad spec is an InputError located at ``--gpus``."""
    try:
        return parse_gpus(spec)
    except DeviceSpecError as err:
        raise InputError(str(err), "--gpus") from None


def engine_factory_for(model_config, model_path: str):
    """The factory each worker calls after fork. It imports the engine (torch,
    transformers) inside the worker: the parent never imports torch."""

    def build(device: Device):
        from ..engine.build import build_engine

        return build_engine(
            device,
            path=model_path,
            dtype=model_config.dtype,
            attn_implementation=model_config.attn_implementation,
            trust_remote_code=model_config.trust_remote_code,
            stop=model_config.stop,
        )

    return build


def run_job(config, devices, *, audit: bool = False, resume: bool = False, overwrite: bool = False,
            debug: bool = False, engine_factory=None, argv: list[str] | None = None) -> int:
    """Run one audit or rule search; return 0 on success. Exceptions propagate (the CLI
    maps InputError -> 2, PoolError -> 1, KeyboardInterrupt -> 130).

    ``devices`` is a list of Device or a ``--gpus`` spec. ``engine_factory`` (a test seam)
    replaces the model engine; ``argv`` is recorded in run.json (default: sys.argv)."""
    started = time.monotonic()
    started_at = rundir.utc_now()
    config = with_mode(config, audit)
    if not isinstance(devices, list):
        devices = resolve_devices(devices)
    if debug:
        devices = devices[:1]

    inputs = load_inputs(config)
    run_dir = rundir.run_dir_path(config, inputs.mission)
    rundir.prepare_run_dir(run_dir, overwrite=overwrite, resume=resume)  # first touch of the disk
    if resume and config.mode == "search":
        # before run.json or guidance.json is rewritten or a worker forked
        state_mod.preflight_resume(run_dir, config=config, tickets=inputs.tickets)

    repo = GuidanceRepository(run_dir, inputs.mission, config.guidance.retention)
    if not (resume and repo.exists()):
        repo.write(inputs.seed_guidance)

    run_json = dict(config=config, devices=devices, debug=debug, started_at=started_at, argv=argv)
    prov = dict(model_path=config.model.path, chunk_size=config.runner.chunk_size,
                profile_hash=content_hash(inputs.profile), tickets_hash=tickets_hash(sorted(inputs.tickets, key=lambda t: t.key)))
    # A first run.json before the workers start marks the directory as a stageb-pool run
    # even if the start fails (so --overwrite may replace it); rewritten with rank 0's info.
    rundir.write_run_json(run_dir, workers=len(devices), provenance=rundir.provenance(worker_info=None, **prov),
                          **run_json)

    factory = engine_factory or engine_factory_for(config.model, inputs.model_path)
    pool = Pool(
        factory, devices, task_timeout=config.pool.task_timeout, start_timeout=config.pool.start_timeout,
        max_restarts=config.pool.max_restarts, inline=debug,
    )
    try:
        progress = Progress(log=log, stats_fn=pool_items_per_rank(pool))
        runner = RolloutRunner(pool, inputs.profile, chunk_size=config.runner.chunk_size,
                               progress=progress, save_rollouts=config.output.save_rollouts)
        info = pool.worker_info[0] if pool.worker_info else {}
        warn_if_workers_differ(pool.worker_info, log)
        rundir.write_run_json(run_dir, workers=pool.size, provenance=rundir.provenance(worker_info=info, **prov),
                              **run_json)
        ctx = RunContext(
            config=config, mission=inputs.mission, tickets=inputs.tickets, profile=inputs.profile,
            guidance_repo=repo, run_dir=Path(run_dir), runner=runner, pool=pool, log=log,
            resume=resume, ingest=inputs.ingest, devices=devices, debug=debug, started=started,
            proposer_system=inputs.proposer_system,
        )
        log.info("%s run of %d tickets (mission %s) on %d worker(s) -> %s",
                 config.mode, len(inputs.tickets), inputs.mission, pool.size, run_dir)
        if config.mode == "audit":
            from ..search.audit import run_audit

            summary = run_audit(ctx)
        else:
            from ..search.rule_search import run_search

            summary = run_search(ctx)
        write_summary(ctx, summary)
    finally:
        pool.close()
    return 0


def warn_if_workers_differ(worker_info: list[dict], log: logging.Logger) -> None:
    """Byte-identical results need every worker on the same software, device model and
    dtype (docs/architecture.md); run.json records rank 0's facts, so say loudly if the
    others differ (e.g. a node that mixes GPU models)."""
    facts = [msgspec.to_builtins(info, enc_hook=str) for info in worker_info]
    odd = [rank for rank, f in enumerate(facts) if f != facts[0]]
    if odd:
        log.warning("workers %s report a different engine than worker 0 (%s vs %s): results may "
                    "depend on which worker ran which chunk", odd, facts[odd[0]], facts[0])


def write_summary(ctx: RunContext, summary: dict) -> dict:
    """Add the volatile ``timing`` and ``workers`` objects and write ``summary.json``."""
    summary = dict(summary)
    timing = dict(summary.get("timing") or {})
    timing.setdefault("wall_s", round(time.monotonic() - ctx.started, 3))
    timing.setdefault("rollout_s", round(ctx.runner.rollout_seconds, 3))
    summary["timing"] = timing
    summary.setdefault("generations_done", ctx.runner.generations_done)
    summary.setdefault("generations_saved", ctx.runner.generations_saved)
    summary["workers"] = worker_throughput(ctx.pool, ctx.runner.tickets_by_rank)
    path = ctx.run_dir / rundir.SUMMARY_JSON
    write_json(path, summary)
    ctx.log.info("summary written to %s", path)
    return summary


def worker_throughput(pool, tickets_by_rank: dict[int, int] | None = None) -> dict:
    """Per worker: items done, busy seconds (from pool.stats), rollout tickets and tickets/s."""
    items, busy = pool.stats.items, pool.stats.busy_s  # per rank
    out = {}
    for rank, device in enumerate(pool.devices):
        n, s = items[rank], busy[rank]
        tickets = (tickets_by_rank or {}).get(rank, 0)
        out[device.name] = {"items": n, "busy_s": round(float(s), 3), "rollout_tickets": tickets,
                            "tickets_per_s": round(tickets / s, 3) if s > 0 else None}
    return out
