"""The worker: a forked child that builds one engine and answers tasks until told to stop.

Everything here runs in a child process that the zygote forked with ``fork.fork_child``,
which ran the common first steps and makes the child leave through ``os._exit`` with the
code ``worker_main`` returns.
"""

from __future__ import annotations

import os
import sys
import traceback

from . import protocol
from .calls import Calls
from .protocol import Failure, InitFailed, Ready, Result, Shutdown, Snapshot, Task


def limit_threads(device) -> None:
    """Pin devices and thread counts before anything can initialise CUDA or OpenMP."""
    if device.kind == "cuda":
        os.environ["CUDA_VISIBLE_DEVICES"] = device.visible_devices()
    os.environ["OMP_NUM_THREADS"] = str(device.threads)
    os.environ["MKL_NUM_THREADS"] = str(device.threads)
    torch = sys.modules.get("torch")
    if torch is not None:
        # Must happen before the first torch op in this process (fork + OpenMP deadlock).
        torch.set_num_threads(device.threads)


def _line_buffered_stdio() -> None:
    # fds 1 and 2 are pipes to the zygote, which prefixes each line with our rank; line
    # buffering makes prints appear promptly and never lost at os._exit.
    sys.stdout = open(1, "w", buffering=1, closefd=False, errors="backslashreplace")
    sys.stderr = open(2, "w", buffering=1, closefd=False, errors="backslashreplace")


def worker_main(sock, device, engine_factory, max_frame: int) -> int:
    """Body of a worker process: start the engine, then answer tasks; the exit code."""
    _line_buffered_stdio()
    limit_threads(device)
    try:
        engine, info = start_engine(engine_factory, device)
    except Exception as exc:
        protocol.send(sock, InitFailed(protocol.PROTOCOL_VERSION, os.getpid(), exception_summary(exc), traceback.format_exc()))
        return 1
    protocol.send(sock, Ready(protocol.PROTOCOL_VERSION, os.getpid(), info), max_frame)
    serve(sock, engine, max_frame)
    return 0


def serve(sock, engine, max_frame: int) -> None:
    """Answer tasks until Shutdown or EOF (EOF means the parent is gone)."""
    calls = Calls(engine)
    while True:
        msg = protocol.recv(sock, max_frame)
        if msg is None or isinstance(msg, Shutdown):
            return
        if isinstance(msg, Snapshot):
            calls.add_snapshot(msg.key, msg.value, msg.evict)
        elif isinstance(msg, Task):
            sock.sendall(run_task(calls, msg, max_frame))
        else:
            raise protocol.ProtocolError(f"worker got unexpected {type(msg).__name__}")


def run_task(calls: Calls, task: Task, max_frame: int) -> bytes:
    """The reply frame for one task: a Result, or a Failure carrying the traceback."""
    try:
        value = calls.call(task.method, task.item, task.shared)
        return protocol.frame(Result(task.id, value), max_frame)
    except Exception as exc:
        return protocol.frame(Failure(task.id, exception_summary(exc), traceback.format_exc()), max_frame)


def start_engine(engine_factory, device) -> tuple:
    """``(engine, info)``: the engine for ``device`` and its ``info()`` ({} without one).
    Shared with the pool's inline mode, so both start an engine the same way."""
    engine = engine_factory(device)
    return engine, dict(engine.info()) if hasattr(engine, "info") else {}


def exception_summary(exc: BaseException) -> str:
    """The one-line summary of an engine exception, in every WorkerError."""
    return f"{type(exc).__name__}: {exc}"
