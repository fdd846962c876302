"""The run report: ``report.html``, one self-contained page drawn from a run directory's
files alone (it imports nothing of the pool, the engines or the search).

matplotlib is imported only by ``render_report`` and ``load_chart_libraries`` (charts.py says why).
"""

from .files import ReportError
from .output import check_target
from .page import load_chart_libraries, render_report

__all__ = ["ReportError", "check_target", "load_chart_libraries", "render_report"]
