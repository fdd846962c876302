"""Which devices the workers run on: ``--gpus`` specs, GPU groups (``gpus_per_worker``) and
``CUDA_VISIBLE_DEVICES``, without touching CUDA (docs/architecture.md, "GPU groups"). A spec
is untrusted input: only ASCII digits are numbers, ranges are checked before they are
expanded, and every problem is a ``DeviceSpecError`` quoting at most a short excerpt.
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess

import msgspec

MAX_CPU_WORKERS = 64  # not the core count: tests rightly run 8 workers on 2 cores
MAX_RAY_WORKERS = 4096  # far above any cluster; keeps a typo from a huge placement request
MAX_GPUS_PER_WORKER = 16  # the largest single machines; a group never spans nodes
MAX_THREADS_PER_WORKER = 1024  # torch threads of one worker: more cores than any machine has


class DeviceSpecError(ValueError):
    """A ``--gpus`` spec that cannot be read or names devices that do not exist."""


class GroupSizeError(DeviceSpecError):
    """A GPUs-per-worker value that does not fit the spec (the CLI names ``--gpus-per-worker`` or the config key)."""


class Device(msgspec.Struct, frozen=True):
    """A worker's device. ``index``: the GPU index as ``--gpus`` numbers it (a group's first) or
    the CPU worker's number; ``rank``: its position in the pool; ``threads``: the torch threads it
    sets before its first op, never a share of the cores (docs/architecture.md, "Determinism
    contract"); ``group``: every GPU of a multi-GPU worker, else ``()``; ``ordinal``: torch's
    number of its first GPU in the engine's process (0 in a worker, ``index`` inline)."""

    kind: str  # "cuda" | "cpu"
    index: int
    rank: int
    threads: int = 1
    ordinal: int = 0
    group: tuple[int, ...] = ()
    in_parent: bool = False  # set by in_this_process: the engine runs in the parent (inline)

    @property
    def gpus(self) -> tuple[int, ...]:  # none on CPU
        if self.kind != "cuda":
            return ()
        return self.group or (self.index,)

    @property
    def group_size(self) -> int:  # 1 for a CPU worker too
        return max(1, len(self.gpus))

    @property
    def name(self) -> str:
        if len(self.gpus) > 1:
            return f"{self.kind}:{','.join(str(g) for g in self.gpus)}"
        return f"{self.kind}:{self.index}"

    @property
    def torch_device(self) -> str:
        """The device the engine puts its inputs on: the (first) GPU of the worker, or cpu."""
        return f"cuda:{self.ordinal}" if self.kind == "cuda" else "cpu"

    @property
    def torch_devices(self) -> list[str]:
        """Every GPU of the worker as torch numbers it in the engine's process (physical
        indices inline, where the parent sees every GPU)."""
        if self.kind != "cuda":
            return ["cpu"]
        if self.in_parent:
            return [f"cuda:{g}" for g in self.gpus]
        return [f"cuda:{self.ordinal + i}" for i in range(len(self.gpus))]

    def in_this_process(self) -> Device:  # as an engine in the parent sees it (inline mode)
        return msgspec.structs.replace(self, ordinal=self.index if self.kind == "cuda" else 0, in_parent=True)

    def physical_gpus(self) -> list[str]:
        """This worker's GPUs as the machine names them (the parent's mask entries)."""
        mask = visible_mask()
        return [str(g) if mask is None else mask[g] for g in self.gpus]

    def visible_devices(self) -> str:  # relative to the parent's own mask
        return ",".join(self.physical_gpus())


# A GPU index, or a GPU or MIG UUID ("MIG-GPU-<uuid>/<gi>/<ci>" is the older MIG spelling).
_MASK_ENTRY = re.compile(r"[0-9]+|(?:GPU|MIG)-[0-9A-Za-z/-]+")


def visible_mask() -> list[str] | None:
    """The GPUs ``CUDA_VISIBLE_DEVICES`` lets this process see, as CUDA reads it: its entries
    up to the first invalid one, where CUDA stops (``4,-1,5`` is GPU 4 alone); None without a mask.
    An index past the machine's GPUs is not checked (that would take the driver)."""
    mask = os.environ.get("CUDA_VISIBLE_DEVICES")
    if mask is None:
        return None
    entries = []
    for entry in mask.split(","):
        if not _MASK_ENTRY.fullmatch(entry.strip()):
            break
        entries.append(entry.strip())
    return entries


def mask_stop() -> str | None:
    """The invalid entry where CUDA stops reading the mask, if any."""
    mask, visible = os.environ.get("CUDA_VISIBLE_DEVICES"), visible_mask()
    if mask is None or not mask.strip() or len(visible) == len(mask.split(",")):
        return None
    return mask.split(",")[len(visible)].strip()


def mask_text() -> str:
    stop = mask_stop()
    where = f" (CUDA stops at its invalid entry {_quote(stop)})" if stop is not None else ""
    return f"CUDA_VISIBLE_DEVICES={_quote(os.environ.get('CUDA_VISIBLE_DEVICES', ''))}{where}"


def count_gpus() -> int:
    """GPUs this process may use, counted without initialising CUDA."""
    mask = visible_mask()
    if mask is not None:
        return len(mask)
    proc = "/proc/driver/nvidia/gpus"
    if os.path.isdir(proc):
        return len(os.listdir(proc))
    if shutil.which("nvidia-smi"):
        out = subprocess.run(["nvidia-smi", "-L"], capture_output=True, text=True, timeout=30)
        return sum(1 for line in out.stdout.splitlines() if line.startswith("GPU "))
    return 0


def gpu_memory_bytes() -> dict[int, int] | None:
    """Each usable GPU's total memory by its ``--gpus`` index, from ``nvidia-smi``; None if unreadable."""
    if not shutil.which("nvidia-smi"):
        return None
    try:
        out = subprocess.run(["nvidia-smi", "--query-gpu=index,uuid,memory.total", "--format=csv,noheader,nounits"],
                             capture_output=True, text=True, timeout=30)
    except (OSError, subprocess.SubprocessError):
        return None
    by_name: dict[str, int] = {}
    for line in out.stdout.splitlines():
        parts = [p.strip() for p in line.split(",")]
        if len(parts) == 3 and parts[2].isascii() and parts[2].isdigit():
            mib = int(parts[2]) * 2**20
            by_name[parts[0]] = by_name[parts[1]] = mib  # a mask may name a GPU by index or UUID
    if out.returncode != 0 or not by_name:
        return None
    names = visible_mask()
    if names is None:
        return {int(k): v for k, v in by_name.items() if k.isascii() and k.isdigit()}
    if not all(name in by_name for name in names):
        return None
    return {i: by_name[name] for i, name in enumerate(names)}


_NUMBER = "([0-9]+)"  # ASCII digits only: str.isdigit accepts "²", and int() and \d accept "٣"
_RANGE = re.compile(rf"{_NUMBER}(?:-{_NUMBER})?")
_CPU = re.compile(rf"cpu(?::{_NUMBER})?")
_TOO_BIG = 10**9  # stands for any number of 10 or more digits: never a GPU index or a count


def _quote(text: str) -> str:
    return repr(text) if len(text) <= 40 else repr(text[:30]) + f"... ({len(text)} characters)"


def _int(digits: str) -> int:
    """The value of ASCII digits; ``_TOO_BIG`` for 10 or more (int() may refuse 4300)."""
    digits = digits.lstrip("0") or "0"
    return int(digits) if len(digits) < 10 else _TOO_BIG


def _show(lo: int, hi: int, digits: str) -> str:
    """A range of missing GPUs, as the user wrote its upper end."""
    top = str(hi) if hi < _TOO_BIG else f"{digits[:6]}... ({len(digits)} digits)"
    return str(lo) if lo == hi else (f"{lo}, {top}" if hi == lo + 1 else f"{lo}-{top}")


def _gpu_ranges(spec: str) -> list[tuple[int, int, str]]:
    """``(low, high, high as written)`` per comma-separated part, in the spec's order."""
    ranges = []
    for part in spec.split(","):
        m = _RANGE.fullmatch(part.strip())
        if not m:
            raise DeviceSpecError(f"cannot read GPU list {_quote(spec)}: use e.g. 0-7, 0,2,5-6, 0, cpu or cpu:4")
        high = m.group(2) if m.group(2) is not None else m.group(1)
        lo, hi = _int(m.group(1)), _int(high)
        if hi < lo:
            raise DeviceSpecError(f"GPU range {_quote(part.strip())} runs backwards")
        ranges.append((lo, hi, high))
    return ranges


def _which_exist(have: int, counted: bool) -> str:
    """The GPUs ``--gpus`` may name, for an error (under a mask, named as the mask names them)."""
    mask = visible_mask() if counted else None
    if mask is None:
        return f"GPUs 0-{have - 1} exist" if have > 1 else ("GPU 0 exists" if have == 1 else
                                                            "no GPU is visible (use --gpus cpu:N)")
    if not mask:
        return f"no GPU is visible under {mask_text()} (use --gpus cpu:N)"
    numbers = f"0-{have - 1}" if have > 1 else "0"
    shown = ", ".join(mask[:8]) + (", ..." if len(mask) > 8 else "")
    return (f"{mask_text()} makes {have} GPU{'s' if have != 1 else ''} visible, which --gpus numbers {numbers} "
            f"(GPU{'s' if have != 1 else ''} {shown})")


def _refuse_mig_groups(gpus_per_worker: int, counted: bool) -> None:
    # A CUDA process uses one MIG device, whatever its mask lists: a group of them would leave
    # all but one idle (and a sharded model without room). Refused, not silently shrunk.
    mask = visible_mask() if counted else None
    if gpus_per_worker > 1 and mask and any(entry.startswith("MIG-") for entry in mask):
        raise GroupSizeError(f"{mask_text()} lists MIG devices, and a CUDA process uses only one: "
                             f"{gpus_per_worker} GPUs per worker cannot be MIG devices (use 1)")


def check_gpus_per_worker(gpus_per_worker) -> int:
    if isinstance(gpus_per_worker, bool) or not isinstance(gpus_per_worker, int) \
            or not 1 <= gpus_per_worker <= MAX_GPUS_PER_WORKER:
        raise GroupSizeError(f"GPUs per worker must be a whole number from 1 to {MAX_GPUS_PER_WORKER}, "
                             f"got {_quote(str(gpus_per_worker))}")
    return gpus_per_worker


def _refuse_cpu_groups(spec: str, gpus_per_worker: int) -> None:
    # Refused rather than ignored: a config written for 2-GPU groups run on cpu:N would
    # otherwise silently change its engine identity (group size) and so its results.
    if gpus_per_worker != 1:
        raise GroupSizeError(f"{_quote(spec)}: GPUs per worker ({gpus_per_worker}) applies to GPU workers only; "
                             "each CPU worker holds one whole model (leave it at 1 with cpu or cpu:N)")


def _check_multiple(count: int, gpus_per_worker: int, what: str) -> None:
    if count % gpus_per_worker:
        below = count - count % gpus_per_worker
        hint = f"use {below} GPUs or" if below else "name more GPUs or use"
        raise GroupSizeError(f"{what} {count} GPU{'s' if count != 1 else ''}, not a multiple of {gpus_per_worker} "
                             f"GPUs per worker ({hint} a group size that divides {count})")


def check_threads_per_worker(value) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or not 1 <= value <= MAX_THREADS_PER_WORKER:
        raise ValueError(f"threads_per_worker must be an integer from 1 to {MAX_THREADS_PER_WORKER}, got {value!r}")
    return value


def parse_gpus(spec: str | int | list[int], *, gpu_count: int | None = None, gpus_per_worker: int = 1,
               threads_per_worker: int = 1) -> list[Device]:
    """``"0-7"``, ``"0,2,5-6"``, ``"0"``, ``[0, 1]``, ``"cpu"`` or ``"cpu:N"``: one worker per GPU,
    or per contiguous group of ``gpus_per_worker`` GPUs (a multiple; a CPU spec takes only 1).
    GPU indices are checked against those that exist (``gpu_count``, counted when not given)."""
    gpus_per_worker = check_gpus_per_worker(gpus_per_worker)
    threads = check_threads_per_worker(threads_per_worker)
    if isinstance(spec, list):
        spec = ",".join(str(i) for i in spec)
    spec = str(spec).strip()
    if spec == "cpu" or spec.startswith("cpu:"):
        m = _CPU.fullmatch(spec)
        if m is None:
            raise DeviceSpecError(f"{_quote(spec)}: cpu:N needs a worker count N >= 1")
        _refuse_cpu_groups(spec, gpus_per_worker)
        n = 1 if m.group(1) is None else _int(m.group(1))
        if n < 1:
            raise DeviceSpecError(f"{_quote(spec)}: cpu:N needs a worker count N >= 1")
        if n > MAX_CPU_WORKERS:
            raise DeviceSpecError(f"{_quote(spec)}: at most {MAX_CPU_WORKERS} CPU workers")
        return [Device("cpu", i, i, threads) for i in range(n)]
    ranges = _gpu_ranges(spec)
    have = count_gpus() if gpu_count is None else gpu_count
    # Check before expanding: "0-99999999" must not build a list of 10^8 indices.
    missing = [_show(max(lo, have), hi, high) for lo, hi, high in ranges if hi >= have]
    if missing:
        raise DeviceSpecError(f"GPU {', '.join(missing)} does not exist: {_which_exist(have, gpu_count is None)}")
    _refuse_mig_groups(gpus_per_worker, gpu_count is None)
    indices = [i for lo, hi, _ in ranges for i in range(lo, hi + 1)]
    if len(set(indices)) != len(indices):
        raise DeviceSpecError(f"GPU list {_quote(spec)} names a GPU twice")
    _check_multiple(len(indices), gpus_per_worker, f"--gpus {_quote(spec)} names")
    return _gpu_workers(indices, gpus_per_worker, threads)


def _gpu_workers(indices: list[int], gpus_per_worker: int, threads: int) -> list[Device]:
    groups = [tuple(indices[i:i + gpus_per_worker]) for i in range(0, len(indices), gpus_per_worker)]
    return [Device("cuda", group[0], rank, threads, group=group if len(group) > 1 else ())
            for rank, group in enumerate(groups)]


def ray_devices(spec: str | int, *, gpus_per_worker: int = 1, threads_per_worker: int = 1) -> list[Device]:
    """A ``--gpus`` spec under Ray, which chooses the GPUs: a GPU count (a multiple of
    ``gpus_per_worker``), ``"cpu"`` or ``"cpu:N"``; devices numbered by rank."""
    gpus_per_worker = check_gpus_per_worker(gpus_per_worker)
    threads = check_threads_per_worker(threads_per_worker)
    spec = str(spec).strip()
    kind = "cpu" if spec == "cpu" or spec.startswith("cpu:") else "cuda"
    m = _CPU.fullmatch(spec) if kind == "cpu" else re.fullmatch(_NUMBER, spec)
    n = None if m is None else (1 if m.group(1) is None else _int(m.group(1)))
    if n is None or n < 1:
        raise DeviceSpecError(f"{_quote(spec)}: with Ray, the GPU spec is a count of GPUs N >= 1 "
                              "(Ray chooses which), cpu or cpu:N")
    if n > MAX_RAY_WORKERS * (gpus_per_worker if kind == "cuda" else 1):
        raise DeviceSpecError(f"{_quote(spec)}: at most {MAX_RAY_WORKERS} Ray workers")
    if kind == "cpu":
        _refuse_cpu_groups(spec, gpus_per_worker)
        return [Device("cpu", rank, rank, threads) for rank in range(n)]
    _check_multiple(n, gpus_per_worker, "--gpus asks Ray for")
    return _gpu_workers(list(range(n)), gpus_per_worker, threads)
