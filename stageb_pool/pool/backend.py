"""Where a pool's workers run, one value chosen once: ``Fork()`` (the default), ``Inline()``
or ``Ray(address)``; and ``plan_devices``, the one reading of a ``--gpus`` spec for a backend.
"""

from __future__ import annotations

import msgspec

from .cluster_probe import CONNECT_TIMEOUT
from .devices import Device, DeviceSpecError, check_gpus_per_worker, parse_gpus, ray_devices


class Fork(msgspec.Struct, frozen=True):
    """One worker process per device on this machine, forked by the zygote, one socketpair each."""


class Inline(msgspec.Struct, frozen=True):
    """The engine in this process, on the spec's first device (``breakpoint()`` works in it)."""


class Ray(msgspec.Struct, frozen=True):
    """One Ray actor per worker on the cluster at ``address``: ``"auto"``, ``"local"`` (a new
    cluster, stopped by ``Pool.close``) or ``"host:port"``; the spec is then a GPU count or
    ``"cpu:N"``. Connecting and reserving the workers fail within their timeouts, naming the cause."""

    address: str = "auto"
    placement_timeout: float = 60.0
    connect_timeout: float = CONNECT_TIMEOUT


Backend = Fork | Inline | Ray


def plan_devices(backend: Backend, gpus, *, gpus_per_worker: int = 1, threads_per_worker: int = 1) -> list[Device]:
    """The workers' devices: a list of ``Device`` as given, else the spec read as ``backend``
    takes it (under Ray a count, numbered by rank); ``Inline`` keeps the first. DeviceSpecError if bad."""
    if isinstance(gpus, (list, tuple)) and gpus and all(isinstance(d, Device) for d in gpus):
        if check_gpus_per_worker(gpus_per_worker) != 1:
            raise DeviceSpecError("gpus_per_worker goes with a spec; a list of Device carries its groups itself")
        devices = list(gpus)
    elif isinstance(backend, Ray):
        devices = ray_devices(gpus, gpus_per_worker=gpus_per_worker, threads_per_worker=threads_per_worker)
    else:
        devices = parse_gpus(gpus, gpus_per_worker=gpus_per_worker, threads_per_worker=threads_per_worker)
    return devices[:1] if isinstance(backend, Inline) else devices
