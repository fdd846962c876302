"""A submitted task, the queue it waits in, how a dispatcher reports it finished, the counters.
"""

from __future__ import annotations

import enum
import heapq
import time
from typing import NamedTuple

import msgspec


class PoolStats(msgspec.Struct):  # for tests, benchmarks and the run summary

    bytes_sent: int
    bytes_received: int
    tasks_sent: int  # Task frames (a retried task counts again)
    shared_sends: int  # Share frames: a shared value sent to a worker
    items: list[int]  # tasks completed, per rank
    busy_s: list[float]  # seconds with a task in flight, per rank
    restarts: int
    restarts_by_rank: list[int]  # replacements of each rank's worker (each is also logged)
    # One (rank, method, label, start_s, end_s) per completed task, seconds from ``origin``: the
    # per-worker timeline of a run's report (a tuple append costs about a microsecond).
    intervals: list[tuple[int, str, str | None, float, float]]
    origin: float  # time.monotonic() when the pool was made

    @classmethod
    def empty(cls, size: int) -> "PoolStats":
        return cls(0, 0, 0, 0, [0] * size, [0.0] * size, 0, [0] * size, [], time.monotonic())

    def record(self, rank: int, task: "TaskHandle", start: float, end: float) -> None:
        """A completed task of ``rank`` that ran from ``start`` to ``end`` (monotonic)."""
        self.items[rank] += 1
        self.busy_s[rank] += end - start
        task.busy_s += end - start
        self.intervals.append((rank, task.method, task.label, start - self.origin, end - self.origin))


class _State(enum.Enum):
    PENDING = "pending"  # queued or running
    FINISHED = "finished"  # a result or an error
    CANCELLED = "cancelled"


class TaskHandle:
    """A submitted task, used like a ``concurrent.futures.Future`` (``done``, ``cancelled``, and
    ``result``/``exception``, which drive the pool until it is finished), but not one: only the
    caller's thread drives this pool, so ``wait``/``as_completed`` would wait forever (and a driver
    thread would take Ctrl-C away from the event loop). ``ran_on``: the rank that computed it;
    ``busy_s``: the worker time it took."""

    __slots__ = ("id", "method", "item", "shared", "shared_data", "rank", "result_type", "cost", "label", "index",
                 "owner", "ran_on", "speculative", "busy_s", "_pool", "_state", "_result", "_error")

    def __init__(self, pool, id: int, method: str, item: bytes, shared: dict[str, str],
                 rank: int | None, result_type, cost: float | None = None, label: str | None = None,
                 shared_data: dict[str, bytes] | None = None):
        self.id, self.method, self.item, self.shared = id, method, item, shared
        self.shared_data = shared_data or {}  # key -> encoding, of each value in ``shared``
        self.rank, self.result_type, self.cost, self.label = rank, result_type, cost, label
        self.index: int | None = None  # position in the gather that waits for it
        self.owner = None  # the gather waiting for it
        self.ran_on: int | None = None
        self.speculative = False
        self.busy_s = 0.0
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
        """The task's own error, or None; an error of the whole pool met while waiting is raised."""
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


class Outcome(NamedTuple):  # how a task finished, as a dispatcher reports it: the encoded result, or an error
    task: TaskHandle
    raw: bytes | None = None
    error: BaseException | None = None


class TaskQueue:
    """Tasks waiting for a worker: one heap for any worker, one per rank for pinned tasks.

    A free worker takes a retried task first, then uncosted tasks in submission order, then
    costed ones most expensive first (a short tail); speculative tasks last, and only a worker
    with nothing in flight takes one. The order never changes a result."""

    def __init__(self, size: int):
        self._any: list = []
        self._pinned: list[list] = [[] for _ in range(size)]
        self._speculative: set[int] = set()  # ids of the speculative tasks still queued as such

    def push(self, task: TaskHandle, *, retry: bool = False) -> None:
        key = (task.speculative, not retry, task.cost is not None, -(task.cost or 0.0), task.id)
        if task.speculative:
            self._speculative.add(task.id)
        heapq.heappush(self._any if task.rank is None else self._pinned[task.rank], (key, task))

    def promote(self, task: TaskHandle) -> None:
        """Queue a speculative task again as an ordinary one (its old entry is dropped when
        reached); one already sent just runs on."""
        if task.id in self._speculative:
            self._speculative.discard(task.id)
            self.push(task)

    def retry(self, task: TaskHandle) -> None:  # a task whose worker died goes first
        self.push(task, retry=True)

    def any_queued(self) -> bool:
        """Whether the queue for any worker holds an entry (maybe a done one, dropped when reached)."""
        return bool(self._any)

    def __len__(self) -> int:
        """Tasks queued (cancelled ones included until they are dropped)."""
        return len(self._any) + sum(len(heap) for heap in self._pinned)

    def pop(self, rank: int, *, speculative: bool = False) -> TaskHandle | None:
        """The first task the worker of ``rank`` may run (a speculative one only with
        ``speculative``), dropping done and replaced entries on the way."""
        heap = self._live(self._any)
        pinned = self._pinned[rank]
        if pinned and self._live(pinned) and (not heap or pinned[0][0] < heap[0][0]):
            heap = pinned
        if not heap:
            return None
        if heap[0][0][0]:
            if not speculative:
                return None
            self._speculative.discard(heap[0][1].id)
        return heapq.heappop(heap)[1]

    def _live(self, heap: list) -> list:
        """``heap`` without the done or replaced entries at its top (the rest are dropped when reached)."""
        while heap and (heap[0][1]._state is not _State.PENDING
                        or (heap[0][0][0] and heap[0][1].id not in self._speculative)):
            heapq.heappop(heap)
        return heap
