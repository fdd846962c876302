"""Building a worker's engine: prepare the device, load the model, wrap it in an engine.

The engines take a loaded model and tokenizer (as nanochat's ``Engine(model, tokenizer)``),
so tests and benchmarks can hand them any model; each engine's module has its builder
(``build_transformers_engine``, ``build_vllm_engine``, ``build_simulated_engine``), each
taking the worker's device, the model (a ``ModelRef`` the parent checked) and the
``EngineSettings``; ``build_engine`` is what the pool's engine factory calls inside each
worker, after the fork: it picks one. torch and vllm are imported only here, inside the
functions: vLLM reads its settings from the environment before torch starts.
"""

from __future__ import annotations

import os

import msgspec

from ..pool.devices import Device
from .model_path import ModelRef
from .records import ENGINES, EngineSettings

_DETERMINISTIC_CUBLAS = (":4096:8", ":16:8")


def preload(model: ModelRef, settings: EngineSettings = EngineSettings()):
    """What every worker of this engine would load alike, loaded once in the parent before it
    forks the pool, so that each worker inherits it (pass it to ``build_engine``): the
    simulated engine's token counter (``simulated_engine.preloaded_counter``: a
    ``tokenizer.json`` read without any thread). None for the model engines: their model and
    tokenizer need torch or transformers, which the parent never imports."""
    if settings.engine != "simulated":
        return None
    from .simulated_engine import preloaded_counter

    return preloaded_counter(model)


def build_engine(device, model: ModelRef, settings: EngineSettings = EngineSettings(), preloaded=None):
    """The engine ``settings.engine`` ("transformers", "vllm" or "simulated") for ``device``,
    with ``model`` loaded as it is: its path was checked in the parent
    (``model_path.check_model_path``) and is not checked again here. The simulated engine
    loads no model, only ``model``'s tokenizer (``preloaded``: ``preload``'s, inherited from
    the parent), and never touches torch."""
    device = device if isinstance(device, Device) else msgspec.convert(device, Device)
    if settings.engine not in ENGINES:
        raise ValueError(f"unknown engine {settings.engine!r} (expected one of {', '.join(ENGINES)})")
    if settings.engine == "simulated":
        from .simulated_engine import build_simulated_engine

        return build_simulated_engine(device, model, settings, preloaded)
    if device.kind == "cuda":
        _pin_cuda_environment()
    if settings.engine == "vllm":
        from .vllm_engine import build_vllm_engine

        return build_vllm_engine(device, model, settings)
    from .transformers_engine import build_transformers_engine

    return build_transformers_engine(device, model, settings)


def prepare_device(device: Device) -> None:
    """What must happen before the first torch op of a worker: its thread count (fork rule)
    and, on a GPU, the deterministic settings that must precede the CUDA context."""
    import torch

    torch.set_num_threads(max(1, device.threads))
    if device.kind == "cuda":
        torch.use_deterministic_algorithms(True, warn_only=True)
        torch.backends.cudnn.benchmark = False
        torch.backends.cudnn.deterministic = True
        # TF32 pinned off, so a run does not depend on a default that differs between versions.
        torch.backends.cuda.matmul.fp32_precision = "ieee"
        torch.backends.cudnn.fp32_precision = "ieee"
        # cuDNN's attention, which sdpa prefers for bfloat16 on Hopper, gave a sampled chunk
        # 4 different results in 8 repeats on an H100 (torch 2.11); without it, 8 of 8 alike
        # at the same speed (bench/cuda_check.py repeat, docs/performance.md).
        torch.backends.cuda.enable_cudnn_sdp(False)


def _pin_cuda_environment() -> None:
    if os.environ.get("CUBLAS_WORKSPACE_CONFIG") not in _DETERMINISTIC_CUBLAS:
        os.environ["CUBLAS_WORKSPACE_CONFIG"] = ":4096:8"
