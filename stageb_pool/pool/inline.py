"""Inline mode: the engine runs in the calling process around a ``WorkerCore`` (so the same
results as a worker process), and ``breakpoint()`` or ``pdb.post_mortem`` work inside it.
"""

from __future__ import annotations

import os
import time
import traceback

from . import protocol
from .errors import FrameTooLarge, WorkerError
from .shared import SharedCache
from .tasks import Outcome, PoolStats, TaskHandle
from .worker_core import WorkerCore, exception_summary


class InlineDispatcher:
    """Runs the gathered tasks one by one, in the order of the gather."""

    def __init__(self, engine_factory, device, stats: PoolStats, max_frame: int):
        self.device = device.in_this_process()  # e.g. cuda:3, not the cuda:0 of a worker process
        self.core = WorkerCore(engine_factory, self.device, max_frame)
        self.stats = stats
        self.max_frame = max_frame
        self.worker_info: list[dict] = [{}]
        self.cache = SharedCache()  # the mirror of the core's shared values, as a Slot's

    @property
    def pids(self) -> list[int]:
        return [os.getpid()]

    def start(self) -> None:
        try:
            self.worker_info[0] = self.core.start()
        except Exception as exc:
            raise self._error(exc, method="engine_factory") from exc

    def submit(self, task: TaskHandle) -> None:
        pass  # run when a gather asks for it (so a speculative task never runs ahead)

    promote = submit

    def stop(self, task: TaskHandle) -> None:
        pass  # nothing runs between two calls of ``advance``

    def advance(self, waiting) -> list[Outcome]:
        task = next(t for t in waiting if not t.done())
        started = time.monotonic()
        try:
            for key, evict in self.cache.admit(task.shared):
                self.core.add_shared(key, task.shared_data[key], evict)
            raw = protocol.encode(self.core.call(task.method, task.item, task.shared))
            if len(raw) > self.max_frame:
                raise FrameTooLarge(len(raw), self.max_frame, "Result frame")
        except Exception as exc:
            error = self._error(exc, index=task.index, method=task.method)
            error.__cause__ = exc  # the real frames, for pdb.post_mortem
            return [Outcome(task, error=error)]
        self.stats.record(0, task, started, time.monotonic())
        task.ran_on = 0
        return [Outcome(task, raw=raw)]

    def close(self) -> None:
        pass

    def _error(self, exc: Exception, **where) -> WorkerError:
        return WorkerError(exception_summary(exc), rank=0, device=self.device.name,
                           remote_traceback=traceback.format_exc(), **where)
