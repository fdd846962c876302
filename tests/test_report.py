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
import os
import resource
import shutil
import socket
import stat
import subprocess
import sys
from html.parser import HTMLParser
from pathlib import Path

import pytest
from doubles import scripted_engine as se
from doubles.run_inputs import MISSION, search_inputs
from headless import Browser, chromium

from stageb_pool.app import cli, job
from stageb_pool.app import config as config_mod
from stageb_pool.report import ReportError, files, load_chart_libraries, render_report

REPO = Path(__file__).resolve().parents[1]


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
    assert "<code>rule_candidates.jsonl</code> unreadable (line 1: not JSON (Input data was truncated))" in page
    assert "<code>benchmarks.jsonl</code>" not in page  # a finished run without accepted edits has none
    assert "Nothing is recorded about the pool." in page


def test_not_a_run_is_a_report_error(tmp_path):
    with pytest.raises(ReportError, match="no such directory"):
        render_report(tmp_path / "absent")
    with pytest.raises(ReportError, match="no run.json"):
        render_report(tmp_path)


@pytest.mark.parametrize("chart", ["metrics_per_iteration", "worker_timeline"])  # drawn by a child, by the process
def test_a_failing_report_leaves_the_run_finished_with_a_warning(tmp_path, monkeypatch, caplog, chart):
    def broken(*args):
        raise RuntimeError("no ink")

    monkeypatch.setattr(load_chart_libraries(), chart, broken)  # the report's process inherits it
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


# -- stageb-pool report -o: a report and nothing else (issue 32) --------------------------------
def report_command(*args: str, env: dict | None = None, timeout: float = 120) -> subprocess.CompletedProcess:
    """``stageb-pool report ARGS`` as a real process; its address space is capped (3 GiB), so
    that a report that did read /dev/zero fails with a MemoryError instead of filling the machine."""
    def cap_memory():
        resource.setrlimit(resource.RLIMIT_AS, (3 << 30, 3 << 30))

    return subprocess.run([sys.executable, "-m", "stageb_pool", "report", *args], capture_output=True,
                          env={**os.environ, "PYTHONPATH": str(REPO), **(env or {})}, timeout=timeout,
                          preexec_fn=cap_memory)


def one_error_line(proc: subprocess.CompletedProcess, *words: str) -> str:
    err = proc.stderr.decode()
    assert proc.returncode == 2 and "Traceback" not in err, (proc.returncode, err)
    lines = err.splitlines()
    assert len(lines) == 1 and lines[0].startswith("stageb-pool: error: "), err
    assert all(w in lines[0] for w in words), lines[0]
    return lines[0]


def entry(path) -> tuple:
    """What a path is, without following a link: kind, inode, device number, size, mtime, and a
    regular file's bytes."""
    info = os.lstat(path)
    data = Path(path).read_bytes() if stat.S_ISREG(info.st_mode) else None
    return stat.S_IFMT(info.st_mode), info.st_ino, info.st_rdev, info.st_size, info.st_mtime_ns, data


def test_report_o_writes_a_new_file_over_a_previous_report_or_to_stdout(run_dir, tmp_path):
    page = render_report(run_dir).encode()
    own = entry(run_dir / "report.html")
    out = tmp_path / "r.html"
    assert report_command(str(run_dir), "-o", str(out)).returncode == 0 and out.read_bytes() == page
    out.write_bytes(page.replace(b"Overview", b"An older overview"))  # a previous report, of another version
    again = report_command(str(run_dir), "-o", str(out))
    assert again.returncode == 0 and out.read_bytes() == page
    assert again.stderr.decode() == f"wrote {out}\n"
    to_stdout = report_command(str(run_dir), "-o", "-")
    assert to_stdout.returncode == 0 and to_stdout.stdout == page and to_stdout.stderr == b""
    assert entry(run_dir / "report.html") == own and sorted(os.listdir(tmp_path)) == ["r.html"]


def test_report_o_refuses_whatever_is_not_a_new_file_or_a_previous_report(run_dir, tmp_path):
    run = tmp_path / "run"
    shutil.copytree(run_dir, run)
    previous = tmp_path / "previous.html"
    previous.write_bytes((run / "report.html").read_bytes())
    targets = {"fifo": "is a FIFO", "sock": "is a socket", "link.html": "is a symbolic link",
               "notes.txt": "exists and is not a stageb-pool report", "folder": "is a folder"}
    os.mkfifo(tmp_path / "fifo")
    server = socket.socket(socket.AF_UNIX)
    server.bind(str(tmp_path / "sock"))
    server.close()  # the socket file stays
    (tmp_path / "link.html").symlink_to(previous)  # even a link to a report: the rename would replace the link
    (tmp_path / "notes.txt").write_text("my notes\n")
    (tmp_path / "folder").mkdir()
    for name in ("state.json", "snapshots/guidance-step0001.json", "extra.html"):  # in the run: only report.html
        targets[f"run/{name}"] = "is in the run directory"
    before = {name: entry(tmp_path / name) for name in targets if (tmp_path / name).exists()}
    listing = sorted(p.relative_to(tmp_path) for p in tmp_path.rglob("*"))
    for name, words in targets.items():
        one_error_line(report_command(str(run), "-o", str(tmp_path / name)), f"{tmp_path / name}: {words}")
    assert {name: entry(tmp_path / name) for name in before} == before
    assert sorted(p.relative_to(tmp_path) for p in tmp_path.rglob("*")) == listing  # no new file, no temp file left
    one_error_line(report_command(str(run), "-o", str(tmp_path / "no" / "such" / "r.html")),
                   f"no folder {tmp_path / 'no' / 'such'} (the report creates none")
    assert not (tmp_path / "no").exists()
    assert report_command(str(run), "-o", str(run / "report.html")).returncode == 0  # the run's own report


def test_report_o_dev_null_is_refused_and_stays_a_device(run_dir, tmp_path):
    # /dev/null takes the same path as a FIFO: shown first, so that this test never hands
    # /dev/null to a report that would replace it (as root, the old code did)
    os.mkfifo(tmp_path / "fifo")
    one_error_line(report_command(str(run_dir), "-o", str(tmp_path / "fifo")), "is a FIFO")
    before = os.lstat("/dev/null")
    assert stat.S_ISCHR(before.st_mode)
    one_error_line(report_command(str(run_dir), "-o", "/dev/null"), "/dev/null: is a character device")
    after = os.lstat("/dev/null")
    assert stat.S_ISCHR(after.st_mode) and (after.st_ino, after.st_rdev) == (before.st_ino, before.st_rdev)


# -- report reads only what it can (issue 32) ----------------------------------------------------
def edit_rows(path: Path, edit) -> None:
    path.write_text("".join(json.dumps(r) + "\n" for r in edit(rows(path))))


def without(row: dict, key: str) -> dict:
    return {k: v for k, v in row.items() if k != key}


ODD_FILES = {  # what is done to a copy of the run, the note the page must carry (None: none)
    "a null row": (lambda run: edit_rows(run / "rule_candidates.jsonl", lambda rs: [rs[0], None, *rs[1:]]),
                   "<code>rule_candidates.jsonl</code> unreadable (line 2: Expected `object`, got `null`)"),
    "a candidate without iteration": (
        lambda run: edit_rows(run / "rule_candidates.jsonl", lambda rs: [rs[0], without(rs[1], "iteration")]),
        "<code>rule_candidates.jsonl</code> unreadable (line 2: Object missing required field `iteration`)"),
    "d_acc null": (lambda run: edit_rows(run / "rule_candidates.jsonl", lambda rs: [{**rs[0], "d_acc": None}]), None),
    "a string guidance section": (lambda run: (run / "guidance.json").write_text(json.dumps({MISSION: "rules"})),
                                  "<code>guidance.json</code> unreadable ($[...]: Expected `object`, got `str`)"),
    "a timeline row without device": (
        lambda run: edit_rows(run / "pool_timeline.jsonl", lambda rs: [without(rs[0], "device"), *rs[1:]]),
        "<code>pool_timeline.jsonl</code> unreadable (line 1: Object missing required field `device`)"),
    "summary.json holding a list": (lambda run: (run / "summary.json").write_text("[1, 2]\n"),
                                    "<code>summary.json</code> unreadable (Expected `object`, got `array`)"),
    "summary.json over the size cap": (lambda run: os.truncate(run / "summary.json", files.MAX_FILE_BYTES + 1),
                                       "<code>summary.json</code> unreadable (larger than 256 MiB)"),
}


@pytest.mark.parametrize("case", ODD_FILES)
def test_an_odd_file_is_left_out_with_its_line_and_the_rest_is_shown(run_dir, tmp_path, case):
    run = tmp_path / "run"
    shutil.copytree(run_dir, run)
    change, note = ODD_FILES[case]
    change(run)
    page = render_report(run)
    for anchor in ("overview", "iterations", "candidates", "guidance", "proposer", "pool"):
        assert f'<section id="{anchor}">' in page
    if note is None:
        assert "Missing or unreadable files" not in page and '<td class="n">–</td>' in page  # d_acc shown as –
    else:
        assert note in html.unescape(page), case


def test_a_fifo_or_a_link_out_of_the_run_is_not_read_and_a_link_inside_is(run_dir, tmp_path):
    run = tmp_path / "run"
    shutil.copytree(run_dir, run)
    summary = run / "summary.json"
    cases = {"fifo": (lambda: os.mkfifo(summary), "(not a regular file)"),
             "/dev/zero": (lambda: summary.symlink_to("/dev/zero"), "(outside the run directory, through a symbolic link)"),
             "a link inside": (lambda: summary.symlink_to("summary-copy.json"), None)}
    (run / "summary-copy.json").write_bytes(summary.read_bytes())
    for case, (make, note) in cases.items():
        summary.unlink()
        make()
        proc = report_command(str(run), "-o", str(tmp_path / "r.html"), timeout=60)  # a hang: TimeoutExpired
        assert proc.returncode == 0, (case, proc.stderr.decode())
        page = (tmp_path / "r.html").read_text()
        if note:
            assert f"<code>summary.json</code> unreadable {note}" in page, case
        else:
            assert "Missing or unreadable files" not in page and page.replace("summary-copy", "summary") == page


# -- every interpolated value is escaped (issue 32) ----------------------------------------------
PAYLOADS = ['<meta http-equiv=refresh content="0;url=http://report-probe.invalid/">', '"><img src=x>',
            "'><svg onload=alert(1)>", "</pre></details></table><script>alert(1)</script>", "a\x00b",
            "\u202egnp.exe", "$\\frac{", "&lt;b&gt;", "\u2066x\u2069\u202a"]
KEPT = {"mode", "sampler"}  # which sections exist: left as they are so that every section is drawn
MAPS = {"experiences", "candidates_rejected", "workers", "timing"}  # objects whose keys are shown


def poisoned(value, counter: list, key: str | None = None):
    """``value`` with every string (and the keys of the maps the page shows) replaced by a payload."""
    def payload():
        counter[0] += 1
        return f"{PAYLOADS[counter[0] % len(PAYLOADS)]}{counter[0]}"

    if isinstance(value, str):
        return value if key in KEPT else payload()
    if isinstance(value, list):
        return [poisoned(v, counter) for v in value]
    if isinstance(value, dict):
        return {(payload() if key in MAPS or key == "<guidance>" else k): poisoned(v, counter, k)
                for k, v in value.items()}
    return value


def poison_run(run: Path) -> None:
    counter = [0]
    for path in sorted(p for p in run.rglob("*") if p.is_file() and p.suffix in (".json", ".jsonl")):
        guidance = path.name == "guidance.json" or path.parent.name == "snapshots"
        if path.suffix == ".json":
            path.write_text(json.dumps(poisoned(json.loads(path.read_text()), counter, "<guidance>" if guidance else None)))
        else:
            edit_rows(path, lambda rs: [poisoned(r, counter) for r in rs])


class Markup(HTMLParser):
    """The elements and attributes of a page (tag, attribute name), and the values of the
    attributes that could load or redirect something."""

    def __init__(self, page: str):
        super().__init__()
        self.shape: set[tuple[str, str | None]] = set()
        self.values: set[tuple[str, str | None]] = set()
        self.feed(page)

    def handle_starttag(self, tag, attrs):
        self.shape.add((tag, None))
        for name, value in attrs:
            self.shape.add((tag, name))
            if name in ("href", "xlink:href"):  # a link within the page ("#anchor", a chart's "#marker-id") or not
                self.values.add((name, "#..." if value.startswith("#") else value))
            elif name in ("src", "http-equiv", "content"):
                self.values.add((name, value))


@pytest.fixture(scope="module")
def hostile_runs(run_dir, tmp_path_factory) -> dict[str, tuple[Path, Path]]:
    """(clean, poisoned) copies of the search run (with the new files) and of an audit."""
    root = tmp_path_factory.mktemp("hostile")
    cfg = config_mod.load_config(search_inputs(root / "in", out=str(root / "out")), ["mode=audit"])
    job.run_job(cfg, "cpu:1", debug=True, engine_factory=se.scripted_factory())
    runs = {"search": with_new_files(run_dir, root / "search-clean"), "audit": root / "out" / MISSION / "run"}
    out = {}
    for mode, clean in runs.items():
        bad = root / f"{mode}-poisoned"
        shutil.copytree(clean, bad)
        poison_run(bad)
        out[mode] = (clean, bad)
    # markup where a number belongs: the fields the page once interpolated as they were
    clean = runs["search"]
    bad = root / "numbers-poisoned"
    shutil.copytree(clean, bad)
    edit_rows(bad / "benchmarks.jsonl", lambda rs: [{**r, "guidance_step_before": PAYLOADS[0],
                                                      "guidance_step_after": PAYLOADS[1]} for r in rs])
    headroom = json.loads((bad / "judge_headroom.json").read_text())
    (bad / "judge_headroom.json").write_text(json.dumps({**headroom, "labels": {"pass": PAYLOADS[0], "fail": PAYLOADS[1]}}))
    out["numbers"] = (clean, bad)
    return out


@pytest.mark.parametrize("mode", ["search", "audit", "numbers"])
def test_markup_in_every_string_of_a_run_stays_text(hostile_runs, mode):
    clean, bad = hostile_runs[mode]
    clean_page, page = render_report(clean), render_report(bad)
    for markup in ("<meta http-equiv=refresh", "<img src=x>", "<svg onload", "<script>"):
        assert markup not in page
        assert mode == "numbers" or html.escape(markup) in page  # shown as text
    if mode == "numbers":  # a string where a number belongs: the file is left out, and says where
        assert "<code>benchmarks.jsonl</code> unreadable (line 1, $.guidance_step_before: Expected `int | null`, " \
               "got `str`)" in page
        assert "<code>judge_headroom.json</code> unreadable ($.labels.pass: Expected `int | null`, got `str`)" in page
    else:
        assert "Missing or unreadable files" not in page  # every file read: the payloads reached the page
        assert page.count("<svg") == clean_page.count("<svg")
    shown, expected = Markup(page), Markup(clean_page)
    expected.shape |= {("span", None), ("span", "title")}  # a long text cut short (markup.short): payloads add up
    if mode == "numbers":
        expected.shape |= {("ul", None), ("li", None), ("code", None)}  # the list of the files left out
    assert shown.shape <= expected.shape, shown.shape - expected.shape
    assert shown.values <= expected.values, shown.values - expected.values
    for char in ("\x00", "\u202e", "\u2066", "\u2069", "\u202a"):
        assert char not in page
    assert mode == "numbers" or ("\\u202egnp.exe" in page and "a\\u0000b" in page)  # shown, as escapes


@pytest.mark.skipif(chromium() is None, reason="chromium is not installed (apt-get install chromium; .ci/run does)")
def test_a_poisoned_run_loads_in_chromium_without_a_request_or_an_error(hostile_runs, tmp_path):
    browser = Browser(timeout=30)
    try:
        for mode, (_, bad) in hostile_runs.items():  # search, audit, numbers
            page = tmp_path / f"{mode}.html"
            page.write_text(render_report(bad))
            seen = browser.load(page, "document.querySelectorAll('img, script, iframe, meta[http-equiv=refresh]').length")
            assert (seen["requests"], seen["errors"], seen["value"]) == ([], [], 0), mode
    finally:
        browser.close()


# -- matplotlib's files (issue 32) ---------------------------------------------------------------
def test_a_report_leaves_no_matplotlib_files_in_home_or_in_the_temporary_folder(run_dir, tmp_path):
    home, tmp = tmp_path / "home", tmp_path / "tmp"
    home.mkdir()
    tmp.mkdir()
    env = {"HOME": str(home), "TMPDIR": str(tmp)}
    for name in ("XDG_CONFIG_HOME", "XDG_CACHE_HOME", "MPLCONFIGDIR"):
        env[name] = ""  # unset for matplotlib: an empty value counts as none
    proc = report_command(str(run_dir), "-o", str(tmp_path / "r.html"), env=env)
    assert proc.returncode == 0, proc.stderr.decode()
    assert (tmp_path / "r.html").read_text() == render_report(run_dir)
    assert list(home.rglob("*")) == [] and list(tmp.rglob("*")) == []


@pytest.mark.parametrize("iterations", [[1], [2, 5]])
def test_the_candidates_chart_keeps_half_an_iteration_either_side(monkeypatch, iterations):
    """Candidates of one iteration sit around its tick (their offsets are a few hundredths),
    not at the two edges of the plot."""
    from stageb_pool.report import charts

    figures = []
    monkeypatch.setattr(charts, "_svg", lambda fig, name, label: figures.append(fig) or "")
    cands = [{"iteration": it, "offset": offset, "d_acc": 0.0, "decision": "rejected", "applied": False}
             for it in iterations for offset in (-0.04, 0.04)]
    charts.candidate_deltas(cands)
    assert figures[0].axes[0].get_xlim() == (iterations[0] - 0.5, iterations[-1] + 0.5)


def test_the_timeline_draws_each_kind_as_one_collection_with_the_proposer_on_top(monkeypatch):
    """One collection per kind of task over all workers (an artist per worker and kind made a
    64-worker page wait for it); intervals of a kind closer than 1/2000 of the run are one bar."""
    from matplotlib.colors import to_hex

    from stageb_pool.report import charts

    figures = []
    monkeypatch.setattr(charts, "_svg", lambda fig, name, label: figures.append(fig) or "")
    rows = [dict(worker="w0", start_s=0.0, end_s=1.0, kind="train"),
            dict(worker="w0", start_s=1.001, end_s=2.0, kind="train"),  # 1 ms after: the same bar
            dict(worker="w1", start_s=0.5, end_s=1.5, kind="proposer"),
            dict(worker="w1", start_s=1.6, end_s=2.5, kind="eval"),
            dict(worker="w0", start_s=2.6, end_s=3.0, kind="eval")]
    charts.worker_timeline(rows, ["w0", "w1"], 3.0)
    collections = figures[0].axes[0].collections
    assert [to_hex(c.get_facecolor()[0]) for c in collections] == [
        charts.COLORS["train"], charts.COLORS["eval"], charts.COLORS["proposer"]]
    bars = [[[tuple(point) for point in path.vertices[:4]] for path in c.get_paths()] for c in collections]
    assert bars == [
        [[(0.0, -0.35), (0.0, 0.35), (2.0, 0.35), (2.0, -0.35)]],
        [[(2.6, -0.35), (2.6, 0.35), (3.0, 0.35), (3.0, -0.35)], [(1.6, 0.65), (1.6, 1.35), (2.5, 1.35), (2.5, 0.65)]],
        [[(0.5, 0.65), (0.5, 1.35), (1.5, 1.35), (1.5, 0.65)]]]
