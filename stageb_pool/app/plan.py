"""The run plan: a command's config and options turned into everything a run is about to do,
validated, by the one start-up sequence of ``check`` (which prints it) and ``run`` (which
executes it, ``job.run_plan``): the backend and devices, the mode, every input (the model path
checked once into the ``ModelRef`` the workers load), the run directory and the outputs.
Nothing here touches the disk or forks a worker: bad input costs nothing and damages nothing.
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
from .config import Config, load_checked_config, replace_at, with_mode
from .identity import run_identity
from .outputs import check_outputs
from .prompt_budget import refuse_unusable_prompts


class DeviceRequest(msgspec.Struct, frozen=True):
    """A command's device options (None: not given); ``command`` locates a usage error in them."""

    gpus: str
    gpus_per_worker: int | None = None
    ray_address: str | None = None
    debug: bool = False
    command: str = "stageb-pool run"

    def backend(self, config: Config) -> Backend:
        """``--debug`` wins over ``--ray``; Ray's bounds are the config's."""
        if self.debug:
            return Inline()
        if self.ray_address is not None:
            return Ray(self.ray_address, placement_timeout=config.pool.start_timeout,
                       connect_timeout=config.pool.connect_timeout)
        return Fork()


class RunInputs(msgspec.Struct):
    mission: str
    ingest: tickets_mod.IngestReport
    tickets: list[tickets_mod.Ticket]  # in the run's order
    profile: prompts.PromptProfile
    model: ModelRef  # model.path, checked: what the workers load
    seed_guidance: guidance_mod.Guidance
    proposer_system: str | None  # the proposer's system prompt (search mode only)


def load_inputs(config: Config, model: ModelRef | None = None) -> RunInputs:
    """Read and validate every input file; InputError with a location on bad input. ``model``:
    the model path ``load_checked_config`` already checked (None: checked here)."""
    exclude = tickets_mod.load_exclusions(
        config.ticket_filter.exclude_ticket_keys, config.ticket_filter.exclude_ticket_keys_path
    )

    ingest = tickets_mod.load_tickets(config.stage_a_paths, on_bad_line=config.ingest.on_bad_line,
                                      exclude_keys=exclude, max_line_bytes=config.ingest.max_line_bytes)
    # the mission (from the tickets) picks the profile's domain; bbu_rru cleans the tickets up
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
    """What a run would do. ``run_dir`` is not created yet; ``devices`` None: ``check`` without
    ``--gpus``; ``config_path`` None: a config built in code."""

    config: Config
    inputs: RunInputs
    run_dir: Path
    devices: list[Device] | None = None
    backend: Backend = Fork()
    config_path: str | None = None

    def identity(self) -> RunIdentity:
        """What a ``--resume`` must match. Computed on request: it hashes the whole config, and
        an audit does not ask for it (a value no file can hold is then refused at run.json)."""
        return run_identity(self.config, self.inputs)


def plan_command(config_path: str, overrides=(), *, audit: bool = False, upstream_root: str | None = None,
                 devices: DeviceRequest | None = None, check_prompts: bool = False) -> RunPlan:
    """A ``run`` or ``check`` command line's plan (its file checks are the run's one check of the model path)."""
    config, model = load_checked_config(config_path, overrides, upstream_root=upstream_root)
    return plan_run(config, audit=audit, config_path=config_path, devices=devices, model=model,
                    check_prompts=check_prompts)


def plan_run(config: Config, *, audit: bool, config_path: str | None, devices: DeviceRequest | None = None,
             model: ModelRef | None = None, check_prompts: bool = False) -> RunPlan:
    """Validate ``config`` (``--audit`` and the device options applied) and every input it
    names; InputError with a location on bad input. ``check_prompts``: also refuse prompts no
    worker could use (``run``; ``check`` measures them in its own table instead)."""
    workers, backend = None, Fork()
    if devices is not None:
        if devices.gpus_per_worker is not None and not 1 <= devices.gpus_per_worker <= 16:
            # the config key's bound, checked here so that the message names the option
            raise UsageError(f"argument --gpus-per-worker: must be from 1 to 16, got {devices.gpus_per_worker}",
                             devices.command)
        if devices.gpus_per_worker is not None:  # so that run.json and the resume identity hold it
            config = replace_at(config, "model.gpus_per_worker", devices.gpus_per_worker)
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
    """One device per worker; InputError located at ``--gpus`` for a bad spec, at
    ``group_location`` (the option or the config key) for a group size that does not fit it."""
    try:
        return plan_devices(backend, spec, gpus_per_worker=gpus_per_worker, threads_per_worker=threads_per_worker)
    except GroupSizeError as err:
        raise InputError(str(err), group_location) from None
    except DeviceSpecError as err:
        raise InputError(str(err), "--gpus") from None

