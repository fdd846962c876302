"""Building a worker's engine: prepare the device, load the model, wrap it in an ``Engine``.

The engine itself takes a loaded model and tokenizer (as nanochat's ``Engine(model,
tokenizer)``), so tests and benchmarks can hand it any model; ``build_engine`` is what the
pool's engine factory calls inside each worker, after the fork.
"""

from __future__ import annotations

import os

import msgspec
import torch

from ..pool.devices import Device
from . import models
from .transformers_engine import Engine

_DETERMINISTIC_CUBLAS = (":4096:8", ":16:8")


def build_engine(device, *, path: str = "embedded", dtype: str | None = None,
                 attn_implementation: str | None = None, trust_remote_code: bool = False,
                 stop: list[str] | None = None) -> Engine:
    """The transformers engine for ``device``, with the model at ``path``.

    ``path``: ``"embedded"``, ``"tiny"``, a checkpoint directory or a ``.gguf`` file.
    ``dtype`` defaults to bfloat16 on CUDA and float32 on CPU; ``attn_implementation`` to
    flash_attention_2 when installed, on CUDA with a 16-bit dtype, else sdpa.
    """
    device = device if isinstance(device, Device) else msgspec.convert(device, Device)
    prepare_device(device)
    dtype = dtype or models.default_dtype(device.kind)
    attn = attn_implementation or models.default_attn_implementation(device.kind, dtype)
    model, tokenizer, name = models.load(path, dtype=dtype, attn_implementation=attn,
                                         trust_remote_code=trust_remote_code, device=device.torch_device)
    return Engine(model, tokenizer, device, stop=stop, model_path=models.check_model_path(path), model_name=name)


def prepare_device(device: Device) -> None:
    """What must happen before the first torch op of a worker: its thread count (fork rule)
    and, on a GPU, the deterministic settings that must precede the CUDA context."""
    torch.set_num_threads(max(1, device.threads))
    if device.kind == "cuda":
        _pin_cuda_determinism()


def _pin_cuda_determinism() -> None:
    if os.environ.get("CUBLAS_WORKSPACE_CONFIG") not in _DETERMINISTIC_CUBLAS:
        os.environ["CUBLAS_WORKSPACE_CONFIG"] = ":4096:8"
    torch.use_deterministic_algorithms(True, warn_only=True)
    torch.backends.cudnn.benchmark = False
    torch.backends.cudnn.deterministic = True
    # TF32 pinned off, so a run does not depend on a default that differs between versions.
    torch.backends.cuda.matmul.fp32_precision = "ieee"
    torch.backends.cudnn.fp32_precision = "ieee"
