"""The list of artifacts (stageb_pool/artifacts.py): a new file is one entry there plus its
writer, and ``diff``, the report and a resume take it from the list."""

from __future__ import annotations

import ast
import html
import json
import re
from pathlib import Path

import msgspec
import pytest

from stageb_pool import artifacts
from stageb_pool.app.diff import diff_runs
from stageb_pool.report import render_report
from stageb_pool.search.fileio import write_jsonl
from stageb_pool.stageb.errors import InputError

PACKAGE = Path(artifacts.__file__).parent


class ScoreRow(msgspec.Struct):
    """The row of the new artifact."""

    ticket_key: str
    score: float
    detail: dict  # detail.seconds is volatile


SCORES = artifacts.Artifact(name="ticket_scores.jsonl", writer="this test", record=ScoreRow, rows=True,
                            volatile=("detail.seconds",))
TRACE = artifacts.Artifact(name="trace.log", writer="this test", volatile_file=True)


def write_scores(run_dir: Path, rows: list[ScoreRow]) -> None:
    """The new artifact's writer."""
    write_jsonl(run_dir / SCORES.name, rows)


def small_run(root: Path, *, score: float = 0.5, seconds: float = 1.0, trace: str | None = None) -> Path:
    root.mkdir(parents=True)
    (root / artifacts.RUN.name).write_text(json.dumps({"tool": {"name": "stageb_pool"}}) + "\n")
    write_scores(root, [ScoreRow("T1", 0.25, {"seconds": 2.0}), ScoreRow("T2", score, {"seconds": seconds})])
    if trace is not None:
        (root / TRACE.name).write_text(trace)
    return root


@pytest.fixture
def registered(monkeypatch):
    monkeypatch.setattr(artifacts, "ARTIFACTS", (*artifacts.ARTIFACTS, SCORES, TRACE))


def test_diff_takes_a_new_artifacts_volatile_fields_from_its_entry(tmp_path, registered):
    base = small_run(tmp_path / "base", trace="worker 0 started")
    slower = small_run(tmp_path / "slower", seconds=9.5)  # and no trace.log
    other = small_run(tmp_path / "other", score=0.75)
    assert diff_runs(base, slower) == []
    [d] = diff_runs(base, other)
    assert (d.file, d.where, d.key, d.a, d.b) == (SCORES.name, "line 2", "score", 0.5, 0.75)


def test_without_its_entry_the_new_artifacts_volatile_fields_count(tmp_path):
    found = diff_runs(small_run(tmp_path / "base", trace="a"), small_run(tmp_path / "slower", seconds=9.5))
    assert [(d.file, d.key) for d in found] == [(SCORES.name, "detail.seconds"), (TRACE.name, "(file)")]


def test_the_report_reads_a_new_artifact_through_its_record(tmp_path, monkeypatch):
    run = small_run(tmp_path / "run")
    with (run / SCORES.name).open("a") as f:
        f.write(json.dumps({"ticket_key": "T3", "score": "high", "detail": {}}) + "\n")
    note = f"<code>{SCORES.name}</code> unreadable (line 3, $.score: Expected `float`, got `str`): left out"
    assert note not in html.unescape(render_report(run))  # not registered: not read
    monkeypatch.setattr(artifacts, "ARTIFACTS", (*artifacts.ARTIFACTS, SCORES))
    assert note in html.unescape(render_report(run))
    (run / SCORES.name).write_bytes(b"".join(msgspec.json.encode(r) + b"\n" for r in (ScoreRow("T1", 1, {}),)))
    assert SCORES.name not in render_report(run)  # of its record's shape: nothing to say


def test_every_file_name_is_a_constant_of_one_module():
    """A string constant that is a run file's name (or a path ending in one) is in artifacts.py
    only, besides the CLI's help text; prose that mentions a file is not a name."""
    names = {a.name.rsplit("/", 1)[-1] for a in artifacts.ARTIFACTS}
    offenders = []
    for path in sorted(PACKAGE.rglob("*.py")):
        where = path.relative_to(PACKAGE).as_posix()
        if where in ("artifacts.py", "app/cli.py"):
            continue
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            if isinstance(node, ast.Constant) and isinstance(node.value, str) and (
                    node.value.rsplit("/", 1)[-1] in names or "guidance-step" in node.value[:15]):
                offenders.append(f"{where}:{node.lineno} {node.value!r}")
    assert offenders == []  # take the name from artifacts.py


def test_a_committed_row_of_the_wrong_shape_is_a_located_refusal_on_resume(tmp_path):
    from doubles import run_inputs
    from doubles import scripted_engine as se

    from stageb_pool.app import config as config_mod
    from stageb_pool.app import job

    cfg = config_mod.load_config(run_inputs.search_inputs(tmp_path / "in", out=str(tmp_path / "out")))
    with pytest.raises(se.ScriptedCrash):
        job.run_job(cfg, "cpu:1", debug=True, engine_factory=se.scripted_factory(crash_at=2))
    path = tmp_path / "out" / run_inputs.MISSION / "run" / artifacts.ITERATIONS.name
    data = path.read_bytes()
    decision = re.search(rb'"decision":("[a-z_]+")', data)
    assert decision and data.count(b"\n") == 1  # the one committed iteration
    number = b"1" * len(decision.group(1))  # same length: the committed length still ends the row
    path.write_bytes(data[:decision.start(1)] + number + data[decision.end(1):])
    with pytest.raises(InputError) as err:
        job.run_job(cfg, "cpu:1", debug=True, engine_factory=se.scripted_factory(), resume=True)
    assert err.value.message == (f"cannot resume: a committed row of {artifacts.ITERATIONS.name} is not one this "
                                 "program wrote (Expected `str`, got `int`)")
    assert err.value.location == f"{path}:1: decision"
