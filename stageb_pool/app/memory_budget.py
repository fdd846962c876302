"""``check``'s memory budget: will the weights (from the checkpoint's file headers, never
loaded) fit one worker group's GPU memory (from ``nvidia-smi``: the parent never initialises
CUDA)? What else a worker needs is not estimated (but vLLM's KV cache): hence the margin.
"""

from __future__ import annotations

import math
import struct
from pathlib import Path

import msgspec

GIB = 2**30
# the rest is for the CUDA context, activations and (transformers) a chunk's KV cache
WEIGHT_SHARE = 0.9
MAX_HEADER_BYTES = 100 * 2**20  # a safetensors header larger than this is not a checkpoint's
DTYPE_BYTES = {"float32": 4, "float64": 8, "float16": 2, "bfloat16": 2}


class HeaderError(ValueError):
    """A model file whose header cannot be read (the estimate is then skipped, not fatal)."""


def weight_bytes(model_file_or_dir: str | Path, dtype: str) -> int | None:
    """Bytes of the weights once loaded in ``dtype``; None without a safetensors or GGUF file."""
    path = Path(model_file_or_dir)
    per_param = DTYPE_BYTES.get(str(dtype), 2)
    if path.is_file() and path.suffix.lower() == ".gguf":
        return gguf_parameters(path) * per_param
    files = sorted(path.glob("*.safetensors")) if path.is_dir() else []
    if not files:
        return None
    return sum(safetensors_parameters(f) for f in files) * per_param


def safetensors_parameters(path: Path) -> int:
    with open(path, "rb") as f:
        head = f.read(8)
        if len(head) != 8:
            raise HeaderError(f"{path}: too short for a safetensors file")
        (size,) = struct.unpack("<Q", head)
        if size > MAX_HEADER_BYTES:
            raise HeaderError(f"{path}: a safetensors header of {size} bytes")
        try:
            header = msgspec.json.decode(f.read(size))
        except msgspec.DecodeError as err:
            raise HeaderError(f"{path}: unreadable safetensors header ({err})") from None
    if not isinstance(header, dict):
        raise HeaderError(f"{path}: the safetensors header is not a JSON object")
    return sum(math.prod(t.get("shape", [])) for k, t in header.items() if k != "__metadata__" and isinstance(t, dict))


# GGUF metadata value types (gguf spec): fixed sizes, 8 = string, 9 = array.
_GGUF_FIXED = {0: 1, 1: 1, 2: 2, 3: 2, 4: 4, 5: 4, 6: 4, 7: 1, 10: 8, 11: 8, 12: 8}


def gguf_parameters(path: Path) -> int:
    """From the tensor table. Not ``gguf.GGUFReader``: it parses every metadata value, the
    vocabulary included (2.8 s on the embedded model, this 0.05 s)."""
    with open(path, "rb") as f:
        def read(n: int) -> bytes:
            data = f.read(n)
            if len(data) != n:
                raise HeaderError(f"{path}: the GGUF header ends early")
            return data

        def u32() -> int:
            return struct.unpack("<I", read(4))[0]

        def u64() -> int:
            return struct.unpack("<Q", read(8))[0]

        def skip_value(kind: int) -> None:
            if kind in _GGUF_FIXED:
                f.seek(_GGUF_FIXED[kind], 1)
            elif kind == 8:
                f.seek(u64(), 1)
            elif kind == 9:
                inner, count = u32(), u64()
                if inner in _GGUF_FIXED:
                    f.seek(_GGUF_FIXED[inner] * count, 1)
                else:
                    for _ in range(count):
                        skip_value(inner)
            else:
                raise HeaderError(f"{path}: unknown GGUF value type {kind}")

        if read(4) != b"GGUF":
            raise HeaderError(f"{path}: not a GGUF file")
        if u32() < 2:
            raise HeaderError(f"{path}: GGUF version 1 is not supported")
        tensors, kvs = u64(), u64()
        for _ in range(kvs):
            f.seek(u64(), 1)  # the key
            skip_value(u32())
        total = 0
        for _ in range(tensors):
            f.seek(u64(), 1)  # the name
            dims = [u64() for _ in range(u32())]
            f.seek(4 + 8, 1)  # ggml type, offset
            total += math.prod(dims)
        return total


def budget_lines(devices, weights: int | None, *, extra_bytes: int = 0, gpu_memory: dict[int, int] | None) -> list[tuple[str, str]]:
    """``devices``: CUDA workers (``describe.memory_lines`` asks); ``extra_bytes``: e.g. vLLM's KV cache."""
    if weights is None:
        return [("memory", "no estimate: the model has no safetensors or GGUF file to read the size from")]
    need = weights + extra_bytes
    what = f"weights ~{weights / GIB:.1f} GiB" + (f" + {extra_bytes / GIB:.1f} GiB KV cache" if extra_bytes else "")
    if gpu_memory is None:
        return [("memory", f"{what} per worker; GPU memory unknown (nvidia-smi cannot be read here)")]
    groups = [d.gpus for d in devices]
    if not all(g in gpu_memory for group in groups for g in group):
        return [("memory", f"{what} per worker; GPU memory unknown for some GPUs of --gpus")]
    smallest = min(sum(gpu_memory[g] for g in group) for group in groups)
    size = devices[0].group_size
    line = f"{what} per worker; a group of {size} GPU{'s' if size != 1 else ''} has {smallest / GIB:.1f} GiB"
    if need <= WEIGHT_SHARE * smallest:
        return [("memory", line + f" (fits, {need / smallest:.0%})")]
    hint = "use more --gpus-per-worker" if size < 16 else "use a smaller model"
    return [("memory", line), ("  WARNING", f"the model will not fit one group: it needs {need / smallest:.0%} of "
                                           f"its GPU memory, at most {WEIGHT_SHARE:.0%} leaves room to run ({hint})")]
