"""Forking a child the one safe way, for the zygote and every worker: refuse an unsafe process,
fork, and always leave through ``os._exit`` (docs/architecture.md, "Process model").
"""

from __future__ import annotations

import ctypes
import gc
import os
import signal
import socket
import sys
import threading
import time
import traceback

import msgspec

from . import protocol
from .errors import PoolError

PR_SET_PDEATHSIG = 1


def fork_child(body, *, keep: tuple[int, ...] = (), setup=None, check_safe: bool = False) -> int:
    """Fork a child that runs ``body()`` (fds above 2 but ``keep`` closed) and exits; return its
    pid. The exit code is what ``body`` returns, or 1 with the traceback on stderr; a child whose
    channel to its parent broke exits quietly with 0 (after a Ctrl-C a traceback would only land
    on the user's terminal)."""
    if check_safe:
        check_fork_safe()
    parent_pid = os.getpid()
    flush_stdio()
    pid = os.fork()
    if pid:
        return pid
    code = 1
    try:
        after_fork_in_child()
        die_with_parent(parent_pid)
        if setup is not None:
            setup()
        close_fds_except(*keep)
        code = body() or 0
    except (BrokenPipeError, ConnectionResetError):
        code = 0
    except BaseException:  # noqa: BLE001 - whatever happens, leave through os._exit
        traceback.print_exc()
    finally:
        flush_stdio()
        os._exit(code)


def call_in_child(body, result_type):
    """``body()``'s value (a ``result_type``), computed in a forked child and sent back as one
    frame: for work whose imports this process must not load before it forks its workers. None
    when the child sends nothing (it died; a traceback is on stderr)."""
    ours, theirs = socket.socketpair()
    with ours:
        try:
            pid = fork_child(lambda: theirs.sendall(protocol.frame(body())), keep=(theirs.fileno(),))
        finally:
            theirs.close()
        answer = protocol.recv_body(ours)
    os.waitpid(pid, 0)
    return None if answer is None else msgspec.json.decode(answer, type=result_type)


def check_fork_safe() -> None:
    """Refuse to fork from a process where a child could deadlock or not use CUDA."""
    problems = []
    if threading.active_count() > 1:
        names = ", ".join(t.name for t in threading.enumerate() if t is not threading.current_thread())
        problems.append(f"{threading.active_count()} Python threads are running (other: {names})")
    torch = sys.modules.get("torch")
    if torch is not None and torch.cuda.is_initialized():
        problems.append("CUDA is initialised in this process (a forked child cannot use it)")
    ray = sys.modules.get("ray")
    if ray is not None and ray.is_initialized():
        # Its gRPC threads (left even after ray.shutdown) make a child segfault or deadlock.
        problems.append("Ray is initialised in this process (use backend=Ray(), or create fork pools before ray.init)")
    if os.path.isdir("/proc/self/task"):
        # Beyond 1 + numpy's BLAS pool, a thread is usually torch's OpenMP pool, and a child
        # forked after it deadlocks in its first op. A joined thread lingers in /proc briefly.
        clean = 1 + blas_threads("numpy" in sys.modules, os.cpu_count() or 1, os.environ)
        deadline = time.monotonic() + 0.5
        while (native := len(os.listdir("/proc/self/task"))) > clean and time.monotonic() < deadline:
            time.sleep(0.01)
        if native > clean and threading.active_count() == 1:
            problems.append(
                f"{native} native threads exist where a clean process has {clean} "
                "(started by a library: a torch op starts torch's OpenMP thread pool; "
                "ray.init leaves threads behind even after ray.shutdown)"
            )
    if problems:
        raise PoolError(
            "Refusing to fork the pool's workers: " + "; ".join(problems) + ". "
            "Create the Pool as early as possible, before starting threads, running torch ops "
            "or initialising CUDA in the parent."
        )


def blas_threads(numpy_imported: bool, cpus: int, environ) -> int:
    """The worker threads numpy's OpenBLAS starts at import (its thread count less one, by
    ``OPENBLAS_NUM_THREADS``, ``GOTO_NUM_THREADS``, ``OMP_NUM_THREADS`` or the CPUs). Safe to fork
    from (OpenBLAS stops them around a fork), so not a hazard."""
    if not numpy_imported:
        return 0
    for name in ("OPENBLAS_NUM_THREADS", "GOTO_NUM_THREADS", "OMP_NUM_THREADS"):
        value = environ.get(name, "").strip()
        if value.isascii() and value.isdigit() and int(value) > 0:
            return min(int(value), cpus) - 1
    return cpus - 1


def after_fork_in_child() -> None:
    # A parent's file object finalised here could close *our* socket reusing its fd number.
    gc.freeze()
    signal.set_wakeup_fd(-1)
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C belongs to the parent
    signal.signal(signal.SIGTERM, signal.SIG_DFL)  # the parent's handlers are not ours
    signal.signal(signal.SIGCHLD, signal.SIG_DFL)


def die_with_parent(expected_ppid: int) -> None:
    """SIGKILL this process when its parent dies; the ``getppid`` re-check closes the race
    where the parent died before prctl()."""
    libc = ctypes.CDLL(None, use_errno=True)
    if libc.prctl(PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0) != 0:
        os._exit(70)
    if os.getppid() != expected_ppid:
        os._exit(71)


def close_fds_except(*keep: int) -> None:
    """Close every fd above stderr but ``keep``: a kept copy of another process's socket
    would hide the EOF that tells the parent that process died."""
    low = 3
    for fd in sorted(set(keep)):
        os.closerange(low, fd)
        low = fd + 1
    os.closerange(low, os.sysconf("SC_OPEN_MAX"))


def flush_stdio() -> None:
    """Before a fork (a child would print the buffers again) and ``os._exit`` (which skips it)."""
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except Exception:
            pass
