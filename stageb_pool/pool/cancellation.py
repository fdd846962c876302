"""In a worker: whether the parent has cancelled the running task, for an engine that can stop early.

The parent tells the worker of a task whose result it no longer wants (a speculation that
turned out wrong, the rest of a gather that failed), so that the work the loop waits for is not
queued behind it: a forked worker gets a ``Cancel`` frame on its channel, a Ray actor's call is
cancelled with ``ray.cancel``, which sets the flag that Ray keeps for the running call. An engine
calls ``checkpoint()`` between steps, or waits with ``sleep()``: either raises ``TaskCancelled``
once the task is cancelled (or, in a forked worker, the channel has ended: the parent is gone),
and the task ends as a failure the parent discards. An engine that calls neither runs every task
to its end. Outside a worker's task (inline mode, a test) ``checkpoint`` does nothing and
``sleep`` sleeps.

A forked worker's check is one system call (a non-blocking peek; nothing is consumed: the
worker's loop reads the Cancel afterwards and drops it); a Ray actor's, one look at Ray's flag.
"""

from __future__ import annotations

import contextlib
import select
import socket
import time
from typing import Callable

from .errors import TaskCancelled
from .protocol import Cancel, FrameReader, decode_request

PEEK_BYTES = 4096  # a Cancel frame is about 30 bytes; while a task runs, nothing else is sent
FLAG_POLL_S = 0.02  # how often ``sleep`` looks at a flag, which has no descriptor to wait on

_channel: socket.socket | None = None  # a forked worker's socket to the parent
_flag: Callable[[], bool] | None = None  # a Ray actor's: whether its running call was cancelled
_task: int | None = None  # the id of the task it is running


def listen(channel: socket.socket | None) -> None:
    """A forked worker's channel to the parent, watched while it runs a task (None: none)."""
    global _channel, _flag
    _channel, _flag = channel, None


def watch(flag: Callable[[], bool]) -> None:
    """A host whose calls are cancelled by a flag (a Ray actor: ``RuntimeContext.is_canceled``),
    asked while it runs a task."""
    global _channel, _flag
    _channel, _flag = None, flag


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
    if _task is None:
        return False
    if _flag is not None:
        return _flag()
    if _channel is None:
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
    deadline = time.monotonic() + seconds
    if _task is not None and _flag is not None:
        while (left := deadline - time.monotonic()) > 0:
            checkpoint()
            time.sleep(min(left, FLAG_POLL_S))
        return
    if _channel is None or _task is None:
        time.sleep(seconds)
        return
    if select.select([_channel], [], [], seconds)[0]:
        checkpoint()
        # Something else is waiting (never sent to a busy worker): sleep the rest.
        time.sleep(max(0.0, deadline - time.monotonic()))
