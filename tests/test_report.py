"""report.html: written by every run, rebuilt by `stageb-pool report` from the files alone.

One scripted rule search on two forked workers (tests/doubles/scripted_engine.py: it accepts two
edits) is the material; the files another branch adds (rule_search_iterations.jsonl,
reflection_cache/proposer_answers.jsonl, judge_headroom.json) are written here with
exactly their documented fields, or left out to see the page name what is missing.
"""

from __future__ import annotations

import html
import json
import logging
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from doubles import scripted_engine as se
from doubles.run_inputs import MISSION, search_inputs
from headless import Browser, chromium

from stageb_pool.app import cli, job
from stageb_pool.app import config as config_mod
from stageb_pool.report import ReportError, render_report


def run_search(root: Path, *, gpus: str = "cpu:2", epochs: int = 8) -> Path:
    cfg = config_mod.load_config(search_inputs(root / "in", out=str(root / "out"), epochs=epochs), [])
    job.run_job(cfg, gpus, debug=(gpus == "cpu:1"), engine_factory=se.scripted_factory())
    return root / "out" / MISSION / "run"


def rows(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines()]


@pytest.fixture(scope="module")
def run_dir(tmp_path_factory) -> Path:
    return run_search(tmp_path_factory.mktemp("report"))


def with_new_files(run_dir: Path, dest: Path) -> Path:
    """A copy of the run with the three files of the other branch, in their documented shape."""
    shutil.copytree(run_dir, dest)
    summary = json.loads((dest / "summary.json").read_text())
    accepted = {b["iteration"]: b["candidate_id"] for b in rows(dest / "benchmarks.jsonl")}
    m = {"n": 60, "acc": 0.6, "fp_rate": 0.1667, "fn_rate": 0.2333}
    iterations = [{"iteration": it, "mission": MISSION, "guidance_step": 0, "guidance_hash": "0" * 16,
                   "proposer_calls": 1, "proposer_parsed": int(it != 2), "candidates_proposed": 2,
                   "candidates_rejected": {"duplicate": 1}, "candidates_evaluated": 1,
                   "decision": "accepted" if it in accepted else ("no_candidates" if it == 5 else "rejected"),
                   "accepted_candidate": accepted.get(it), "reasons": [f"reason of iteration {it}"],
                   "baseline": {"train": m, "eval": summary["baseline"]["eval"]},
                   "best_candidate": {"candidate_id": f"best-{it}", "train": m, "eval": None,
                                      "relative_error_reduction": 0.25} if it != 5 else None,
                   "guidance_step_after": 1} for it in range(1, 6)]
    (dest / "rule_search_iterations.jsonl").write_text("".join(json.dumps(r) + "\n" for r in iterations))
    answers = [{"iteration": 2, "mission": MISSION, "prompt_tokens": 123, "completion_tokens": 45,
                "finish_reason": "length", "examples_used": 4, "constrained": False, "parsed": False,
                "error": "no JSON object", "text": "Sure! Here are <my> rules"}]
    (dest / "reflection_cache" / "proposer_answers.jsonl").write_text("".join(json.dumps(r) + "\n" for r in answers))
    per_ticket = [{"key": f"T{i}", "label": "pass" if i % 2 else "fail", "p_pass": i / 20} for i in range(20)]
    (dest / "judge_headroom.json").write_text(json.dumps({
        "auc": 0.8125, "tickets": 20, "pass_share": 0.5, "labels": {"pass": 10, "fail": 10}, "mean_p_pass": 0.475,
        "min_auc": 0.6, "separates": True, "message": "the judge separates pass from fail", "per_ticket": per_ticket}))
    return dest


# -- what a run writes ---------------------------------------------------------------------
def test_a_run_writes_its_timeline_and_its_report(run_dir):
    timeline = rows(run_dir / "pool_timeline.jsonl")
    assert {tuple(r) for r in timeline} == {("rank", "device", "method", "label", "start_s", "end_s")}
    assert {r["device"] for r in timeline} == {"cpu:0", "cpu:1"}
    chats = [r["label"] for r in timeline if r["method"] == "chat"]
    # one call per iteration, plus at most one speculated ahead and wasted per accepted edit (2)
    assert set(chats) == {"proposer"} and 5 <= len(chats) <= 7
    assert "train/it1/base" in {r["label"] for r in timeline} and "train/it1/cand1" in {r["label"] for r in timeline}
    assert {r["label"] for r in timeline if r["method"] == "verdict_probabilities"} == {"headroom"}
    assert all(0 <= r["start_s"] <= r["end_s"] for r in timeline)
    workers = json.loads((run_dir / "summary.json").read_text())["workers"]
    assert [sum(1 for r in timeline if r["device"] == d) for d in workers] == [w["items"] for w in workers.values()]
    page = (run_dir / "report.html").read_text()
    assert page == render_report(run_dir)  # rebuilding gives the same bytes


def test_the_report_shows_the_artifacts_numbers_and_charts(run_dir):
    page = render_report(run_dir)
    summary = json.loads((run_dir / "summary.json").read_text())
    bench = rows(run_dir / "benchmarks.jsonl")
    assert page.count("<svg") == 4  # metrics per iteration, candidate deltas, headroom histogram, worker timeline
    assert html.escape(bench[0]["candidate_id"]) in page and html.escape(se.rule("crack")) in page
    assert f"{summary['baseline']['train']['acc']:.3f} → {summary['final']['train']['acc']:.3f}" in page
    assert f"+ G2: {html.escape(se.rule('rust'))}" in page  # the guidance diff of the first edit
    assert "RER -0.375 &lt; 0.100" in page  # the gate's reason for the harmful rule
    assert f">{summary['generations_saved']}<" in page
    spec = summary["timing"]["speculation"]  # the run speculated on its 2 workers
    assert f"Speculation: {spec['used']} of {spec['tasks']} speculative tasks used" in page
    for name in ("rule_search_iterations.jsonl", "reflection_cache/proposer_answers.jsonl", "judge_headroom.json",
                 "pool_timeline.jsonl"):
        assert f"<code>{name}</code> missing" not in page  # the run wrote them all


def test_the_new_files_fill_their_sections(run_dir, tmp_path):
    page = render_report(with_new_files(run_dir, tmp_path / "run"))
    assert page.count("<svg") == 4  # + the P(pass) histogram
    assert "Missing or unreadable files" not in page
    assert "0.812" in page and "the judge separates pass from fail" in page  # headroom AUC and message
    assert "reason of iteration 3" in page and "duplicate 1" in page  # iterations table
    assert "Sure! Here are &lt;my&gt; rules" in page and "not parsed" in page  # the proposer's answer, escaped
    assert '<td class="n">0/1</td>' in page  # proposer parsed/calls of iteration 2: its answer did not parse


def test_a_run_of_an_earlier_version_names_what_is_missing(run_dir, tmp_path):
    old = tmp_path / "old"
    shutil.copytree(run_dir, old)
    for name in ("pool_timeline.jsonl", "summary.json", "report.html", "benchmarks.jsonl", "judge_headroom.json",
                 "rule_search_iterations.jsonl", "reflection_cache/proposer_answers.jsonl"):
        (old / name).unlink()
    (old / "rule_candidates.jsonl").write_text('{"iteration": 1, "truncated')  # unreadable, not fatal
    page = render_report(old)
    for name in ("pool_timeline.jsonl", "summary.json", "judge_headroom.json", "rule_search_iterations.jsonl",
                 "reflection_cache/proposer_answers.jsonl"):
        assert f"<code>{name}</code> missing" in page
    assert "<code>rule_candidates.jsonl</code> unreadable (JSONDecodeError)" in page
    assert "<code>benchmarks.jsonl</code>" not in page  # a finished run without accepted edits has none
    assert "Nothing is recorded about the pool." in page


def test_not_a_run_is_a_report_error(tmp_path):
    with pytest.raises(ReportError, match="no such directory"):
        render_report(tmp_path / "absent")
    with pytest.raises(ReportError, match="no run.json"):
        render_report(tmp_path)


def test_a_failing_report_leaves_the_run_finished_with_a_warning(tmp_path, monkeypatch, caplog):
    def broken(run_dir):
        raise RuntimeError("no ink")

    monkeypatch.setattr(job, "render_report", broken)
    with caplog.at_level(logging.WARNING, logger="stageb_pool"):
        run_dir = run_search(tmp_path, gpus="cpu:1", epochs=1)
    assert (run_dir / "summary.json").is_file() and not (run_dir / "report.html").exists()
    assert "report.html was not written (RuntimeError: no ink)" in caplog.text


def test_the_audit_report_has_metrics_confusion_matrix_and_hard_cases(tmp_path):
    cfg = config_mod.load_config(search_inputs(tmp_path / "in", out=str(tmp_path / "out")), ["mode=audit"])
    job.run_job(cfg, "cpu:1", debug=True, engine_factory=se.scripted_factory())
    run_dir = tmp_path / "out" / MISSION / "run"
    metrics = json.loads((run_dir / "baseline_metrics.json").read_text())
    page = (run_dir / "report.html").read_text()
    assert "Confusion matrix" in page and f"{metrics['tp']} (tp)" in page and f"{metrics['fp']} (fp)" in page
    assert f"<b>{metrics['acc']:.3f}</b>" in page and "Hardest cases" in page
    assert page.count("<svg") == 3  # metrics over the run order, headroom histogram, worker timeline
    assert "Missing or unreadable files" not in page  # an audit needs no rule-search file


# -- stageb-pool report ----------------------------------------------------------------------
@pytest.fixture
def cli_logging(monkeypatch):
    """cli.main points the root logger at this test's (captured, soon closed) stderr: the
    tests after this one get the logger as it was."""
    root = logging.getLogger()
    monkeypatch.setattr(root, "handlers", list(root.handlers))
    monkeypatch.setattr(root, "level", root.level)


def test_the_report_command(run_dir, tmp_path, capsys, cli_logging):
    out = tmp_path / "r.html"
    assert cli.main(["report", str(run_dir), "-o", str(out)]) == 0
    assert out.read_text() == render_report(run_dir)
    copy = tmp_path / "copy"
    shutil.copytree(run_dir, copy)
    (copy / "report.html").unlink()
    assert cli.main(["report", str(copy)]) == 0 and (copy / "report.html").is_file()
    capsys.readouterr()
    assert cli.main(["report", str(tmp_path / "absent")]) == 2
    assert capsys.readouterr().err.strip() == f"stageb-pool: error: {tmp_path / 'absent'}: no such directory"
    assert cli.main(["report", str(tmp_path)]) == 2
    assert "not a stageb-pool run directory" in capsys.readouterr().err


def test_building_a_report_is_the_only_thing_that_imports_matplotlib(run_dir):
    code = ("import sys; import stageb_pool.app.cli, stageb_pool.app.job, stageb_pool.report; "
            "print('matplotlib' in sys.modules); from stageb_pool.report import render_report; "
            f"render_report({str(run_dir)!r}); print('matplotlib' in sys.modules)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.split() == ["False", "True"]


# -- in a real browser -------------------------------------------------------------------------
SIZES = "JSON.stringify([...document.querySelectorAll('svg')].map(s => {const r = s.getBoundingClientRect(); " \
        "return [r.width, r.height];}))"


@pytest.mark.skipif(chromium() is None, reason="chromium is not installed (apt-get install chromium; .ci/run does)")
def test_the_page_loads_offline_in_chromium_without_errors_and_its_charts_have_a_size(run_dir, tmp_path):
    page = with_new_files(run_dir, tmp_path / "run") / "report.html"
    page.write_text(render_report(page.parent))
    probe = tmp_path / "probe.html"  # the checks themselves: a page that does make a request and logs an error
    probe.write_text('<!DOCTYPE html><img src="http://report-probe.invalid/x.png">'
                     '<script>console.error("probe error")</script>')
    browser = Browser(timeout=20)
    try:
        seen = browser.load(probe)
        assert seen["requests"] == ["http://report-probe.invalid/x.png"] and "probe error" in seen["errors"]
        seen = browser.load(page, SIZES)
    finally:
        browser.close()
    assert seen["requests"] == [] and seen["errors"] == []
    sizes = json.loads(seen["value"])
    assert len(sizes) == 4 and all(w > 300 and h > 100 for w, h in sizes), sizes
