"""The dispatcher of every backend whose workers are other processes: the queue, one ``Slot``
per rank, deadlines, stall warnings, kills, replacements, retries and the engine agreement; a
``Transport`` owns the processes and sockets (docs/architecture.md, "The pool's modules", "Fault semantics").
"""

from __future__ import annotations

import heapq
import logging
import time
from typing import NamedTuple, Protocol

import msgspec

from . import protocol
from .engine_agreement import ACCEPT_ANY, EngineAgreement
from .errors import PoolError, ProtocolError, WorkerDied, WorkerError, WorkerTimeout
from .protocol import PROTOCOL_VERSION, Failure, InitFailed, Ready, Reply, Result, Share, Task
from .slots import Earliest, Slot, Trouble, WorkerState
from .tasks import Outcome, PoolStats, TaskHandle, TaskQueue

log = logging.getLogger("stageb_pool.pool")

EXIT_REPORT_GRACE = 0.5  # a worker that closed its channel must be reported exited by then, else it is killed
KILL_REPORT_TIMEOUT = 10.0  # a killed worker whose exit is never reported means the pool is broken


class WorkerStarted(NamedTuple):  # a process exists for rank and is building its engine
    rank: int
    pid: int | None


class WorkerMessage(NamedTuple):  # a reply from the worker of rank
    rank: int
    message: Reply


class WorkerClosed(NamedTuple):  # its channel closed; its exit report should follow
    rank: int


class WorkerExited(NamedTuple):
    """The worker of ``rank`` is gone (reaped); ``cause``: why, where no exit code or signal is known."""

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
        """Frames for the worker of ``rank`` (which has fewer tasks than the dispatcher's depth);
        a worker that is gone shows up as a later event, never as an exception here."""

    def cancel(self, rank: int, task_id: int) -> None:
        """Tell the worker of ``rank`` that its running task ``task_id`` is no longer wanted (it may
        stop early: ``cancellation.py``); its reply follows as any task's."""

    def kill(self, rank: int) -> None:
        """Kill the worker of ``rank``; its WorkerExited follows."""

    def poll(self, timeout: float | None) -> list:
        """The events that happened, waiting at most ``timeout`` seconds for the first."""

    def close(self, busy: list[int]) -> None:
        """Stop every worker (``busy`` ones at once) and release everything."""


class Dispatcher:
    """Runs tasks on the workers of ``transport``; ``advance`` is one turn of the event loop."""

    def __init__(self, transport: Transport, devices, stats: PoolStats, *,
                 task_timeout: float | None, start_timeout: float | None, max_restarts: int, max_frame: int,
                 engine_agreement: EngineAgreement = ACCEPT_ANY, depth: int = 1, stall_warning: float | None = None):
        self.transport = transport
        self.devices = devices
        self.stats = stats
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
        # The ranks that may be idle (each idle one once, in a heap) and those that may have pinned tasks.
        self._free: list[int] = []
        self._in_free: set[int] = set()
        self._pinned: set[int] = set()

    @property
    def pids(self) -> list[int | None]:
        return [slot.pid for slot in self.slots]

    def start(self) -> None:
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

    def stop(self, task: TaskHandle) -> None:
        """``task`` was cancelled: if a worker is running it, ask it to stop early, so that the
        tasks waited for are not queued behind it (its reply is discarded, as any cancelled task's)."""
        if task.ran_on is None:
            return
        slot = self.slots[task.ran_on]
        if slot.state is WorkerState.BUSY and slot.task is task:
            self.transport.cancel(slot.rank, task.id)

    def advance(self, waiting) -> list[Outcome]:
        """One turn of the event loop; the tasks finished meanwhile (any, not only ``waiting``)."""
        self._step()
        outcomes, self._outcomes = self._outcomes, []
        return outcomes

    def close(self) -> None:
        self.transport.close([s.rank for s in self.slots if s.state is WorkerState.BUSY])

    def _step(self) -> None:
        self._dispatch()
        # a busy worker's next stall warning wakes the loop too, also when its task has no deadline
        earliest = self._earliest.at
        timeout = max(0.0, earliest - time.monotonic()) if earliest is not None else None
        for event in self.transport.poll(timeout):
            slot = self.slots[event.rank]
            match event:
                case WorkerMessage(message=reply):
                    self._on_reply(slot, reply)
                case WorkerStarted(pid=pid):
                    slot.state, slot.pid = WorkerState.STARTING, pid
                    slot.deadline = _deadline(self.start_timeout)
                case WorkerClosed():
                    self._on_closed(slot)
                case WorkerExited():
                    self._on_exited(slot, event)
        self._check_deadlines()
        self._dispatch()

    def _dispatch(self) -> None:
        """One task to each idle worker, lowest rank first (stale ``_free`` entries are dropped when
        reached); then, with ``depth`` > 1, the further rounds. Each is skipped at once where
        nothing can be sent: this runs twice per turn of the event loop."""
        free = self._free
        while free and self.queue.any_queued():
            slot = self.slots[free[0]]
            if slot.state is WorkerState.IDLE and not slot.tasks:
                task = self.queue.pop(slot.rank, speculative=True)  # an idle worker may take speculative work
                if task is None:
                    break
                self._send_task(slot, task)
            self._in_free.discard(heapq.heappop(free))
        if self._pinned:
            self._dispatch_pinned()
        if self.depth > 1:
            self._dispatch_deeper()

    def _dispatch_pinned(self) -> None:
        for rank in sorted(self._pinned):
            slot = self.slots[rank]
            if slot.state is WorkerState.IDLE and not slot.tasks:
                task = self.queue.pop(rank, speculative=True)
                if task is None:  # neither the shared queue nor this rank's has a task
                    self._pinned.discard(rank)
                else:
                    self._send_task(slot, task)

    def _dispatch_deeper(self) -> None:
        # A next task waits in a worker only while more tasks are queued than there are workers
        # (the last ones never wait behind a long task), and never behind a speculative one.
        for in_flight in range(1, self.depth):
            if len(self.queue) <= len(self.slots):
                return
            for slot in self.slots:
                if (len(slot.tasks) == in_flight and slot.state is WorkerState.BUSY
                        and not any(task.speculative for task in slot.tasks)):
                    task = self.queue.pop(slot.rank)
                    if task is not None:
                        self._send_task(slot, task)

    def _send_task(self, slot: Slot, task: TaskHandle) -> None:
        if not slot.tasks:  # it starts at once; a later one when those before it are done
            self._start_running(slot, time.monotonic())
        slot.state, task.ran_on = WorkerState.BUSY, slot.rank
        slot.tasks.append(task)
        data = protocol.frame(Task(task.id, task.method, msgspec.Raw(task.item), task.shared), self.max_frame)
        self.stats.tasks_sent += 1
        sends = slot.cache.admit(task.shared)
        if sends:
            frames = [protocol.frame(Share(key, msgspec.Raw(task.shared_data[key]), evict), self.max_frame)
                      for key, evict in sends]
            self.stats.shared_sends += len(frames)
            data = b"".join([*frames, data])
        # Blocking sends are safe with depth 1: a worker reads while it has no task, and this
        # one has none (a deeper transport, Ray's, never blocks on a busy worker).
        self.transport.send(slot.rank, data)

    def _on_reply(self, slot: Slot, reply: Reply) -> None:
        match reply:
            case Result(id=task_id, value=value):
                self._outcomes.append(Outcome(self._task_done(slot, task_id), raw=value))
            case Failure(id=task_id, error=error, traceback=remote):
                task = self._task_done(slot, task_id)
                error = WorkerError(error, index=task.index, method=task.method, remote_traceback=remote,
                                    rank=slot.rank, device=slot.device.name)
                self._outcomes.append(Outcome(task, error=error))
            case Ready(version=version, pid=pid, info=info):
                if version != PROTOCOL_VERSION:
                    raise ProtocolError(f"worker {slot.rank} speaks protocol {version}, the parent {PROTOCOL_VERSION}")
                slot.state, slot.deadline = WorkerState.IDLE, None
                self._mark_free(slot.rank)
                slot.pid = slot.pid or pid  # a backend may only learn it here (Ray)
                self.worker_info[slot.rank] = info
                if self._started:  # a replacement; at start all are compared at once
                    self._check_engines(new=slot)
            case InitFailed(error=error, traceback=remote):
                raise WorkerError(error, method="engine_factory", remote_traceback=remote, rank=slot.rank,
                                  device=slot.device.name)

    def _task_done(self, slot: Slot, task_id: int) -> TaskHandle:
        """The running task of ``slot`` answered: counted, and the worker's next one started."""
        task = slot.task
        if task is None or task.id != task_id:
            raise ProtocolError(f"worker {slot.rank} answered task {task_id}, which it was not running")
        now = time.monotonic()
        self.stats.record(slot.rank, task, slot.started, now)
        slot.tasks.popleft()
        if slot.state is WorkerState.BUSY:  # a killed one stays killed
            if slot.tasks:  # the next one runs now
                self._start_running(slot, now)
            else:
                slot.state, slot.deadline, slot.next_warning = WorkerState.IDLE, None, None
                self._mark_free(slot.rank)
        return task

    def _mark_free(self, rank: int) -> None:
        if rank not in self._in_free:  # a rank given a pinned task stays in the heap meanwhile
            self._in_free.add(rank)
            heapq.heappush(self._free, rank)

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
        self._earliest.at = None
        for slot in self.slots:
            self._earliest.lower(slot.deadline)
            if slot.state is WorkerState.BUSY:
                self._earliest.lower(slot.next_warning)

    def _on_exited(self, slot: Slot, exited: WorkerExited) -> None:
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
