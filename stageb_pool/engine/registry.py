"""The list of engines: every name ``model.engine`` may take, and what the rest of the program
needs of each. Adding an engine is its module (an ``Engine``: ``contract.py``) and one entry in
``ENGINES``; the config schema's names, what ``check`` prints, the resume identity and the
workers' agreement check derive from here. An engine's own settings are its section of the
model section, ``model.<name>``. The schema reads ``ENGINES`` when it is defined: an entry
added at run time is added before ``stageb_pool.app`` is imported. Nothing here imports torch:
each worker imports its engine's module after the fork (``build_engine``).
"""

from __future__ import annotations

import functools
import importlib
import logging
import os
from collections.abc import Callable
from dataclasses import dataclass

import msgspec

from ..pool import REFUSE_ANY_DIFFERENCE, Device, EngineAgreement
from ..stageb.errors import InputError
from . import simulated_engine, vllm_engine
from .models import ModelRef

log = logging.getLogger("stageb_pool")
_DETERMINISTIC_CUBLAS = (":4096:8", ":16:8")


@dataclass(frozen=True)
class EngineEntry:
    """What the program needs of one engine. ``build`` is ``"module:function"`` (a leading dot:
    a module of this package), imported inside the worker: ``function(device, model, config,
    preloaded)`` returns the engine (``contract.Engine``) of ``model`` (the ``ModelRef`` the
    parent checked) on ``device``, as ``config`` (the config's model section) says."""

    build: str
    settings: type | None = None  # the record of its own section of the model section, model.<name>
    describe: str = ""  # what ``check`` adds after the engine's name on the model line
    # Its section is in the resume identity of every run, not only of its own runs: the vLLM
    # section was there before other sections existed, and old runs' identity hashes hold it.
    in_every_identity: bool = False
    agreement: tuple[str, ...] = ()  # facts of its info() beyond AGREEMENT that every worker must share
    check: Callable[[], None] | None = None  # run in the parent before anything starts (raises InputError)
    # preload(model): what every worker would load alike, loaded once by the parent before the
    # fork and inherited (None from it: each worker loads its own)
    preload: Callable[[ModelRef], object] | None = None
    # token_counter(model), for an engine that measures prompts with a token counter rather
    # than the chat template (its preload, when it has one, is that counter)
    token_counter: Callable[[ModelRef], object] | None = None
    gpu_bytes: Callable[[object], int] | None = None  # gpu_bytes(config): GPU memory a worker holds besides the weights
    cuda_pinned: bool = True  # the deterministic cuBLAS workspace set before the builder runs on a GPU


ENGINES: dict[str, EngineEntry] = {
    "transformers": EngineEntry(build=".transformers_engine:build_transformers_engine"),
    "vllm": EngineEntry(build=".vllm_engine:build_vllm_engine", settings=vllm_engine.VllmSettings,
                        in_every_identity=True, agreement=vllm_engine.AGREEMENT,
                        check=vllm_engine.check_installed, gpu_bytes=vllm_engine.kv_cache_bytes),
    "simulated": EngineEntry(build=".simulated_engine:build_simulated_engine",
                             settings=simulated_engine.SimulatedSettings, describe=simulated_engine.DESCRIBE,
                             preload=simulated_engine.preloaded_counter, token_counter=simulated_engine.token_counter,
                             cuda_pinned=False),
}
DEFAULT_ENGINE = next(iter(ENGINES))

# The facts every worker must share, whatever the engine: which engine, and the versions of
# the libraries every model engine runs on (another version gives other bytes).
AGREEMENT = ("torch", "transformers")


def entry(name: str) -> EngineEntry:
    if name not in ENGINES:
        raise ValueError(f"unknown engine {name!r} (expected one of {', '.join(ENGINES)})")
    return ENGINES[name]


def check_engine(name: str) -> str:
    """``model.engine``, checked in the parent by its ``check``, without importing the engine."""
    check = entry(name).check
    if check is not None:
        check()
    return name


def build_engine(device, model: ModelRef, config, preloaded=None):
    """The engine ``config.engine`` names, built inside the worker; ``preloaded``: its ``preload``."""
    device = device if isinstance(device, Device) else msgspec.convert(device, Device)
    chosen = entry(config.engine)
    if chosen.cuda_pinned and device.kind == "cuda":
        pin_cuda_environment()
    module, function = chosen.build.split(":")
    builder = getattr(importlib.import_module(module, __package__), function)
    return builder(device, model, config, preloaded)


def engine_factory_for(config, model: ModelRef):
    """The factory each worker calls after the fork (``build_engine``); the entry's ``preload``
    is loaded here, once, before the fork."""
    load = entry(config.engine).preload
    preloaded = None if load is None else load(model)
    return functools.partial(build_engine, model=model, config=config, preloaded=preloaded)


def pin_cuda_environment() -> None:
    """The deterministic cuBLAS workspace, set before the first cuBLAS call of the worker."""
    if os.environ.get("CUBLAS_WORKSPACE_CONFIG") not in _DETERMINISTIC_CUBLAS:
        os.environ["CUBLAS_WORKSPACE_CONFIG"] = ":4096:8"


def gpu_bytes(config) -> int:
    hook = entry(config.engine).gpu_bytes
    return 0 if hook is None else hook(config)


def describe_note(name: str) -> str:
    """What ``check`` adds to the model line (nothing for the default engine)."""
    if name == DEFAULT_ENGINE:
        return ""
    more = entry(name).describe
    return f" (engine {name}{': ' + more if more else ''})"


def identity_model_section(model: dict) -> dict:
    """The config's model section (as plain data) as the resume identity holds it: an
    engine's own section only in the identity of runs of that engine (a latency model's
    rates change nothing another engine computes), unless ``in_every_identity``."""
    out = dict(model)
    for name, known in ENGINES.items():
        if known.settings is not None and name != model.get("engine") and not known.in_every_identity:
            out.pop(name, None)
    return out


def agreement_facts() -> tuple[str, ...]:
    return ("engine", *(fact for known in ENGINES.values() for fact in known.agreement), *AGREEMENT)


def engine_agreement(ray: bool) -> EngineAgreement:
    """What the pool does when the workers report different engines (byte-identical results
    need the same software, device model and dtype). Under Ray any difference is refused. On
    one machine another engine or version is an input error at --gpus, and any other difference
    (mixed GPU models) a warning: run.json records rank 0's facts only."""
    if ray:
        return REFUSE_ANY_DIFFERENCE
    return EngineAgreement(refuse=agreement_facts(), warn=log,
                           error=functools.partial(InputError, location="--gpus"))
