"""The worker's side of the protocol, whatever process it runs in: one engine, built from
``engine_factory(device)``, and the answer to each request.

``WorkerCore`` is the only code that builds an engine or handles a request. Its hosts are
I/O loops around it, with no dispatch of their own:

- the forked worker (``worker.worker_main``): frames over its socketpair;
- the Ray actor (``ray_transport.RayWorker``): frames as the arguments and return values of
  its ``ready`` and ``run`` calls;
- the inline dispatcher (``inline.InlineDispatcher``): calls in the pool's own process.

It works at two levels. ``start``, ``add_shared`` and ``call`` raise the engine's own
exceptions: the inline dispatcher, in the caller's process, chains the real exception to its
``WorkerError`` (so ``pdb.post_mortem`` reaches the engine's frames). ``hello`` and
``answer`` turn the same steps into the protocol's frames, for a host behind a channel:
``Ready`` or ``InitFailed``, then per request nothing (a ``Share`` is cached), a
``Result`` or a ``Failure`` carrying the worker's traceback (a ``Task``). Requests are
decoded as ``protocol.Request``, so any other message is a ``ProtocolError`` naming it.
"""

from __future__ import annotations

import os
import traceback

from . import protocol
from .calls import Calls
from .protocol import Failure, InitFailed, Ready, Result, Share, Shutdown, Task


class WorkerCore:
    """One engine for ``device`` and the answers to the parent's requests."""

    def __init__(self, engine_factory, device, max_frame: int):
        self.engine_factory, self.device = engine_factory, device
        self.max_frame = max_frame
        self.calls: Calls | None = None  # once the engine is built
        self.shut_down = False  # the parent sent Shutdown

    @property
    def started(self) -> bool:
        """Whether the engine was built."""
        return self.calls is not None

    @property
    def serving(self) -> bool:
        """Whether requests are still expected: the engine is built and no Shutdown came."""
        return self.started and not self.shut_down

    # -- the calls: the engine's exceptions propagate ---------------------------------------
    def start(self) -> dict:
        """Build the engine; its ``info()`` ({} for an engine without one)."""
        engine = self.engine_factory(self.device)
        info = dict(engine.info()) if hasattr(engine, "info") else {}
        self.calls = Calls(engine)
        return info

    def add_shared(self, key: str, raw: bytes, evict=()) -> None:
        """Cache a shared value (``evict``: the keys the parent no longer counts on)."""
        self.calls.add_shared(key, raw, evict)

    def call(self, method: str, item: bytes, shared: dict[str, str]):
        """``engine.<method>(item, **shared values)``: its return value."""
        return self.calls.call(method, item, shared)

    # -- the protocol: frames for a host behind a channel -----------------------------------
    def hello(self, **facts) -> bytes:
        """The first frame: ``Ready`` with the engine's info (plus the host's ``facts``: the
        Ray actor's placement), or ``InitFailed`` with the summary and traceback."""
        try:
            info = self.start()
        except Exception as exc:
            return self._frame(InitFailed(protocol.PROTOCOL_VERSION, os.getpid(), exception_summary(exc),
                                          traceback.format_exc()))
        return self._frame(Ready(protocol.PROTOCOL_VERSION, os.getpid(), {**info, **facts}))

    def answer(self, body: bytes) -> bytes:
        """The reply frame to one request frame's ``body``: empty for a Share (cached) and
        for Shutdown (``serving`` turns false), a Result or a Failure for a Task."""
        match protocol.decode_request(body):
            case Share(key=key, value=value, evict=evict):
                self.add_shared(key, value, evict)
            case Task(id=task_id, method=method, item=item, shared=shared):
                try:  # an oversize result too is this task's Failure, not the worker's end
                    return self._frame(Result(task_id, self.call(method, item, shared)))
                except Exception as exc:
                    return self._frame(Failure(task_id, exception_summary(exc), traceback.format_exc()))
            case Shutdown():
                self.shut_down = True
        return b""

    def _frame(self, msg: protocol.Message) -> bytes:
        return protocol.frame(msg, self.max_frame)


def exception_summary(exc: BaseException) -> str:
    """The one-line summary of an engine exception, in every WorkerError."""
    return f"{type(exc).__name__}: {exc}"
