"""The generic per-device process pool: a parent forks one worker per device (through a
zygote) and talks to each over a socketpair with length-prefixed msgspec JSON frames; or,
with ``backend="ray"``, runs the same workers as Ray actors across a cluster.

Standard library and msgspec only (ray lazily, in the Ray backend's two modules); nothing
here knows about Stage-B, and nothing here imports from the rest of the package
(tests/test_layout.py checks it).
"""

from .devices import Device, DeviceSpecError, parse_gpus, parse_ray_spec
from .engine_agreement import ACCEPT_ANY, REFUSE_ANY_DIFFERENCE, EngineAgreement
from .errors import (
    FrameTooLarge,
    PoolError,
    ProtocolError,
    RemoteTraceback,
    TaskCancelled,
    WorkerDied,
    WorkerError,
    WorkerTimeout,
)
from .pool import Pool
from .tasks import PoolStats, TaskHandle

__all__ = ["Pool", "PoolStats", "TaskHandle", "Device", "DeviceSpecError", "parse_gpus", "parse_ray_spec", "PoolError",
           "WorkerError", "WorkerDied", "WorkerTimeout", "TaskCancelled", "RemoteTraceback", "FrameTooLarge",
           "ProtocolError", "EngineAgreement", "ACCEPT_ANY", "REFUSE_ANY_DIFFERENCE"]
