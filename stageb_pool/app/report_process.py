"""report.html for a run, drawn by a forked process; a failure is a warning, not the run's.

Drawing the charts is nearly all of a report's time (matplotlib: 0.1-0.3 s a chart), so the
process draws ahead what it can: on each ``prepare`` (the run committed rows) the charts whose
inputs are committed rows, and on ``render`` only the charts whose inputs the run's last
files hold (summary.json's final metrics, pool_timeline.jsonl), side by side. The page is
the one ``stageb-pool report`` draws from scratch: chart_cache.py says why.
"""

from __future__ import annotations

import logging
import os
import signal
from pathlib import Path

from ..artifacts import REPORT
from ..pool.fork import fork_child
from ..report import load_chart_libraries, render_report
from ..report.chart_cache import Chart, ChartCache
from ..search.fileio import atomic_write_bytes

log = logging.getLogger("stageb_pool")

# The charts whose inputs are final before the run's end: rule_candidates.jsonl grows by one
# committed iteration at a time, judge_headroom.json is written before the first. The metrics
# chart ends with summary.json's final metrics and the worker timeline is written last.
PREDRAWN = frozenset({"candidate_deltas", "headroom_histogram"})
PREPARE, RENDER = b"p", b"r"  # the requests, one byte each; the pipe's end without RENDER: cancelled


def render_report_file(run_dir, render=render_report) -> str | None:
    """Write ``report.html`` (as ``stageb-pool report``); None, or the failure as ``Type: message``."""
    try:
        atomic_write_bytes(Path(run_dir) / REPORT.name, render(run_dir).encode("utf-8"))
    except Exception as err:  # noqa: BLE001 - the run's results are written; the page is a view of them
        return f"{type(err).__name__}: {err}"
    return None


def draw_side_by_side(cache: ChartCache, run_dir) -> str:
    """``run_dir``'s page, its missing charts drawn at once: each but the last by a child
    forked for it, the last here. A chart whose child fails is drawn here again, so that its
    error is the page's, as without the children."""
    missing = cache.missing(run_dir)
    children = []
    try:
        for chart in missing[:-1]:
            children.append((chart, _draw_in_child(cache, chart)))
        if missing:
            cache.add(missing[-1], missing[-1].draw(cache.charts))
    finally:
        for chart, (pid, answer) in children:
            svg = _collect(pid, answer)
            if svg is not None:
                cache.add(chart, svg)
    return cache.page(run_dir)


def _draw_in_child(cache: ChartCache, chart: Chart) -> tuple[int, int]:
    """(pid, the read end of its pipe) of a child that draws ``chart`` and writes its SVG.
    Safe to fork: matplotlib starts no thread, numpy's BLAS pool is fork-safe (pool/fork.py)."""
    answer, theirs = os.pipe()

    def child():
        try:
            svg = chart.draw(cache.charts).encode("utf-8")
        except Exception:  # noqa: BLE001 - drawn again by the parent, which reports the error
            return 1
        with os.fdopen(theirs, "wb") as out:
            out.write(svg)
        return 0

    try:
        pid = fork_child(child, keep=(theirs,))
    except BaseException:
        os.close(answer)
        raise
    finally:
        os.close(theirs)
    return pid, answer


def _collect(pid: int, answer: int) -> str | None:
    """A child's SVG; None when it failed."""
    with os.fdopen(answer, "rb") as pipe:
        data = pipe.read()
    _, status = os.waitpid(pid, 0)
    return data.decode("utf-8") if os.waitstatus_to_exitcode(status) == 0 else None


class ReportJob:
    """A child forked at the run's start, while this process is clean, imports matplotlib
    (seconds) and draws a first chart while the run goes on, draws what it can ahead on
    ``prepare`` and the page on ``render``. This process never imports matplotlib (the fork rules of a later pool)."""

    def __init__(self, run_dir):
        self.run_dir = run_dir
        child_requests, self.requests = os.pipe()
        answers, child_answers = os.pipe()

        def child():
            cache = ChartCache(load_chart_libraries())
            cache.charts.warm_up()
            while RENDER not in (asked := os.read(child_requests, 4096)):
                if not asked:  # cancelled: the run failed
                    return 0
                try:  # every prepare asked meanwhile at once
                    cache.prepare(run_dir, PREDRAWN)
                except Exception:  # noqa: BLE001 - the page at the end draws them again and says what fails
                    pass
            error = render_report_file(run_dir, lambda path: draw_side_by_side(cache, path))
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

    def prepare(self) -> None:
        """The run committed rows (an iteration, the headroom check): draw their charts now."""
        self._ask(PREPARE)

    def render(self) -> None:
        """The run's files are written: draw the page."""
        self._ask(RENDER)
        self._close_requests()

    def _ask(self, request: bytes) -> None:
        try:
            os.write(self.requests, request)
        except BrokenPipeError:  # its process is gone: ``wait`` says so
            pass

    def _close_requests(self) -> None:
        if self.requests is not None:
            os.close(self.requests)
            self.requests = None

    def cancel(self) -> None:
        self._close_requests()
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
