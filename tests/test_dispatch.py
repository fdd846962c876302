"""The dispatcher without processes: a scripted transport and a fake clock.

The dispatcher is shared by the fork and Ray backends; here every rule it owns (queue order,
pinned tasks, one task per worker, shared values once per worker, deadlines, kills, retries and
the errors they become) is checked deterministically: when nothing is scripted to happen,
the fake transport lets the clock run to the deadline the dispatcher waits for.
"""

from __future__ import annotations

import logging

import msgspec
import pytest

from stageb_pool.pool import dispatch, protocol
from stageb_pool.pool.devices import Device
from stageb_pool.pool.engine_agreement import ACCEPT_ANY, REFUSE_ANY_DIFFERENCE, EngineAgreement
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
from stageb_pool.pool.protocol import Failure, InitFailed, Ready, Result, Share, Task
from stageb_pool.pool.shared import SHARED_CACHE_SIZE, SharedCache, SharedStore
from stageb_pool.pool.tasks import PoolStats, TaskHandle


class Clock:
    def __init__(self):
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


class ScriptedTransport:
    """Workers that answer by method name: ``square`` answers, ``hang`` never does (unless
    cancelled: then it fails with TaskCancelled, as an engine that checks),
    ``die`` exits with code 3, ``close`` closes its channel and is never reported, ``fail``
    raises; ``hang_once``/``die_once`` misbehave the first time only. ``silent`` ranks never
    get a process; ``slow_start`` ranks never send Ready; ``mute_kill`` ranks are never
    reported after a kill."""

    def __init__(self, clock: Clock, *, silent=(), slow_start=(), mute_kill=(), init_fails=(), infos=None,
                 exit_cause=None):
        self.clock = clock
        self.infos = list(infos) if infos is not None else None  # engine.info() of each spawn, in order
        self.exit_cause = exit_cause  # a backend that knows no exit code (Ray) says why instead
        self.silent, self.slow_start, self.mute_kill, self.init_fails = silent, slow_start, mute_kill, init_fails
        self.sent: list[tuple[int, object]] = []  # (rank, message) for every frame sent
        self.killed: list[int] = []
        self.cancelled: list[tuple[int, int]] = []  # (rank, task id) of every Cancel
        self.running: dict[int, Task] = {}  # rank -> its hanging task
        self.spawned: list[int] = []
        self.closed_with: list[int] | None = None
        self.events: list = []
        self.calls: dict[str, int] = {}
        self.next_pid = 100
        self.dead: set[int] = set()  # ranks whose process exited: nothing more comes from them

    def spawn(self, rank):
        self.spawned.append(rank)
        self.dead.discard(rank)
        if rank in self.silent:
            return
        self.next_pid += 1
        self.events.append(WorkerStarted(rank, self.next_pid))
        if rank in self.init_fails:
            self.events.append(WorkerMessage(rank, InitFailed(1, self.next_pid, "RuntimeError: no model", "Traceback")))
        elif rank not in self.slow_start:
            info = self.infos.pop(0) if self.infos is not None else {"rank": rank}
            self.events.append(WorkerMessage(rank, Ready(protocol.PROTOCOL_VERSION, self.next_pid, info)))

    def send(self, rank, data):
        messages = [protocol.decode_request(body) for body in protocol.FrameReader().bodies(data)]
        self.sent += [(rank, m) for m in messages]
        task = messages[-1]
        assert isinstance(task, Task) and all(isinstance(m, Share) for m in messages[:-1])
        if rank in self.dead:
            return
        n = self.calls[task.method] = self.calls.get(task.method, 0) + 1
        method = task.method.removesuffix("_once") if n == 1 else task.method
        if method in ("square", "hang_once", "die_once"):
            x = msgspec.json.decode(task.item)
            self.events.append(WorkerMessage(rank, Result(task.id, msgspec.Raw(msgspec.json.encode(x * x)))))
        elif method == "fail":
            self.events.append(WorkerMessage(rank, Failure(task.id, "ValueError: bad", "Traceback ... ValueError")))
        elif method == "die":
            exited = WorkerExited(rank, None, None, self.exit_cause) if self.exit_cause else WorkerExited(rank, 3, None)
            self.events.append(exited)
            self.dead.add(rank)
        elif method == "close":
            self.events.append(WorkerClosed(rank))
        elif method == "hang":
            self.running[rank] = task

    def cancel(self, rank, task_id):
        # A hanging task stops when cancelled, as an engine that checks does.
        self.cancelled.append((rank, task_id))
        if rank in self.running and self.running[rank].id == task_id:
            del self.running[rank]
            self.events.append(WorkerMessage(rank, Failure(task_id, "TaskCancelled: cancelled", "Traceback")))

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


def make(transport, size=2, *, task_timeout=60.0, start_timeout=30.0, max_restarts=0, engine_agreement=ACCEPT_ANY,
         depth=1):
    devices = [Device("cpu", i, i) for i in range(size)]
    store = SharedStore(protocol.MAX_FRAME_BYTES)
    d = Dispatcher(transport, devices, PoolStats.empty(size), task_timeout=task_timeout,
                   start_timeout=start_timeout, max_restarts=max_restarts, max_frame=protocol.MAX_FRAME_BYTES,
                   engine_agreement=engine_agreement, depth=depth)
    d.start()
    return d, store


def task(store, id, method="square", item=2, rank=None, **shared):
    keys, data = store.resolve(shared)
    t = TaskHandle(None, id, method, msgspec.json.encode(item), keys, rank, None, shared_data=data)
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


# -- the cost of an event -----------------------------------------------------------------------
def test_an_event_visits_the_free_workers_not_every_worker(clock, monkeypatch):
    """At 64 workers, a result that arrives while nothing is queued costs a look or two at
    the queue, not one per idle worker: no scan of every worker per event."""
    t = ScriptedTransport(clock)
    d, store = make(t, 64)
    run(d, [task(store, i, item=i) for i in range(64)])  # every worker ran one: all idle now
    pops = []
    monkeypatch.setattr(d.queue, "pop", lambda rank, real=d.queue.pop, **kw: pops.append(rank) or real(rank, **kw))
    for i in range(64, 74):  # one task at a time: each result leaves the queue empty
        pops.clear()
        assert run(d, [task(store, i, item=3)]) == {i: 9}
        assert len(pops) <= 4, pops  # the worker that takes it, then one empty look per dispatch
        assert t.sent[-1][0] == 0  # the lowest free rank first


def test_pinned_tasks_leave_one_entry_per_free_worker(clock):
    """A rank busy with pinned tasks while a lower one idles stays in the free heap once, however
    many tasks it runs (the heap never grows with the tasks)."""
    t = ScriptedTransport(clock)
    d, store = make(t, 8)
    for i in range(50):
        assert run(d, [task(store, i, item=2, rank=5)]) == {i: 4}
        assert t.sent[-1][0] == 5
    assert sorted(d._free) == list(range(8))


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
    values = [{"v": i} for i in range(SHARED_CACHE_SIZE + 1)]
    run(d, [task(store, i, g=values[0]) for i in range(3)])
    run(d, [task(store, 10 + i, g=v) for i, v in enumerate(values)])
    shares = [m for _, m in t.sent if isinstance(m, Share)]
    assert len(shares) == SHARED_CACHE_SIZE + 1  # values[0] once, then the other 8
    assert shares[-1].evict == [shares[0].key]  # the 9th value evicts the least recently used
    assert all(not s.evict for s in shares[:-1])


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


def test_a_death_the_backend_cannot_explain_by_code_carries_its_cause(clock):
    d, store = make(ScriptedTransport(clock, exit_cause="The actor is dead because its node died"), 1)
    with pytest.raises(WorkerDied, match=r"in die\(\) on item 0: worker process died: The actor is dead because "
                                         r"its node died$") as info:
        run(d, [task(store, 0, "die")])
    assert (info.value.exitcode, info.value.signal) == (None, None)


def test_workers_with_different_engines_are_refused_naming_the_odd_one(clock):
    same, odd = {"torch": "2.13", "gpu": "H100"}, {"torch": "2.12", "gpu": "H100"}
    with pytest.raises(PoolError, match=r"worker 1 \(cpu:1\) reports a different engine \(torch: '2.12' "
                                        r"where worker 0 has '2.13'\)"):
        make(ScriptedTransport(clock, infos=[same, odd, same]), 3, engine_agreement=REFUSE_ANY_DIFFERENCE)
    with pytest.raises(PoolError, match=r"worker 0 \(cpu:0\) reports a different engine"):  # the odd one is named
        make(ScriptedTransport(clock, infos=[odd, same, same]), 3, engine_agreement=REFUSE_ANY_DIFFERENCE)
    make(ScriptedTransport(clock, infos=[same, odd, same]), 3)  # the fork backend leaves it to the caller


def test_a_replacement_with_another_engine_is_refused(clock):
    same, odd = {"gpu": "H100"}, {"gpu": "A100"}
    d, store = make(ScriptedTransport(clock, infos=[same, same, odd]), 2, max_restarts=1,
                    engine_agreement=REFUSE_ANY_DIFFERENCE)
    with pytest.raises(PoolError, match=r"worker 0 \(cpu:0\) reports a different engine \(gpu: 'A100' where worker 1"):
        run(d, [task(store, 0, "die_once", rank=0)])


@pytest.mark.parametrize("how", ["hang_once", "die_once"])
def test_a_replacement_gets_the_task_first_and_the_shared_values_again(clock, how):
    t = ScriptedTransport(clock)
    d, store = make(t, 1, task_timeout=5.0, max_restarts=1)
    first_pid = d.pids[0]
    out = run(d, [task(store, 0, how, item=3, g="G"), task(store, 1, item=4, g="G")])
    assert out == {0: 9, 1: 16}
    assert d.stats.restarts == 1 and d.pids[0] != first_pid and t.spawned == [0, 0]
    # the replacement got the shared value again, then the retried task before the queued one
    assert [type(m).__name__ + str(getattr(m, "id", "")) for _, m in t.sent] == [
        "Share", "Task0", "Share", "Task0", "Task1"]


@pytest.mark.parametrize("how, cause", [("hang_once", "in hang_once() on item 0: no answer within 5 s"),
                                        ("die_once", "in die_once() on item 0: worker process died")])
def test_every_restart_is_logged_with_its_cause_and_counted_per_worker(clock, caplog, how, cause):
    t = ScriptedTransport(clock)
    d, store = make(t, 2, task_timeout=5.0, max_restarts=1)
    with caplog.at_level("WARNING", logger="stageb_pool.pool"):
        assert run(d, [task(store, 0, how, item=3, rank=1)]) == {0: 9}
    assert d.stats.restarts_by_rank == [0, 1]
    [record] = [r.getMessage() for r in caplog.records if r.name == "stageb_pool.pool"]
    assert record.startswith(f"worker 1 (cpu:1) {cause}") and record.endswith(
        "; replacing it and retrying its work (restart 1, 0 left)"), record


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


def test_a_cancelled_task_is_stopped_only_where_it_runs_and_its_worker_is_free_after_its_answer(clock):
    t = ScriptedTransport(clock)
    d, store = make(t, 1)
    running, queued = task(store, 0, "hang"), task(store, 1)
    d.submit(running)
    d.submit(queued)
    d._dispatch()
    for cancelled in (running, queued):  # as Pool.cancel does: the handle first, then the dispatcher
        cancelled._finish(cancelled=True)
        d.stop(cancelled)
    assert t.cancelled == [(0, 0)]  # the queued one is dropped when reached: nothing to tell
    [answer] = d.advance([])  # its engine stopped: a failure, which the pool drops (the handle is cancelled)
    assert answer.task is running and "TaskCancelled" in str(answer.error)
    assert run(d, [task(store, 2)]) == {2: 4}  # the worker is free again
    d.stop(running)  # answered already: no second Cancel
    assert t.cancelled == [(0, 0)]


# -- depth: the next task waits in the worker (the Ray backend) ---------------------------------------
class Quiet(ScriptedTransport):
    """Answers only when told (``answer(rank)``), so the tasks in flight can be inspected."""

    def send(self, rank, data):
        messages = [protocol.decode_request(body) for body in protocol.FrameReader().bodies(data)]
        self.sent += [(rank, m) for m in messages]

    def answer(self, rank):
        task = next(m for r, m in self.sent if r == rank and isinstance(m, Task) and m.id not in self.answered)
        self.answered.add(task.id)
        self.events.append(WorkerMessage(rank, Result(task.id, msgspec.Raw(b"0"))))

    answered: set = set()


def test_with_depth_2_every_free_worker_gets_a_task_before_any_gets_a_second(clock):
    t = Quiet(clock)
    t.answered = set()
    d, store = make(t, 2, depth=2)
    tasks = [task(store, i) for i in range(7)]
    for x in tasks:
        d.submit(x)
    d._dispatch()
    assert [(rank, m.id) for rank, m in t.sent if isinstance(m, Task)] == [(0, 0), (1, 1), (0, 2), (1, 3)]
    t.answer(0)
    assert [o.task.id for o in d.advance(tasks)] == [0]
    assert [x.id for x in d.slots[0].tasks] == [2, 4]  # 4 waits behind the running 2
    t.answer(0)
    assert [o.task.id for o in d.advance(tasks)] == [2]
    # 5 and 6 are left, no more than the workers: they go to whichever is free first
    assert [x.id for x in d.slots[0].tasks] == [4] and len(d.queue) == 2


def test_with_depth_2_the_second_tasks_deadline_starts_when_the_first_is_done(clock):
    t = Quiet(clock)
    t.answered = set()
    d, store = make(t, 1, depth=2, task_timeout=5.0)
    tasks = [task(store, 0), task(store, 1, "hang")]
    for x in tasks:
        d.submit(x)
    d._dispatch()
    clock.now += 4.0
    t.answer(0)
    assert [o.task.id for o in d.advance(tasks)] == [0]
    with pytest.raises(WorkerTimeout) as info:
        for _ in range(10):
            d.advance(tasks)
    assert info.value.method == "hang" and clock.now == pytest.approx(1009.0)  # 4 s + its own 5 s


def test_with_depth_2_a_death_retries_every_task_it_held_in_their_order(clock):
    t = ScriptedTransport(clock)
    d, store = make(t, 2, depth=2, max_restarts=1)
    tasks = [task(store, 0, "die_once", item=3, rank=0), task(store, 1, item=4, rank=0)]
    tasks += [task(store, i, item=i) for i in range(2, 6)]
    assert run(d, tasks) == {0: 9, 1: 16, 2: 4, 3: 9, 4: 16, 5: 25} and d.stats.restarts == 1
    # rank 0 held 0 and 1 when it died; its replacement got them again, the running one first
    ids = [m.id for r, m in t.sent if r == 0 and isinstance(m, Task)]
    assert ids[:3] == [0, 1, 0] and 1 in ids[3:]


# -- the pure parts -------------------------------------------------------------------------------
def test_task_queue_order_pins_retries_and_cancelled_tasks():
    q = TaskQueue(2)
    tasks = [TaskHandle(None, i, "m", b"0", {}, rank, None) for i, rank in enumerate([None, 1, None, 1, None])]
    for x in tasks:
        q.push(x)
    tasks[2]._finish(cancelled=True)
    assert q.pop(1).id == 0 and q.pop(1).id == 1 and q.pop(0).id == 4  # 2 was cancelled
    q.retry(tasks[4])
    q.retry(tasks[0])
    assert [q.pop(1).id for _ in range(3)] == [0, 4, 3]  # retried first, oldest first
    assert q.pop(0) is None and q.pop(1) is None


def test_task_queue_runs_costed_tasks_most_expensive_first_after_the_others():
    q = TaskQueue(1)
    costs = [3.0, None, 7.0, 3.0, 0.0, None, 9.5]
    for i, cost in enumerate(costs):
        q.push(TaskHandle(None, i, "m", b"0", {}, None, None, cost))
    assert [q.pop(0).id for _ in costs] == [1, 5, 6, 2, 0, 3, 4]


def test_task_queue_gives_speculative_tasks_only_when_asked_and_nothing_else_waits():
    q = TaskQueue(1)
    tasks = [TaskHandle(None, i, "m", b"0", {}, None, None, cost) for i, cost in enumerate([None, 5.0, 1.0, None])]
    tasks[0].speculative = tasks[1].speculative = True
    for x in tasks:
        q.push(x)
    assert [q.pop(0, speculative=True).id for _ in range(2)] == [3, 2]  # the ordinary ones first
    assert q.pop(0) is None  # a busy worker's next task is never speculative
    tasks[0].speculative = False  # a gather waits for it now (the pool clears the flag)
    q.promote(tasks[0])
    assert q.pop(0).id == 0
    q.promote(tasks[1])  # still speculative: promote of a non-cleared flag queues it again as such
    assert q.pop(0) is None and q.pop(0, speculative=True).id == 1
    assert q.pop(0, speculative=True) is None  # nothing twice


def test_a_speculative_task_takes_only_an_idle_worker_and_never_one_a_queued_task_wants(clock):
    t = ScriptedTransport(clock)
    d, store = make(t, 2)
    spec = [task(store, i) for i in range(3)]
    for x in spec:
        x.speculative = True
        d.submit(x)
    real = task(store, 3)
    d.submit(real)
    d._dispatch()
    # the ordinary task first, then speculation on the other idle worker; the third waits
    assert [m.id for _, m in t.sent] == [3, 0]
    assert {o.task.id for o in d.advance([real])} == {3, 0}
    assert [m.id for _, m in t.sent] == [3, 0, 1, 2]  # both idle again: the rest of the speculation


def test_with_depth_2_no_task_waits_behind_a_speculative_one(clock):
    """Under Ray a second task waits in a busy worker; never behind speculative work, which
    may run long (a proposer call) while nobody waits for it."""
    t = ScriptedTransport(clock)
    d, store = make(t, 2, depth=2)
    ahead = task(store, 0)
    ahead.speculative = True
    d.submit(ahead)
    d._dispatch()
    assert [m.id for _, m in t.sent] == [0]  # speculation on an idle worker
    for i in range(1, 5):
        d.submit(task(store, i))
    d._dispatch()
    sent = [(rank, m.id) for rank, m in t.sent]
    assert sent[0] == (0, 0) and all(rank != 0 for rank, _ in sent[1:]), sent  # the rest go to worker 1 only


def test_snapshot_cache_never_evicts_what_the_task_needs():
    cache = SharedCache(capacity=2)
    assert cache.admit({"a": "k1", "b": "k2"}) == [("k1", []), ("k2", [])]
    assert cache.admit({"a": "k1"}) == []  # held; k1 is now the most recently used
    assert cache.admit({"c": "k3"}) == [("k3", ["k2"])]
    assert cache.admit({"a": "k1", "c": "k3", "d": "k4"}) == [("k4", [])]  # grows past capacity
    assert cache.admit({"e": "k5"}) == [("k5", ["k1", "k3"])]


def test_slot_locates_a_fault():
    slot = Slot(2, Device("cuda", 5, 2), None)
    slot.trouble = dispatch.Trouble(WorkerState.STARTING, 30.0)
    assert slot.where() == dict(rank=2, device="cuda:5", index=None, method="engine_factory")


def test_the_callers_engine_agreement_applies_at_start_and_to_a_replacement(clock, caplog):
    class Refused(Exception):
        pass

    policy = EngineAgreement(refuse=("torch",), warn=logging.getLogger("stageb_pool.test"), error=Refused)
    same, other_gpu, other_torch = {"torch": "2.13", "gpu": "H100"}, {"torch": "2.13", "gpu": "A100"}, {"torch": "2.12"}
    with caplog.at_level("WARNING", logger="stageb_pool.test"):
        make(ScriptedTransport(clock, infos=[same, other_gpu]), 2, engine_agreement=policy)
    [record] = caplog.records
    assert record.getMessage().startswith("workers [1] report a different engine than worker 0")
    with pytest.raises(Refused, match=r"^workers \[1\] run another engine or version than worker 0"):
        make(ScriptedTransport(clock, infos=[same, other_torch]), 2, engine_agreement=policy)
    d, store = make(ScriptedTransport(clock, infos=[same, same, other_torch]), 2, max_restarts=1,
                    engine_agreement=policy)
    with pytest.raises(Refused, match=r"^workers \[0\] run another engine or version than worker 1 "
                                      r"\(\{'torch': '2.12'\} vs \{'torch': '2.13'\}\)"):
        run(d, [task(store, 0, "die_once", rank=0)])
