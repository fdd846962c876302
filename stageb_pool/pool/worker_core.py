"""The worker's side of the protocol in every host (the forked worker, the Ray actor, the
inline dispatcher): the only code that builds an engine or answers a request.
"""

from __future__ import annotations

import os
import traceback

from . import cancellation, protocol
from .calls import Calls
from .protocol import Cancel, Failure, InitFailed, Ready, Result, Share, Shutdown, Task


class WorkerCore:
    def __init__(self, engine_factory, device, max_frame: int):
        self.engine_factory, self.device = engine_factory, device
        self.max_frame = max_frame
        self.calls: Calls | None = None  # once the engine is built
        self.shut_down = False  # the parent sent Shutdown

    @property
    def started(self) -> bool:
        return self.calls is not None

    @property
    def serving(self) -> bool:
        return self.started and not self.shut_down

    # -- the calls: the engine's exceptions propagate (inline mode chains them, for pdb) ----
    def start(self) -> dict:
        """Build the engine; its ``info()`` ({} for an engine without one)."""
        engine = self.engine_factory(self.device)
        info = dict(engine.info()) if hasattr(engine, "info") else {}
        self.calls = Calls(engine)
        return info

    def add_shared(self, key: str, raw: bytes, evict=()) -> None:
        self.calls.add_shared(key, raw, evict)

    def call(self, method: str, item: bytes, shared: dict[str, str]):
        return self.calls.call(method, item, shared)

    # -- the protocol: frames for a host behind a channel -----------------------------------
    def hello(self, **facts) -> bytes:
        """``Ready`` with the engine's info (plus the host's ``facts``), or ``InitFailed``."""
        try:
            info = self.start()
        except Exception as exc:
            return self._frame(InitFailed(protocol.PROTOCOL_VERSION, os.getpid(), exception_summary(exc),
                                          traceback.format_exc()))
        return self._frame(Ready(protocol.PROTOCOL_VERSION, os.getpid(), {**info, **facts}))

    def answer(self, body: bytes) -> bytes:
        """The reply frame to a request: empty for Share, Cancel and Shutdown, Result or Failure
        for a Task (a Task the parent cancels while it runs may end as a Failure: TaskCancelled)."""
        match protocol.decode_request(body):
            case Share(key=key, value=value, evict=evict):
                self.add_shared(key, value, evict)
            case Task(id=task_id, method=method, item=item, shared=shared):
                try:  # an oversize result too is this task's Failure, not the worker's end
                    with cancellation.running(task_id):
                        value = self.call(method, item, shared)
                    return self._frame(Result(task_id, value))
                except Exception as exc:
                    return self._frame(Failure(task_id, exception_summary(exc), traceback.format_exc()))
            case Cancel():
                pass  # it came after its task had finished (or it ended the task): nothing to do
            case Shutdown():
                self.shut_down = True
        return b""

    def _frame(self, msg: protocol.Message) -> bytes:
        return protocol.frame(msg, self.max_frame)


def exception_summary(exc: BaseException) -> str:
    return f"{type(exc).__name__}: {exc}"
