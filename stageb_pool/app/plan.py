"""The run plan: a command's config and options turned into everything a run is about to do,
validated, by one start-up sequence shared by ``check`` and ``run``: ``plan_command`` from the
command line, ``plan_run`` from a config already loaded (tests, benchmarks).

The plan chooses the backend (``--debug``: inline; ``--ray``: Ray; else forked workers) and
reads the ``--gpus`` spec as it takes it, once (``pool.plan_devices``); applies the mode; reads
and validates every input (``load_inputs``), the model path once into a ``ModelRef`` that the
workers load without checking it again; places and checks the run directory and the outputs.
``check`` prints the plan (``describe``), ``run`` executes it (``job.run_plan``). Nothing here
touches the disk or forks a worker: bad input costs nothing and damages nothing.
"""

from __future__ import annotations

import os
import random
from pathlib import Path

import msgspec

from ..engine import models
from ..engine.models import ModelRef
from ..engine.registry import check_engine
from ..pool import Backend, Device, DeviceSpecError, Fork, Inline, Ray, plan_devices
from ..pool.devices import GroupSizeError
from ..search import rundir
from ..search.settings import RunIdentity
from ..stageb import guidance as guidance_mod
from ..stageb import prompts
from ..stageb import tickets as tickets_mod
from ..stageb.errors import InputError, UsageError
from .config import Config, load_checked_config, with_mode
from .identity import run_identity
from .outputs import check_outputs
from .prompt_budget import refuse_unusable_prompts


class DeviceRequest(msgspec.Struct, frozen=True):
    """A command's device options: the ``--gpus`` spec, ``--gpus-per-worker`` (None: the
    config's ``model.gpus_per_worker``), ``--ray``'s address (None: not Ray) and ``--debug``
    (one worker, inline); ``command`` (``stageb-pool run``) is where a usage error in them is
    located."""

    gpus: str
    gpus_per_worker: int | None = None
    ray_address: str | None = None
    debug: bool = False
    command: str = "stageb-pool run"

    def backend(self, config: Config) -> Backend:
        """Where the workers run (``--debug`` before ``--ray``); Ray's bounds are the config's."""
        if self.debug:
            return Inline()
        if self.ray_address is not None:
            return Ray(self.ray_address, placement_timeout=config.pool.start_timeout,
                       connect_timeout=config.pool.connect_timeout)
        return Fork()


class RunInputs(msgspec.Struct):
    """Every input of a run, read and validated (``load_inputs``)."""

    mission: str
    ingest: tickets_mod.IngestReport
    tickets: list[tickets_mod.Ticket]  # in the run's order
    profile: prompts.PromptProfile
    model: ModelRef  # model.path, checked: what the workers load
    seed_guidance: guidance_mod.Guidance
    proposer_system: str | None  # the proposer's system prompt (search mode only)


def load_inputs(config: Config, model: ModelRef | None = None) -> RunInputs:
    """Read and validate every input file; raises InputError with a location on bad input.
    ``model``: the model path as the config's file checks resolved it (``load_checked_config``);
    None (a config loaded without them) checks it here."""
    exclude = tickets_mod.load_exclusions(
        config.ticket_filter.exclude_ticket_keys, config.ticket_filter.exclude_ticket_keys_path
    )

    ingest = tickets_mod.load_tickets(config.stage_a_paths, on_bad_line=config.ingest.on_bad_line,
                                      exclude_keys=exclude, max_line_bytes=config.ingest.max_line_bytes)
    # The mission (from the tickets) picks the profile's domain, and the profile may ask
    # for upstream's BBU summary clean-up (bbu_rru), applied to the tickets already loaded.
    mission = ingest.tickets[0].mission
    profile = prompts.load_profile(config.prompt.profile, mission=mission, domain=config.prompt.domain_for(mission))
    if profile.options.bbu_cleanup:
        ingest = msgspec.structs.replace(ingest, tickets=tickets_mod.bbu_clean_tickets(ingest.tickets))
    if model is None:
        model = models.check_model_path(config.model.path)
    check_engine(config.model.engine)
    seed_guidance = guidance_mod.load_guidance(config.guidance.path, mission)
    proposer_system = None
    if config.mode == "search":
        proposer_system = prompts.load_proposer_prompt(config.prompt.profile, config.rule_search.proposer_prompt_path)
    run_order = list(ingest.tickets)
    random.Random(config.seed).shuffle(run_order)  # upstream run order (3.1 step 7)
    return RunInputs(mission, ingest, run_order, profile, model, seed_guidance, proposer_system)


class RunPlan(msgspec.Struct, frozen=True):
    """What a run of ``config`` would do: its inputs, its run directory (not created yet), its
    workers' devices (None: ``check`` without ``--gpus``) and where they run (``backend``).
    ``config`` holds the mode and the group size the run uses; ``config_path`` is the file it
    was read from (None: a config built in code)."""

    config: Config
    inputs: RunInputs
    run_dir: Path
    devices: list[Device] | None = None
    backend: Backend = Fork()
    config_path: str | None = None

    def identity(self) -> RunIdentity:
        """What a ``--resume`` must match (a rule search's; ``check`` shows its hash in either
        mode). Computed on request: it hashes the whole config, and an audit run does not
        ask for it (a value no file can hold is then refused as the run writes run.json)."""
        return run_identity(self.config, self.inputs)


def plan_command(config_path: str, overrides=(), *, audit: bool = False, upstream_root: str | None = None,
                 devices: DeviceRequest | None = None, check_prompts: bool = False) -> RunPlan:
    """The plan of a ``run`` or ``check`` command line: the config file read with its ``--set``
    overrides (``load_checked_config``: its file checks are the run's one check of the model
    path), then ``plan_run``."""
    config, model = load_checked_config(config_path, overrides, upstream_root=upstream_root)
    return plan_run(config, audit=audit, config_path=config_path, devices=devices, model=model,
                    check_prompts=check_prompts)


def plan_run(config: Config, *, audit: bool, config_path: str | None, devices: DeviceRequest | None = None,
             model: ModelRef | None = None, check_prompts: bool = False) -> RunPlan:
    """Validate ``config`` (``--audit`` and the device options applied) and every input it
    names; raises InputError with a location on bad input. ``model``: the model path already
    checked (None: checked here). ``check_prompts``: also refuse prompts no worker could use
    (``refuse_unusable_prompts``: a tokenizer without a chat template, a guidance over a
    prompt cap), as ``run`` does before any worker loads the model; ``check`` measures the
    prompts in its own table instead. ``config_path`` is one of the inputs no output may
    overwrite."""
    workers, backend = None, Fork()
    if devices is not None:
        if devices.gpus_per_worker is not None and not 1 <= devices.gpus_per_worker <= 16:
            # The same bound as the config key, checked here so that the message names the option;
            # after the config is read, as the option's other checks are.
            raise UsageError(f"argument --gpus-per-worker: must be from 1 to 16, got {devices.gpus_per_worker}",
                             devices.command)
        config = with_gpus_per_worker(config, devices.gpus_per_worker)
        given = devices.gpus_per_worker is not None
        key = f"{os.path.abspath(config_path)}: model.gpus_per_worker" if config_path else "model.gpus_per_worker"
        backend = devices.backend(config)
        workers = resolve_devices(devices.gpus, backend, gpus_per_worker=config.model.gpus_per_worker,
                                  threads_per_worker=config.pool.threads_per_worker,
                                  group_location="--gpus-per-worker" if given else key)
    config = with_mode(config, audit)
    inputs = load_inputs(config, model)
    if check_prompts:
        refuse_unusable_prompts(config, inputs)
    run_dir = rundir.run_dir_path(config, inputs.mission)
    rundir.check_inside(run_dir, config.output.root)
    check_outputs(config, run_dir, config_path=config_path)
    return RunPlan(config, inputs, run_dir, workers, backend, config_path)


def resolve_devices(spec, backend: Backend = Fork(), *, gpus_per_worker: int = 1, threads_per_worker: int = 1,
                    group_location: str = "--gpus-per-worker") -> list[Device]:
    """The devices of a ``--gpus`` spec as ``backend`` reads it (``pool.plan_devices``), one per
    worker; a bad spec is an InputError located at ``--gpus``, a group size that does not fit
    it one located at ``group_location`` (the option, or the config key it came from)."""
    try:
        return plan_devices(backend, spec, gpus_per_worker=gpus_per_worker, threads_per_worker=threads_per_worker)
    except GroupSizeError as err:
        raise InputError(str(err), group_location) from None
    except DeviceSpecError as err:
        raise InputError(str(err), "--gpus") from None


def with_gpus_per_worker(config: Config, gpus_per_worker: int | None) -> Config:
    """The config with ``--gpus-per-worker`` (when given) in ``model.gpus_per_worker``, so the
    resolved config in run.json and the resume identity hold the group size the run used."""
    if gpus_per_worker is None or gpus_per_worker == config.model.gpus_per_worker:
        return config
    model = msgspec.structs.replace(config.model, gpus_per_worker=gpus_per_worker)
    return msgspec.structs.replace(config, model=model)
