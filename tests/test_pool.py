"""The worker pool with real processes: order, dispatch, shared values, faults, signals.

Every wait is on a condition with a deadline (a file appearing, a process vanishing);
nothing sleeps to synchronise.
"""

from __future__ import annotations

import concurrent.futures
import json
import logging
import os
import signal
import subprocess
import sys
import threading
import time
import traceback

import pytest

from doubles.pool_engines import Echoed, Engine, FailingEngine, touch, wait_for_path
from processes import gone, parent_pid

from stageb_pool import Pool, PoolError, WorkerDied, WorkerError, WorkerTimeout
from stageb_pool.pool import Fork, Inline, RemoteTraceback, TaskCancelled, protocol
from stageb_pool.pool.protocol import PROTOCOL_VERSION, FrameTooLarge, ProtocolError

TESTS = os.path.dirname(os.path.abspath(__file__))
SCRIPTS = os.path.join(TESTS, "pool_scripts")


def wait_until(condition, timeout: float) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if condition():
            return True
        time.sleep(0.01)
    return condition()


def all_processes(pool) -> list[int]:
    """The workers and their parent, the zygote."""
    workers = [p for p in pool.pids if p is not None]
    return workers + [parent_pid(workers[0])]


@pytest.fixture
def pool3():
    with Pool(Engine, "cpu:3") as pool:
        yield pool


# -- order and dispatch ----------------------------------------------------------------
@pytest.mark.parametrize("n", [0, 1, 2, 3, 10])  # k-1, k, 3k+1 for k = 3 workers
def test_results_come_back_in_input_order(pool3, n):
    seen = []
    out = pool3.map("jitter_square", list(range(n)), on_result=lambda i, r: seen.append((i, r)))
    assert out == [x * x for x in range(n)]
    assert sorted(seen) == [(i, i * i) for i in range(n)]


def test_speculative_tasks_run_on_idle_workers_and_between_sees_them_finish(pool3):
    before = sum(pool3.stats.items)
    with pool3.speculation():
        ahead = [pool3.submit("square", x) for x in range(4)]
    seen = []
    # one real task on 3 idle workers: the other two take speculative tasks at once, and
    # ``between`` runs after every turn in which any task finished, this gather's or not
    assert pool3.gather([pool3.submit("square", 10)], between=lambda: seen.append(sum(t.done() for t in ahead))) == [100]
    assert seen and seen == sorted(seen)
    assert pool3.gather([ahead[0]]) == [0]  # gathered: an ordinary task with its result
    pool3.cancel(ahead)  # what the run did not need: queued ones never run, late results are dropped
    assert pool3.gather([pool3.submit("square", 3)]) == [9]
    assert all(t.done() for t in ahead) and not ahead[0].cancelled()
    assert sum(pool3.stats.items) - before >= 2 + 1  # the two real tasks and the gathered speculative one


def test_a_cancelled_running_task_stops_early_and_its_worker_takes_the_next_task():
    # The engine waits 60 s unless cancelled: a worker that ran it to its end would hold the
    # pinned task behind it for a minute.
    with Pool(Engine, "cpu:2", task_timeout=120) as pool:
        slow = pool.submit("until_cancelled", 60)
        assert pool.gather([pool.submit("square", 3)]) == [9]  # both sent; the slow one runs on
        pool.cancel([slow])
        assert pool.gather([pool.submit("pid", rank=slow.ran_on)]) == [pool.pids[slow.ran_on]]
        assert slow.cancelled()
        [(_, _, _, start, end)] = [i for i in pool.stats.intervals if i[1] == "until_cancelled"]
        assert end - start < 30
        assert pool.stats.restarts == 0  # stopped by its engine, not killed


def test_every_worker_gets_work_and_results_name_their_rank(pool3):
    out = pool3.map("echo", list(range(30)))
    assert [o["item"] for o in out] == list(range(30))
    assert sum(pool3.stats.items) == 30
    assert pool3.worker_info == [{"rank": r, "device": f"cpu:{r}"} for r in range(3)]
    assert [pool3.call(r, "echo", None)["rank"] for r in range(3)] == [0, 1, 2]


def test_a_slow_item_does_not_block_the_others(tmp_path):
    # Item 0 waits until the parent has received every other item; with static slices
    # (or one blocked worker) that never happens and item 0 reports a timeout (False).
    release = str(tmp_path / "release")
    n_fast = 12
    order = []

    def on_result(index, result):
        order.append(index)
        if len(order) == n_fast:
            open(release, "w").close()

    with Pool(Engine, "cpu:2") as pool:
        tasks = [pool.submit("wait_for", release)] + [pool.submit("square", i) for i in range(n_fast)]
        out = pool.gather(tasks, on_result=on_result)
    assert out[0] is True
    assert order[-1] == 0
    assert sorted(pool.stats.items) == [1, n_fast]


def test_pinned_tasks_run_on_their_rank(pool3):
    tasks = [pool3.submit("pid", rank=i % 3) for i in range(9)]
    assert pool3.gather(tasks) == [pool3.pids[i % 3] for i in range(9)]


def test_costed_tasks_run_most_expensive_first_and_results_keep_input_order():
    with Pool(Engine, "cpu:1") as pool:
        order = []
        tasks = [pool.submit("square", x, cost=c) for x, c in [(1, 1.0), (2, 5.0), (3, 2.5)]]
        tasks.append(pool.submit("square", 4))  # no cost: before the costed ones
        assert pool.gather(tasks, on_result=lambda i, r: order.append(i)) == [1, 4, 9, 16]
        assert order == [3, 1, 2, 0]
        with pytest.raises(ValueError, match="cost must be a finite number >= 0"):
            pool.submit("square", 1, cost=float("nan"))


def test_result_type_decodes_structs(pool3):
    out = pool3.map("echo", [1, 2], result_type=Echoed, guidance={"G0": "x"})
    assert out[0] == Echoed(item=1, shared={"guidance": {"G0": "x"}}, rank=out[0].rank)


# -- shared values ---------------------------------------------------------------------------
def test_each_snapshot_is_sent_once_per_worker():
    a, b = {"G0": "rule a", "G1": "x"}, {"G0": "rule b"}
    with Pool(Engine, "cpu:2") as pool:
        tasks = [pool.submit("echo", i, rank=i % 2, guidance=a) for i in range(10)]
        tasks += [pool.submit("echo", i, rank=i % 2, guidance=b) for i in range(10)]
        tasks += [pool.submit("echo", i, rank=i % 2, guidance=dict(a)) for i in range(10)]  # equal value
        out = pool.gather(tasks)
        assert [o["shared"]["guidance"] for o in out] == [a] * 10 + [b] * 10 + [a] * 10
        assert pool.stats.shared_sends == 4  # {a, b} x 2 workers
        assert pool.stats.tasks_sent == 30


def test_a_value_shared_once_is_the_same_snapshot_as_the_value_itself(monkeypatch):
    """``pool.share`` encodes a value once for many submits (a rollout's chunks): the workers
    get the same value and the same shared value as when each submit passes the value."""
    a = {"G0": "rule a", "G1": "x"}
    with Pool(Engine, "cpu:2") as pool:
        shared = pool.share(a)
        encoded = []
        monkeypatch.setattr(protocol, "encode", lambda value, real=protocol.encode: encoded.append(value) or real(value))
        tasks = [pool.submit("echo", i, rank=i % 2, guidance=shared) for i in range(10)]
        tasks += [pool.submit("echo", i, rank=i % 2, guidance=dict(a)) for i in range(10)]
        out = pool.gather(tasks)
        assert [o["shared"]["guidance"] for o in out] == [a] * 20
        assert pool.stats.shared_sends == 2  # one shared value: {a} x 2 workers
        assert encoded.count(a) == 10  # encoded by the 10 submits that pass the value, never by the others


def test_a_value_changed_between_submits_is_sent_as_it_was_at_each_submit():
    """Only a shared value made by ``pool.share`` (immutable) is resolved once for many submits:
    a plain value passed again after a change is encoded again, as the worker must see it."""
    rules = {"G0": "rule a"}
    with Pool(Engine, "cpu:1") as pool:
        first = pool.submit("echo", 0, guidance=rules)
        rules["G1"] = "rule b"
        second = pool.submit("echo", 1, guidance=rules)
        assert [t.result()["shared"]["guidance"] for t in (first, second)] == [{"G0": "rule a"}, rules]


def test_snapshot_cache_evicts_and_resends():
    from stageb_pool.pool.shared import SHARED_CACHE_SIZE

    values = [{"v": i} for i in range(SHARED_CACHE_SIZE + 2)]
    with Pool(Engine, "cpu:1") as pool:
        for v in values + values[:1]:  # the first value was evicted: sent again
            assert pool.call(0, "echo", 0, g=v)["shared"] == {"g": v}
        assert pool.stats.shared_sends == len(values) + 1


# -- faults ------------------------------------------------------------------------------
def test_engine_exception_carries_rank_item_and_remote_traceback(pool3):
    with pytest.raises(WorkerError) as info:
        pool3.map("fail_on", list(range(6)), bad=4)
    err = info.value
    assert err.index == 4 and err.method == "fail_on" and 0 <= err.rank < 3
    assert err.device == f"cpu:{err.rank}"
    assert "ValueError: item 4 is bad" in err.remote_traceback
    assert "in fail_on" in err.remote_traceback
    first_line = str(err).splitlines()[0]
    assert first_line == f"worker {err.rank} (cpu:{err.rank}) in fail_on() on item 4: ValueError: item 4 is bad"
    assert pool3.map("square", [1, 2, 3]) == [1, 4, 9]  # the pool is still usable


def test_a_worker_error_is_one_line_and_chains_the_workers_traceback(pool3):
    with pytest.raises(WorkerError) as info:
        pool3.call(1, "fail_on", 2)
    err = info.value
    assert str(err) == "worker 1 (cpu:1) in fail_on() on item 0: ValueError: item 2 is bad"
    assert isinstance(err.__cause__, RemoteTraceback) and err.__cause__.text == err.remote_traceback
    printed = "".join(traceback.format_exception(type(err), err, err.__traceback__))
    # the worker's frames first, then the parent's, as with concurrent.futures
    assert printed.index("in fail_on") < printed.index("direct cause") < printed.index("WorkerError: worker 1")


def test_task_handles_behave_like_futures():
    with Pool(Engine, "cpu:1") as pool:
        ok, bad = pool.submit("square", 4), pool.submit("fail_on", 2)
        assert not ok.done() and not ok.cancelled()
        assert ok.result() == 16 and ok.done() and ok.exception() is None and ok.ran_on == 0
        assert isinstance(bad.exception(), WorkerError) and bad.done() and not bad.cancelled()
        with pytest.raises(WorkerError, match="item 2 is bad"):
            bad.result()
        first, second = pool.submit("fail_on", 2), pool.submit("square", 3)
        with pytest.raises(WorkerError):
            pool.gather([first, second])  # one worker: the second is still queued, and cancelled
        assert second.cancelled() and isinstance(second.exception(), concurrent.futures.CancelledError)
        with pytest.raises(TaskCancelled, match="cancelled: an earlier error in its gather"):
            second.result()
        pending = pool.submit("square", 5)
    assert pending.cancelled()  # closing the pool cancels what was never gathered


def test_engine_init_failure_raises_from_the_constructor():
    with pytest.raises(WorkerError, match="RuntimeError: no model for cpu:") as info:
        Pool(FailingEngine, "cpu:2")
    assert "in __init__" in info.value.remote_traceback
    with pytest.raises(WorkerError, match="RuntimeError: no model for cpu:0"):
        Pool(FailingEngine, "cpu:2", backend=Inline())


def test_kill_9_mid_task_raises_worker_died_within_a_second(tmp_path):
    marker = str(tmp_path / "started")
    killed_at = []

    def killer(pid):
        if wait_for_path(f"{marker}.{pid}"):
            killed_at.append(time.monotonic())
            os.kill(pid, signal.SIGKILL)

    pool = Pool(Engine, "cpu:2")
    processes = all_processes(pool)
    victim = pool.pids[1]
    thread = threading.Thread(target=killer, args=(victim,))
    thread.start()
    try:
        with pytest.raises(WorkerDied) as info:
            pool.gather([pool.submit("block", marker, rank=1), pool.submit("square", 3, rank=0)])
        raised_at = time.monotonic()
    finally:
        thread.join()
        pool.close()
    assert raised_at - killed_at[0] < 1.0
    err = info.value
    assert (err.rank, err.device, err.signal, err.exitcode, err.index) == (1, "cpu:1", 9, None, 0)
    assert "killed by signal 9 (SIGKILL)" in str(err)
    assert all(gone(p) for p in processes)


def test_worker_exit_code_is_reported(pool3):
    with pytest.raises(WorkerDied, match="exited with code 3") as info:
        pool3.call(2, "exit_with", 3)
    assert (info.value.rank, info.value.exitcode, info.value.signal) == (2, 3, None)


def test_hang_raises_worker_timeout_and_kills_the_worker(tmp_path):
    pool = Pool(Engine, "cpu:2", task_timeout=0.5)
    processes = all_processes(pool)
    hung = pool.pids[0]
    with pytest.raises(WorkerTimeout) as info:
        pool.call(0, "block", str(tmp_path / "m"))
    assert (info.value.rank, info.value.device, info.value.index) == (0, "cpu:0", 0)
    assert "no answer within 0.5 s" in str(info.value)
    assert gone(hung) and all(gone(p) for p in processes)  # killed, reaped, pool closed


class _ReleaseOnStallWarning(logging.Handler):
    """Keeps the pool's stall warnings and lets the silent task finish after the second."""

    def __init__(self, release: str):
        super().__init__()
        self.release_path, self.messages = release, []

    def emit(self, record):
        if "silent" in record.getMessage():
            self.messages.append(record.getMessage())
            if len(self.messages) == 2:
                touch(self.release_path)


def test_a_silent_task_is_named_in_a_warning_long_before_its_timeout(tmp_path):
    release = str(tmp_path / "release")
    handler = _ReleaseOnStallWarning(release)
    logger = logging.getLogger("stageb_pool.pool")
    logger.addHandler(handler)
    try:
        with Pool(Engine, "cpu:2", stall_warning=0.2, task_timeout=600) as pool:
            quiet = pool.submit("wait_for", release, label="train/it1")  # returns once released
            assert pool.gather([quiet] + [pool.submit("square", 3)]) == [True, 9]
            pid = pool.pids[quiet.ran_on]
    finally:
        logger.removeHandler(handler)
    first, second = handler.messages  # the task was still silent: warned again, once per interval
    assert first.startswith(f"worker {quiet.ran_on} (cpu:{quiet.ran_on}, pid {pid}) has been silent for ")
    assert "in wait_for() on item 0 (train/it1); it is stopped at task_timeout 600 s" in first
    assert float(first.split("silent for ")[1].split(" s")[0]) < float(second.split("silent for ")[1].split(" s")[0])


def test_a_silent_task_without_a_timeout_is_warned_about_too(tmp_path):
    """With no task_timeout the busy worker has no deadline: its warning must still wake the loop."""
    release = str(tmp_path / "release")
    handler = _ReleaseOnStallWarning(release)
    logger = logging.getLogger("stageb_pool.pool")
    logger.addHandler(handler)
    try:
        with Pool(Engine, "cpu:1", stall_warning=0.2, task_timeout=None) as pool:
            assert pool.map("wait_for", [release]) == [True]
    finally:
        logger.removeHandler(handler)
    assert len(handler.messages) == 2 and "task_timeout" not in handler.messages[0]


def test_no_stall_warning_for_tasks_that_answer_in_time(caplog):
    with caplog.at_level(logging.WARNING, "stageb_pool.pool"):
        with Pool(Engine, "cpu:2", stall_warning=600) as pool:
            assert pool.map("square", range(6)) == [x * x for x in range(6)]
    assert not caplog.records


@pytest.mark.parametrize("bad", [0, -1, float("nan"), "5", True])
def test_a_stall_warning_that_is_not_a_number_of_seconds_is_refused(bad):
    with pytest.raises(ValueError, match="stall_warning must be"):
        Pool(Engine, "cpu:1", stall_warning=bad)


@pytest.mark.parametrize("how", ["kill", "hang"])
def test_restart_and_retry_give_identical_results(tmp_path, how):
    items = list(range(8))
    with Pool(Engine, "cpu:2") as pool:
        clean = pool.map("die_once", items, marker=str(tmp_path / "unused"), how="none")
    with Pool(Engine, "cpu:2", max_restarts=1, task_timeout=0.5 if how == "hang" else 600) as pool:
        first_pids = list(pool.pids)
        faulty = pool.map("die_once", items, marker=str(tmp_path / how), how=how)
        assert faulty == clean == [x * x for x in items]
        assert pool.stats.restarts == 1
        assert len(set(pool.pids) - set(first_pids)) == 1  # one fresh worker
        assert pool.map("square", [5]) == [25]  # and it works


@pytest.mark.parametrize("inline", [False, True])
def test_a_task_may_share_more_values_than_the_snapshot_cache_holds(inline):
    shared = {f"v{i}": i for i in range(12)}
    with Pool(Engine, "cpu:1", backend=Inline() if inline else Fork()) as pool:
        assert pool.map("sum_shared", [0, 100], **shared) == [66, 166]
        assert pool.call(0, "sum_shared", 1, a=1) == 2  # older shared values can be evicted again


def test_restart_budget_is_pool_wide():
    with Pool(Engine, "cpu:2", max_restarts=1) as pool:
        with pytest.raises(WorkerDied, match="exited with code 1"):
            pool.call(0, "exit_with", 1)  # retried once on a replacement, which dies too
        assert pool.stats.restarts == 1


@pytest.mark.parametrize("name, value", [
    ("task_timeout", 1e300),  # was an OverflowError from select()
    ("start_timeout", 1e300),
    ("task_timeout", float("inf")),
    ("start_timeout", float("nan")),
    ("task_timeout", 0),
    ("start_timeout", -5.0),
    ("task_timeout", "600"),
    ("max_restarts", -1),
])
def test_absurd_limits_are_value_errors_naming_the_argument(name, value):
    with pytest.raises(ValueError, match=f"^{name} must be"):
        Pool(Engine, "cpu:1", **{name: value})


def test_close_reaps_everything_and_is_idempotent():
    pool = Pool(Engine, "cpu:2")
    processes = all_processes(pool)
    pool.close()
    pool.close()
    assert all(gone(p) for p in processes)
    with pytest.raises(PoolError, match="closed"):
        pool.map("square", [1])


# -- frames --------------------------------------------------------------------------------
def test_oversize_frames_are_clear_errors():
    with Pool(Engine, "cpu:1", max_frame_bytes=1000) as pool:
        with pytest.raises(FrameTooLarge, match="item for echo\\(\\) of 2,002 bytes exceeds the pool's frame limit of 1,000"):
            pool.submit("echo", "y" * 2000)
        with pytest.raises(FrameTooLarge, match="shared value 'guidance'"):
            pool.submit("echo", 1, guidance="z" * 2000)
        with pytest.raises(WorkerError, match="Result frame of .* exceeds the pool's frame limit"):
            pool.call(0, "big", 5000)
        assert pool.call(0, "big", 10) == "x" * 10


def test_protocol_version_mismatch_is_a_clear_error():
    def factory(device):
        import stageb_pool.pool.protocol

        stageb_pool.pool.protocol.PROTOCOL_VERSION = 99  # only in this worker process
        return Engine(device)

    with pytest.raises(ProtocolError, match=f"speaks protocol 99, the parent {PROTOCOL_VERSION}"):
        Pool(factory, "cpu:1")


# -- the timeline of the pool's work -------------------------------------------------------
@pytest.mark.parametrize("inline", [False, True], ids=["forked", "inline"])
def test_each_task_is_recorded_with_its_interval_and_label(inline):
    with Pool(Engine, "cpu:1" if inline else "cpu:2", backend=Inline() if inline else Fork()) as pool:
        submitted = time.monotonic()
        tasks = [pool.submit("jitter_square", i, label=f"chunk{i}") for i in range(6)]
        tasks.append(pool.submit("echo", None))  # no label
        arrived = {}
        pool.gather(tasks, on_result=lambda i, _: arrived.setdefault(i, time.monotonic()))
        stats = pool.stats
    assert sorted(label or "" for _, _, label, _, _ in stats.intervals) == ["", *(f"chunk{i}" for i in range(6))]
    assert sorted(method for _, method, *_ in stats.intervals) == ["echo"] + ["jitter_square"] * 6
    by_label = {label: (rank, start, end) for rank, _, label, start, end in stats.intervals}
    for index, task in enumerate(tasks):
        rank, start, end = by_label[task.label]
        assert rank == task.ran_on
        # within the task's submit..result window (1 us slack: the times are stored as offsets)
        assert submitted - 1e-6 <= stats.origin + start <= stats.origin + end <= arrived[index] + 1e-6
    for rank, busy in enumerate(stats.busy_s):
        assert busy == pytest.approx(sum(e - s for r, _, _, s, e in stats.intervals if r == rank), abs=1e-9)
    assert [sum(1 for r, *_ in stats.intervals if r == rank) for rank in range(len(stats.items))] == stats.items


def test_a_label_is_a_string_or_none(pool3):
    with pytest.raises(ValueError, match="label must be a string"):
        pool3.submit("square", 1, label=3)


def test_the_backend_is_one_value_and_a_name_is_refused():
    """``backend`` is ``Fork()``, ``Inline()`` or ``Ray(...)``: a string (the old keyword's
    spelling) or a bad Ray bound is a ValueError before anything starts."""
    with pytest.raises(ValueError, match=r"backend must be Fork\(\), Inline\(\) or Ray\(address\), got 'ray'"):
        Pool(Engine, "cpu:1", backend="ray")
    from stageb_pool.pool import Ray

    with pytest.raises(ValueError, match="connect_timeout must be more than 0"):
        Pool(Engine, "1", backend=Ray("local", connect_timeout=0))
    with Pool(Engine, "cpu:3", backend=Inline()) as pool:  # one device: the spec's first
        assert pool.size == 1 and [d.name for d in pool.devices] == ["cpu:0"]


def test_call_in_child_answers_with_one_frame_and_none_when_the_child_dies():
    """The one-shot fork helper (the prompt check's) answers as a worker does: one protocol
    frame over a socketpair, decoded as the caller's type; a child that dies says nothing."""
    from stageb_pool.pool.fork import call_in_child

    assert call_in_child(lambda: {"pid": os.getpid()}, dict[str, int])["pid"] != os.getpid()
    assert call_in_child(lambda: os._exit(3), dict) is None


# -- inline mode -----------------------------------------------------------------------------
def test_inline_mode_gives_the_same_results_as_workers():
    items = [1, "two", {"three": [3.5, None]}, [True]]
    shared = {"guidance": {"G0": "é ünïcode", "G1": "x"}}
    with Pool(Engine, "cpu:1") as forked:
        expected = forked.map("echo", items, result_type=Echoed, **shared)
        expected_plain = forked.map("echo", items, **shared)
    with Pool(Engine, "cpu:1", backend=Inline()) as inline:
        assert inline.pids == [os.getpid()]
        assert inline.map("echo", items, result_type=Echoed, **shared) == expected
        assert inline.map("echo", items, **shared) == expected_plain
        with pytest.raises(WorkerError, match="on item 2: ValueError") as info:
            inline.map("fail_on", [0, 1, 2])
        assert isinstance(info.value.__cause__, ValueError)


# -- process hygiene -------------------------------------------------------------------------
def test_refuses_to_fork_with_a_live_thread():
    stop = threading.Event()
    thread = threading.Thread(target=stop.wait, name="bystander")
    thread.start()
    try:
        with pytest.raises(PoolError, match="Refusing to fork.*2 Python threads.*bystander"):
            Pool(Engine, "cpu:1")
    finally:
        stop.set()
        thread.join()


def test_worker_output_is_prefixed_with_rank_and_device(capfd):
    with Pool(Engine, "cpu:2") as pool:
        pool.call(1, "print_lines", "hello from a worker")
    out, err = capfd.readouterr()
    assert "[w1 cpu:1] hello from a worker\n" in out
    assert "[w1 cpu:1] to stderr\n" in err


def test_a_redrawn_progress_line_reaches_the_terminal_as_its_last_state(capfd):
    """A progress bar (the GGUF conversion's, on a first run) is one line redrawn with \\r:
    relayed as is it was one long line of every state behind the prefix."""
    with Pool(Engine, "cpu:1") as pool:
        pool.call(0, "progress_bar", 500)
    _, err = capfd.readouterr()
    assert "[w0 cpu:0] converting: 500/500\n" in err
    assert "\r" not in err and "converting: 499/500" not in err


def start_parent(tmp_path):
    proc = subprocess.Popen([sys.executable, os.path.join(SCRIPTS, "run_pool.py"), str(tmp_path)])
    pids_file = tmp_path / "pids.json"
    assert wait_for_path(str(pids_file), 20), "the pool script did not start"
    pids = json.loads(pids_file.read_text())
    for pid in pids["workers"]:  # both workers are inside their task
        assert wait_for_path(str(tmp_path / f"started.{pid}"), 10)
    return proc, pids["workers"] + [pids["zygote"]]


def test_sigint_to_the_parent_exits_130_and_leaves_no_process(tmp_path):
    proc, children = start_parent(tmp_path)
    sent = time.monotonic()
    proc.send_signal(signal.SIGINT)
    assert proc.wait(timeout=5) == 130
    assert time.monotonic() - sent < 5
    assert all(gone(p) for p in children)


def test_ctrl_c_while_the_engines_start_prints_no_traceback(tmp_path):
    # Each worker finishes its engine start only after the interrupted parent closed its
    # socket, so its Ready meets a closed socket (once: a BrokenPipeError traceback on the
    # user's terminal, in 4 of 10 trials of issue 15). A worker whose parent is gone must
    # exit quietly.
    proc = subprocess.Popen([sys.executable, os.path.join(SCRIPTS, "run_pool.py"), str(tmp_path), "slow-start"],
                            stderr=subprocess.PIPE, text=True)
    assert wait_until(lambda: len(list(tmp_path.glob("starting.*"))) == 2, 20), "the workers did not start"
    proc.send_signal(signal.SIGINT)
    _, err = proc.communicate(timeout=10)
    assert proc.returncode == 130
    assert "Traceback" not in err and "Error" not in err, err


def test_parent_sigkill_takes_workers_and_zygote_down(tmp_path):
    proc, children = start_parent(tmp_path)
    proc.kill()
    proc.wait(timeout=5)
    assert wait_until(lambda: all(gone(p) for p in children), 5.0), [p for p in children if not gone(p)]


@pytest.mark.parametrize("numpy_imported, cpus, environ, expected", [
    (False, 16, {}, 0),
    (True, 16, {}, 15),  # the H100 machine: `import torch` left 16 native threads
    (True, 2, {}, 1),
    (True, 1, {}, 0),
    (True, 16, {"OMP_NUM_THREADS": "4"}, 3),
    (True, 16, {"OPENBLAS_NUM_THREADS": "1", "OMP_NUM_THREADS": "8"}, 0),
    (True, 16, {"GOTO_NUM_THREADS": "2"}, 1),
    (True, 4, {"OPENBLAS_NUM_THREADS": "64"}, 3),  # capped by the CPUs
    (True, 8, {"OPENBLAS_NUM_THREADS": "", "OMP_NUM_THREADS": "x"}, 7),  # unreadable: the CPUs
    (True, 8, {"OMP_NUM_THREADS": "0"}, 7),
    (True, 8, {"OMP_NUM_THREADS": "٣"}, 7),  # not an ASCII number
])
def test_numpys_blas_pool_is_allowed_for_in_the_fork_check(numpy_imported, cpus, environ, expected):
    from stageb_pool.pool.fork import blas_threads

    assert blas_threads(numpy_imported, cpus, environ) == expected


def test_a_torch_op_in_the_parent_is_refused():
    # A torch op starts OpenMP threads in the parent; a forked child would deadlock.
    code = (
        "import sys, torch; sys.path.insert(0, %r)\n"
        "torch.ones(512, 512) @ torch.ones(512, 512)\n"
        "from doubles.pool_engines import Engine\nfrom stageb_pool import Pool, PoolError\n"
        "try:\n    Pool(Engine, 'cpu:1')\nexcept PoolError as e:\n    print(e); sys.exit(3)\n" % TESTS
    )
    if (os.cpu_count() or 1) < 2:
        pytest.skip("OpenMP starts no extra thread on one core")
    env = {k: v for k, v in os.environ.items() if k not in ("OMP_NUM_THREADS", "MKL_NUM_THREADS")}
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, env=env)
    assert out.returncode == 3, out.stderr
    assert "native threads" in out.stdout and "OpenMP" in out.stdout


# -- Ray stays out of the fork path ------------------------------------------------------------
def test_ray_is_imported_only_lazily_and_only_by_the_ray_backend():
    import ast
    from pathlib import Path

    import stageb_pool.pool

    for path in Path(stageb_pool.pool.__file__).parent.glob("*.py"):
        tree = ast.parse(path.read_text(encoding="utf-8"))
        top_level = {id(node) for node in tree.body}
        for node in ast.walk(tree):
            names = [a.name for a in node.names] if isinstance(node, ast.Import) else (
                [node.module or ""] if isinstance(node, ast.ImportFrom) else [])
            if any(n == "ray" or n.startswith("ray.") for n in names):
                assert path.name.startswith("ray_") or path.name == "cluster_probe.py", f"{path.name} imports ray"
                assert id(node) not in top_level, f"{path.name}:{node.lineno} imports ray at module level"


def test_the_fork_backend_never_imports_ray_and_works_without_it():
    code = (
        "import sys; sys.path.insert(0, %r); sys.modules['ray'] = None  # as if not installed\n"
        "from doubles.pool_engines import Engine\nfrom stageb_pool import Pool, PoolError\n"
        "with Pool(Engine, 'cpu:1') as pool:\n    assert pool.map('square', [3]) == [9]\n"
        "from stageb_pool.pool import Ray\n"
        "try:\n    Pool(Engine, '2', backend=Ray())\nexcept PoolError as e:\n    print(e)\n" % TESTS
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert "the Ray backend needs Ray: pip install 'stageb_pool[ray]'" in out.stdout
    code = ("import sys; sys.path.insert(0, %r)\nfrom doubles.pool_engines import Engine\nfrom stageb_pool import Pool\n"
            "with Pool(Engine, 'cpu:1') as pool:\n    pool.map('square', [3])\nprint('ray' in sys.modules)\n" % TESTS)
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.stdout.strip() == "False", out.stderr


@pytest.mark.parametrize("message, cause", [
    ("The actor is dead because its worker process has died. Worker exit type: SYSTEM_ERROR Worker exit detail: "
     "Worker unexpectedly exits with a connection error code 2. End of file. Some common causes include: (1) OOM",
     "The actor is dead because its worker process has died (Worker unexpectedly exits with a connection error "
     "code 2. End of file.)"),
    ("The actor is dead because it was killed by `ray.kill`.", "The actor is dead because it was killed by `ray.kill`"),
    ("The actor died because of an error raised in its creation task, \x1b[36mray::RayWorker.__init__()\x1b[39m "
     "(pid=1) At least one of the input arguments could not be computed.",
     "The actor died because of an error raised in its creation task, ray::RayWorker.__init__() (pid=1) At least one "
     "of the input arguments could not be computed"),
    ("Something\nelse entirely", "RuntimeError: Something else entirely"),
])
def test_a_dead_actor_is_explained_in_one_line(message, cause):
    from stageb_pool.pool.ray_transport import _cause  # importable without Ray: it imports ray lazily

    assert _cause(RuntimeError(message)) == cause


def test_ray_answers_are_taken_in_the_order_each_actor_got_its_calls():
    from stageb_pool.pool.ray_transport import RayTransport

    transport = RayTransport.__new__(RayTransport)  # only its bookkeeping: no Ray needed
    a, b = object(), object()
    transport.inflight = {"a1": (0, a), "b1": (1, b), "a2": (0, a), "b2": (1, b), "a3": (0, a)}
    # Ray reported a2 and b1 done, a1 (sent before a2, so done too) not yet: a1 and a2 in order
    assert transport._in_order(["a2", "b1"]) == ["a1", "b1", "a2"]
    assert transport._in_order(["b2"]) == ["b1", "b2"] and transport._in_order([]) == []
