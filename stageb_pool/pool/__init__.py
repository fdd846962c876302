"""The generic fork-per-device process pool: a parent forks one worker per device (through
a zygote) and talks to each over a socketpair with length-prefixed msgspec JSON frames.

Standard library and msgspec only; nothing here knows about Stage-B, and nothing here
imports from the rest of the package (tests/test_layout.py checks it).
"""

from .devices import Device, DeviceSpecError, parse_gpus
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

__all__ = ["Pool", "PoolStats", "TaskHandle", "Device", "DeviceSpecError", "parse_gpus", "PoolError",
           "WorkerError", "WorkerDied", "WorkerTimeout", "TaskCancelled", "RemoteTraceback", "FrameTooLarge",
           "ProtocolError"]
