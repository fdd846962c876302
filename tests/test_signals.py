"""Signals to the main process and a dead zygote say what happened (issue 21), with real
processes: the CLI runs the scripted search on two workers (forked, or Ray actors on a local
cluster of its own; tests/pool_scripts/cli_scripted_run.py) and is signalled inside iteration 2."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest
from doubles.run_inputs import MISSION, search_inputs
from processes import descendants, gone, parent_pid
from test_pool import wait_until

SCRIPT = os.path.join(os.path.dirname(__file__), "pool_scripts", "cli_scripted_run.py")


def start_run(tmp_path, *extra, env=None):
    """The CLI inside iteration 2 (a worker blocks in the proposer call); returns the process,
    its child processes (the report's process, the zygote and workers) and the command's
    arguments."""
    cfg = search_inputs(tmp_path / "in", out=str(tmp_path / "out"))
    marker = tmp_path / "hanging"
    args = ["run", "--gpus", "cpu:2", cfg, *extra]
    proc = subprocess.Popen([sys.executable, SCRIPT, str(marker), *args], cwd=str(tmp_path),
                            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True, env=env)
    # Speculation may start iteration 2's proposer call (the one that blocks) while iteration 1
    # still runs on the other worker: inside iteration 2 means that call blocks and iteration 1
    # is committed.
    state = tmp_path / "out" / MISSION / "run" / "state.json"
    assert wait_until(lambda: (marker.exists() and state.exists()) or proc.poll() is not None, 120), \
        "iteration 2 never started"
    assert proc.poll() is None, proc.communicate()[1]
    return proc, descendants(proc.pid), args


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGHUP])
def test_a_stop_signal_to_the_main_process_names_it_and_the_resume_command(tmp_path, sig):
    proc, children, args = start_run(tmp_path)
    assert len(children) == 4  # the report's process (forked at the start), the zygote and two workers
    proc.send_signal(sig)
    _, err = proc.communicate(timeout=30)
    assert proc.returncode == 128 + sig
    lines = err.strip().splitlines()
    assert lines[-1].startswith(f"stageb-pool: stopped by {signal.Signals(sig).name}; ")
    assert lines[-1].endswith(f"continue with: stageb-pool run --gpus cpu:2 {args[3]} --resume")
    assert "Traceback" not in err
    assert wait_until(lambda: all(gone(p) for p in children), 5), "workers left behind"
    state = Path(tmp_path / "out" / MISSION / "run" / "state.json")
    assert state.exists()  # iteration 1 committed: the printed command continues from it


def test_a_dead_zygote_is_named_and_not_hidden_by_the_close(tmp_path):
    proc, children, _ = start_run(tmp_path)
    # the workers are its children (the run's other child, the report's process, has none)
    [zygote] = [p for p in children if parent_pid(p) == proc.pid and any(parent_pid(q) == p for q in children)]
    os.kill(zygote, signal.SIGTERM)
    _, err = proc.communicate(timeout=60)
    assert proc.returncode == 1
    assert "Traceback" not in err and "BrokenPipeError" not in err, err
    last = err.strip().splitlines()[-1]
    assert last.startswith("stageb-pool: run failed: ") and "zygote" in last and "SIGTERM" in last, err
    assert wait_until(lambda: all(gone(p) for p in children), 5), "workers left behind"


@pytest.mark.ray
def test_a_stop_signal_to_a_run_on_its_own_ray_cluster_stops_it_and_leaves_nothing(tmp_path):
    """Under Ray the run waits in Ray's blocking calls, which pass on only a KeyboardInterrupt
    raised by a signal handler, and ray.init installs a SIGTERM handler of its own: the
    signal must still stop the run the CLI's way (before: a hang, or exit 1 saying nothing)."""
    pytest.importorskip("ray", reason="Ray is not installed: .venv/bin/python -m pip install -e '.[ray]'")
    tests = os.path.dirname(os.path.abspath(__file__))
    env = {k: v for k, v in os.environ.items() if not k.startswith("RAY_")}
    env["PYTHONPATH"] = os.pathsep.join([tests, os.path.dirname(tests)])  # the actors import the scripted engine
    proc, children, args = start_run(tmp_path, "--ray", "local", env=env)
    proc.send_signal(signal.SIGTERM)
    _, err = proc.communicate(timeout=60)
    assert proc.returncode == 128 + signal.SIGTERM, err[-3000:]
    last = err.strip().splitlines()[-1]
    assert last.startswith("stageb-pool: stopped by SIGTERM; the workers are stopped; "), err[-3000:]
    assert last.endswith(f"continue with: stageb-pool run --gpus cpu:2 {args[3]} --ray local --resume")
    assert "Traceback" not in err and "SIGTERM received" not in err, err[-3000:]
    assert wait_until(lambda: all(gone(p) for p in children), 10), "Ray processes left behind"
