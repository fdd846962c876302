"""Where a report may be written: a new file, or over a previous report, and nothing else.

``stageb-pool report RUN -o TARGET`` replaces TARGET by a rename, which would turn a device
(``/dev/null``), a FIFO, a socket or a symbolic link into a regular file, and would silently
replace any file, such as the run's own ``state.json``. So the target is checked first: a new
name in a folder that exists (none is created, as for a shell's redirection), or a regular file
that holds a previous report (``is_report``); inside the run directory, only its ``report.html``.
"""

from __future__ import annotations

import os
import stat

from ..artifacts import REPORT
from .files import OPEN_FLAGS, ReportError, RunFiles
from .page import REPORT_OPENING, REPORT_TITLE

HEAD_BYTES = 4096  # the title is within them (it comes about 250 bytes in, before the CSS)
_KINDS = ((stat.S_ISLNK, "a symbolic link"), (stat.S_ISDIR, "a folder"), (stat.S_ISCHR, "a character device"),
          (stat.S_ISBLK, "a block device"), (stat.S_ISFIFO, "a FIFO"), (stat.S_ISSOCK, "a socket"))
_WHAT = "the report writes a new file or replaces a previous report, nothing else"


def is_report(path: str) -> bool:
    """Whether ``path`` is a regular file (not a link) that holds a stageb-pool report."""
    try:
        fd = os.open(path, OPEN_FLAGS)
    except OSError:
        return False
    try:
        if not stat.S_ISREG(os.fstat(fd).st_mode):
            return False
        head = os.read(fd, HEAD_BYTES)
    finally:
        os.close(fd)
    return head.startswith(REPORT_OPENING.encode()) and REPORT_TITLE.encode() in head


def check_target(target: str, run_dir: str) -> None:
    """Raise ReportError unless ``run_dir`` is a run and its report may be written to ``target``
    (then named by the error). Reads only the two entries and the target's head; writes nothing."""
    RunFiles(run_dir)
    path = os.path.abspath(target)
    parent, name = os.path.split(path)
    real_run = os.path.realpath(run_dir)
    real_path = os.path.join(os.path.realpath(parent), name)
    if real_path != os.path.join(real_run, REPORT.name) and os.path.commonpath([real_path, real_run]) == real_run:
        raise ReportError(f"is in the run directory, which the report leaves as it is but for its {REPORT.name}",
                          target)
    try:
        info = os.lstat(path)
    except FileNotFoundError:
        if not os.path.isdir(parent):
            raise ReportError(f"no folder {parent} (the report creates none: create it first)", target) from None
        return
    except OSError as err:
        raise ReportError(f"cannot write the report: {err.strerror or err}", target) from None
    for test, kind in _KINDS:
        if test(info.st_mode):
            raise ReportError(f"is {kind}: {_WHAT}", target)
    if not is_report(path):
        raise ReportError(f"exists and is not a stageb-pool report: {_WHAT} (remove it, or choose another name)",
                          target)
