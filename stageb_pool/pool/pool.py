"""A reusable process pool: one forked worker per device, msgspec frames over socketpairs.

The parent owns every decision. Workers only hold an engine and a cache of shared
snapshots; they are replaceable. One event loop (``_step``) runs inside ``gather`` and
waits on every worker socket and the zygote's control socket with a deadline, so a worker
that raises, dies or stalls becomes an exception (or a retry) within a bounded time.

    with Pool(Engine, gpus="cpu:2") as pool:
        out = pool.map("square", items, guidance=snapshot)   # results in input order
"""

from __future__ import annotations

import hashlib
import os
import selectors
import signal
import socket
import time
import traceback
from collections import OrderedDict, deque

import msgspec

from . import protocol
from .calls import Calls
from .devices import Device, parse_gpus
from .protocol import (
    MAX_FRAME_BYTES,
    PROTOCOL_VERSION,
    Exited,
    Failure,
    FrameTooLarge,
    InitFailed,
    PoolError,
    ProtocolError,
    Ready,
    Result,
    Shutdown,
    Snapshot,
    Spawned,
    Task,
)
from .worker import exception_summary, start_engine
from .zygote import Zygote

__all__ = ["Pool", "TaskHandle", "PoolStats", "PoolError", "WorkerError", "WorkerDied", "WorkerTimeout",
           "FrameTooLarge", "ProtocolError"]

CLOSE_GRACE = 1.0  # seconds a worker gets after Shutdown, and again after SIGTERM, before SIGKILL
EXIT_REPORT_GRACE = 0.5  # a worker that closed its socket must be reported exited by then, else it is killed
KILL_REPORT_TIMEOUT = 10.0  # a killed worker the zygote never reports means the pool is broken
SNAPSHOT_CACHE_SIZE = 8  # distinct shared values each worker keeps (a baseline + candidates)


# -- errors -------------------------------------------------------------------------------
class _WorkerFault(PoolError):
    """Something went wrong on one worker; says which worker, device, item and method."""

    def __init__(self, summary: str, *, rank: int, device: str, index: int | None = None,
                 method: str | None = None):
        where = f"worker {rank} ({device})"
        if method is not None:
            where += f" in {method}()"
        if index is not None:
            where += f" on item {index}"
        super().__init__(f"{where}: {summary}")
        self.rank, self.device, self.index, self.method = rank, device, index, method


class WorkerError(_WorkerFault):
    """An exception in an engine method or in the engine's construction."""

    def __init__(self, summary: str, *, remote_traceback: str = "", **where):
        super().__init__(summary, **where)
        self.remote_traceback = remote_traceback

    def __str__(self) -> str:
        first = super().__str__()
        if not self.remote_traceback:
            return first
        return f"{first}\n\nremote traceback:\n{self.remote_traceback.rstrip()}"


class WorkerDied(_WorkerFault):
    """A worker process exited or was killed (OOM killer, segfault, kill -9)."""

    def __init__(self, *, exitcode: int | None, signal: int | None, **where):
        if signal is not None:
            cause = f"killed by signal {signal} ({_signal_name(signal)})"
        else:
            cause = f"exited with code {exitcode}"
        super().__init__(f"worker process died: {cause}", **where)
        self.exitcode, self.signal = exitcode, signal


class WorkerTimeout(_WorkerFault):
    """A worker exceeded task_timeout (or start_timeout); it was killed and reaped."""

    def __init__(self, timeout: float, **where):
        super().__init__(f"no answer within {timeout:g} s; the worker was killed", **where)
        self.timeout = timeout


def _signal_name(sig: int) -> str:
    try:
        return signal.Signals(sig).name
    except ValueError:
        return "?"


# -- bookkeeping ----------------------------------------------------------------------------
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


class TaskHandle:
    """A submitted task. Pass it to ``gather``; its result comes back there."""

    __slots__ = ("id", "method", "item", "shared", "rank", "result_type", "index",
                 "done", "result", "error", "cancelled", "owner", "ran_on")

    def __init__(self, id, method, item, shared, rank, result_type):
        self.id, self.method, self.item, self.shared = id, method, item, shared
        self.rank, self.result_type = rank, result_type
        self.index = None  # position in the gather that waits for it
        self.done = False
        self.result = None
        self.error: BaseException | None = None
        self.cancelled = False
        self.owner = None  # the gather waiting for it
        self.ran_on: int | None = None  # rank of the worker that computed the result

    def __repr__(self) -> str:
        state = "done" if self.done else "pending"
        return f"<TaskHandle {self.id} {self.method}() {state}>"


class _Worker:
    """The parent's view of one worker process."""

    def __init__(self, rank: int, device: Device, pid: int, sock, max_frame: int, deadline):
        self.rank, self.device, self.pid, self.sock = rank, device, pid, sock
        self.reader = protocol.FrameReader(max_frame)
        self.state = "starting"  # starting -> idle <-> busy; lost (socket gone), killed -> dead (reaped)
        self.task: TaskHandle | None = None
        self.started = 0.0
        self.deadline = deadline  # start, task, exit-report or kill deadline
        self.timed_out: float | None = None  # the limit it exceeded
        self.exit: Exited | None = None
        self.ready = False  # sent Ready: a death before that is an engine start failure
        self.cache: OrderedDict[str, None] = OrderedDict()  # snapshot keys the worker holds


# -- the pool -------------------------------------------------------------------------------
class Pool:
    """One worker process per device, each holding ``engine_factory(device)``.

    ``gpus``: ``"0-7"``, ``"0,2,5-6"``, ``"0"``, a list of ints, ``"cpu"``, ``"cpu:N"`` or a
    list of ``Device``. ``task_timeout``/``start_timeout`` are seconds (None: no limit).
    ``max_restarts``: how many dead or timed-out workers may be replaced (pool-wide); the
    task they were running is retried. ``inline=True`` runs the engine in this process.
    ``max_frame_bytes`` bounds every message (items, snapshots, results).
    """

    def __init__(self, engine_factory, gpus="cpu:2", *, task_timeout: float | None = 600.0,
                 start_timeout: float | None = 600.0, max_restarts: int = 0, inline: bool = False,
                 max_frame_bytes: int = MAX_FRAME_BYTES):
        if isinstance(gpus, (list, tuple)) and gpus and all(isinstance(d, Device) for d in gpus):
            self.devices = list(gpus)
        else:
            self.devices = parse_gpus(gpus)
        self.size = len(self.devices)
        self.inline = inline
        self.task_timeout, self.start_timeout = task_timeout, start_timeout
        self.max_frame = max_frame_bytes
        self._restarts_left = max_restarts
        self.worker_info: list[dict] = [{} for _ in self.devices]
        self.stats = PoolStats({}, {}, 0, 0, 0, [0] * self.size, [0.0] * self.size, 0)
        self._closed = False
        self._next_id = 0
        self._queue: deque[TaskHandle] = deque()  # unpinned tasks, in submission order
        self._pinned: list[deque[TaskHandle]] = [deque() for _ in self.devices]
        self._snapshots: dict[str, list] = {}  # key -> [encoded value, tasks using it]
        self._completed: list[TaskHandle] = []
        self._workers: list[_Worker | None] = [None] * self.size
        self._spawning: dict[int, float] = {}  # rank -> deadline for the zygote's Spawned
        if inline:
            try:
                self._engine, self.worker_info[0] = start_engine(engine_factory, self.devices[0])
            except Exception as exc:
                raise WorkerError(exception_summary(exc), rank=0, device=self.devices[0].name,
                                  method="engine_factory", remote_traceback=traceback.format_exc()) from exc
            self._inline_cache: OrderedDict[str, None] = OrderedDict()
            self._inline_calls = Calls(self._engine)
            return
        self._zygote = Zygote(self.devices, engine_factory, max_frame_bytes)
        self._sel = selectors.DefaultSelector()
        self._sel.register(self._zygote.sock, selectors.EVENT_READ, None)
        try:
            for rank in range(self.size):
                self._spawn(rank)
            while any(w is None or w.state != "idle" for w in self._workers):
                self._step()
        except BaseException:
            self.close()
            raise

    # -- public API ---------------------------------------------------------------------
    @property
    def pids(self) -> list[int]:
        if self.inline:
            return [os.getpid()]
        return [w.pid if w is not None else None for w in self._workers]

    def submit(self, method: str, item=None, *, rank: int | None = None, result_type=None,
               **shared) -> TaskHandle:
        """Queue ``engine.<method>(item, **shared)``; run by the first free worker (or by
        worker ``rank``) once a ``gather`` drives the pool."""
        return self._submit(method, item, rank, result_type, self._share(shared))

    def gather(self, tasks, *, on_result=None) -> list:
        """Run the pool until every task is done; results in the order of ``tasks``.

        ``on_result(index, result)`` is called as each task completes. On an error, this
        gather's remaining tasks are cancelled; the pool stays usable after a WorkerError
        and is closed after a death, a timeout or an interrupt."""
        self._check_open()
        tasks = list(tasks)
        owner = object()
        remaining = 0
        for index, task in enumerate(tasks):
            task.index, task.owner = index, owner
            remaining += not task.done
        self._completed = []  # tasks done before this gather are delivered from `tasks`
        try:
            for task in tasks:
                if task.done:
                    self._deliver(task, on_result)
            pending = iter([task for task in tasks if not task.done])
            while remaining:
                if self.inline:
                    self._run_inline(next(pending))
                else:
                    try:
                        self._step()
                    except BaseException:  # a death, a timeout, Ctrl-C: nothing is left to trust
                        self.close()
                        raise
                completed, self._completed = self._completed, []
                for task in completed:
                    if task.owner is owner:
                        remaining -= 1
                        self._deliver(task, on_result)
            return [task.result for task in tasks]
        except BaseException:
            self._cancel(tasks)
            raise

    def map(self, method: str, items, *, on_result=None, result_type=None, **shared) -> list:
        """``engine.<method>(item, **shared)`` for every item; results in input order."""
        keys = self._share(shared)
        tasks = [self._submit(method, item, None, result_type, keys) for item in items]
        return self.gather(tasks, on_result=on_result)

    def call(self, rank: int, method: str, item=None, *, result_type=None, **shared):
        """One request on one worker."""
        return self.gather([self.submit(method, item, rank=rank, result_type=result_type, **shared)])[0]

    def close(self) -> None:
        """Stop every worker (message, SIGTERM, SIGKILL), reap them and the zygote. Idempotent."""
        if self._closed:
            return
        self._closed = True
        self._cancel(list(self._queue) + [t for q in self._pinned for t in q])
        if self.inline:
            return
        for w in self._workers:
            if w is not None and w.sock is not None:
                if w.state == "busy":
                    # Mid-task it cannot read Shutdown, and nobody will collect its result:
                    # stop it now rather than after the grace period (Ctrl-C stays prompt).
                    self._zygote.kill(w.pid, signal.SIGTERM)
                else:
                    try:
                        w.sock.sendall(protocol.frame(Shutdown()))
                    except OSError:
                        pass
                self._drop_socket(w)
        self._zygote.shutdown(CLOSE_GRACE)  # returns once all workers and the zygote are reaped
        self._sel.close()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()

    # -- submission -----------------------------------------------------------------------
    def _check_open(self) -> None:
        if self._closed:
            raise PoolError("the pool is closed")

    def _share(self, shared: dict) -> dict[str, str]:
        """Snapshot keys of shared values; each distinct value is encoded once."""
        keys = {}
        for name, value in shared.items():
            data = protocol.encode(value)
            key = hashlib.sha256(data).hexdigest()[:16]  # equal encodings are one snapshot
            if key not in self._snapshots:
                if len(data) > self.max_frame:
                    raise FrameTooLarge(len(data), self.max_frame, f"shared value {name!r}")
                self._snapshots[key] = [data, 0]
            keys[name] = key
        return keys

    def _submit(self, method, item, rank, result_type, keys) -> TaskHandle:
        self._check_open()
        if rank is not None and not 0 <= rank < self.size:
            raise ValueError(f"rank {rank} does not exist: the pool has ranks 0-{self.size - 1}")
        data = protocol.encode(item)  # encode now: a bad item fails here, not in the loop
        if len(data) > self.max_frame:
            raise FrameTooLarge(len(data), self.max_frame, f"item for {method}()")
        for key in keys.values():
            self._snapshots[key][1] += 1
        task = TaskHandle(self._next_id, method, data, keys, rank, result_type)
        self._next_id += 1
        if not self.inline:  # inline tasks run in gather, in order; nothing to dispatch
            (self._queue if rank is None else self._pinned[rank]).append(task)
        return task

    def _finish(self, task: TaskHandle, *, result=None, error=None) -> None:
        task.done, task.result, task.error = True, result, error
        for key in task.shared.values():  # the parent keeps a snapshot while a task needs it
            entry = self._snapshots[key]
            entry[1] -= 1
            if entry[1] == 0:
                del self._snapshots[key]
        self._completed.append(task)

    def _deliver(self, task: TaskHandle, on_result) -> None:
        if task.error is not None:
            raise task.error
        if on_result is not None:
            on_result(task.index, task.result)

    def _cancel(self, tasks) -> None:
        """Forget tasks that will not be gathered; a late result of one is discarded."""
        for task in tasks:
            if not task.done:
                task.cancelled = True
                self._finish(task, error=PoolError(f"task {task.index} was cancelled by an earlier error"))
        self._completed = [t for t in self._completed if not t.cancelled]

    def _decode_result(self, task: TaskHandle, raw) -> tuple:
        """(result, error): the result decoded as the caller's result_type, if any."""
        try:
            if task.result_type is None:
                return msgspec.json.decode(raw), None
            return msgspec.json.decode(raw, type=task.result_type), None
        except msgspec.ValidationError as exc:
            return None, PoolError(f"result of {task.method}() for item {task.index} is not a "
                                   f"{getattr(task.result_type, '__name__', task.result_type)}: {exc}")

    # -- inline mode ----------------------------------------------------------------------
    def _run_inline(self, task: TaskHandle) -> None:
        """Run one task in this process through the same codec as a worker would."""
        started = time.perf_counter()
        try:
            for key in task.shared.values():
                self._inline_snapshot(key)
            value = self._inline_calls.call(task.method, task.item, task.shared)
            raw = protocol.encode(value)
            if len(raw) > self.max_frame:
                raise FrameTooLarge(len(raw), self.max_frame, "Result frame")
        except Exception as exc:
            error = WorkerError(exception_summary(exc), rank=0, device=self.devices[0].name,
                                index=task.index, method=task.method, remote_traceback=traceback.format_exc())
            error.__cause__ = exc  # keeps the real frames for pdb.post_mortem
            self._finish(task, error=error)
            return
        self.stats.items[0] += 1
        self.stats.busy_s[0] += time.perf_counter() - started
        task.ran_on = 0
        result, error = self._decode_result(task, raw)
        self._finish(task, result=result, error=error)

    def _inline_snapshot(self, key: str) -> None:
        """Keep the last SNAPSHOT_CACHE_SIZE shared values, as a worker's cache would."""
        if key in self._inline_cache:
            self._inline_cache.move_to_end(key)
            return
        self._inline_cache[key] = None
        evict = [self._inline_cache.popitem(last=False)[0]] if len(self._inline_cache) > SNAPSHOT_CACHE_SIZE else []
        self._inline_calls.add_snapshot(key, self._snapshots[key][0], evict)

    # -- the event loop -------------------------------------------------------------------
    def _step(self) -> None:
        """Wait for the next event (or deadline), handle it, hand out queued tasks."""
        self._dispatch()
        deadlines = [w.deadline for w in self._workers if w is not None and w.deadline is not None]
        deadlines += self._spawning.values()
        timeout = max(0.0, min(deadlines) - time.monotonic()) if deadlines else None
        for key, _ in self._sel.select(timeout):
            if key.data is None:
                self._on_zygote()
            elif key.data.sock is not None:  # may have been dropped by an earlier event
                self._on_readable(key.data)
        self._check_deadlines()
        self._dispatch()

    def _spawn(self, rank: int) -> None:
        self._workers[rank] = None
        self._spawning[rank] = _deadline(self.start_timeout)
        self._zygote.spawn(rank)

    def _dispatch(self) -> None:
        for w in self._workers:
            if w is not None and w.state == "idle":
                task = self._next_task(w.rank)
                if task is not None:
                    self._send_task(w, task)

    def _next_task(self, rank: int) -> TaskHandle | None:
        """The oldest queued task this worker may run (unpinned, or pinned to it)."""
        for queue in (self._queue, self._pinned[rank]):
            while queue and queue[0].cancelled:
                queue.popleft()
        candidates = [q for q in (self._queue, self._pinned[rank]) if q]
        if not candidates:
            return None
        return min(candidates, key=lambda q: q[0].id).popleft()

    def _send_task(self, w: _Worker, task: TaskHandle) -> None:
        w.state, w.task, task.ran_on = "busy", task, w.rank
        w.started = time.monotonic()
        w.deadline = _deadline(self.task_timeout)
        for key in task.shared.values():
            if key in w.cache:
                w.cache.move_to_end(key)
                continue
            evict = []
            while len(w.cache) >= SNAPSHOT_CACHE_SIZE:
                old = next((k for k in w.cache if k not in task.shared.values()), None)
                if old is None:  # this task needs every cached value: let the cache grow
                    break
                del w.cache[old]
                evict.append(old)
            self._send(w, Snapshot(key, msgspec.Raw(self._snapshots[key][0]), evict))
            w.cache[key] = None
            self.stats.snapshot_sends += 1
        self._send(w, Task(task.id, task.method, msgspec.Raw(task.item), task.shared))

    def _send(self, w: _Worker, msg) -> None:
        if w.sock is None:
            return
        data = protocol.frame(msg, self.max_frame)
        try:
            # Blocking is safe: a worker only reads while it has no task, and we only send
            # to a worker that has no task (one task in flight per worker).
            w.sock.sendall(data)
        except OSError:  # it died; its exit report will follow (and the task be retried)
            self._on_eof(w)
            return
        name = type(msg).__name__
        self.stats.frames_sent[name] = self.stats.frames_sent.get(name, 0) + 1
        self.stats.bytes_sent += len(data)

    def _on_readable(self, w: _Worker) -> None:
        try:
            data = w.sock.recv(1 << 20)
        except OSError:
            data = b""
        if not data:
            self._on_eof(w)
            return
        self.stats.bytes_received += len(data)
        try:
            messages = w.reader.feed(data)
        except ProtocolError as exc:
            self._zygote.kill(w.pid)
            raise ProtocolError(f"worker {w.rank} ({w.device.name}): {exc}") from None
        for msg in messages:
            self._on_message(w, msg)

    def _on_message(self, w: _Worker, msg) -> None:
        name = type(msg).__name__
        self.stats.frames_received[name] = self.stats.frames_received.get(name, 0) + 1
        where = dict(rank=w.rank, device=w.device.name)
        if isinstance(msg, Ready):
            if msg.version != PROTOCOL_VERSION:
                raise ProtocolError(f"worker {w.rank} speaks protocol {msg.version}, the parent {PROTOCOL_VERSION}")
            w.state, w.deadline, w.ready = "idle", None, True
            self.worker_info[w.rank] = msg.info
        elif isinstance(msg, InitFailed):
            raise WorkerError(msg.error, method="engine_factory", remote_traceback=msg.traceback, **where)
        elif isinstance(msg, (Result, Failure)):
            task = w.task
            if task is None or task.id != msg.id:
                raise ProtocolError(f"worker {w.rank} answered task {msg.id}, which it was not running")
            self.stats.items[w.rank] += 1
            self.stats.busy_s[w.rank] += time.monotonic() - w.started
            w.state, w.task, w.deadline = "idle", None, None
            if task.cancelled:
                return
            if isinstance(msg, Result):
                result, error = self._decode_result(task, msg.value)
                self._finish(task, result=result, error=error)
            else:
                self._finish(task, error=WorkerError(msg.error, index=task.index, method=task.method,
                                                     remote_traceback=msg.traceback, **where))
        else:
            raise ProtocolError(f"worker {w.rank} sent an unexpected {name}")

    def _on_zygote(self) -> None:
        msg, fds = self._zygote.receive()
        if msg is None:
            raise PoolError(f"the pool's zygote process (pid {self._zygote.pid}) died; no worker can be replaced")
        if isinstance(msg, Spawned):
            sock = socket.socket(fileno=fds[0])
            self._spawning.pop(msg.rank, None)
            w = _Worker(msg.rank, self.devices[msg.rank], msg.pid, sock, self.max_frame,
                        _deadline(self.start_timeout))
            self._workers[msg.rank] = w
            self._sel.register(sock, selectors.EVENT_READ, w)
        elif isinstance(msg, Exited):
            w = next((w for w in self._workers if w is not None and w.pid == msg.pid), None)
            if w is not None:
                w.exit = msg
                if w.sock is not None:  # read what it wrote before dying (a result, maybe)
                    w.sock.setblocking(False)
                    while w.sock is not None:
                        self._on_readable(w)
                self._on_lost(w)

    def _on_eof(self, w: _Worker) -> None:
        self._drop_socket(w)
        if w.exit is None:
            w.state = "lost"
            w.deadline = time.monotonic() + EXIT_REPORT_GRACE

    def _drop_socket(self, w: _Worker) -> None:
        if w.sock is not None:
            try:
                self._sel.unregister(w.sock)
            except (KeyError, ValueError):
                pass
            w.sock.close()
            w.sock = None

    def _check_deadlines(self) -> None:
        now = time.monotonic()
        for rank, deadline in list(self._spawning.items()):
            if now >= deadline:
                raise PoolError(f"the zygote did not start worker {rank} within {self.start_timeout:g} s")
        for w in self._workers:
            if w is None or w.deadline is None or now < w.deadline:
                continue
            # Too slow, or alive after closing its socket: kill it, then wait for its reaping.
            if w.state in ("starting", "busy", "lost"):
                if w.state != "lost":
                    w.timed_out = self.start_timeout if w.state == "starting" else self.task_timeout
                w.state, w.deadline = "killed", now + KILL_REPORT_TIMEOUT
                self._zygote.kill(w.pid)
            else:
                raise PoolError(f"worker {w.rank} (pid {w.pid}) was killed but never reaped")

    def _on_lost(self, w: _Worker) -> None:
        """A worker process is gone (exit reported): replace it and retry, or raise."""
        self._drop_socket(w)
        task, was_starting = w.task, not w.ready
        w.state, w.deadline, w.task = "dead", None, None
        where = dict(rank=w.rank, device=w.device.name, index=task.index if task else None,
                     method=task.method if task else ("engine_factory" if was_starting else None))
        if self._restarts_left > 0:
            self._restarts_left -= 1
            self.stats.restarts += 1
            if task is not None and not task.cancelled:
                # Oldest task in flight, so the front keeps the queue in submission order.
                (self._queue if task.rank is None else self._pinned[task.rank]).appendleft(task)
            self._spawn(w.rank)
            return
        if w.timed_out is not None:
            raise WorkerTimeout(w.timed_out, **where)
        raise WorkerDied(exitcode=w.exit.exitcode, signal=w.exit.signal, **where)


def _deadline(seconds: float | None) -> float | None:
    return None if seconds is None else time.monotonic() + seconds
