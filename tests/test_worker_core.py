"""The worker core (``pool/worker_core.py``) without a process: the hello, and the answer to
each request frame, as the forked worker and the Ray actor send them on."""

from __future__ import annotations

import os
import time

import msgspec
import pytest

from stageb_pool.pool import cancellation, protocol
from stageb_pool.pool.devices import Device
from stageb_pool.pool.errors import ProtocolError, TaskCancelled
from stageb_pool.pool.protocol import Cancel, Failure, InitFailed, Ready, Result, Shutdown, Share, Task
from stageb_pool.pool.worker_core import WorkerCore

DEVICE = Device("cpu", 0, 0)


class Point(msgspec.Struct, frozen=True):
    x: int
    y: int


class Engine:
    def __init__(self, device):
        self.device = device

    def info(self):
        return {"engine": "test", "device": self.device.name}

    def scaled(self, item: Point, *, scale: dict[str, int]) -> int:
        return (item.x + item.y) * scale["k"]

    def fail_on(self, x, *, bad=2):
        if x == bad:
            raise ValueError(f"item {x} is bad")
        return x

    def big(self, n):
        return "x" * n

    def checks(self, steps):
        """An engine that can stop early: a checkpoint between steps."""
        for _ in range(steps):
            cancellation.checkpoint()
        return steps


class NoInfo:
    def __init__(self, device):
        pass


def no_model(device):
    raise RuntimeError(f"no model for {device.name}")


def body(msg: protocol.Message) -> bytes:
    """A request frame's body, as a worker's host reads it off the channel."""
    return protocol.frame(msg)[protocol.HEADER.size:]


def reply(frame: bytes) -> protocol.Message:
    [msg] = protocol.FrameReader().feed(frame)
    return msg


def started(factory=Engine, max_frame: int = protocol.MAX_FRAME_BYTES) -> WorkerCore:
    core = WorkerCore(factory, DEVICE, max_frame)
    assert isinstance(reply(core.hello()), Ready)
    return core


def test_hello_builds_the_engine_and_answers_ready_with_its_info_and_the_hosts_facts():
    core = WorkerCore(Engine, DEVICE, protocol.MAX_FRAME_BYTES)
    assert not core.started and not core.serving
    assert reply(core.hello(ray={"node_ip": "10.0.0.1"})) == Ready(
        protocol.PROTOCOL_VERSION, os.getpid(), {"engine": "test", "device": "cpu:0", "ray": {"node_ip": "10.0.0.1"}})
    assert core.started and core.serving
    assert reply(WorkerCore(NoInfo, DEVICE, protocol.MAX_FRAME_BYTES).hello()).info == {}  # info() is optional


def test_an_engine_that_fails_to_start_answers_init_failed_with_the_summary_and_traceback():
    core = WorkerCore(no_model, DEVICE, protocol.MAX_FRAME_BYTES)
    hello = reply(core.hello())
    assert isinstance(hello, InitFailed)
    assert (hello.version, hello.pid, hello.error) == (protocol.PROTOCOL_VERSION, os.getpid(),
                                                       "RuntimeError: no model for cpu:0")
    assert "in no_model" in hello.traceback and hello.traceback.rstrip().endswith("RuntimeError: no model for cpu:0")
    assert not core.started and not core.serving  # a forked worker exits with 1


def test_a_snapshot_is_cached_without_a_reply_and_a_task_gets_its_result():
    core = started()
    assert core.answer(body(Share("s1", msgspec.Raw(b'{"k": 3}')))) == b""
    task = Task(7, "scaled", msgspec.Raw(b'{"x": 1, "y": 2}'), {"scale": "s1"})
    assert reply(core.answer(body(task))) == Result(7, msgspec.Raw(b"9"))
    # the evictions the parent sends with the next shared value leave the worker's cache as its mirror
    core.answer(body(Share("s2", msgspec.Raw(b'{"k": 5}'), ["s1"])))
    assert reply(core.answer(body(Task(8, "scaled", msgspec.Raw(b'{"x": 1, "y": 1}'), {"scale": "s2"})))) == Result(
        8, msgspec.Raw(b"10"))
    failure = reply(core.answer(body(task)))  # s1 was evicted: this task fails, the worker goes on
    assert isinstance(failure, Failure) and failure.id == 7 and failure.error == "KeyError: 's1'"


def test_an_engine_exception_is_the_tasks_failure_with_the_workers_traceback():
    core = started()
    failure = reply(core.answer(body(Task(3, "fail_on", msgspec.Raw(b"2")))))
    assert isinstance(failure, Failure)
    assert (failure.id, failure.error) == (3, "ValueError: item 2 is bad")
    assert "in fail_on" in failure.traceback and "Traceback (most recent call last)" in failure.traceback
    assert reply(core.answer(body(Task(4, "fail_on", msgspec.Raw(b"5"))))) == Result(4, msgspec.Raw(b"5"))
    assert core.serving


def test_an_oversize_result_is_the_tasks_failure_not_the_workers_end():
    core = started(max_frame=1000)
    failure = reply(core.answer(body(Task(1, "big", msgspec.Raw(b"5000")))))
    assert isinstance(failure, Failure)
    assert failure.error.startswith("FrameTooLarge: Result frame of 5,0") and "frame limit of 1,000 bytes" in failure.error
    assert reply(core.answer(body(Task(2, "big", msgspec.Raw(b"3"))))) == Result(2, msgspec.Raw(b'"xxx"'))


def test_the_calls_raise_the_engines_own_exceptions_for_a_host_in_the_same_process():
    with pytest.raises(RuntimeError, match="no model for cpu:0"):
        WorkerCore(no_model, DEVICE, protocol.MAX_FRAME_BYTES).start()
    core = WorkerCore(Engine, DEVICE, protocol.MAX_FRAME_BYTES)
    assert core.start() == {"engine": "test", "device": "cpu:0"}
    core.add_shared("s1", b'{"k": 2}')
    assert core.call("scaled", b'{"x": 2, "y": 2}', {"scale": "s1"}) == 8
    with pytest.raises(ValueError, match="item 2 is bad"):
        core.call("fail_on", b"2", {})


@pytest.mark.parametrize("msg", [Ready(1, 2), Result(1, msgspec.Raw(b"1")), protocol.Spawn(0)],
                         ids=lambda m: type(m).__name__)
def test_a_message_that_is_no_request_is_a_protocol_error_naming_it(msg):
    core = started()
    with pytest.raises(ProtocolError, match=f"^worker got unexpected {type(msg).__name__}$"):
        core.answer(body(msg))
    with pytest.raises(ProtocolError, match="cannot decode message"):
        core.answer(b'{"type": "Task", "id": "one"}')
    assert core.serving


def test_shutdown_ends_the_serving_without_a_reply():
    core = started()
    assert core.answer(body(Shutdown())) == b""
    assert core.started and not core.serving


# -- cancellation: the worker's side ------------------------------------------------------------
def test_only_a_cancel_of_the_running_task_or_the_channels_end_is_a_request_to_stop(channel):
    worker, parent = channel
    assert not cancellation.requested()  # no task running
    with cancellation.running(7):
        assert not cancellation.requested()  # nothing sent
        parent.sendall(protocol.frame(Cancel(8)))
        assert not cancellation.requested()  # another task's (a late one)
        cancellation.checkpoint()
        parent.sendall(protocol.frame(Cancel(7))[:3])
        assert not cancellation.requested()  # not whole yet
        parent.sendall(protocol.frame(Cancel(7))[3:])
        assert cancellation.requested()
        with pytest.raises(TaskCancelled, match="task 7 was cancelled by the parent"):
            cancellation.checkpoint()
    assert not cancellation.requested()  # between tasks nothing is checked
    # Peeked, never consumed: the worker's loop reads both Cancels next, in order.
    bodies = protocol.FrameReader().bodies(worker.recv(4096))
    assert [protocol.decode_request(b) for b in bodies] == [Cancel(8), Cancel(7)]
    with cancellation.running(9):
        parent.close()  # the parent is gone
        assert cancellation.requested()


def test_a_sleep_ends_when_the_running_task_is_cancelled(channel):
    _, parent = channel
    with cancellation.running(3):
        cancellation.sleep(0.001)  # nothing came: a plain sleep
        parent.sendall(protocol.frame(Cancel(3)))
        started = time.monotonic()
        with pytest.raises(TaskCancelled):
            cancellation.sleep(60)
        assert time.monotonic() - started < 30


def test_a_task_cancelled_while_it_runs_is_a_failure_and_a_late_cancel_gets_no_reply(channel):
    _, parent = channel
    core = started()
    assert reply(core.answer(body(Task(1, "checks", msgspec.Raw(b"3"))))) == Result(1, msgspec.Raw(b"3"))
    assert core.answer(body(Cancel(1))) == b""  # it finished before the Cancel came: dropped
    parent.sendall(protocol.frame(Cancel(2)))
    failure = reply(core.answer(body(Task(2, "checks", msgspec.Raw(b"3")))))
    assert isinstance(failure, Failure) and failure.id == 2 and failure.error.startswith("TaskCancelled: ")
    assert core.serving
