"""report.html for a run, drawn by a forked process that loads matplotlib while the run goes
on and draws the page while the run closes its pool (``ReportJob``, what ``job.run_plan``
uses). The same function writes the same bytes as ``stageb-pool report``; a failure is a
warning, never the run's failure."""

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
    """Render and write ``report.html``; None, or the failure as ``Type: message``."""
    try:
        atomic_write_bytes(Path(run_dir) / REPORT.name, render_report(run_dir).encode("utf-8"))
    except Exception as err:  # noqa: BLE001 - the run's results are written; the page is a view of them
        return f"{type(err).__name__}: {err}"
    return None


def _report_outcome(run_dir, error: str | None) -> bool:
    """A finished run stays finished whatever happened to its page: a failure is a warning
    naming the cause (``stageb-pool report`` can retry)."""
    if error is not None:
        log.warning("report.html was not written (%s); rebuild it with: stageb-pool report %s", error, run_dir)
        return False
    log.info("report written to %s", Path(run_dir) / REPORT.name)
    return True


class ReportJob:
    """``report.html`` from a forked child: forked at the run's start, while this process is
    clean, it imports the chart libraries (matplotlib: seconds) while the run goes on, then
    waits; ``render(run_dir)`` once the run's files are written makes it draw and write the
    page (``render_report_file``, the same bytes as ``stageb-pool report``) while this
    process closes its pool; ``wait`` collects the outcome (``_report_outcome`` logs it);
    ``cancel`` (a failed run) ends it without a page. This process never imports
    matplotlib (the fork rules of any later pool in it)."""

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
        """Draw the page of ``run_dir`` now (its files are written)."""
        self.run_dir = run_dir
        try:
            with os.fdopen(self.requests, "w") as request:
                request.write(str(run_dir))
        except BrokenPipeError:  # its process is gone: ``wait`` says so
            pass

    def cancel(self) -> None:
        """No page: the run failed (or was interrupted)."""
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
        return _report_outcome(self.run_dir, error or None)
