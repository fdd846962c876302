"""One owner per run directory: an exclusive ``flock`` held for the whole run.

The lock file is ``.{run_name}.lock`` beside the run directory, in the mission folder, not
inside it: ``--overwrite`` moves the old directory aside and builds a new one, and a lock
file inside would go with the old directory, letting a third process in half-way. The file
is never deleted (deleting a lock file lets two processes hold locks on two different
inodes of the same name); it holds the owner's pid, written after locking and read only to
name the holder in a refusal. The lock itself is the kernel's ``flock``: it dies with the
process (also on SIGKILL), so a stale pid in the file never blocks anyone.

Fork hygiene: the pool's zygote and workers are forked without exec, so ``O_CLOEXEC`` does
not close the descriptor in them; ``pool/fork.py`` ``close_fds_except`` closes every
descriptor a child does not own, so a worker never keeps the run locked after the parent
died.
"""

from __future__ import annotations

import errno
import fcntl
import math
import os
import stat
import sys
import time
from pathlib import Path

from ..stageb.errors import InputError


def lock_path(run_dir: str | Path) -> Path:
    """``{mission folder}/.{run_name}.lock``"""
    run_dir = Path(run_dir)
    return run_dir.parent / f".{run_dir.name}.lock"


class RunDirLock:
    """The held lock of one run directory; ``release()`` (or the process's end) frees it."""

    def __init__(self, run_dir: Path, fd: int):
        self.run_dir = run_dir
        self._fd: int | None = fd

    @property
    def held(self) -> bool:
        return self._fd is not None

    def release(self) -> None:
        if self._fd is not None:
            fd, self._fd = self._fd, None
            os.close(fd)  # closing the only descriptor of the open file drops the flock

    def __enter__(self) -> RunDirLock:
        return self

    def __exit__(self, *exc) -> None:
        self.release()


class WaitStopped(KeyboardInterrupt):
    """Ctrl-C or a stop signal (``signum``; None for Ctrl-C) while ``--wait`` waited for
    another run (``holder``, its pid) to release the run directory: nothing was started and
    nothing on disk changed. A KeyboardInterrupt, as the stop it stands for."""

    def __init__(self, signum: int | None, holder: str):
        super().__init__(signum, holder)
        self.signum, self.holder = signum, holder


WAIT_POLL_S = 0.1  # how often a bounded wait tries the lock again


def acquire(run_dir: str | Path, *, wait: bool | float = False) -> RunDirLock:
    """Lock ``run_dir`` for this process, creating its mission folder and lock file if needed.

    Another holder: an InputError located at the run directory naming its pid, at once. With
    ``wait`` (True or ``math.inf``: without a bound; a number: at most that many seconds) it
    says on stderr, at every log level, which pid it waits for and waits until the holder is
    gone; past the bound, an InputError says so. A stop while waiting is a ``WaitStopped``.
    A lock file that is a symbolic link, a hard link or not a regular file is refused (its pid
    would be written elsewhere)."""
    run_dir = Path(run_dir)
    path = lock_path(run_dir)
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC | os.O_NOFOLLOW, 0o666)
    except OSError as err:
        if err.errno == errno.ELOOP:
            raise InputError(f"cannot lock the run directory: {path} is a symbolic link", str(run_dir)) from None
        # The mission folder or the lock file could not be made: the same message as any other
        # output.root the file system refuses (rundir.start_run_dir).
        raise InputError(f"cannot prepare the run directory (output.root): cannot make its lock file {path}: "
                         f"{err.strerror or err}", str(run_dir)) from None
    try:
        info = os.fstat(fd)
        if not stat.S_ISREG(info.st_mode) or info.st_nlink != 1:
            raise InputError(f"cannot lock the run directory: {path} is not a private regular file "
                             "(a hard link or a special file): remove it", str(run_dir))
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            holder = _holder(fd)
            if not wait:
                raise InputError(f"the run directory is in use by another stageb-pool run (pid {holder}): "
                                 "wait for it to end, or pass --wait to wait for it", str(run_dir)) from None
            _wait(fd, run_dir, holder, math.inf if wait is True else float(wait))
        os.ftruncate(fd, 0)
        os.pwrite(fd, f"{os.getpid()}\n".encode(), 0)
    except BaseException:
        os.close(fd)
        raise
    return RunDirLock(run_dir, fd)


def _wait(fd: int, run_dir: Path, holder: str, bound: float) -> None:
    """Block until the lock is this process's, at most ``bound`` seconds. Said on stderr rather
    than logged: a silent wait looks like a hang whatever ``--log-level`` says."""
    limit = "" if math.isinf(bound) else f" for at most {bound:g} s"
    try:  # the line is inside: a stop that comes as soon as it is read is a stop while waiting
        print(f"stageb-pool: waiting{limit} for pid {holder}, which holds the run directory {run_dir} (--wait); "
              "nothing is started until it ends", file=sys.stderr, flush=True)
        if math.isinf(bound):
            fcntl.flock(fd, fcntl.LOCK_EX)
            return
        deadline = time.monotonic() + bound
        while True:
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                return
            except BlockingIOError:
                left = deadline - time.monotonic()
                if left <= 0:
                    break
                time.sleep(min(WAIT_POLL_S, left))
    except KeyboardInterrupt as stop:
        raise WaitStopped(getattr(stop, "signum", None), holder) from None
    raise InputError(f"the run directory is still in use by another stageb-pool run (pid {_holder(fd)}) after "
                     f"waiting {bound:g} s (--wait {bound:g}): nothing was started; wait longer, or without a bound "
                     "(--wait)", str(run_dir))


def _holder(fd: int) -> str:
    """The pid the holder wrote (for the message only; "unknown" before it wrote it)."""
    try:
        text = os.pread(fd, 32, 0).decode("ascii", "replace").strip()
    except OSError:
        text = ""
    return text if text.isdigit() else "unknown"
