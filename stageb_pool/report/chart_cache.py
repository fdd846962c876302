"""Charts drawn ahead of their page: each SVG kept by the inputs it was drawn from, so that a
page built later from equal inputs takes it instead of drawing it again.

A chart is a function of its arguments alone (charts.py: the same inputs give the same bytes,
whatever the process drew before), so a page built through the cache is byte for byte the
page ``render_report`` draws from scratch. The run's report process (app/report_process.py)
draws the charts whose inputs are committed rows while the run goes on (``prepare``), and at
the end only the charts still missing (``missing``, ``add``, then ``page``).
"""

from __future__ import annotations

import functools
from typing import Callable, NamedTuple

from .page import render_report


class Chart(NamedTuple):
    """One chart of a page: which function of charts.py, its arguments, and the key of both."""
    name: str
    args: tuple
    key: tuple

    def draw(self, charts) -> str:
        return getattr(charts, self.name)(*self.args)


class ChartCache:
    """``charts``: charts.py (``load_chart_libraries()``)."""

    def __init__(self, charts):
        self.charts = charts
        self.svgs: dict[tuple, str] = {}

    def page(self, run_dir) -> str:
        """``render_report(run_dir)``, drawing only the charts the cache lacks."""
        return self._render(run_dir, lambda chart: chart.draw(self.charts))

    def prepare(self, run_dir, names) -> None:
        """Draw the charts of ``run_dir``'s page called ``names`` (charts.py's functions) that
        the cache lacks; the other charts are not drawn."""
        self._render(run_dir, lambda chart: chart.draw(self.charts) if chart.name in names else None)

    def missing(self, run_dir) -> list[Chart]:
        """The charts of ``run_dir``'s page that the cache lacks, each once; none is drawn."""
        wanted: dict[tuple, Chart] = {}

        def note(chart: Chart) -> None:
            wanted.setdefault(chart.key, chart)

        self._render(run_dir, note)
        return list(wanted.values())

    def add(self, chart: Chart, svg: str) -> None:
        self.svgs[chart.key] = svg

    def _render(self, run_dir, on_miss: Callable[[Chart], str | None]) -> str:
        """The page, each chart from the cache or ``on_miss`` (None: not drawn, left empty).
        The cache keeps the charts of this page only: the older ones will not be asked again."""
        kept: dict[tuple, str] = {}

        def chart(name: str, *args) -> str:
            # repr: the arguments are plain values (lists, dicts, str, int, float, bool, None),
            # whose repr tells any two unequal ones apart (floats exactly, -0.0 from 0.0)
            key = (name, repr(args))
            svg = self.svgs.get(key)
            if svg is None:
                svg = on_miss(Chart(name, args, key))
            if svg is None:
                return ""
            kept[key] = svg
            return svg

        page = render_report(run_dir, charts=_Charts(chart))
        self.svgs = kept
        return page


class _Charts:
    """What ``render_report`` calls as charts.py: each chart function through ``chart``."""

    def __init__(self, chart: Callable[..., str]):
        self._chart = chart

    def __getattr__(self, name: str):
        return functools.partial(self._chart, name)
