"""report.html for a run, drawn by a forked process; a failure is a warning, not the run's."""

from __future__ import annotations

import logging
import os
import signal
from pathlib import Path

from ..pool.fork import fork_child
from ..artifacts import REPORT
from ..report import load_chart_libraries, render_report
from ..search.fileio import atomic_write_bytes

log = logging.getLogger("stageb_pool")


def render_report_file(run_dir) -> str | None:
    """Write ``report.html`` (as ``stageb-pool report``); None, or the failure as ``Type: message``."""
    try:
        atomic_write_bytes(Path(run_dir) / REPORT.name, render_report(run_dir).encode("utf-8"))
    except Exception as err:  # noqa: BLE001 - the run's results are written; the page is a view of them
        return f"{type(err).__name__}: {err}"
    return None


class ReportJob:
    """A child forked at the run's start, while this process is clean, imports matplotlib
    (seconds) while the run goes on, and draws the page on ``render``. This process never
    imports matplotlib (the fork rules of a later pool)."""

    def __init__(self):
        child_requests, self.requests = os.pipe()
        answers, child_answers = os.pipe()

        def child():
            load_chart_libraries()
            with os.fdopen(child_requests) as request:
                run_dir = request.read()
            if not run_dir:  # cancelled: the run failed
                return 0
            error = render_report_file(run_dir)
            with os.fdopen(child_answers, "w") as out:
                out.write("" if error is None else error)

        try:
            self.pid = fork_child(child, keep=(child_requests, child_answers))
        except BaseException:
            for fd in (self.requests, answers):
                os.close(fd)
            raise
        finally:
            os.close(child_requests)
            os.close(child_answers)
        self.answers = answers
        self.run_dir = None

    def render(self, run_dir) -> None:
        self.run_dir = run_dir
        try:
            with os.fdopen(self.requests, "w") as request:
                request.write(str(run_dir))
        except BrokenPipeError:  # its process is gone: ``wait`` says so
            pass

    def cancel(self) -> None:
        os.close(self.requests)
        os.close(self.answers)
        try:
            os.kill(self.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        os.waitpid(self.pid, 0)

    def wait(self) -> bool:
        """Whether report.html was written (a warning says why not)."""
        try:
            with os.fdopen(self.answers) as answer:
                error = answer.read()
            _, status = os.waitpid(self.pid, 0)
        except BaseException:  # Ctrl-C while waiting: the page is not worth a lingering process
            os.kill(self.pid, signal.SIGKILL)
            os.waitpid(self.pid, 0)
            raise
        if not error and os.waitstatus_to_exitcode(status) != 0:
            error = f"its process ended with status {os.waitstatus_to_exitcode(status)}"
        if error:  # a finished run stays finished: the page can be rebuilt
            log.warning("report.html was not written (%s); rebuild it with: stageb-pool report %s", error,
                        self.run_dir)
            return False
        log.info("report written to %s", Path(self.run_dir) / REPORT.name)
        return True
