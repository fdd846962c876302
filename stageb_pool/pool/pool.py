"""``Pool``: one worker per device, each holding ``engine_factory(device)``; the parent decides.

    with Pool(Engine, gpus="cpu:2") as pool:
        out = pool.map("square", items, guidance=guidance)   # results in input order
"""

from __future__ import annotations

import typing
from contextlib import contextmanager

import msgspec

from .backend import Backend, Fork, Inline, Ray, plan_devices
from .devices import check_threads_per_worker
from .dispatch import Dispatcher
from .engine_agreement import ACCEPT_ANY, REFUSE_ANY_DIFFERENCE, EngineAgreement
from .errors import FrameTooLarge, PoolError, TaskCancelled
from .fork_transport import ForkedTransport
from .inline import InlineDispatcher
from .protocol import MAX_FRAME_BYTES, encode
from .shared import SharedValue, SharedStore
from .tasks import Outcome, PoolStats, TaskHandle

MAX_TIMEOUT = 7 * 24 * 3600.0  # a week; a longer limit is a typo (and overflows select())
RAY_DEPTH = 2  # tasks in flight per Ray actor: Ray's ~1 ms round trip is not spent idle


class Pool:
    """One worker per device, each holding ``engine_factory(device)``, run by ``backend``
    (``Fork()``, the default; ``Inline()``; ``Ray(address)``).

    ``gpus``: a spec (``parse_gpus``; under Ray a GPU count) or ``Device``s (``backend.plan_devices``).
    ``task_timeout``/``start_timeout``: seconds, None for no limit; outside (0, ``MAX_TIMEOUT``] a
    ValueError. ``max_restarts``: dead or timed-out workers that may be replaced, pool-wide; their
    tasks are retried. ``stall_warning``: seconds a task may run silent before a warning names its
    worker (again after each further interval). ``max_frame_bytes`` bounds every message.
    ``gpus_per_worker=G``: one worker per group of G GPUs. ``threads_per_worker``: every worker's
    torch threads, whatever the layout (the same bits anywhere). ``engine_agreement``: what to do
    when the workers' ``engine.info()`` differ (default: Ray refuses any difference, fork compares
    nothing). Errors, restarts, order and results are the same under every backend."""

    def __init__(self, engine_factory, gpus="cpu:2", *, backend: Backend = Fork(),
                 task_timeout: float | None = 600.0, start_timeout: float | None = 600.0, max_restarts: int = 0,
                 max_frame_bytes: int = MAX_FRAME_BYTES, gpus_per_worker: int = 1, threads_per_worker: int = 1,
                 stall_warning: float | None = None, engine_agreement: EngineAgreement | None = None):
        limits = {name: _checked_timeout(name, value) for name, value in
                  (("task_timeout", task_timeout), ("stall_warning", stall_warning), ("start_timeout", start_timeout))}
        if isinstance(max_restarts, bool) or not isinstance(max_restarts, int) or max_restarts < 0:
            raise ValueError(f"max_restarts must be an integer >= 0, got {max_restarts!r}")
        check_threads_per_worker(threads_per_worker)
        if not isinstance(backend, (Fork, Inline, Ray)):
            raise ValueError(f"backend must be Fork(), Inline() or Ray(address), got {backend!r}")
        if isinstance(backend, Ray):
            _checked_timeout("placement_timeout", backend.placement_timeout)
            _checked_timeout("connect_timeout", backend.connect_timeout)
        self.devices = plan_devices(backend, gpus, gpus_per_worker=gpus_per_worker,
                                    threads_per_worker=threads_per_worker)
        self.size = len(self.devices)
        self.max_frame = max_frame_bytes
        self.stats = PoolStats.empty(self.size)
        self._shared = SharedStore(max_frame_bytes)
        self._unfinished: dict[int, TaskHandle] = {}  # by id: submitted, not yet finished
        self._next_id = 0
        self._closed = False
        self._speculating = False  # inside ``speculation()``
        if engine_agreement is None:
            engine_agreement = REFUSE_ANY_DIFFERENCE if isinstance(backend, Ray) else ACCEPT_ANY
        self._dispatcher = self._dispatcher_for(engine_factory, backend, max_restarts=max_restarts,
                                                engine_agreement=engine_agreement, **limits)
        try:
            self._dispatcher.start()
        except BaseException:
            self.close()
            raise

    def _dispatcher_for(self, engine_factory, backend: Backend, **limits):
        if isinstance(backend, Inline):
            return InlineDispatcher(engine_factory, self.devices[0], self.stats, self.max_frame)
        if isinstance(backend, Fork):
            transport, depth = ForkedTransport(self.devices, engine_factory, self.max_frame, self.stats), 1
        else:
            from .ray_transport import RayTransport  # imports ray; never on the fork path

            transport = RayTransport(self.devices, engine_factory, self.max_frame, self.stats, backend)
            depth = RAY_DEPTH
        return Dispatcher(transport, self.devices, self.stats, max_frame=self.max_frame,
                          depth=depth, **limits)

    @property
    def pids(self) -> list[int | None]:
        """The process id of each rank's worker (None while one is being replaced)."""
        return self._dispatcher.pids

    @property
    def worker_info(self) -> list[dict]:
        """Each rank's ``engine.info()``, as reported when its engine started."""
        return self._dispatcher.worker_info

    @property
    def placement(self) -> list[dict]:
        """Where each rank's worker runs under Ray (node, Ray's GPU ids, pid); {} on this machine."""
        transport = getattr(self._dispatcher, "transport", None)
        return getattr(transport, "placement", None) or [{} for _ in range(self.size)]

    def submit(self, method: str, item=None, *, rank: int | None = None, result_type=None,
               cost: float | None = None, label: str | None = None, **shared) -> TaskHandle:
        """Queue ``engine.<method>(item, **shared)`` for the first free worker (or worker
        ``rank``); it runs once a ``gather`` or the handle's ``result()`` drives the pool.

        ``cost``: an estimate of the run time, in any unit: costed tasks start most expensive first,
        after uncosted ones (in submission order); results never depend on it. ``label``: the
        caller's name for the task, kept in ``stats.intervals``, never sent to a worker."""
        if cost is not None and (isinstance(cost, bool) or not isinstance(cost, (int, float))
                                 or not 0 <= cost < float("inf")):
            raise ValueError(f"cost must be a finite number >= 0 or None, got {cost!r}")
        if label is not None and not isinstance(label, str):
            raise ValueError(f"label must be a string or None, got {label!r}")
        return self._submit(method, item, rank, result_type, self._shared.resolve(shared), cost, label)

    def share(self, value) -> SharedValue:
        """``value`` encoded and hashed once, for a shared keyword of many ``submit`` calls."""
        return self._shared.encode(value)

    @contextmanager
    def speculation(self):
        """Tasks submitted inside are speculative: a worker takes one only with nothing in
        flight and nothing else queued; a gather that waits for one makes it ordinary, and ``cancel``
        drops one never gathered. (Inline mode computes nothing ahead.)"""
        self._speculating = True
        try:
            yield
        finally:
            self._speculating = False

    def cancel(self, tasks) -> None:
        """Drop tasks that will not be gathered. A running one's result is discarded, and its
        worker is told: an engine that checks (``cancellation.checkpoint``) stops it early."""
        self._cancel(list(tasks), "cancelled by its submitter")

    def gather(self, tasks, *, on_result=None, between=None) -> list:
        """Run the pool until every task is done; results in the order of ``tasks``.

        ``on_result(index, result)`` as each completes; ``between()`` after every turn in which any
        task finished (to submit work that just became possible). On an error this gather's other
        tasks are cancelled; the pool stays usable after a WorkerError and is closed after a death,
        a timeout or an interrupt."""
        self._check_open()
        tasks = list(tasks)
        owner = object()
        for index, task in enumerate(tasks):
            task.index, task.owner = index, owner
            if task.speculative:  # waited for now: an ordinary task (also if its worker dies)
                task.speculative = False
                self._dispatcher.promote(task)
        try:
            for task in tasks:
                if task.done():  # finished before this gather
                    self._deliver(task, on_result)
            waiting = [task for task in tasks if not task.done()]
            remaining = len(waiting)
            while remaining:
                finished = self._advance(waiting)
                for task in finished:
                    if task.owner is owner:
                        remaining -= 1
                        self._deliver(task, on_result)
                if finished and between is not None:
                    between()
            return [task.result() for task in tasks]
        except BaseException:
            self._cancel(tasks, "an earlier error in its gather")
            raise

    def map(self, method: str, items, *, on_result=None, result_type=None, **shared) -> list:
        """``engine.<method>(item, **shared)`` for every item; results in input order."""
        resolved = self._shared.resolve(shared)
        tasks = [self._submit(method, item, None, result_type, resolved) for item in items]
        return self.gather(tasks, on_result=on_result)

    def call(self, rank: int, method: str, item=None, *, result_type=None, **shared):
        return self.submit(method, item, rank=rank, result_type=result_type, **shared).result()

    def close(self) -> None:
        """Stop and reap every worker (and the zygote), cancel every unfinished task. Idempotent."""
        if self._closed:
            return
        self._closed = True
        self._cancel(list(self._unfinished.values()), "the pool was closed")
        self._dispatcher.close()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()

    def _check_open(self) -> None:
        if self._closed:
            raise PoolError("the pool is closed")

    def _submit(self, method, item, rank, result_type, shared, cost=None, label=None) -> TaskHandle:
        """``shared``: the task's shared keywords, resolved (``SharedStore.resolve``)."""
        self._check_open()
        if rank is not None and not 0 <= rank < self.size:
            raise ValueError(f"rank {rank} does not exist: the pool has ranks 0-{self.size - 1}")
        data = encode(item)  # encode now: a bad item fails here, not in the loop
        if len(data) > self.max_frame:
            raise FrameTooLarge(len(data), self.max_frame, f"item for {method}()")
        keys, shared_data = shared
        task = TaskHandle(self, self._next_id, method, data, keys, rank, result_type, cost, label, shared_data)
        task.speculative = self._speculating
        self._next_id += 1
        self._unfinished[task.id] = task
        self._dispatcher.submit(task)
        return task

    def _advance(self, waiting) -> list[TaskHandle]:
        """One turn of the dispatcher; the tasks it finished. Anything it raises closes the pool."""
        try:
            outcomes = self._dispatcher.advance(waiting)
        except BaseException:
            self.close()
            raise
        return [outcome.task for outcome in outcomes if self._finish(outcome)]

    def _finish(self, outcome: Outcome, *, cancelled: bool = False) -> bool:
        task = outcome.task
        if task.done():
            return False
        result, error = None, outcome.error
        if error is None and not cancelled:
            result, error = _decode(task, outcome.raw)
        task._finish(result, error, cancelled=cancelled)
        del self._unfinished[task.id]
        return True

    def _deliver(self, task: TaskHandle, on_result) -> None:
        result = task.result()  # finished: raises its error
        if on_result is not None:
            on_result(task.index, result)

    def _cancel(self, tasks, why: str) -> None:
        for task in tasks:
            if not task.done():
                error = TaskCancelled(f"task {task.index} {task.method}() was cancelled: {why}")
                self._finish(Outcome(task, error=error), cancelled=True)
                if not self._closed:  # a closing pool stops its workers anyway
                    self._dispatcher.stop(task)


_decoders: dict = {}  # result_type -> its decoder, made once


def _decode(task: TaskHandle, raw) -> tuple:
    decoder = _decoders.get(task.result_type)
    if decoder is None:
        decoder = _decoders[task.result_type] = msgspec.json.Decoder(task.result_type or typing.Any)
    try:
        return decoder.decode(raw), None
    except msgspec.ValidationError as exc:
        return None, PoolError(f"result of {task.method}() for item {task.index} is not a "
                               f"{getattr(task.result_type, '__name__', task.result_type)}: {exc}")


def _checked_timeout(name: str, seconds) -> float | None:
    if seconds is None:
        return None
    if isinstance(seconds, bool) or not isinstance(seconds, (int, float)):
        raise ValueError(f"{name} must be a number of seconds (or None: no limit), got {seconds!r}")
    if not 0 < seconds <= MAX_TIMEOUT:  # also refuses nan and inf
        raise ValueError(f"{name} must be more than 0 and at most {MAX_TIMEOUT:g} seconds "
                         f"(or None: no limit), got {seconds!r}")
    return float(seconds)

