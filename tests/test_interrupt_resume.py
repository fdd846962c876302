"""Ctrl-C, failed writes and --resume through the real command line (promises 2 and 4).

A rule search on the tiny model is interrupted with SIGINT once its first iteration is
committed: the command must exit 130 within seconds and leave no process behind; then
``--resume`` must reach exactly the artifacts of an uninterrupted run (``stageb-pool diff``).
A write that fails (a file size limit standing in for a full disk) must name the file and
exit 1, and leave a run that resumes to the same result; an output.root the system refuses
is bad input (exit 2).
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from processes import CORES, descendants, gone, pinned

REPO = Path(__file__).resolve().parents[1]
DEMO = REPO / "configs" / "demo"
SETTINGS = [  # small but long enough (a few seconds per iteration) to be interrupted in the middle
    "model.path=tiny", "runner.epochs=6", "runner.chunk_size=4", "rule_search.early_stop.patience=6",
    "rule_search.train_pool_size=40", "rule_search.eval_pool_size=16",
    "rule_search.train_sampler.grid=[{temperature: 0.7, top_p: 0.9, max_new_tokens: 48}]",
    "rule_search.eval_sampler.grid=[{temperature: 0.7, top_p: 0.9, max_new_tokens: 48}]",
]


def command(root: Path, name: str, *extra: str, gpus: str = "cpu:2") -> list[str]:
    sets = [arg for s in SETTINGS + [f"output.root={root}", f"output.run_name={name}"] for arg in ("--set", s)]
    return [sys.executable, "-m", "stageb_pool.app.cli", "--gpus", gpus, str(REPO / "configs" / "demo.yaml"), *sets, *extra]


def env() -> dict:
    return dict(os.environ, PYTHONPATH=str(REPO), HF_HUB_OFFLINE="1")


def wait_for_committed_iteration(state: Path, proc: subprocess.Popen, deadline_s: float) -> int:
    deadline = time.monotonic() + deadline_s
    while time.monotonic() < deadline and proc.poll() is None:
        try:
            done = json.loads(state.read_text())["iteration"]
        except (OSError, ValueError, KeyError):
            done = 0
        if done >= 1:
            return done
        time.sleep(0.02)
    raise AssertionError(f"no committed iteration in {state} (exit code {proc.poll()})")


def test_ctrl_c_then_resume_reaches_the_uninterrupted_result(tmp_path):
    mission_dir = tmp_path / "Rooftop antenna mount inspection"
    proc = subprocess.Popen(command(tmp_path, "interrupted"), env=env(), stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True)
    wait_for_committed_iteration(mission_dir / "interrupted" / "state.json", proc, 120)
    children = descendants(proc.pid)
    assert children, "the run should have a zygote and workers"
    sent = time.monotonic()
    proc.send_signal(signal.SIGINT)
    _, err = proc.communicate(timeout=10)
    assert proc.returncode == 130, err[-2000:]
    assert time.monotonic() - sent < 5
    assert all(gone(p) for p in children), [p for p in children if not gone(p)]
    assert json.loads((mission_dir / "interrupted" / "state.json").read_text())["iteration"] < 6, \
        "the run finished before the interrupt; make it longer"

    resumed = subprocess.run(command(tmp_path, "interrupted", "--resume"), env=env(), capture_output=True,
                             text=True, timeout=300)
    assert resumed.returncode == 0, resumed.stderr[-2000:]
    # The uninterrupted run on one worker seeing every core (the interrupted one had two
    # workers): a worker's thread count follows neither, so the floats behind every verdict agree.
    with pinned(CORES):
        straight = subprocess.run(command(tmp_path, "straight", gpus="cpu:1"), env=env(), capture_output=True,
                                  text=True, timeout=300)
    assert straight.returncode == 0, straight.stderr[-2000:]

    diff = subprocess.run([sys.executable, "-m", "stageb_pool.app.cli", "diff", str(mission_dir / "interrupted"),
                           str(mission_dir / "straight")], env=env(), capture_output=True, text=True, timeout=60)
    # Only the run name (part of config.output, volatile) differs: everything the search
    # decided and counted must be identical (the generation counts continue from state.json).
    assert diff.returncode == 0, diff.stdout + diff.stderr


# ----------------------------------------------------------------------------- write failures

TESTS = REPO / "tests"
# The CLI in a child whose files may not grow past LIMIT bytes (RLIMIT_FSIZE: a write beyond it
# fails with EFBIG, as a full disk fails with ENOSPC), with the scripted engine in place of a model.
DRIVER = """
import resource, signal, sys
sys.path[:0] = [{tests!r}]
limit = int(sys.argv.pop(1))
if limit:
    signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
    resource.setrlimit(resource.RLIMIT_FSIZE, (limit, limit))
from doubles import scripted_engine as se
from stageb_pool.app import cli, job
job.engine_factory_for = lambda model, path: se.scripted_factory()
sys.exit(cli.main(sys.argv[1:]))
"""


def scripted_cli(limit: int, *args: str) -> subprocess.CompletedProcess:
    code = DRIVER.format(tests=str(TESTS))
    return subprocess.run([sys.executable, "-c", code, str(limit), *args], env=env(), capture_output=True,
                          text=True, timeout=300)


def test_a_failed_write_names_the_file_exits_1_and_the_run_resumes_to_the_same_result(tmp_path):
    from doubles.run_inputs import MISSION, search_inputs

    cfg = search_inputs(tmp_path / "in", out=str(tmp_path / "out"))
    straight = scripted_cli(0, "--gpus", "cpu:1", "--debug", cfg, "--set", "output.run_name=straight")
    assert straight.returncode == 0, straight.stderr[-2000:]
    failed = scripted_cli(25_000, "--gpus", "cpu:1", "--debug", cfg)
    assert failed.returncode == 1, failed.stderr[-2000:]
    run = tmp_path / "out" / MISSION / "run"
    last = failed.stderr.strip().splitlines()[-1]
    assert last.startswith(f"stageb-pool: run failed: cannot write {run}/rule_search_hard_cases.jsonl: File too large")
    assert "Traceback" not in failed.stderr
    committed = json.loads((run / "state.json").read_text())
    assert 1 <= committed["iteration"] < 5
    assert (run / "rule_search_hard_cases.jsonl").stat().st_size > committed["artifacts"]["rule_search_hard_cases.jsonl"]

    resumed = scripted_cli(0, "--gpus", "cpu:1", "--debug", cfg, "--resume")
    assert resumed.returncode == 0, resumed.stderr[-2000:]
    diff = subprocess.run([sys.executable, "-m", "stageb_pool.app.cli", "diff", str(run), str(run.parent / "straight")],
                          env=env(), capture_output=True, text=True, timeout=60)
    assert diff.returncode == 0, diff.stdout + diff.stderr


@pytest.mark.parametrize("root", ["long", "under_a_file"])
def test_an_unusable_output_root_is_a_located_input_error(tmp_path, root):
    from doubles.run_inputs import search_inputs

    cfg = search_inputs(tmp_path / "in", out=str(tmp_path / "out"))
    (tmp_path / "a_file").write_text("not a folder")
    where = tmp_path / ("x" * 5000) if root == "long" else tmp_path / "a_file" / "out"
    for command in (["--gpus", "cpu:1", "--debug", cfg], ["check", cfg]):
        proc = scripted_cli(0, *command, "--set", f"output.root={where}")
        assert proc.returncode == 2, proc.stderr[-2000:]
        lines = proc.stderr.strip().splitlines()
        assert len(lines) == 1 and lines[0].startswith("stageb-pool: error: ") and "output.root" in lines[0], lines
    assert (tmp_path / "a_file").read_text() == "not a folder"
