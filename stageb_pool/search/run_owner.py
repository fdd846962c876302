"""The run directory's one owner, ``RunDir`` (its states are the run's life), and the lock it
holds for the whole run: what they do and why, docs/artifacts.md, "The run directory itself".
The lock file is never deleted (two processes could then lock two inodes of one name). The
pool's children are forked without exec, so ``O_CLOEXEC`` does not close the lock there:
``pool/fork.py`` ``close_fds_except`` does.
"""

from __future__ import annotations

import enum
import errno
import fcntl
import logging
import math
import os
import shutil
import stat
import sys
import tempfile
import time
from pathlib import Path
from typing import TYPE_CHECKING, Callable

from ..stageb.errors import InputError
from .fileio import TMP_SUFFIX, atomic_write_bytes, file_mode, normalise_modes, read_json, remove, write_json
from ..artifacts import GUIDANCE, RUN, RUN_FOLDERS
from .rundir import CANNOT_PREPARE, REPLACED, RunJson, encoded

if TYPE_CHECKING:  # state.py imports rundir, which this module imports
    from .state import ResumePoint

log = logging.getLogger("stageb_pool")
WAIT_POLL_S = 0.1  # how often a bounded wait tries the lock again


class Phase(enum.Enum):
    PLANNED = "planned"  # every refusal made, nothing written
    LOCKED = "locked"  # this process owns the directory (the lock file, its first write)
    STARTED = "started"  # the directory made, replaced or kept; its first files being written
    COMMITTED = "committed"  # the first files written; an --overwrite's old run deleted
    ROLLED_BACK = "rolled back"  # the first files failed; an --overwrite's old run put back


class RunDir:
    """The run directory of one run: ``RunDir(...)`` (planned) -> ``lock`` -> ``start`` (then
    committed or rolled back) -> ``record_workers``; ``release``; a step out of order raises
    RuntimeError. Planned: every refusal made, reading only (the first documents encoded, the
    directory, ``distillation_file``, on ``--resume`` its folders and ``resume_check``, answered
    in ``resume_point``); again after a lock that waited (the other run may have changed them)."""

    def __init__(self, path: str | Path, *, overwrite: bool = False, resume: bool = False,
                 run_json: RunJson | None = None, seed_guidance: dict | None = None,
                 distillation_file: str | None = None,
                 resume_check: Callable[[Path], ResumePoint] | None = None):
        self.path = Path(path)
        self.overwrite, self.resume = overwrite, resume
        self.run_json = run_json
        self.first_files = {name: encoded(doc, name) for name, doc in
                            ((RUN.name, run_json and run_json.document()), (GUIDANCE.name, seed_guidance))
                            if doc is not None}
        self.distillation_file = distillation_file
        self.resume_check = resume_check
        self.resume_point: ResumePoint | None = None
        self._lock_fd: int | None = None  # the lock's descriptor while this process holds it
        self._aside: Path | None = None  # the old run of an --overwrite, until the commit
        self._check()
        self.phase = Phase.PLANNED

    def _expect(self, phase: Phase) -> None:
        if self.phase is not phase:
            raise RuntimeError(f"the run directory is {self.phase.value}, not {phase.value}")

    def _check(self) -> None:
        if self.overwrite and self.resume:
            raise InputError("--overwrite and --resume exclude each other: choose one", str(self.path))
        try:
            self._check_path()
        except OSError as err:
            raise InputError(f"{CANNOT_PREPARE}: {err.strerror or err}", str(self.path)) from None
        self._check_distillation_file()
        if self.resume:
            check_folders(self.path)
            if self.resume_check is not None:
                self.resume_point = self.resume_check(self.path)

    def _check_path(self) -> None:
        path = self.path
        if path.exists() and not path.is_dir():
            raise InputError("the run directory path exists and is not a directory", str(path))
        if self.resume and not path.is_dir():
            raise InputError("nothing to resume: the run directory does not exist (drop --resume to start it)", str(path))
        if self.resume or not path.is_dir():
            return
        if not self.overwrite:
            raise InputError("the run directory already exists: pass --overwrite to replace it or --resume to "
                             "continue it", str(path))
        if any(path.iterdir()) and not (path / RUN.name).exists():
            raise InputError(f"refusing to --overwrite a non-empty directory without {RUN.name}: it does not look "
                             "like a stageb-pool run", str(path))

    def _check_distillation_file(self) -> None:
        chatml = self.distillation_file
        if chatml is None or self.overwrite or not os.path.lexists(chatml):
            return
        real, run_real = os.path.realpath(chatml), os.path.realpath(self.path)
        if real == run_real or real.startswith(run_real.rstrip(os.sep) + os.sep):
            return  # a file of the run directory: replaced with the run, like every artifact there
        if self.resume and real == self._recorded_distillation_file():
            return  # the run being continued wrote it, and redoes its export
        raise InputError(f"{chatml} exists and is not this run's own earlier output: pass --overwrite to replace it, "
                         "or choose another path", "stage_b_distillation.log_chatml_path")

    def _recorded_distillation_file(self) -> str | None:
        try:
            recorded = read_json(self.path / RUN.name)["config"]["stage_b_distillation"]["log_chatml_path"]
        except (OSError, ValueError, KeyError, TypeError):
            return None
        return os.path.realpath(recorded) if isinstance(recorded, str) else None

    def lock(self, *, wait: bool | float = False) -> RunDir:
        """Take the directory's lock (``acquire``); ``with`` the result releases it."""
        self._expect(Phase.PLANNED)
        self._lock_fd, waited = acquire(self.path, wait=wait)
        self.phase = Phase.LOCKED
        if waited:
            try:
                self._check()
            except BaseException:
                self.release()
                raise
        return self

    def release(self) -> None:
        """Free the lock (the process's end frees it too)."""
        if self._lock_fd is not None:
            fd, self._lock_fd = self._lock_fd, None
            os.close(fd)  # closing the only descriptor of the open file drops the flock

    def __enter__(self) -> RunDir:
        return self

    def __exit__(self, *exc) -> None:
        self.release()

    def start(self) -> None:
        """Make (or, on resume, ``clean_up``) the directory, write the first files (run.json
        first: it marks a run ``--overwrite`` may replace even if the start fails later; the
        seed guidance unless a resumed run has one), then commit. A failure before the commit
        rolls back (the old run put back) and is raised."""
        self._expect(Phase.LOCKED)
        self._aside = self._make()
        self.phase = Phase.STARTED
        try:
            if self.resume:
                self.clean_up()
            for name, data in self.first_files.items():
                if not (self.resume and name == GUIDANCE.name and (self.path / name).is_file()):
                    atomic_write_bytes(self.path / name, data)
        except BaseException:
            self._roll_back()
            raise
        self._commit()

    def _make(self) -> Path | None:
        """The directory, ready for the first files; returns where the old run was moved aside."""
        path = self.path
        if self.resume:
            return None
        if not path.is_dir():
            try:
                path.mkdir(parents=True)
            except OSError as err:
                raise InputError(f"{CANNOT_PREPARE}: {err.strerror or err}", str(path)) from None
            return None
        try:
            aside = Path(tempfile.mkdtemp(prefix=f".{path.name}{REPLACED}", dir=path.parent))
        except OSError as err:
            raise InputError(f"{CANNOT_PREPARE}: cannot make room to move the old run aside ({err.strerror or err}); "
                             "the old run is unchanged", str(path)) from None
        try:
            os.rename(path, aside)  # a directory renames onto an empty one: atomic, same folder
        except OSError as err:
            os.rmdir(aside)
            raise InputError(f"{CANNOT_PREPARE}: cannot move the old run aside ({err.strerror or err}); the old run "
                             "is unchanged", str(path)) from None
        try:
            path.mkdir()
        except OSError as err:
            os.rename(aside, path)
            raise InputError(f"{CANNOT_PREPARE}: cannot make the new run directory ({err.strerror or err}); the old "
                             "run is back, unchanged", str(path)) from None
        return aside

    def clean_up(self) -> None:
        """A resumed directory as this version would have left it: unfinished atomic writes'
        temporary files deleted, every file given the mode a run writes."""
        for stale in sorted(p for p in self.path.rglob(f".*{TMP_SUFFIX}") if p.is_file()):
            remove(stale)
            log.info("resume: removed %s (a write the interrupted run did not finish)", stale)
        changed = normalise_modes(self.path)
        if changed:
            log.info("resume: %d file(s) given mode %04o, as every file a run writes (versions before 0.2.0 "
                     "wrote whole files 0600)", len(changed), file_mode())

    def _commit(self) -> None:
        """Delete the old run; a leftover is named in a warning and the new run goes on."""
        aside, self._aside = self._aside, None
        self.phase = Phase.COMMITTED
        if aside is None:
            return
        try:
            shutil.rmtree(aside)
        except OSError as err:
            log.warning("--overwrite: the new run is in place, but the old run could not be deleted completely "
                        "(%s): what is left of it is in %s; delete it by hand", err.strerror or err, aside)

    def _roll_back(self) -> None:
        """Put the old run back (the new run's start failed), logging where it is either way."""
        aside, self._aside = self._aside, None
        self.phase = Phase.ROLLED_BACK
        if aside is None:
            return
        try:
            shutil.rmtree(self.path, ignore_errors=True)
            os.rename(aside, self.path)
        except OSError as err:
            log.error("--overwrite failed: the old run could not be put back (%s); it is intact in %s",
                      err.strerror or err, aside)
            return
        log.error("--overwrite failed: the old run is back, unchanged, in %s", self.path)

    def record_workers(self, worker_info: dict) -> None:
        """Rewrite run.json with the started workers' engine facts (rank 0's ``engine.info()``)."""
        self._expect(Phase.COMMITTED)
        write_json(self.path / RUN.name, self.run_json.document(worker_info))


def check_folders(run_dir: Path) -> None:
    """Refuse a folder the run writes into that is a symbolic link or not a folder: its files
    would be written, and snapshots pruned, outside the run (docs/artifacts.md)."""
    for name in RUN_FOLDERS:
        folder = Path(run_dir) / name
        if folder.is_symlink() or (os.path.lexists(folder) and not folder.is_dir()):
            what = "a symbolic link" if folder.is_symlink() else "not a folder"
            raise InputError(f"{name} in the run directory is {what}: a run writes only into real folders "
                             "inside it (replace it by a folder holding its files)", str(folder))


def lock_path(run_dir: str | Path) -> Path:
    run_dir = Path(run_dir)
    return run_dir.parent / f".{run_dir.name}.lock"


class WaitStopped(KeyboardInterrupt):
    """Ctrl-C (``signum`` None) or a stop signal while ``--wait`` waited for ``holder`` (a pid):
    nothing was started or changed. A KeyboardInterrupt, as the stop it stands for."""

    def __init__(self, signum: int | None, holder: str):
        super().__init__(signum, holder)
        self.signum, self.holder = signum, holder


def acquire(run_dir: str | Path, *, wait: bool | float = False) -> tuple[int, bool]:
    """Lock ``run_dir`` for this process (making its mission folder and lock file); returns the
    lock's descriptor and whether it waited. Another holder is an InputError naming its pid,
    or with ``wait`` (True: no bound; a number: seconds) waited for (``_wait``). A lock file
    that is a link or not a regular file is refused: its pid would be written elsewhere."""
    run_dir = Path(run_dir)
    path = lock_path(run_dir)
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC | os.O_NOFOLLOW, 0o666)
    except OSError as err:
        if err.errno == errno.ELOOP:
            raise InputError(f"cannot lock the run directory: {path} is a symbolic link", str(run_dir)) from None
        # the same message as any other output.root the file system refuses
        raise InputError(f"{CANNOT_PREPARE}: cannot make its lock file {path}: {err.strerror or err}",
                         str(run_dir)) from None
    waited = False
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
            waited = True
        os.ftruncate(fd, 0)
        os.pwrite(fd, f"{os.getpid()}\n".encode(), 0)
    except BaseException:
        os.close(fd)
        raise
    return fd, waited


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
