"""stageb-pool diff: structural comparison of run directories, volatile fields ignored."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from stageb_pool.app.diff import ABSENT, compare_values, diff_runs, format_differences
from stageb_pool.artifacts import ARTIFACTS, VOLATILE_KEYS
from stageb_pool.stageb.errors import InputError


def make_run(root: Path, **changes) -> Path:
    """A small run directory; ``changes`` replace whole files by name (dots as __)."""
    files = {
        "run.json": {"config": {"seed": 1, "output": {"root": str(root)}}, "invocation": {"gpus": "0", "workers": 1},
                     "version": "0.1.0"},
        "summary.json": {"iterations": 2, "timing": {"rollout_s": 1.5}, "workers": {"0": 3.0}, "finished_at": "x"},
        "guidance.json": {"M": {"step": 2, "updated_at": "2025-01-01", "experiences": {"G0": "a", "G1": "b"}}},
        "rule_candidates.jsonl": [{"iteration": 1, "timestamp": 1.0, "rer": 0.5}, {"iteration": 2, "timestamp": 2.0, "rer": 0.1}],
        "snapshots/guidance-step0001.json": {"M": {"step": 1}},
        "notes.txt": "hello\nworld\n",
    }
    for name, value in changes.items():
        files[name.replace("__", ".").replace("_SLASH_", "/")] = value
    root.mkdir(parents=True)
    for name, value in files.items():
        if value is None:
            continue
        path = root / name
        path.parent.mkdir(parents=True, exist_ok=True)
        if isinstance(value, str):
            path.write_text(value)
        elif name.endswith(".jsonl"):
            path.write_text("".join(json.dumps(r) + "\n" for r in value))
        else:
            path.write_text(json.dumps(value, indent=2) + "\n")
    return root


def test_volatile_lists_match_the_contract():
    assert VOLATILE_KEYS == {"timestamp", "updated_at", "started_at", "finished_at", "elapsed_s", "elapsed_sec"}
    inputs = ("config.stage_a_paths", "config.guidance.path", "config.prompt.profile",
              "config.rule_search.proposer_prompt_path", "config.ticket_filter.exclude_ticket_keys_path",
              "config.stage_b_distillation.log_chatml_path")
    versions = ("tool.version", "tool.format")
    assert {a.name: a.volatile for a in ARTIFACTS if a.volatile} == {
        "run.json": ("invocation", "config.output", *inputs, "config.runner.speculate", *versions),
        "state.json": ("version", "tool_version"), "summary.json": ("timing", "workers")}
    assert {a.name for a in ARTIFACTS if a.volatile_file} == {"pool_timeline.jsonl", "report.html"}


def test_identical_runs(tmp_path):
    assert diff_runs(make_run(tmp_path / "a"), make_run(tmp_path / "b")) == []


def test_volatile_fields_are_ignored(tmp_path):
    a = make_run(tmp_path / "a")
    b = make_run(
        tmp_path / "b",
        run__json={"config": {"seed": 1, "output": {"root": "/elsewhere"}}, "invocation": {"gpus": "0-7", "workers": 8,
                   "hostname": "h"}, "version": "0.1.0"},
        summary__json={"iterations": 2, "timing": {"rollout_s": 9.0}, "workers": {"0": 1.0, "1": 1.0}, "finished_at": "y"},
        rule_candidates__jsonl=[{"iteration": 1, "timestamp": 5.0, "rer": 0.5}, {"iteration": 2, "timestamp": 6.0, "rer": 0.1}],
    )
    assert diff_runs(a, b) == []


def test_the_version_that_wrote_a_run_is_not_a_result(tmp_path):
    """A run of 0.1.0 (no format, a state without tool_version) and the same run of today's
    version: identical (what a format change changes shows in the rows themselves)."""
    state = {"iteration": 2, "version": 2}
    a = make_run(tmp_path / "a", run__json={"tool": {"name": "stageb_pool", "version": "0.1.0"}, "config": {}},
                 state__json=state)
    b = make_run(tmp_path / "b", run__json={"tool": {"name": "stageb_pool", "version": "0.2.0", "format": 3},
                                            "config": {}}, state__json={**state, "version": 3, "tool_version": "0.2.0"})
    assert diff_runs(a, b) == []
    c = make_run(tmp_path / "c", run__json={"tool": {"name": "other", "version": "0.1.0"}, "config": {}},
                 state__json={**state, "iteration": 3})
    assert [(d.file, d.key) for d in diff_runs(a, c)] == [("run.json", "tool.name"), ("state.json", "iteration")]


def test_the_timeline_and_the_report_are_ignored_whole_even_on_one_side_only(tmp_path):
    a = make_run(tmp_path / "a", pool_timeline__jsonl=[{"rank": 0, "start_s": 0.1}], report__html="<p>a</p>")
    b = make_run(tmp_path / "b", pool_timeline__jsonl=[{"rank": 1, "start_s": 0.2}, {"rank": 0, "start_s": 0.3}])
    assert diff_runs(a, b) == []


def test_a_changed_value_is_reported_with_file_line_and_key(tmp_path):
    a = make_run(tmp_path / "a")
    b = make_run(tmp_path / "b", rule_candidates__jsonl=[{"iteration": 1, "timestamp": 1.0, "rer": 0.5},
                                                         {"iteration": 2, "timestamp": 2.0, "rer": 0.2}])
    [d] = diff_runs(a, b)
    assert (d.file, d.where, d.key, d.a, d.b) == ("rule_candidates.jsonl", "line 2", "rer", 0.1, 0.2)


def test_volatile_key_name_only_protects_that_key(tmp_path):
    a = make_run(tmp_path / "a")
    b = make_run(tmp_path / "b", guidance__json={"M": {"step": 2, "updated_at": "later", "experiences": {"G0": "a", "G1": "c"}}})
    [d] = diff_runs(a, b)
    assert (d.file, d.key, d.a, d.b) == ("guidance.json", "M.experiences.G1", "b", "c")


def test_non_volatile_part_of_run_json_is_compared(tmp_path):
    a = make_run(tmp_path / "a")
    b = make_run(tmp_path / "b", run__json={"config": {"seed": 2, "output": {}}, "invocation": {}, "version": "0.1.0"})
    [d] = diff_runs(a, b)
    assert (d.file, d.key, d.a, d.b) == ("run.json", "config.seed", 1, 2)


def test_int_and_float_differ(tmp_path):
    a = make_run(tmp_path / "a")
    b = make_run(tmp_path / "b", summary__json={"iterations": 2.0, "timing": {}, "workers": {}})
    [d] = diff_runs(a, b)
    assert d.key == "iterations"


def test_missing_and_extra_files(tmp_path):
    a = make_run(tmp_path / "a")
    b = make_run(tmp_path / "b", notes__txt=None, extra__json={})
    diffs = diff_runs(a, b)
    assert [(d.file, d.a, d.b) for d in diffs] == [("extra.json", ABSENT, "present"), ("notes.txt", "present", ABSENT)]


def test_extra_jsonl_row_and_text_line(tmp_path):
    a = make_run(tmp_path / "a")
    b = make_run(tmp_path / "b", notes__txt="hello\nthere\n",
                 rule_candidates__jsonl=[{"iteration": 1, "timestamp": 1.0, "rer": 0.5},
                                         {"iteration": 2, "timestamp": 2.0, "rer": 0.1}, {"iteration": 3}])
    diffs = diff_runs(a, b)
    assert [(d.file, d.where) for d in diffs] == [("notes.txt", "line 2"), ("rule_candidates.jsonl", "line 3")]
    assert diffs[0].a == "world" and diffs[0].b == "there"
    assert diffs[1].a is ABSENT


def test_byte_difference_without_line_difference(tmp_path):
    a = make_run(tmp_path / "a")
    b = make_run(tmp_path / "b", notes__txt="hello\r\nworld\r\n")
    [d] = diff_runs(a, b)
    assert d.file == "notes.txt"


def test_limit_caps_the_report(tmp_path):
    rows = [{"i": i} for i in range(30)]
    a = make_run(tmp_path / "a", rule_candidates__jsonl=rows)
    b = make_run(tmp_path / "b", rule_candidates__jsonl=[{"i": -i} for i in range(1, 31)])
    assert len(diff_runs(a, b, limit=5)) == 5
    assert len(diff_runs(a, b, limit=None)) == 30


def test_compare_values_nested_and_lists():
    a = {"x": [1, {"y": 2, "timestamp": 1}], "z": 1}
    b = {"x": [1, {"y": 3, "timestamp": 2}, 4], "w": 0}
    assert list(compare_values(a, b)) == [("x[1].y", 2, 3), ("x[2]", ABSENT, 4), ("z", 1, ABSENT), ("w", ABSENT, 0)]


def test_not_a_directory_is_input_error(tmp_path):
    a = make_run(tmp_path / "a")
    with pytest.raises(InputError) as info:
        diff_runs(a, tmp_path / "missing")
    assert info.value.location == str(tmp_path / "missing")


def test_format_names_both_values(tmp_path):
    a = make_run(tmp_path / "a")
    b = make_run(tmp_path / "b", summary__json={"iterations": 3, "timing": {}, "workers": {}})
    text = format_differences(diff_runs(a, b), "A", "B")
    assert "summary.json iterations" in text and "A: 2" in text and "B: 3" in text


PREFIX = '{"iterations": '
DEEP = PREFIX + "[" * 1000 + "]" * 1000 + "}"


def test_json_nested_deeper_than_any_artifact_is_located_not_a_recursion_error(tmp_path):
    a = make_run(tmp_path / "a")
    b = make_run(tmp_path / "b", summary__json=DEEP)
    with pytest.raises(InputError) as info:
        diff_runs(a, b)
    assert info.value.location == f"{b / 'summary.json'}:1:{len(PREFIX) + 200}"
    assert "nested deeper than 200 levels" in info.value.message


def test_a_deep_jsonl_line_is_located_at_its_line(tmp_path):
    a = make_run(tmp_path / "a")
    b = make_run(tmp_path / "b", rule_candidates__jsonl=[{"iteration": 1}, json.loads('{"x": ' + "[" * 300 + "]" * 300 + "}")])
    with pytest.raises(InputError) as info:
        diff_runs(a, b)
    assert info.value.location.startswith(f"{b / 'rule_candidates.jsonl'}:2:")


def test_json_nested_as_deep_as_an_artifact_may_be_is_compared(tmp_path):
    deep = "[" * 199 + "]" * 199  # 200 levels with the object around it
    a = make_run(tmp_path / "a", summary__json=f'{{"x": 1, "y": {deep}}}')
    b = make_run(tmp_path / "b", summary__json=f'{{"x": 2, "y": {deep}}}')
    assert [(d.file, d.key) for d in diff_runs(a, b)] == [("summary.json", "x")]


def test_a_fifo_in_a_run_directory_is_refused_without_opening_it(tmp_path):
    a = make_run(tmp_path / "a")
    b = make_run(tmp_path / "b", notes__txt=None)
    os.mkfifo(b / "notes.txt")
    env = dict(os.environ, HF_HUB_OFFLINE="1")
    proc = subprocess.run([sys.executable, "-m", "stageb_pool.app.cli", "diff", str(a), str(b)], capture_output=True,
                          text=True, env=env, timeout=60)  # a regression blocks on the FIFO: fail, do not hang
    assert proc.returncode == 2 and "Traceback" not in proc.stderr, proc.stderr[-2000:]
    assert proc.stderr.strip().splitlines() == [f"stageb-pool: error: {b / 'notes.txt'}: the run file is not a regular file"]
