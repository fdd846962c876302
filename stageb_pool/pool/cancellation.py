"""In a worker: whether the parent has cancelled the running task, for an engine that can stop early.

The parent sends ``Cancel`` to the forked worker of a task whose result it no longer wants (a
speculation that turned out wrong, the rest of a gather that failed), so that the work the loop
waits for is not queued behind it. An engine calls ``checkpoint()`` between steps, or waits with
``sleep()``: either raises ``TaskCancelled`` once that Cancel (or the end of the channel: the
parent is gone) is waiting, and the task ends as a failure the parent discards. An engine that
calls neither runs every task to its end. Outside a forked worker's task (inline
mode, a Ray actor, a test) ``checkpoint`` does nothing and ``sleep`` sleeps.

One system call per check (a non-blocking peek; nothing is consumed): the worker's loop reads
the Cancel afterwards and drops it.
"""

from __future__ import annotations

import contextlib
import select
import socket
import time

from .errors import TaskCancelled
from .protocol import Cancel, FrameReader, decode_request

PEEK_BYTES = 4096  # a Cancel frame is about 30 bytes; while a task runs, nothing else is sent

_channel: socket.socket | None = None  # the forked worker's socket to the parent
_task: int | None = None  # the id of the task it is running


def listen(channel: socket.socket | None) -> None:
    """The forked worker's channel to the parent, watched while it runs a task (None: none)."""
    global _channel
    _channel = channel


@contextlib.contextmanager
def running(task_id: int):
    """Around one task's engine call."""
    global _task
    _task = task_id
    try:
        yield
    finally:
        _task = None


def requested() -> bool:
    """Whether the parent cancelled the running task (or closed the channel)."""
    if _channel is None or _task is None:
        return False
    try:
        data = _channel.recv(PEEK_BYTES, socket.MSG_PEEK | socket.MSG_DONTWAIT)
    except (BlockingIOError, InterruptedError):
        return False
    except OSError:  # the channel broke: the parent is gone
        return True
    if not data:
        return True
    # The whole frames peeked at (a partial one is left for the next check).
    return any(isinstance(message, Cancel) and message.id == _task
               for message in map(decode_request, FrameReader().bodies(data)))


def checkpoint() -> None:
    """Raise ``TaskCancelled`` if the parent cancelled the running task."""
    if requested():
        raise TaskCancelled(f"task {_task} was cancelled by the parent while it ran")


def sleep(seconds: float) -> None:
    """``time.sleep``, ended early by ``TaskCancelled`` when the parent cancels the running task."""
    if _channel is None or _task is None:
        time.sleep(seconds)
        return
    deadline = time.monotonic() + seconds
    if select.select([_channel], [], [], seconds)[0]:
        checkpoint()
        # Something else is waiting (never sent to a busy worker): sleep the rest.
        time.sleep(max(0.0, deadline - time.monotonic()))
