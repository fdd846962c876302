"""A submitted task (``TaskHandle``, shaped like a ``concurrent.futures.Future``), how a
runner reports it finished (``Outcome``), and the pool's counters (``PoolStats``)."""

from __future__ import annotations

import enum
import time
from typing import NamedTuple

import msgspec


class PoolStats(msgspec.Struct):
    """Counters for tests, benchmarks and the run summary."""

    frames_sent: dict[str, int]  # by message type, parent -> workers
    frames_received: dict[str, int]  # by message type, workers -> parent
    bytes_sent: int
    bytes_received: int
    snapshot_sends: int
    items: list[int]  # tasks completed, per rank
    busy_s: list[float]  # seconds with a task in flight, per rank
    restarts: int
    restarts_by_rank: list[int]  # replacements of each rank's worker (each is also logged)
    # One (rank, method, label, start_s, end_s) per completed task, seconds from ``origin``
    # (the pool's start): the per-worker timeline of a run's report. A tuple append per task
    # costs about a microsecond; busy_s of a rank is the sum of its intervals.
    intervals: list[tuple[int, str, str | None, float, float]]
    origin: float  # time.monotonic() when the pool was made

    @classmethod
    def empty(cls, size: int) -> "PoolStats":
        return cls({}, {}, 0, 0, 0, [0] * size, [0.0] * size, 0, [0] * size, [], time.monotonic())

    def record(self, rank: int, task: "TaskHandle", start: float, end: float) -> None:
        """Count a completed task of ``rank`` that ran from ``start`` to ``end`` (monotonic)."""
        self.items[rank] += 1
        self.busy_s[rank] += end - start
        self.intervals.append((rank, task.method, task.label, start - self.origin, end - self.origin))


class _State(enum.Enum):
    PENDING = "pending"  # queued or running
    FINISHED = "finished"  # a result or an error
    CANCELLED = "cancelled"


class TaskHandle:
    """A submitted task, used like a ``concurrent.futures.Future``.

    ``done()``, ``cancelled()``, ``result()`` and ``exception()`` mean what they mean there;
    ``result()``/``exception()`` of an unfinished task drive the pool until it is finished,
    as ``pool.gather([task])`` does (which is also how several tasks come back in order).
    ``ran_on`` is the rank of the worker that computed the result; ``label`` is the
    submitter's name for the task (in ``PoolStats.intervals``)."""

    __slots__ = ("id", "method", "item", "shared", "rank", "result_type", "cost", "label", "index", "owner",
                 "ran_on", "_pool", "_state", "_result", "_error")

    def __init__(self, pool, id: int, method: str, item: bytes, shared: dict[str, str],
                 rank: int | None, result_type, cost: float | None = None, label: str | None = None):
        self.id, self.method, self.item, self.shared = id, method, item, shared
        self.rank, self.result_type, self.cost, self.label = rank, result_type, cost, label
        self.index: int | None = None  # position in the gather that waits for it
        self.owner = None  # the gather waiting for it
        self.ran_on: int | None = None
        self._pool = pool
        self._state = _State.PENDING
        self._result = None
        self._error: BaseException | None = None

    def done(self) -> bool:
        return self._state is not _State.PENDING

    def cancelled(self) -> bool:
        return self._state is _State.CANCELLED

    def result(self):
        """The engine method's return value; raises its error (``WorkerError``, ...)."""
        if not self.done():
            return self._pool.gather([self])[0]
        if self._error is not None:
            raise self._error
        return self._result

    def exception(self) -> BaseException | None:
        """The task's own error, or None. An error of the whole pool (a dead worker, a
        timeout, Ctrl-C) met while waiting is raised, as by ``gather``."""
        if not self.done():
            try:
                self._pool.gather([self])
            except BaseException as exc:
                if exc is not self._error:
                    raise
        return self._error

    def _finish(self, result=None, error: BaseException | None = None, *, cancelled: bool = False) -> None:
        self._state = _State.CANCELLED if cancelled else _State.FINISHED
        self._result, self._error = result, error

    def __repr__(self) -> str:
        return f"<TaskHandle {self.id} {self.method}() {self._state.value}>"


class Outcome(NamedTuple):
    """How a task finished, as a runner reports it: the encoded result, or an error."""

    task: TaskHandle
    raw: bytes | None = None
    error: BaseException | None = None
