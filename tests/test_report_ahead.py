"""report.html drawn ahead: the charts of committed rows drawn while the run goes on, the rest
at the end side by side, give the bytes of the page drawn from scratch (``stageb-pool report``).

The material is one scripted rule search on two forked workers (tests/doubles/scripted_engine.py).
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
from doubles import scripted_engine as se
from doubles.run_inputs import MISSION, search_inputs

from stageb_pool.app import config as config_mod
from stageb_pool.app import job, report_process
from stageb_pool.report import load_chart_libraries, render_report
from stageb_pool.report.chart_cache import ChartCache

EPOCHS = 3


@pytest.fixture(scope="module")
def run_dir(tmp_path_factory) -> Path:
    root = tmp_path_factory.mktemp("ahead")
    cfg = config_mod.load_config(search_inputs(root / "in", out=str(root / "out"), epochs=EPOCHS), [])
    job.run_job(cfg, "cpu:2", engine_factory=se.scripted_factory())
    return root / "out" / MISSION / "run"


def as_after_the_first_commit(run_dir: Path, dest: Path) -> Path:
    """A copy of the finished run as it stood after iteration 1's commit: its candidates only,
    no summary.json or pool_timeline.jsonl yet."""
    shutil.copytree(run_dir, dest)
    lines = (dest / "rule_candidates.jsonl").read_text().splitlines(keepends=True)
    (dest / "rule_candidates.jsonl").write_text("".join(r for r in lines if json.loads(r)["iteration"] == 1))
    for name in ("summary.json", "pool_timeline.jsonl", "report.html"):
        (dest / name).unlink()
    return dest


def test_charts_drawn_ahead_give_the_page_drawn_from_scratch(run_dir, tmp_path):
    earlier = as_after_the_first_commit(run_dir, tmp_path / "earlier")
    cache = ChartCache(load_chart_libraries())
    cache.prepare(earlier, report_process.PREDRAWN)  # iteration 1's candidates, the headroom histogram
    assert sorted(key[0] for key in cache.svgs) == ["candidate_deltas", "headroom_histogram"]
    # the histogram's input is final, iteration 1's candidates chart is not: it is drawn again
    assert [c.name for c in cache.missing(run_dir)] == ["metrics_per_iteration", "candidate_deltas",
                                                        "worker_timeline"]
    cache.prepare(run_dir, report_process.PREDRAWN)  # the last commit
    assert [c.name for c in cache.missing(run_dir)] == ["metrics_per_iteration", "worker_timeline"]
    page = report_process.draw_side_by_side(cache, run_dir)  # the metrics chart by a child, the timeline here
    assert page == render_report(run_dir) == (run_dir / "report.html").read_text()
    assert page.count("<svg") == 4
    assert cache.missing(run_dir) == []  # and a page asked again draws nothing


def test_the_run_asks_for_the_charts_ahead_after_the_headroom_check_and_each_commit(tmp_path, monkeypatch):
    asked = []
    prepare = report_process.ReportJob.prepare
    monkeypatch.setattr(report_process.ReportJob, "prepare", lambda job: (asked.append(1), prepare(job)))
    cfg = config_mod.load_config(search_inputs(tmp_path / "in", out=str(tmp_path / "out"), epochs=2), [])
    job.run_job(cfg, "cpu:1", engine_factory=se.scripted_factory())
    run_dir = tmp_path / "out" / MISSION / "run"
    assert len(asked) == 1 + 2  # the headroom check, then iterations 1 and 2
    assert (run_dir / "report.html").read_text() == render_report(run_dir)
