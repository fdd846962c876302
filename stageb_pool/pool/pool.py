"""``Pool``: one worker per device, each holding ``engine_factory(device)``; the parent decides.

    with Pool(Engine, gpus="cpu:2") as pool:
        out = pool.map("square", items, guidance=snapshot)   # results in input order

The facade over a runner, chosen by the backend value (backend.py): ``Inline`` is the
``InlineRunner`` (the engine in this process); ``Fork`` and ``Ray`` are a ``Dispatcher``
driving workers through a transport (``ForkedTransport``: forked by the zygote, one socketpair
each; ``RayTransport``: Ray actors in one placement group). The pool encodes items and shared
values at submit, gathers results in the order it was given, decodes them (as ``result_type``
when given) and owns the tasks' life cycle; the runner decides where a task runs and turns
every worker fault into an error or a retry.
"""

from __future__ import annotations

from contextlib import contextmanager

import msgspec

from .backend import Backend, Fork, Inline, Ray, plan_devices
from .devices import check_threads_per_worker
from .dispatch import Dispatcher
from .engine_agreement import ACCEPT_ANY, REFUSE_ANY_DIFFERENCE, EngineAgreement
from .errors import FrameTooLarge, PoolError, TaskCancelled
from .fork_transport import ForkedTransport
from .inline import InlineRunner
from .protocol import MAX_FRAME_BYTES, encode
from .snapshots import SharedValue, SnapshotStore
from .tasks import Outcome, PoolStats, TaskHandle

MAX_TIMEOUT = 7 * 24 * 3600.0  # a week; a longer limit is a typo (and overflows select())
RAY_DEPTH = 2  # tasks in flight per Ray actor: Ray's ~1 ms round trip is not spent idle


class Pool:
    """One worker per device, each holding ``engine_factory(device)``, run by ``backend``
    (``Fork()``, the default; ``Inline()``; ``Ray(address)``: backend.py).

    ``gpus``: ``"0-7"``, ``"0,2,5-6"``, ``"0"``, a list of ints, ``"cpu"``, ``"cpu:N"`` (under
    Ray a GPU count, ``"32"``, or ``"cpu:N"``), or a list of ``Device`` already planned
    (``backend.plan_devices``). ``task_timeout``/``start_timeout`` are seconds (None: no
    limit). ``max_restarts``: how many dead or timed-out workers may be replaced (pool-wide);
    the task they were running is retried. ``stall_warning``: seconds a task may run without a
    result before a warning names its worker (repeated after each further ``stall_warning``;
    None: never). ``max_frame_bytes`` bounds every message (items, snapshots, results). A
    timeout that is not a number of seconds in (0, ``MAX_TIMEOUT``], or a negative
    ``max_restarts``, is a ValueError naming the argument. Errors, restarts, snapshots, order
    and results are the same under every backend.

    ``gpus_per_worker=G``: one worker per group of G GPUs (contiguous in the spec's order;
    under Ray, G GPUs of one node in the worker's bundle), its ``Device.group`` listing them
    and its CUDA_VISIBLE_DEVICES set to them; the engine shards its model over the group.
    The GPU count must be a multiple of G; a CPU spec takes only G=1 (DeviceSpecError).

    ``threads_per_worker``: the torch intra-op threads of every worker, whatever the worker
    count and the machine's cores, so that a task gives the same bits on any layout (another
    thread count sums reductions in another order); a list of ``Device`` carries its own.

    ``engine_agreement``: what the pool does when its workers' ``engine.info()`` differ, at
    start and for every replacement (``engine_agreement.EngineAgreement``). By default the
    Ray backend refuses any difference (``REFUSE_ANY_DIFFERENCE``: a PoolError naming the odd
    worker) and the fork backend, one machine, compares nothing (``ACCEPT_ANY``).
    """

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
        self._snapshots = SnapshotStore(max_frame_bytes)
        self._unfinished: dict[int, TaskHandle] = {}  # by id: submitted, not yet finished
        self._next_id = 0
        self._closed = False
        self._speculating = False  # inside ``speculation()``
        if engine_agreement is None:
            engine_agreement = REFUSE_ANY_DIFFERENCE if isinstance(backend, Ray) else ACCEPT_ANY
        self._runner = self._runner_for(engine_factory, backend, max_restarts=max_restarts,
                                        engine_agreement=engine_agreement, **limits)
        try:
            self._runner.start()
        except BaseException:
            self.close()
            raise

    def _runner_for(self, engine_factory, backend: Backend, **limits):
        """The inline runner, or the dispatcher over the fork or the Ray transport (``limits``:
        its timeouts, restarts and engine agreement)."""
        if isinstance(backend, Inline):
            return InlineRunner(engine_factory, self.devices[0], self._snapshots, self.stats, self.max_frame)
        if isinstance(backend, Fork):
            transport, depth = ForkedTransport(self.devices, engine_factory, self.max_frame, self.stats), 1
        else:
            from .ray_transport import RayTransport  # imports ray; never on the fork path

            transport = RayTransport(self.devices, engine_factory, self.max_frame, self.stats, backend)
            depth = RAY_DEPTH
        return Dispatcher(transport, self.devices, self._snapshots, self.stats, max_frame=self.max_frame,
                          depth=depth, **limits)

    # -- public API ---------------------------------------------------------------------
    @property
    def pids(self) -> list[int | None]:
        """The process id of each rank's worker (None while one is being replaced)."""
        return self._runner.pids

    @property
    def worker_info(self) -> list[dict]:
        """Each rank's ``engine.info()``, as reported when its engine started."""
        return self._runner.worker_info

    @property
    def placement(self) -> list[dict]:
        """Where each rank's worker runs: under Ray, its node (id, address), Ray's GPU ids
        and its pid there; {} for workers on this machine."""
        transport = getattr(self._runner, "transport", None)
        return getattr(transport, "placement", None) or [{} for _ in range(self.size)]

    def submit(self, method: str, item=None, *, rank: int | None = None, result_type=None,
               cost: float | None = None, label: str | None = None, **shared) -> TaskHandle:
        """Queue ``engine.<method>(item, **shared)``; run by the first free worker (or by
        worker ``rank``) once a ``gather`` (or the handle's ``result()``) drives the pool.

        ``cost``: an estimate of the task's run time, in any unit. Queued tasks with a cost
        start most expensive first, after those without one (which keep submission order);
        results and seeds do not depend on it. Inline mode runs in gather order.
        ``label``: the caller's name for the task, kept with its interval in
        ``stats.intervals`` (e.g. which rollout a chunk belongs to); never sent to a worker."""
        if cost is not None and (isinstance(cost, bool) or not isinstance(cost, (int, float))
                                 or not 0 <= cost < float("inf")):
            raise ValueError(f"cost must be a finite number >= 0 or None, got {cost!r}")
        if label is not None and not isinstance(label, str):
            raise ValueError(f"label must be a string or None, got {label!r}")
        return self._submit(method, item, rank, result_type, self._snapshots.share(shared), cost, label)

    def share(self, value) -> SharedValue:
        """``value`` encoded once, to pass as a shared keyword of many ``submit`` calls
        (``submit("m", item, guidance=pool.share(g))``): the same snapshot as the value
        itself, without encoding and hashing it again for each task."""
        return self._snapshots.encode(value)

    @contextmanager
    def speculation(self):
        """Tasks submitted inside are speculative: work the caller may need later. A worker
        takes one only when it has nothing in flight and no other task is queued, so it
        never delays the work a gather waits for; once a gather waits for it, it is an
        ordinary task. One never gathered is dropped with ``cancel``. (Inline mode runs
        tasks only when gathered: there, speculation computes nothing ahead.)"""
        self._speculating = True
        try:
            yield
        finally:
            self._speculating = False

    def cancel(self, tasks) -> None:
        """Drop tasks that will not be gathered (e.g. a speculation that turned out wrong):
        queued ones never run; a running one's result is discarded when it comes."""
        self._cancel(list(tasks), "cancelled by its submitter")

    def gather(self, tasks, *, on_result=None, between=None) -> list:
        """Run the pool until every task is done; results in the order of ``tasks``.

        ``on_result(index, result)`` is called as each task completes; ``between()`` after
        every turn of the event loop in which any task finished (one of another gather, a
        speculative one), e.g. to submit work that just became possible. On an error, this
        gather's remaining tasks are cancelled; the pool stays usable after a WorkerError
        and is closed after a death, a timeout or an interrupt."""
        self._check_open()
        tasks = list(tasks)
        owner = object()
        for index, task in enumerate(tasks):
            task.index, task.owner = index, owner
            if task.speculative:  # waited for now: an ordinary task (also if its worker dies)
                task.speculative = False
                self._runner.promote(task)
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
        keys = self._snapshots.share(shared)
        tasks = [self._submit(method, item, None, result_type, keys) for item in items]
        return self.gather(tasks, on_result=on_result)

    def call(self, rank: int, method: str, item=None, *, result_type=None, **shared):
        """One request on one worker."""
        return self.submit(method, item, rank=rank, result_type=result_type, **shared).result()

    def close(self) -> None:
        """Stop every worker (message, SIGTERM, SIGKILL), reap them (and the zygote), cancel
        every unfinished task. Idempotent."""
        if self._closed:
            return
        self._closed = True
        self._cancel(list(self._unfinished.values()), "the pool was closed")
        self._runner.close()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()

    # -- the tasks' life cycle ----------------------------------------------------------------
    def _check_open(self) -> None:
        if self._closed:
            raise PoolError("the pool is closed")

    def _submit(self, method, item, rank, result_type, keys, cost=None, label=None) -> TaskHandle:
        self._check_open()
        if rank is not None and not 0 <= rank < self.size:
            raise ValueError(f"rank {rank} does not exist: the pool has ranks 0-{self.size - 1}")
        data = encode(item)  # encode now: a bad item fails here, not in the loop
        if len(data) > self.max_frame:
            raise FrameTooLarge(len(data), self.max_frame, f"item for {method}()")
        self._snapshots.acquire(keys)
        task = TaskHandle(self, self._next_id, method, data, keys, rank, result_type, cost, label)
        task.speculative = self._speculating
        self._next_id += 1
        self._unfinished[task.id] = task
        self._runner.submit(task)
        return task

    def _advance(self, waiting) -> list[TaskHandle]:
        """One turn of the runner; the tasks it finished (late results of cancelled tasks
        are dropped). Anything the runner raises (a death, a timeout, Ctrl-C) closes the pool."""
        try:
            outcomes = self._runner.advance(waiting)
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
        self._snapshots.release(task.shared)  # the parent keeps a snapshot while a task needs it
        del self._unfinished[task.id]
        return True

    def _deliver(self, task: TaskHandle, on_result) -> None:
        error = task.exception()
        if error is not None:
            raise error
        if on_result is not None:
            on_result(task.index, task.result())

    def _cancel(self, tasks, why: str) -> None:
        """Forget tasks that will not be gathered; a late result of one is discarded."""
        for task in tasks:
            if not task.done():
                error = TaskCancelled(f"task {task.index} {task.method}() was cancelled: {why}")
                self._finish(Outcome(task, error=error), cancelled=True)


def _decode(task: TaskHandle, raw) -> tuple:
    """(result, error): the result decoded as the caller's result_type, if any."""
    try:
        if task.result_type is None:
            return msgspec.json.decode(raw), None
        return msgspec.json.decode(raw, type=task.result_type), None
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

