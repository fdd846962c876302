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
import sys
import threading
import time
import traceback

from .errors import PoolError

PR_SET_PDEATHSIG = 1


def fork_child(body, *, keep: tuple[int, ...] = (), setup=None, check_safe: bool = False) -> int:
    """Fork a child that runs ``body()`` and exits; return its pid (in the parent).

    In the child: ``after_fork_in_child``, ``die_with_parent``, ``setup()`` (e.g. pointing
    fds 1/2 somewhere), closing every descriptor above 2 but ``keep``, then ``body()``.
    The exit code is what ``body`` returns (None: 0), or 1 with the traceback on stderr
    when it raises."""
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
    except BaseException:  # noqa: BLE001 - whatever happens, leave through os._exit
        traceback.print_exc()
    finally:
        flush_stdio()
        os._exit(code)


def check_fork_safe() -> None:
    """Refuse to fork from a process where a child could deadlock or not use CUDA."""
    problems = []
    if threading.active_count() > 1:
        names = ", ".join(t.name for t in threading.enumerate() if t is not threading.current_thread())
        problems.append(f"{threading.active_count()} Python threads are running (other: {names})")
    torch = sys.modules.get("torch")
    if torch is not None and torch.cuda.is_initialized():
        problems.append("CUDA is initialised in this process (a forked child cannot use it)")
    if os.path.isdir("/proc/self/task"):
        # A clean interpreter has 1 thread; `import torch` starts exactly one more. Any other
        # thread is usually torch's OpenMP pool, started by a torch op: a forked child that
        # runs its own first op would then deadlock. A thread that was just joined can linger
        # in /proc for a moment, so give the count a little time to settle.
        clean = 1 + (torch is not None)
        deadline = time.monotonic() + 0.5
        while (native := len(os.listdir("/proc/self/task"))) > clean and time.monotonic() < deadline:
            time.sleep(0.01)
        if native > clean and threading.active_count() == 1:
            problems.append(
                f"{native} native threads exist where a clean process has {clean} "
                "(started by a library: a torch op starts torch's OpenMP thread pool)"
            )
    if problems:
        raise PoolError(
            "Refusing to fork the pool's workers: " + "; ".join(problems) + ". "
            "Create the Pool as early as possible, before starting threads, running torch ops "
            "or initialising CUDA in the parent."
        )


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
