"""Every error the pool raises, all subclasses of ``PoolError``; ``str()`` of each is one line
(what the CLI prints), and a worker's fault names its rank, device, method and item.
"""

from __future__ import annotations

import concurrent.futures
import signal


class PoolError(Exception):
    """Base class of every error the pool raises."""


class ProtocolError(PoolError):
    """The other end sent something that is not a valid frame of this protocol."""


class FrameTooLarge(PoolError):
    """A message does not fit in one frame (``max_frame`` bytes)."""

    def __init__(self, size: int, limit: int, what: str = "message"):
        super().__init__(
            f"{what} of {size:,} bytes exceeds the pool's frame limit of {limit:,} bytes "
            f"(raise max_frame_bytes, or pass a path instead of the data)"
        )
        self.size = size
        self.limit = limit


class TaskCancelled(PoolError, concurrent.futures.CancelledError):
    """A task was cancelled by an earlier error in its gather, or by ``close()``."""


class RemoteTraceback(Exception):
    """A worker's traceback: a ``WorkerError``'s ``__cause__``, printed above the parent's frames."""

    def __init__(self, text: str):
        super().__init__(text)
        self.text = text

    def __str__(self) -> str:
        return f'\n"""\n{self.text.rstrip()}\n"""'


class _WorkerFault(PoolError):
    def __init__(self, summary: str, *, rank: int, device: str, index: int | None = None,
                 method: str | None = None):
        where = f"worker {rank} ({device})"
        if method is not None:
            where += f" in {method}()"
        if index is not None:
            where += f" on item {index}"
        super().__init__(f"{where}: {summary}")
        self.summary = summary  # what went wrong, without where: the same whichever worker ran it
        self.rank, self.device, self.index, self.method = rank, device, index, method


class WorkerError(_WorkerFault):
    """An exception in an engine method or in the engine's construction (``remote_traceback``)."""

    def __init__(self, summary: str, *, remote_traceback: str = "", **where):
        super().__init__(summary, **where)
        self.remote_traceback = remote_traceback
        if remote_traceback:
            self.__cause__ = RemoteTraceback(remote_traceback)


class WorkerDied(_WorkerFault):
    """A worker process exited or was killed: ``exitcode`` or ``signal`` where the backend
    knows them, else ``cause`` in its own words (Ray reports neither)."""

    def __init__(self, *, exitcode: int | None, signal: int | None, cause: str | None = None, **where):
        if signal is not None:
            cause = f"killed by signal {signal} ({_signal_name(signal)})"
        elif exitcode is not None or cause is None:
            cause = f"exited with code {exitcode}"
        super().__init__(f"worker process died: {cause}", **where)
        self.exitcode, self.signal, self.cause = exitcode, signal, cause


class WorkerTimeout(_WorkerFault):
    """A worker exceeded task_timeout (or start_timeout); it was killed and reaped."""

    def __init__(self, timeout: float, **where):
        super().__init__(f"no answer within {timeout:g} s; the worker was killed", **where)
        self.timeout = timeout


def _signal_name(sig: int) -> str:
    try:
        return signal.Signals(sig).name
    except ValueError:
        return "?"
