"""Forking a child the one safe way; used for the zygote and for every worker.

``fork_child`` owns the whole sequence, as moolib's env.cc does: refuse if the process is
not safe to fork (for the zygote, forked from the user's process), flush stdio, fork, and in
the child run the common first steps, die with the parent, close every descriptor it does not
own, run the body and always leave through ``os._exit``, never returning into the caller.
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
    """Fork a child that runs ``body()`` and exits; return its pid (in the parent).

    In the child: ``after_fork_in_child``, ``die_with_parent``, ``setup()`` (e.g. pointing
    fds 1/2 somewhere), closing every descriptor above 2 but ``keep``, then ``body()``.
    The exit code is what ``body`` returns (None: 0), or 1 with the traceback on stderr
    when it raises. A child whose channel to its parent broke (the pool's process closed
    it, or is gone) exits quietly with 0: nobody is left to tell, and a traceback would
    only land on the user's terminal after a Ctrl-C."""
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
    """``body()``'s value (a ``result_type``), computed in a child forked by ``fork_child`` and
    sent back as one protocol frame over a socketpair, as a worker answers: for work whose
    imports (torch, a tokenizer's libraries) this process must not load before it forks its
    workers. None when the child sends nothing (it died; a traceback is on stderr)."""
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
        # Its gRPC threads do not survive a fork: a child segfaults on its first Ray call,
        # and may deadlock in any lock they held. They stay even after ray.shutdown().
        problems.append("Ray is initialised in this process (use backend=Ray(), or create fork pools before ray.init)")
    if os.path.isdir("/proc/self/task"):
        # A clean interpreter has 1 thread, plus the BLAS thread pool that `import numpy`
        # starts (torch imports numpy). Any other thread is usually torch's OpenMP pool,
        # started by a torch op: a forked child that runs its own first op would then
        # deadlock. A thread that was just joined can linger in /proc for a moment, so give
        # the count a little time to settle.
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
    """The worker threads numpy's OpenBLAS starts when numpy is imported: one fewer than its
    thread count, which is ``OPENBLAS_NUM_THREADS`` (else ``GOTO_NUM_THREADS``, else
    ``OMP_NUM_THREADS``) capped by the CPUs, or the CPUs. They are safe to fork from
    (OpenBLAS stops them around a fork), and a 16-core GPU machine has 15 of them: counting
    them as a hazard refused every pool created after `import torch` there."""
    if not numpy_imported:
        return 0
    for name in ("OPENBLAS_NUM_THREADS", "GOTO_NUM_THREADS", "OMP_NUM_THREADS"):
        value = environ.get(name, "").strip()
        if value.isascii() and value.isdigit() and int(value) > 0:
            return min(int(value), cpus) - 1
    return cpus - 1


def after_fork_in_child() -> None:
    """Common first steps of the zygote and of every worker, right after fork."""
    # Objects inherited from the parent must never be finalised here: a file object of the
    # parent whose descriptor number we reuse would otherwise close *our* socket.
    gc.freeze()
    signal.set_wakeup_fd(-1)
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C belongs to the parent
    signal.signal(signal.SIGTERM, signal.SIG_DFL)  # the parent's handlers are not ours
    signal.signal(signal.SIGCHLD, signal.SIG_DFL)


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


def flush_stdio() -> None:
    """Flush Python's stdio buffers before a fork (a child would inherit them and print
    them once more) and before ``os._exit`` (which skips the flush)."""
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except Exception:
            pass
