"""The dispatcher: which worker runs which task, and what a stalled or dead worker becomes.

It is shared by every backend whose workers are other processes, and knows nothing about
processes or sockets: a *transport* starts, feeds, kills and listens to the workers and
reports what happened as events (``WorkerStarted``, ``WorkerMessage``, ``WorkerClosed``,
``WorkerExited``). The dispatcher owns

- the queue: a free worker takes the next task it may run (tasks submitted with ``rank=``
  only go to that worker): a retried task first, then in submission order, or most
  expensive first for tasks submitted with a ``cost``; one task in flight per worker, or
  ``depth`` where a transport's round trip is worth hiding (the next task then waits in the
  worker, which runs its tasks in order; free workers are served first);
- one ``Slot`` per rank (slots.py): its ``WorkerState``, the tasks in flight and the deadline of the
  state it is in (engine start, the running task, exit report), and the mirror of its
  snapshot cache;
- faults: a worker past its deadline is killed; once its exit is reported it is replaced
  and its task retried (``max_restarts``, pool-wide), or the fault is raised. Before that,
  a task silent for ``stall_warning`` seconds is logged as a warning (and again after each
  further ``stall_warning``), so a long wait names its worker well before the timeout;
- the pool's engine agreement (``engine_agreement.EngineAgreement``): applied to the
  workers' ``engine.info()`` once all are ready, and to each replacement when it is.
"""

from __future__ import annotations

import logging
import time
from typing import NamedTuple, Protocol

import msgspec

from . import protocol
from .engine_agreement import ACCEPT_ANY, EngineAgreement
from .errors import PoolError, ProtocolError, WorkerDied, WorkerError, WorkerTimeout
from .protocol import PROTOCOL_VERSION, Failure, InitFailed, Ready, Result, Snapshot, Task
from .slots import Earliest, Slot, Trouble, WorkerState
from .snapshots import SnapshotStore
from .tasks import Outcome, PoolStats, TaskHandle, TaskQueue

log = logging.getLogger("stageb_pool.pool")

EXIT_REPORT_GRACE = 0.5  # a worker that closed its channel must be reported exited by then, else it is killed
KILL_REPORT_TIMEOUT = 10.0  # a killed worker whose exit is never reported means the pool is broken


# -- what a transport reports ---------------------------------------------------------------
class WorkerStarted(NamedTuple):
    """A process exists for ``rank`` and is building its engine."""

    rank: int
    pid: int | None


class WorkerMessage(NamedTuple):
    """A message from the worker of ``rank``: Ready, InitFailed, Result or Failure."""

    rank: int
    message: protocol.Message


class WorkerClosed(NamedTuple):
    """The channel to the worker of ``rank`` closed; its exit report should follow."""

    rank: int


class WorkerExited(NamedTuple):
    """The worker of ``rank`` is gone (reaped); nothing more will come from it. A backend
    that knows no exit code or signal says why in ``cause``."""

    rank: int
    exitcode: int | None
    signal: int | None
    cause: str | None = None


class Transport(Protocol):
    """How a backend starts, feeds, kills and listens to its workers. Events always refer
    to the rank's current process, never to one it replaced."""

    def spawn(self, rank: int) -> None:
        """Start a worker process for ``rank`` (its first, or a replacement)."""

    def send(self, rank: int, data: bytes) -> None:
        """Frames for the worker of ``rank``, which has no task (or fewer than the
        dispatcher's depth; the worker runs them in order); a worker that is gone shows
        up as a later event, never as an exception here."""

    def kill(self, rank: int) -> None:
        """Kill the worker of ``rank``; its WorkerExited follows."""

    def poll(self, timeout: float | None) -> list:
        """The events that happened, waiting at most ``timeout`` seconds for the first."""

    def close(self, busy: list[int]) -> None:
        """Stop every worker (``busy`` ones at once) and release everything."""




# -- the dispatcher ---------------------------------------------------------------------------
class Dispatcher:
    """Runs tasks on the workers of ``transport``; the pool's runner for every backend but
    inline. ``advance`` is one turn of the event loop."""

    def __init__(self, transport: Transport, devices, snapshots: SnapshotStore, stats: PoolStats, *,
                 task_timeout: float | None, start_timeout: float | None, max_restarts: int, max_frame: int,
                 engine_agreement: EngineAgreement = ACCEPT_ANY, depth: int = 1, stall_warning: float | None = None):
        self.transport = transport
        self.devices = devices
        self.snapshots, self.stats = snapshots, stats
        self.task_timeout, self.start_timeout = task_timeout, start_timeout
        self.stall_warning = stall_warning
        self.restarts_left = max_restarts
        self.max_frame = max_frame
        self.engine_agreement = engine_agreement  # applied at start and to every replacement
        self.depth = depth  # tasks in flight per worker
        self.queue = TaskQueue(len(devices))
        self.slots: list[Slot] = []
        self.worker_info: list[dict] = [{} for _ in devices]
        self._outcomes: list[Outcome] = []
        self._started = False
        self._earliest = Earliest()  # no deadline or warning of any slot is before it
        # Ranks that may be idle (every idle one is here): depth-1 dispatch visits these, not
        # every worker, at each event; and the ranks that may have pinned tasks queued.
        self._free: set[int] = set()
        self._pinned: set[int] = set()

    @property
    def pids(self) -> list[int | None]:
        return [slot.pid for slot in self.slots]

    def start(self) -> None:
        """Start every worker; return once all are ready."""
        self.slots = [Slot(rank, device, _deadline(self.start_timeout), self._earliest)
                      for rank, device in enumerate(self.devices)]
        for rank in range(len(self.devices)):
            self.transport.spawn(rank)
        while any(slot.state is not WorkerState.IDLE for slot in self.slots):
            self._step()
        self._check_engines()
        self._started = True

    def submit(self, task: TaskHandle) -> None:
        if task.rank is not None:
            self._pinned.add(task.rank)
        self.queue.push(task)

    def promote(self, task: TaskHandle) -> None:
        self.queue.promote(task)

    def advance(self, waiting) -> list[Outcome]:
        """Wait for the next event (or deadline), handle it, hand out queued tasks; the
        tasks finished meanwhile (any task, not only ``waiting``)."""
        self._step()
        outcomes, self._outcomes = self._outcomes, []
        return outcomes

    def close(self) -> None:
        self.transport.close([s.rank for s in self.slots if s.state is WorkerState.BUSY])

    # -- the event loop ---------------------------------------------------------------------
    def _step(self) -> None:
        self._dispatch()
        # a busy worker's next stall warning wakes the loop too, also when its task has no deadline
        earliest = self._earliest.at
        timeout = max(0.0, earliest - time.monotonic()) if earliest is not None else None
        for event in self.transport.poll(timeout):
            slot = self.slots[event.rank]
            if isinstance(event, WorkerStarted):
                slot.state, slot.pid = WorkerState.STARTING, event.pid
                slot.deadline = _deadline(self.start_timeout)
            elif isinstance(event, WorkerMessage):
                self._on_message(slot, event.message)
            elif isinstance(event, WorkerClosed):
                self._on_closed(slot)
            else:
                self._on_exited(slot, event)
        self._check_deadlines()
        self._dispatch()

    def _dispatch(self) -> None:
        if self.depth == 1:
            self._dispatch_to_free()
            return
        # Round by round: every idle worker gets a task before any gets a second one, and a
        # second only while more tasks are queued than there are workers: the last ones go
        # to whichever worker is free first, never behind a long task (a short tail), and
        # never behind a speculative one (work nobody waits for must not delay work somebody does).
        for in_flight in range(self.depth):
            if in_flight and len(self.queue) <= len(self.slots):
                return
            for slot in self.slots:
                if (len(slot.tasks) == in_flight and slot.state in (WorkerState.IDLE, WorkerState.BUSY)
                        and not any(task.speculative for task in slot.tasks)):
                    task = self.queue.pop(slot.rank, speculative=not in_flight)
                    if task is not None:
                        self._send_task(slot, task)

    def _dispatch_to_free(self) -> None:
        """One task to each idle worker, in rank order (as the rounds above, with depth 1),
        visiting only the ranks in ``_free``: once the shared queue is empty, only ranks that
        may have pinned tasks are asked."""
        exhausted = False  # the queue holds no task any worker may run
        for rank in sorted(self._free):
            slot = self.slots[rank]
            if slot.state is not WorkerState.IDLE or slot.tasks:
                self._free.discard(rank)
                continue
            if exhausted and rank not in self._pinned:
                continue
            task = self.queue.pop(rank, speculative=True)  # an idle worker may take speculative work
            if task is None:  # neither the shared queue nor this rank's has a task
                exhausted = True
                self._pinned.discard(rank)
                continue
            self._free.discard(rank)
            self._send_task(slot, task)

    def _send_task(self, slot: Slot, task: TaskHandle) -> None:
        if not slot.tasks:  # it starts at once; a later one when those before it are done
            self._start_running(slot, time.monotonic())
        slot.state, task.ran_on = WorkerState.BUSY, slot.rank
        slot.tasks.append(task)
        messages = [Snapshot(key, msgspec.Raw(self.snapshots.data(key)), evict)
                    for key, evict in slot.cache.admit(task.shared)]
        self.stats.snapshot_sends += len(messages)
        messages.append(Task(task.id, task.method, msgspec.Raw(task.item), task.shared))
        frames = []
        for msg in messages:
            frames.append(protocol.frame(msg, self.max_frame))
            name = type(msg).__name__
            self.stats.frames_sent[name] = self.stats.frames_sent.get(name, 0) + 1
        # Blocking sends are safe with depth 1: a worker reads while it has no task, and this
        # one has none (a deeper transport, Ray's, never blocks on a busy worker).
        self.transport.send(slot.rank, b"".join(frames))

    def _on_message(self, slot: Slot, msg) -> None:
        name = type(msg).__name__
        self.stats.frames_received[name] = self.stats.frames_received.get(name, 0) + 1
        where = dict(rank=slot.rank, device=slot.device.name)
        if isinstance(msg, Ready):
            if msg.version != PROTOCOL_VERSION:
                raise ProtocolError(f"worker {slot.rank} speaks protocol {msg.version}, the parent {PROTOCOL_VERSION}")
            slot.state, slot.deadline = WorkerState.IDLE, None
            self._free.add(slot.rank)
            slot.pid = slot.pid or msg.pid  # a backend may only learn it here (Ray)
            self.worker_info[slot.rank] = msg.info
            if self._started:  # a replacement; at start all are compared at once
                self._check_engines(new=slot)
        elif isinstance(msg, InitFailed):
            raise WorkerError(msg.error, method="engine_factory", remote_traceback=msg.traceback, **where)
        elif isinstance(msg, (Result, Failure)):
            task = slot.task
            if task is None or task.id != msg.id:
                raise ProtocolError(f"worker {slot.rank} answered task {msg.id}, which it was not running")
            now = time.monotonic()
            self.stats.record(slot.rank, task, slot.started, now)
            slot.tasks.popleft()
            if slot.state is WorkerState.BUSY:  # a killed one stays killed
                if slot.tasks:  # the next one runs now
                    self._start_running(slot, now)
                else:
                    slot.state, slot.deadline, slot.next_warning = WorkerState.IDLE, None, None
                    self._free.add(slot.rank)
            if isinstance(msg, Result):
                self._outcomes.append(Outcome(task, raw=msg.value))
            else:
                error = WorkerError(msg.error, index=task.index, method=task.method,
                                    remote_traceback=msg.traceback, **where)
                self._outcomes.append(Outcome(task, error=error))
        else:
            raise ProtocolError(f"worker {slot.rank} sent an unexpected {name}")

    def _check_engines(self, new: Slot | None = None) -> None:
        """Whether the running workers (and ``new``, a replacement) run the same engine."""
        running = {slot.rank: self.worker_info[slot.rank] for slot in self.slots
                   if slot.state in (WorkerState.IDLE, WorkerState.BUSY)}
        self.engine_agreement.check(running, [d.name for d in self.devices], newcomer=None if new is None else new.rank)

    def _on_closed(self, slot: Slot) -> None:
        if slot.state in (WorkerState.STARTING, WorkerState.IDLE, WorkerState.BUSY):
            slot.trouble = Trouble(slot.state, None)
            slot.state, slot.deadline = WorkerState.LOST, time.monotonic() + EXIT_REPORT_GRACE

    def _start_running(self, slot: Slot, now: float) -> None:
        slot.started, slot.deadline = now, _deadline(self.task_timeout)
        slot.next_warning = now + self.stall_warning if self.stall_warning else None

    def _warn_stalled(self, slot: Slot, now: float) -> None:
        task = slot.task  # a busy worker always runs one
        label = f" ({task.label})" if task.label else ""
        limit = f"; it is stopped at task_timeout {self.task_timeout:g} s" if self.task_timeout else ""
        log.warning("worker %d (%s, pid %s) has been silent for %.1f s in %s() on item %s%s%s",
                    slot.rank, slot.device.name, slot.pid, now - slot.started, task.method, task.index, label, limit)
        slot.next_warning = now + self.stall_warning

    def _check_deadlines(self) -> None:
        now = time.monotonic()
        if self._earliest.at is None or now < self._earliest.at:
            return  # no slot's time has come: nothing to scan
        for slot in self.slots:
            if slot.next_warning is not None and now >= slot.next_warning and slot.state is WorkerState.BUSY:
                self._warn_stalled(slot, now)
            if slot.deadline is None or now < slot.deadline:
                continue
            if slot.state is WorkerState.SPAWNING:
                raise PoolError(f"no process was started for worker {slot.rank} within {self.start_timeout:g} s")
            if slot.state is WorkerState.KILLED:
                raise PoolError(f"worker {slot.rank} (pid {slot.pid}) was killed but its exit was never reported")
            # Too slow, or alive after closing its channel: kill it, then wait for its exit.
            if slot.trouble is None:
                limit = self.start_timeout if slot.state is WorkerState.STARTING else self.task_timeout
                slot.trouble = Trouble(slot.state, limit)
            slot.state, slot.deadline, slot.next_warning = WorkerState.KILLED, now + KILL_REPORT_TIMEOUT, None
            self.transport.kill(slot.rank)
        # The exact earliest time again (a busy worker's next stall warning counts; an idle
        # one has none).
        self._earliest.at = None
        for slot in self.slots:
            self._earliest.lower(slot.deadline)
            if slot.state is WorkerState.BUSY:
                self._earliest.lower(slot.next_warning)

    def _on_exited(self, slot: Slot, exited: WorkerExited) -> None:
        """The worker is gone: replace it and retry its tasks, or raise."""
        if slot.trouble is None:
            slot.trouble = Trouble(slot.state, None)
        where, tasks = slot.where(), list(slot.tasks)
        slot.state, slot.deadline = WorkerState.DEAD, None
        slot.tasks.clear()
        if slot.trouble.timeout is not None:
            fault = WorkerTimeout(slot.trouble.timeout, **where)
        else:
            fault = WorkerDied(exitcode=exited.exitcode, signal=exited.signal, cause=exited.cause, **where)
        if self.restarts_left > 0:
            self.restarts_left -= 1
            self.stats.restarts += 1
            self.stats.restarts_by_rank[slot.rank] += 1
            # The one trace of a fault the run survived (summary.json counts them per worker).
            log.warning("%s; replacing it and retrying its work (restart %d, %d left)", fault, self.stats.restarts,
                        self.restarts_left)
            for task in tasks:
                if not task.done():
                    self.queue.retry(task)
            self._spawn(slot.rank)
            return
        raise fault

    def _spawn(self, rank: int) -> None:
        self.slots[rank] = Slot(rank, self.devices[rank], _deadline(self.start_timeout), self._earliest)
        self.transport.spawn(rank)


def _deadline(seconds: float | None) -> float | None:
    return None if seconds is None else time.monotonic() + seconds
