"""The ``info()`` of the model engines (``contract.py``): it is hashed into every rollout
cache key, so its keys, values *and order* are a contract, written once here; each engine
passes only what is its own.
"""

from __future__ import annotations

import importlib.metadata

from ..pool.devices import Device


def engine_info(engine: str, device: Device, *, dtype: str | None, model_path: str, model_name: str,
                stop: list[str], sharding: str, engine_version: str | None = None,
                model_options: dict | None = None, engine_settings: dict | None = None) -> dict:
    """``info()`` of a model engine; ``engine_version``: its own library's (vLLM's)."""
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
    """The device's name and, on a GPU, its CUDA and cuDNN versions (another stack, other bits)."""
    import torch

    if device_kind != "cuda":
        return {"device": "cpu"}
    return {"device": torch.cuda.get_device_name(0), "cuda": str(torch.version.cuda),
            "cudnn": torch.backends.cudnn.version()}


def group_facts(device: Device, sharding: str) -> dict:
    """How the model is spread over the worker's GPU group (another size, other bits); nothing
    for one GPU, whose identity names no group."""
    if device.group_size == 1:
        return {}
    return {"gpus_per_worker": device.group_size, "sharding": sharding}
