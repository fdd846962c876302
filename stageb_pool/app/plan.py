"""The run plan: a config and its mode turned into everything a run is about to do, validated.

``plan_run`` is the one start-up sequence of ``check`` and ``run``: the mode applied, every
input read and validated (``load_inputs``: tickets, exclusions, prompt profile, model path,
engine, seed guidance, proposer prompt), the run directory placed and checked, the outputs
checked against the inputs; the run's identity on request. ``check`` prints the plan
(``describe``), ``run`` executes it (``job.run_job``). Nothing here touches the disk or
forks a worker: bad input costs nothing and damages nothing.
"""

from __future__ import annotations

import random
from pathlib import Path

import msgspec

from ..engine.model_path import ModelRef, check_engine, check_model_path
from ..search import rundir
from ..search.settings import RunIdentity
from ..stageb import guidance as guidance_mod
from ..stageb import prompts
from ..stageb import tickets as tickets_mod
from .config import with_mode
from .identity import run_identity
from .outputs import check_outputs
from .prompt_budget import refuse_unusable_prompts


class RunInputs(msgspec.Struct):
    """Every input of a run, read and validated (``load_inputs``)."""

    mission: str
    ingest: object
    tickets: list
    profile: object
    model: ModelRef  # model.path, checked: what the workers load
    seed_guidance: object
    proposer_system: str | None  # the proposer's system prompt (search mode only)


def load_inputs(config) -> RunInputs:
    """Read and validate every input file; raises InputError with a location on bad input."""
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
    model = check_model_path(config.model.path)
    check_engine(config.model.engine)
    seed_guidance = guidance_mod.load_guidance(config.guidance.path, mission)
    proposer_system = None
    if config.mode == "search":
        proposer_system = prompts.load_proposer_prompt(config.prompt.profile, config.rule_search.proposer_prompt_path)
    run_order = list(ingest.tickets)
    random.Random(config.seed).shuffle(run_order)  # upstream run order (3.1 step 7)
    return RunInputs(mission, ingest, run_order, profile, model, seed_guidance, proposer_system)


class RunPlan(msgspec.Struct, frozen=True):
    """What a run of ``config`` would do: its inputs and its run directory (not created yet)."""

    config: object
    inputs: RunInputs
    run_dir: Path

    def identity(self) -> RunIdentity:
        """What a ``--resume`` must match (a rule search's; ``check`` shows its hash in either
        mode). Computed on request: it hashes the whole config, and an audit run does not
        ask for it (a value no file can hold is then refused as the run writes run.json)."""
        return run_identity(self.config, self.inputs)


def plan_run(config, *, audit: bool, config_path: str | None, check_prompts: bool = False) -> RunPlan:
    """Validate ``config`` (``--audit`` applied) and every input it names; raises InputError
    with a location on bad input. ``check_prompts``: also refuse prompts no worker could use
    (``refuse_unusable_prompts``: a tokenizer without a chat template, a guidance over a
    prompt cap), as ``run`` does before any worker loads the model; ``check`` measures the
    prompts in its own table instead. ``config_path`` is one of the inputs no output may
    overwrite."""
    config = with_mode(config, audit)
    inputs = load_inputs(config)
    if check_prompts:
        refuse_unusable_prompts(config, inputs)
    run_dir = rundir.run_dir_path(config, inputs.mission)
    rundir.check_inside(run_dir, config.output.root)
    check_outputs(config, run_dir, config_path=config_path)
    return RunPlan(config, inputs, run_dir)
