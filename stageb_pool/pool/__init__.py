"""The generic per-device process pool (docs/architecture.md, "The worker pool"): a parent
forks one worker per device and talks to each over a socketpair with msgspec JSON frames, or
runs the same workers as Ray actors. Standard library and msgspec only (ray lazily); nothing
here imports from the rest of the package (tests/test_layout.py checks it).
"""

from .backend import Backend, Fork, Inline, Ray, plan_devices
from .devices import Device, DeviceSpecError, parse_gpus
from .engine_agreement import ACCEPT_ANY, REFUSE_ANY_DIFFERENCE, EngineAgreement
from .errors import (FrameTooLarge, PoolError, ProtocolError, RemoteTraceback, TaskCancelled, WorkerDied,
                     WorkerError, WorkerTimeout)
from .pool import Pool
from .tasks import PoolStats, TaskHandle

__all__ = ["Pool", "PoolStats", "TaskHandle", "Backend", "Fork", "Inline", "Ray", "plan_devices", "Device",
           "DeviceSpecError", "parse_gpus", "PoolError", "WorkerError", "WorkerDied", "WorkerTimeout", "TaskCancelled",
           "RemoteTraceback", "FrameTooLarge", "ProtocolError", "EngineAgreement", "ACCEPT_ANY", "REFUSE_ANY_DIFFERENCE"]
