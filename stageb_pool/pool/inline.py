"""Inline mode: the engine runs in the calling process (single-device debugging).

Items, snapshots and results take the same path as with a worker process (the msgspec
codec, ``Calls``, the snapshot cache with its evictions), so results are identical to the
forked pool's, and ``breakpoint()`` or ``pdb.post_mortem`` work inside the engine.
"""

from __future__ import annotations

import os
import time
import traceback

from . import protocol
from .calls import Calls
from .errors import FrameTooLarge, WorkerError
from .snapshots import SnapshotCache, SnapshotStore
from .tasks import Outcome, PoolStats, TaskHandle
from .worker import exception_summary, start_engine


class InlineRunner:
    """Runs the gathered tasks one by one, in the order of the gather."""

    def __init__(self, engine_factory, device, snapshots: SnapshotStore, stats: PoolStats, max_frame: int):
        self.engine_factory = engine_factory
        self.device = device.in_this_process()  # e.g. cuda:3, not the cuda:0 of a worker process
        self.snapshots, self.stats = snapshots, stats
        self.max_frame = max_frame
        self.worker_info: list[dict] = [{}]
        self.cache = SnapshotCache()
        self.calls: Calls | None = None

    @property
    def pids(self) -> list[int]:
        return [os.getpid()]

    def start(self) -> None:
        try:
            engine, self.worker_info[0] = start_engine(self.engine_factory, self.device)
        except Exception as exc:
            raise self._error(exc, method="engine_factory") from exc
        self.calls = Calls(engine)

    def submit(self, task: TaskHandle) -> None:
        pass  # run when a gather asks for it

    def advance(self, waiting) -> list[Outcome]:
        """Run the first unfinished task of ``waiting``."""
        task = next(t for t in waiting if not t.done())
        started = time.monotonic()
        try:
            for key, evict in self.cache.admit(task.shared):
                self.calls.add_snapshot(key, self.snapshots.data(key), evict)
            raw = protocol.encode(self.calls.call(task.method, task.item, task.shared))
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
