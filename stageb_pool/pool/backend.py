"""Where a pool's workers run: one value, chosen once (by the CLI's plan, or by a script).

- ``Fork()``: one process per device on this machine, forked by the zygote (the default);
- ``Inline()``: the engine in the calling process, on one device (breakpoints work);
- ``Ray(address)``: Ray actors across a cluster; Ray chooses the nodes and GPUs.

``plan_devices`` reads a ``--gpus`` spec as the backend takes it, once: the plan's devices are
what the pool starts and what run.json records.
"""

from __future__ import annotations

import msgspec

from .cluster_probe import CONNECT_TIMEOUT
from .devices import Device, DeviceSpecError, check_gpus_per_worker, parse_gpus, ray_devices


class Fork(msgspec.Struct, frozen=True):
    """One worker process per device on this machine, forked by the zygote, one socketpair each."""


class Inline(msgspec.Struct, frozen=True):
    """The engine in this process, on the spec's first device: single-device debugging, where
    ``breakpoint()`` and ``pdb.post_mortem`` work inside the engine."""


class Ray(msgspec.Struct, frozen=True):
    """One Ray actor per worker on the cluster at ``address``: ``"auto"`` (the one ``ray start``
    started), ``"local"`` (a new one on this machine, stopped by ``Pool.close``) or
    ``"host:port"``. The spec is then a GPU count (``"32"``) or ``"cpu:N"``. An existing cluster
    must answer and accept this process within ``connect_timeout`` seconds, and the workers be
    reserved within ``placement_timeout`` seconds, or the pool fails naming the address and the
    cause, or the resources."""

    address: str = "auto"
    placement_timeout: float = 60.0
    connect_timeout: float = CONNECT_TIMEOUT


Backend = Fork | Inline | Ray


def plan_devices(backend: Backend, gpus, *, gpus_per_worker: int = 1, threads_per_worker: int = 1) -> list[Device]:
    """The workers' devices: a list of ``Device`` as given (already planned), else the spec read
    as ``backend`` takes it (``parse_gpus``; under Ray ``ray_devices``, numbered by rank);
    ``Inline`` keeps the first. A bad spec is a DeviceSpecError."""
    if isinstance(gpus, (list, tuple)) and gpus and all(isinstance(d, Device) for d in gpus):
        if check_gpus_per_worker(gpus_per_worker) != 1:
            raise DeviceSpecError("gpus_per_worker goes with a spec; a list of Device carries its groups itself")
        devices = list(gpus)
    elif isinstance(backend, Ray):
        devices = ray_devices(gpus, gpus_per_worker=gpus_per_worker, threads_per_worker=threads_per_worker)
    else:
        devices = parse_gpus(gpus, gpus_per_worker=gpus_per_worker, threads_per_worker=threads_per_worker)
    return devices[:1] if isinstance(backend, Inline) else devices
