"""The dispatcher without processes: a scripted transport and a fake clock.

The dispatcher is shared by the fork and Ray backends; here every rule it owns (queue order,
pinned tasks, one task per worker, snapshots once per worker, deadlines, kills, retries and
the errors they become) is checked deterministically: when nothing is scripted to happen,
the fake transport lets the clock run to the deadline the dispatcher waits for.
"""

from __future__ import annotations

import msgspec
import pytest

from stageb_pool.pool import dispatch, protocol
from stageb_pool.pool.devices import Device
from stageb_pool.pool.dispatch import (
    EXIT_REPORT_GRACE,
    KILL_REPORT_TIMEOUT,
    Dispatcher,
    Slot,
    TaskQueue,
    WorkerClosed,
    WorkerExited,
    WorkerMessage,
    WorkerStarted,
    WorkerState,
)
from stageb_pool.pool.errors import (
    PoolError,
    ProtocolError,
    WorkerDied,
    WorkerError,
    WorkerTimeout,
)
from stageb_pool.pool.protocol import Failure, InitFailed, Ready, Result, Snapshot, Task
from stageb_pool.pool.snapshots import SNAPSHOT_CACHE_SIZE, SnapshotCache, SnapshotStore
from stageb_pool.pool.tasks import PoolStats, TaskHandle


class Clock:
    def __init__(self):
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


class ScriptedTransport:
    """Workers that answer by method name: ``square`` answers, ``hang`` never does,
    ``die`` exits with code 3, ``close`` closes its channel and is never reported, ``fail``
    raises; ``hang_once``/``die_once`` misbehave the first time only. ``silent`` ranks never
    get a process; ``slow_start`` ranks never send Ready; ``mute_kill`` ranks are never
    reported after a kill."""

    def __init__(self, clock: Clock, *, silent=(), slow_start=(), mute_kill=(), init_fails=()):
        self.clock = clock
        self.silent, self.slow_start, self.mute_kill, self.init_fails = silent, slow_start, mute_kill, init_fails
        self.sent: list[tuple[int, object]] = []  # (rank, message) for every frame sent
        self.killed: list[int] = []
        self.spawned: list[int] = []
        self.closed_with: list[int] | None = None
        self.events: list = []
        self.calls: dict[str, int] = {}
        self.next_pid = 100

    def spawn(self, rank):
        self.spawned.append(rank)
        if rank in self.silent:
            return
        self.next_pid += 1
        self.events.append(WorkerStarted(rank, self.next_pid))
        if rank in self.init_fails:
            self.events.append(WorkerMessage(rank, InitFailed(1, self.next_pid, "RuntimeError: no model", "Traceback")))
        elif rank not in self.slow_start:
            self.events.append(WorkerMessage(rank, Ready(protocol.PROTOCOL_VERSION, self.next_pid, {"rank": rank})))

    def send(self, rank, data):
        messages = protocol.FrameReader().feed(data)
        self.sent += [(rank, m) for m in messages]
        task = messages[-1]
        assert isinstance(task, Task) and all(isinstance(m, Snapshot) for m in messages[:-1])
        n = self.calls[task.method] = self.calls.get(task.method, 0) + 1
        method = task.method.removesuffix("_once") if n == 1 else task.method
        if method in ("square", "hang_once", "die_once"):
            x = msgspec.json.decode(task.item)
            self.events.append(WorkerMessage(rank, Result(task.id, msgspec.Raw(msgspec.json.encode(x * x)))))
        elif method == "fail":
            self.events.append(WorkerMessage(rank, Failure(task.id, "ValueError: bad", "Traceback ... ValueError")))
        elif method == "die":
            self.events.append(WorkerExited(rank, 3, None))
        elif method == "close":
            self.events.append(WorkerClosed(rank))

    def kill(self, rank):
        self.killed.append(rank)
        if rank not in self.mute_kill:
            self.events.append(WorkerExited(rank, None, 9))

    def poll(self, timeout):
        if self.events:
            events, self.events = self.events, []
            return events
        assert timeout is not None, "the dispatcher would wait forever"
        self.clock.now += timeout  # nothing happens until the deadline
        return []

    def close(self, busy):
        self.closed_with = busy


@pytest.fixture
def clock(monkeypatch):
    clock = Clock()
    monkeypatch.setattr(dispatch.time, "monotonic", clock)
    return clock


def make(transport, size=2, *, task_timeout=60.0, start_timeout=30.0, max_restarts=0):
    devices = [Device("cpu", i, i) for i in range(size)]
    store = SnapshotStore(protocol.MAX_FRAME_BYTES)
    d = Dispatcher(transport, devices, store, PoolStats.empty(size), task_timeout=task_timeout,
                   start_timeout=start_timeout, max_restarts=max_restarts, max_frame=protocol.MAX_FRAME_BYTES)
    d.start()
    return d, store


def task(store, id, method="square", item=2, rank=None, **shared):
    keys = store.share(shared)
    store.acquire(keys)
    t = TaskHandle(None, id, method, msgspec.json.encode(item), keys, rank, None)
    t.index = id
    return t


def run(d, tasks) -> dict[int, object]:
    """Advance until every task has an outcome; {task id: decoded result or error}."""
    for t in tasks:
        d.submit(t)
    out = {}
    for _ in range(1000):
        if len(out) == len(tasks):
            return out
        for o in d.advance(tasks):
            out[o.task.id] = o.error if o.error is not None else msgspec.json.decode(o.raw)
            o.task._finish()
    raise AssertionError("the dispatcher made no progress")


# -- start ------------------------------------------------------------------------------------
def test_start_spawns_every_rank_and_waits_for_ready(clock):
    t = ScriptedTransport(clock)
    d, _ = make(t, 3)
    assert t.spawned == [0, 1, 2]
    assert [s.state for s in d.slots] == [WorkerState.IDLE] * 3
    assert d.worker_info == [{"rank": 0}, {"rank": 1}, {"rank": 2}]
    assert d.pids == [101, 102, 103]


def test_an_engine_that_never_starts_is_killed_at_the_start_deadline(clock):
    t = ScriptedTransport(clock, slow_start={1})
    with pytest.raises(WorkerTimeout) as info:
        make(t, 2, start_timeout=30.0)
    assert t.killed == [1]
    assert (info.value.rank, info.value.method, info.value.timeout) == (1, "engine_factory", 30.0)
    assert clock.now == pytest.approx(1030.0)


def test_a_process_that_never_appears_is_a_pool_error(clock):
    with pytest.raises(PoolError, match="no process was started for worker 0 within 30 s"):
        make(ScriptedTransport(clock, silent={0}), 1)


def test_an_engine_that_fails_to_start_is_a_worker_error(clock):
    with pytest.raises(WorkerError, match=r"worker 1 \(cpu:1\) in engine_factory\(\): RuntimeError: no model"):
        make(ScriptedTransport(clock, init_fails={1}), 2)


# -- dispatch -----------------------------------------------------------------------------------
def test_one_task_per_worker_oldest_first_pinned_only_to_their_rank(clock):
    t = ScriptedTransport(clock)
    d, store = make(t, 2)
    tasks = [task(store, 0, rank=1), task(store, 1), task(store, 2, rank=1), task(store, 3)]
    for x in tasks:
        d.submit(x)
    d._dispatch()
    # rank 0 takes the oldest task it may run (1); rank 1 its own pinned one (0)
    assert [(rank, m.id) for rank, m in t.sent] == [(0, 1), (1, 0)]
    out = {}
    while len(out) < 4:
        for o in d.advance(tasks):
            out[o.task.id] = o.task.ran_on
            o.task._finish()
    assert out[2] == 1 and out[0] == 1 and out[1] == 0


def test_each_snapshot_is_sent_once_per_worker_and_evictions_travel_with_the_next(clock):
    t = ScriptedTransport(clock)
    d, store = make(t, 1)
    values = [{"v": i} for i in range(SNAPSHOT_CACHE_SIZE + 1)]
    run(d, [task(store, i, g=values[0]) for i in range(3)])
    run(d, [task(store, 10 + i, g=v) for i, v in enumerate(values)])
    snapshots = [m for _, m in t.sent if isinstance(m, Snapshot)]
    assert len(snapshots) == SNAPSHOT_CACHE_SIZE + 1  # values[0] once, then the other 8
    assert snapshots[-1].evict == [snapshots[0].key]  # the 9th value evicts the least recently used
    assert all(not s.evict for s in snapshots[:-1])


def test_an_engine_exception_is_that_tasks_error_and_the_worker_stays(clock):
    t = ScriptedTransport(clock)
    d, store = make(t, 1)
    out = run(d, [task(store, 0, "fail"), task(store, 1)])
    assert isinstance(out[0], WorkerError) and out[0].remote_traceback == "Traceback ... ValueError"
    assert str(out[0]) == "worker 0 (cpu:0) in fail() on item 0: ValueError: bad"
    assert out[1] == 4


def test_an_answer_to_a_task_the_worker_was_not_running_is_a_protocol_error(clock):
    t = ScriptedTransport(clock)
    d, _ = make(t, 1)
    t.events.append(WorkerMessage(0, Result(7, msgspec.Raw(b"1"))))
    with pytest.raises(ProtocolError, match="answered task 7, which it was not running"):
        d.advance([])


# -- faults -------------------------------------------------------------------------------------
def test_a_stalled_task_is_killed_at_its_deadline(clock):
    t = ScriptedTransport(clock)
    d, store = make(t, 2, task_timeout=5.0)
    with pytest.raises(WorkerTimeout) as info:
        run(d, [task(store, 0, "hang", rank=1)])
    assert t.killed == [1] and clock.now == pytest.approx(1005.0)
    assert (info.value.rank, info.value.index, info.value.method) == (1, 0, "hang")


def test_a_dead_worker_is_worker_died_with_its_exit_code(clock):
    d, store = make(ScriptedTransport(clock), 2)
    with pytest.raises(WorkerDied, match="in die\\(\\) on item 0: worker process died: exited with code 3"):
        run(d, [task(store, 0, "die")])


@pytest.mark.parametrize("how", ["hang_once", "die_once"])
def test_a_replacement_gets_the_task_first_and_the_snapshots_again(clock, how):
    t = ScriptedTransport(clock)
    d, store = make(t, 1, task_timeout=5.0, max_restarts=1)
    first_pid = d.pids[0]
    out = run(d, [task(store, 0, how, item=3, g="G"), task(store, 1, item=4, g="G")])
    assert out == {0: 9, 1: 16}
    assert d.stats.restarts == 1 and d.pids[0] != first_pid and t.spawned == [0, 0]
    # the replacement got the snapshot again, then the retried task before the queued one
    assert [type(m).__name__ + str(getattr(m, "id", "")) for _, m in t.sent] == [
        "Snapshot", "Task0", "Snapshot", "Task0", "Task1"]


def test_the_restart_budget_is_pool_wide(clock):
    d, store = make(ScriptedTransport(clock), 2, max_restarts=1)
    with pytest.raises(WorkerDied):
        run(d, [task(store, 0, "die")])  # dies, is retried once on a replacement, dies again
    assert d.stats.restarts == 1


def test_a_worker_that_closes_its_channel_but_lives_on_is_killed_after_a_grace(clock):
    t = ScriptedTransport(clock)
    d, store = make(t, 1)
    with pytest.raises(WorkerDied, match="killed by signal 9"):
        run(d, [task(store, 0, "close")])
    assert t.killed == [0] and clock.now == pytest.approx(1000.0 + EXIT_REPORT_GRACE)


def test_a_killed_worker_that_is_never_reported_breaks_the_pool(clock):
    t = ScriptedTransport(clock, mute_kill={0})
    d, store = make(t, 1, task_timeout=5.0)
    with pytest.raises(PoolError, match="was killed but its exit was never reported"):
        run(d, [task(store, 0, "hang")])
    assert clock.now == pytest.approx(1005.0 + KILL_REPORT_TIMEOUT)


def test_close_names_the_busy_workers(clock):
    t = ScriptedTransport(clock)
    d, store = make(t, 2)
    d.submit(task(store, 0, "hang", rank=1))
    d._dispatch()
    d.close()
    assert t.closed_with == [1]


# -- the pure parts -------------------------------------------------------------------------------
def test_task_queue_order_pins_retries_and_cancelled_tasks():
    q = TaskQueue(2)
    tasks = [TaskHandle(None, i, "m", b"0", {}, rank, None) for i, rank in enumerate([None, 1, None, 1, None])]
    for x in tasks:
        q.push(x)
    tasks[2]._finish(cancelled=True)
    assert q.pop(1).id == 0 and q.pop(1).id == 1 and q.pop(0).id == 4  # 2 was cancelled
    q.retry(tasks[0])
    assert q.pop(1).id == 0 and q.pop(1).id == 3 and q.pop(0) is None and q.pop(1) is None


def test_snapshot_cache_never_evicts_what_the_task_needs():
    cache = SnapshotCache(capacity=2)
    assert cache.admit({"a": "k1", "b": "k2"}) == [("k1", []), ("k2", [])]
    assert cache.admit({"a": "k1"}) == []  # held; k1 is now the most recently used
    assert cache.admit({"c": "k3"}) == [("k3", ["k2"])]
    assert cache.admit({"a": "k1", "c": "k3", "d": "k4"}) == [("k4", [])]  # grows past capacity
    assert cache.admit({"e": "k5"}) == [("k5", ["k1", "k3"])]


def test_slot_locates_a_fault():
    slot = Slot(2, Device("cuda", 5, 2), None)
    slot.trouble = dispatch.Trouble(WorkerState.STARTING, 30.0)
    assert slot.where() == dict(rank=2, device="cuda:5", index=None, method="engine_factory")
