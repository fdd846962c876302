"""The worker: a forked child that builds one engine and answers tasks until told to stop.

Everything here runs in a child process that was forked by the zygote. The child never
returns into the code that forked it: ``worker_main`` always leaves through ``os._exit``.
"""

from __future__ import annotations

import ctypes
import gc
import os
import signal
import sys
import traceback

from . import protocol
from .calls import Calls
from .protocol import Failure, InitFailed, Ready, Result, Shutdown, Snapshot, Task

PR_SET_PDEATHSIG = 1


def die_with_parent(expected_ppid: int) -> None:
    """SIGKILL this process when its parent dies.

    The ``getppid`` re-check closes the race where the parent died between fork() and
    prctl(): we would then already be re-parented and never get the signal."""
    libc = ctypes.CDLL(None, use_errno=True)
    if libc.prctl(PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0) != 0:
        os._exit(70)
    if os.getppid() != expected_ppid:
        os._exit(71)


def close_fds_except(*keep: int) -> None:
    """Close every descriptor above stderr except ``keep``.

    A child that kept a sibling's socket (or the zygote's control socket) would hold that
    connection open, and the parent would never see the EOF that tells it a process died."""
    low = 3
    for fd in sorted(set(keep)):
        os.closerange(low, fd)
        low = fd + 1
    os.closerange(low, os.sysconf("SC_OPEN_MAX"))


def after_fork_in_child() -> None:
    """Common first steps of the zygote and of every worker, right after fork."""
    # Objects inherited from the parent must never be finalised here: a file object of the
    # parent whose descriptor number we reuse would otherwise close *our* socket.
    gc.freeze()
    signal.set_wakeup_fd(-1)
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C belongs to the parent
    signal.signal(signal.SIGTERM, signal.SIG_DFL)  # the parent's handlers are not ours
    signal.signal(signal.SIGCHLD, signal.SIG_DFL)


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


def flush_stdio() -> None:
    """Flush Python's stdio buffers before a fork (a child would inherit them and print
    them once more) and before ``os._exit`` (which skips the flush)."""
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except Exception:
            pass


def _line_buffered_stdio() -> None:
    # fds 1 and 2 are pipes to the zygote, which prefixes each line with our rank; line
    # buffering makes prints appear promptly and never lost at os._exit.
    sys.stdout = open(1, "w", buffering=1, closefd=False, errors="backslashreplace")
    sys.stderr = open(2, "w", buffering=1, closefd=False, errors="backslashreplace")


def worker_main(sock, device, engine_factory, max_frame: int) -> None:
    """Body of a worker process. Never returns."""
    code = 1
    try:
        _line_buffered_stdio()
        limit_threads(device)
        try:
            engine, info = start_engine(engine_factory, device)
        except Exception as exc:
            protocol.send(sock, InitFailed(protocol.PROTOCOL_VERSION, os.getpid(), exception_summary(exc), traceback.format_exc()))
            return
        protocol.send(sock, Ready(protocol.PROTOCOL_VERSION, os.getpid(), info), max_frame)
        serve(sock, engine, max_frame)
        code = 0
    except BaseException:  # noqa: BLE001 - whatever happens, leave through os._exit
        traceback.print_exc()
    finally:
        flush_stdio()
        os._exit(code)


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
