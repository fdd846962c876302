"""Which devices the workers run on: parsing ``--gpus`` specs without touching CUDA.

The parent must never initialise CUDA (a forked child could not use it), so GPUs are
counted from the driver's /proc entries or ``nvidia-smi``, never through torch.cuda.
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess

import msgspec


class DeviceSpecError(ValueError):
    """A ``--gpus`` spec that cannot be read or names devices that do not exist."""


class Device(msgspec.Struct, frozen=True):
    """A worker's device. ``index`` is the physical GPU index (as the user wrote it) or the
    CPU worker's number; ``rank`` is the worker's position in the pool; ``threads`` is the
    torch intra-op thread count the worker sets before its first torch op."""

    kind: str  # "cuda" | "cpu"
    index: int
    rank: int
    threads: int = 1

    @property
    def name(self) -> str:
        return f"{self.kind}:{self.index}"

    @property
    def torch_device(self) -> str:
        # A GPU worker sees only its own GPU (CUDA_VISIBLE_DEVICES), which torch calls cuda:0.
        return "cuda:0" if self.kind == "cuda" else "cpu"

    def visible_devices(self) -> str:
        """The CUDA_VISIBLE_DEVICES value for this worker, relative to the parent's own."""
        parent = os.environ.get("CUDA_VISIBLE_DEVICES")
        if parent is None:
            return str(self.index)
        return [d.strip() for d in parent.split(",") if d.strip()][self.index]


def available_cpus() -> int:
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # not Linux
        return os.cpu_count() or 1


def count_gpus() -> int:
    """Number of GPUs this process may use, without initialising CUDA."""
    parent = os.environ.get("CUDA_VISIBLE_DEVICES")
    if parent is not None:
        return len([d for d in parent.split(",") if d.strip() and d.strip() != "-1"])
    proc = "/proc/driver/nvidia/gpus"
    if os.path.isdir(proc):
        return len(os.listdir(proc))
    if shutil.which("nvidia-smi"):
        out = subprocess.run(["nvidia-smi", "-L"], capture_output=True, text=True, timeout=30)
        return sum(1 for line in out.stdout.splitlines() if line.startswith("GPU "))
    return 0


_RANGE = re.compile(r"^(\d+)(?:-(\d+))?$")


def _gpu_indices(spec: str) -> list[int]:
    indices: list[int] = []
    for part in spec.split(","):
        m = _RANGE.match(part.strip())
        if not m:
            raise DeviceSpecError(f"cannot read GPU list {spec!r}: use e.g. 0-7, 0,2,5-6, 0, cpu or cpu:4")
        lo, hi = int(m.group(1)), int(m.group(2) or m.group(1))
        if hi < lo:
            raise DeviceSpecError(f"GPU range {part.strip()!r} runs backwards")
        indices.extend(range(lo, hi + 1))
    if len(set(indices)) != len(indices):
        raise DeviceSpecError(f"GPU list {spec!r} names a GPU twice")
    return indices


def parse_gpus(spec: str | int | list[int], *, gpu_count: int | None = None) -> list[Device]:
    """``"0-7"``, ``"0,2,5-6"``, ``"0"``, ``[0, 1]``, ``"cpu"`` (one CPU worker), ``"cpu:N"``.

    GPU indices are checked against the GPUs that exist (``gpu_count``, counted when not
    given); an index that does not exist is an error naming the ones that do.
    CPU workers split the available cores between them (at least one thread each).
    """
    if isinstance(spec, int):
        spec = str(spec)
    if isinstance(spec, list):
        spec = ",".join(str(i) for i in spec)
    spec = str(spec).strip()
    cpus = available_cpus()
    if spec == "cpu" or spec.startswith("cpu:"):
        n_text = spec[4:] if spec.startswith("cpu:") else "1"
        if not n_text.isdigit() or int(n_text) < 1:
            raise DeviceSpecError(f"{spec!r}: cpu:N needs a worker count N >= 1")
        n = int(n_text)
        threads = max(1, cpus // n)
        return [Device("cpu", i, i, threads) for i in range(n)]
    indices = _gpu_indices(spec)
    have = count_gpus() if gpu_count is None else gpu_count
    missing = [i for i in indices if i >= have]
    if missing:
        which = f"GPUs 0-{have - 1} exist" if have > 1 else ("GPU 0 exists" if have == 1 else "no GPU is visible (use --gpus cpu:N)")
        raise DeviceSpecError(f"GPU {', '.join(map(str, missing))} does not exist: {which}")
    threads = max(1, min(8, cpus // len(indices)))
    return [Device("cuda", gpu, rank, threads) for rank, gpu in enumerate(indices)]
