"""What an engine reports about itself (``info()``): the facts its results' bytes depend on.

Rank 0's report goes into run.json (``provenance``) and, hashed, into every rollout cache
key; the parent refuses workers whose engine or versions differ. So the dict's keys, values
*and order* are a contract: ``engine_info`` writes the part both model engines share, in the
one order both have always used, and each engine passes only what is its own.
"""

from __future__ import annotations

import importlib.metadata

from ..pool.devices import Device


def engine_info(engine: str, device: Device, *, dtype: str | None, model_path: str, model_name: str,
                stop: list[str], sharding: str, engine_version: str | None = None,
                model_options: dict | None = None, engine_settings: dict | None = None) -> dict:
    """``info()`` of a model engine, in this order: the engine's name, its own library's
    version under that name (``engine_version``: vLLM's), torch and transformers, the device
    (``device_facts``), ``dtype``, the model (``model_path``: "embedded", "tiny" or an absolute
    path; its name), how it was loaded (``model_options``: the transformers engine's attention
    implementation), the stop strings, llguidance (constrained decoding), the engine's pinned
    settings (``engine_settings``: vLLM's) and, for a worker of a GPU group, how the model is
    split over it (``group_facts`` with the scheme ``sharding``)."""
    import torch
    import transformers

    return {
        "engine": engine,
        **({engine: engine_version} if engine_version is not None else {}),
        "torch": str(torch.__version__),  # a TorchVersion, not JSON-encodable as is
        "transformers": transformers.__version__,
        **device_facts(device.kind),
        "dtype": dtype,
        "model_path": model_path,
        "model": model_name,
        **(model_options or {}),
        "stop": stop,
        "llguidance": importlib.metadata.version("llguidance"),
        **(engine_settings or {}),
        **group_facts(device, sharding),
    }


def device_facts(device_kind: str) -> dict:
    """The device part of an engine's provenance: its name, and on a GPU the CUDA and cuDNN
    versions (another stack can give other bits)."""
    import torch

    if device_kind != "cuda":
        return {"device": "cpu"}
    return {"device": torch.cuda.get_device_name(0), "cuda": str(torch.version.cuda),
            "cudnn": torch.backends.cudnn.version()}


def group_facts(device: Device, sharding: str) -> dict:
    """How the model is spread over the worker's GPU group (``sharding``: the scheme's name):
    part of the identity, since another group size may give other bits. Nothing for one GPU:
    the identity (and the rollout cache key) of a one-GPU worker names no group."""
    if device.group_size == 1:
        return {}
    return {"gpus_per_worker": device.group_size, "sharding": sharding}
