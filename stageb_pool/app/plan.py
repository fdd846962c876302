"""The run plan: a command's config and options turned into everything a run is about to do,
validated.

``plan_command`` (the config file, ``--set``, ``--audit``, the device options, ``--upstream-root``)
and ``plan_run`` (a config already loaded, as tests and benchmarks hold it) are the one start-up
sequence of ``check`` and ``run``: the group size and the ``--gpus`` spec turned into the
workers' devices (``resolve_devices``, the one parse of the spec), the mode applied, every
input read and validated (``load_inputs``: tickets, exclusions, prompt profile, model path,
engine, seed guidance, proposer prompt), the run directory placed and checked, the outputs
checked against the inputs; the run's identity on request. The model path is checked once, in
this process, into a ``ModelRef`` that the workers load without checking it again. ``check``
prints the plan (``describe``), ``run`` executes it (``job.run_plan``). Nothing here touches
the disk or forks a worker: bad input costs nothing and damages nothing.
"""

from __future__ import annotations

import os
import random
from pathlib import Path

import msgspec

from ..engine import models
from ..engine.models import ModelRef
from ..engine.registry import check_engine
from ..pool import Device, DeviceSpecError, parse_gpus, parse_ray_spec
from ..pool.devices import GroupSizeError, ray_devices
from ..search import rundir
from ..search.settings import RunIdentity
from ..stageb import guidance as guidance_mod
from ..stageb import prompts
from ..stageb import tickets as tickets_mod
from ..stageb.errors import InputError, UsageError
from .config import load_checked_config, with_mode
from .identity import run_identity
from .outputs import check_outputs
from .prompt_budget import refuse_unusable_prompts


class DeviceRequest(msgspec.Struct, frozen=True):
    """A command's device options: the ``--gpus`` spec, ``--gpus-per-worker`` (None: the
    config's ``model.gpus_per_worker``) and ``--ray``'s address (None: workers forked here);
    ``command`` (``stageb-pool run``) is where a usage error in them is located."""

    gpus: str
    gpus_per_worker: int | None = None
    ray_address: str | None = None
    command: str = "stageb-pool run"


class RunInputs(msgspec.Struct):
    """Every input of a run, read and validated (``load_inputs``)."""

    mission: str
    ingest: object
    tickets: list
    profile: object
    model: ModelRef  # model.path, checked: what the workers load
    seed_guidance: object
    proposer_system: str | None  # the proposer's system prompt (search mode only)


def load_inputs(config, model: ModelRef | None = None) -> RunInputs:
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
    """What a run of ``config`` would do: its inputs, its run directory (not created yet) and
    its workers' devices (None: ``check`` without ``--gpus``), run as Ray actors on the cluster
    at ``ray_address`` when it is set. ``config`` holds the mode and the group size the run
    uses; ``config_path`` is the file it was read from (None: a config built in code)."""

    config: object
    inputs: RunInputs
    run_dir: Path
    devices: list[Device] | None = None
    ray_address: str | None = None
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


def plan_run(config, *, audit: bool, config_path: str | None, devices: DeviceRequest | None = None,
             model: ModelRef | None = None, check_prompts: bool = False) -> RunPlan:
    """Validate ``config`` (``--audit`` and the device options applied) and every input it
    names; raises InputError with a location on bad input. ``model``: the model path already
    checked (None: checked here). ``check_prompts``: also refuse prompts no worker could use
    (``refuse_unusable_prompts``: a tokenizer without a chat template, a guidance over a
    prompt cap), as ``run`` does before any worker loads the model; ``check`` measures the
    prompts in its own table instead. ``config_path`` is one of the inputs no output may
    overwrite."""
    workers = None
    if devices is not None:
        if devices.gpus_per_worker is not None and not 1 <= devices.gpus_per_worker <= 16:
            # The same bound as the config key, checked here so that the message names the option;
            # after the config is read, as the option's other checks are.
            raise UsageError(f"argument --gpus-per-worker: must be from 1 to 16, got {devices.gpus_per_worker}",
                             devices.command)
        config = with_gpus_per_worker(config, devices.gpus_per_worker)
        given = devices.gpus_per_worker is not None
        key = f"{os.path.abspath(config_path)}: model.gpus_per_worker" if config_path else "model.gpus_per_worker"
        workers = resolve_devices(devices.gpus, ray=devices.ray_address is not None,
                                  gpus_per_worker=config.model.gpus_per_worker,
                                  threads_per_worker=config.pool.threads_per_worker,
                                  group_location="--gpus-per-worker" if given else key)
    config = with_mode(config, audit)
    inputs = load_inputs(config, model)
    if check_prompts:
        refuse_unusable_prompts(config, inputs)
    run_dir = rundir.run_dir_path(config, inputs.mission)
    rundir.check_inside(run_dir, config.output.root)
    check_outputs(config, run_dir, config_path=config_path)
    return RunPlan(config, inputs, run_dir, workers, devices.ray_address if devices is not None else None,
                   config_path)


def resolve_devices(spec, *, ray: bool = False, gpus_per_worker: int = 1, threads_per_worker: int = 1,
                    group_location: str = "--gpus-per-worker") -> list[Device]:
    """The devices of a ``--gpus`` spec, one per worker (a group of ``gpus_per_worker`` GPUs
    each, ``threads_per_worker`` torch threads each: ``pool.threads_per_worker``); a bad spec is an InputError located at ``--gpus``, a group size that does not fit
    it one located at ``group_location`` (the option, or the config key it came from).
    Under Ray (``--ray``) the spec is a GPU count or ``cpu:N``: Ray chooses the GPUs, so the
    devices are numbered by rank."""
    try:
        if ray:
            kind, count = parse_ray_spec(spec, gpus_per_worker=gpus_per_worker)
            return ray_devices(kind, count, gpus_per_worker, threads_per_worker)
        return parse_gpus(spec, gpus_per_worker=gpus_per_worker, threads_per_worker=threads_per_worker)
    except GroupSizeError as err:
        raise InputError(str(err), group_location) from None
    except DeviceSpecError as err:
        raise InputError(str(err), "--gpus") from None


def with_gpus_per_worker(config, gpus_per_worker: int | None):
    """The config with ``--gpus-per-worker`` (when given) in ``model.gpus_per_worker``, so the
    resolved config in run.json and the resume identity hold the group size the run used."""
    if gpus_per_worker is None or gpus_per_worker == config.model.gpus_per_worker:
        return config
    model = msgspec.structs.replace(config.model, gpus_per_worker=gpus_per_worker)
    return msgspec.structs.replace(config, model=model)
