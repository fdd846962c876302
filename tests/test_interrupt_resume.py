"""Ctrl-C and --resume through the real command line (promises 2 and 4).

A rule search on the tiny model is interrupted with SIGINT once its first iteration is
committed: the command must exit 130 within seconds and leave no process behind; then
``--resume`` must reach exactly the artifacts of an uninterrupted run (``stageb-pool diff``).
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

from processes import descendants, gone

REPO = Path(__file__).resolve().parents[1]
DEMO = REPO / "configs" / "demo"
SETTINGS = [  # small but long enough (about a second per iteration) to be interrupted in the middle
    "model.path=tiny", "runner.epochs=12", "runner.chunk_size=4", "rule_search.early_stop.patience=12",
    "rule_search.train_pool_size=40", "rule_search.eval_pool_size=16",
    "rule_search.train_sampler.grid=[{temperature: 0.7, top_p: 0.9, max_new_tokens: 48}]",
    "rule_search.eval_sampler.grid=[{temperature: 0.7, top_p: 0.9, max_new_tokens: 48}]",
]


def command(root: Path, name: str, *extra: str) -> list[str]:
    sets = [arg for s in SETTINGS + [f"output.root={root}", f"output.run_name={name}"] for arg in ("--set", s)]
    return [sys.executable, "-m", "stageb_pool.app.cli", "--gpus", "cpu:2", str(REPO / "configs" / "demo.yaml"), *sets, *extra]


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
    assert json.loads((mission_dir / "interrupted" / "state.json").read_text())["iteration"] < 12, \
        "the run finished before the interrupt; make it longer"

    resumed = subprocess.run(command(tmp_path, "interrupted", "--resume"), env=env(), capture_output=True,
                             text=True, timeout=300)
    assert resumed.returncode == 0, resumed.stderr[-2000:]
    straight = subprocess.run(command(tmp_path, "straight"), env=env(), capture_output=True, text=True, timeout=300)
    assert straight.returncode == 0, straight.stderr[-2000:]

    diff = subprocess.run([sys.executable, "-m", "stageb_pool.app.cli", "diff", str(mission_dir / "interrupted"),
                           str(mission_dir / "straight")], env=env(), capture_output=True, text=True, timeout=60)
    # Only the run name (part of config.output, volatile) and the generation counters of
    # the resumed process may differ; everything the search decided must be identical.
    assert diff.returncode in (0, 1) and (diff.returncode == 0 or "runs differ" in diff.stdout), diff.stderr
    lines = [l for l in diff.stdout.splitlines() if l.startswith("  ") and not l.startswith("  A =") and not l.startswith("  B =")]
    keys = {l.strip().rstrip(":") for l in lines if not l.strip().startswith(("A:", "B:"))}
    assert keys <= {"summary.json generations_done", "summary.json generations_saved"}, diff.stdout
