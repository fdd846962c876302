"""A run directory has one owner, nothing is written through a link, --overwrite is all or
nothing, artifacts follow the umask, and an unrelated distillation file needs --overwrite
(issue 21).

The ownership tests drive real CLI processes with the scripted engine in forked workers
(``--gpus cpu:2``): the first run blocks in its proposer call after touching a marker file,
which is what the test waits for; the lock it holds is the kernel's, so killing it frees the
directory even while its workers are still being torn down.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
from doubles import scripted_engine as se
from doubles.run_inputs import MISSION, search_inputs
from processes import descendants

from stageb_pool.app import cli, job
from stageb_pool.search import fileio, run_owner
from stageb_pool.search.guidance_store import GuidanceStore
from stageb_pool.stageb.errors import InputError

REPO = Path(__file__).resolve().parents[1]
TESTS = REPO / "tests"
# The CLI with the scripted engine; SCRIPTED_HANG_AT / SCRIPTED_MARKER make the proposer call
# of that iteration block after touching the marker.
DRIVER = """
import os, sys
sys.path[:0] = [{tests!r}]
from doubles import scripted_engine as se
from stageb_pool.app import cli, job
hang = os.environ.get("SCRIPTED_HANG_AT")
kw = dict(hang_at=int(hang), marker=os.environ["SCRIPTED_MARKER"]) if hang else {{}}
job.engine_factory_for = lambda model, path: se.scripted_factory(**kw)
sys.exit(cli.main(sys.argv[1:]))
"""


def cli_process(*args: str, hang_at: int | None = None, marker: Path | None = None) -> subprocess.Popen:
    env = dict(os.environ, PYTHONPATH=str(REPO), HF_HUB_OFFLINE="1")
    env.pop("SCRIPTED_HANG_AT", None)
    if hang_at is not None:
        env.update(SCRIPTED_HANG_AT=str(hang_at), SCRIPTED_MARKER=str(marker))
        # Speculation would start iteration N's proposer call during iteration N-1: the hang
        # must mark iteration N itself.
        args = (*args, "--set", "runner.speculate=false")
    return subprocess.Popen([sys.executable, "-c", DRIVER.format(tests=str(TESTS)), *args], env=env,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


def finished(proc: subprocess.Popen, timeout: float = 240) -> tuple[int, str]:
    _, err = proc.communicate(timeout=timeout)
    return proc.returncode, err


def wait_for(path: Path, proc: subprocess.Popen, deadline_s: float = 120) -> None:
    """Until the blocked run has touched its marker (it is then inside its proposer call)."""
    deadline = time.monotonic() + deadline_s
    while not path.exists():
        assert proc.poll() is None, proc.communicate()[1][-2000:]
        assert time.monotonic() < deadline, "the run never reached its proposer call"
        time.sleep(0.02)


def wait_for_line(proc: subprocess.Popen, text: str) -> None:
    """Read the process's stderr until a line holds ``text`` (it blocks on the pipe, no sleep)."""
    for line in proc.stderr:
        if text in line:
            return
    raise AssertionError(f"{text!r} never printed (exit code {proc.wait()})")


def open_files(pid: int) -> set[str]:
    """What the descriptors of a living process point to."""
    found = set()
    for fd in Path(f"/proc/{pid}/fd").iterdir():
        try:
            found.add(os.readlink(fd))
        except OSError:  # closed meanwhile
            pass
    return found


def tree(root: Path) -> dict:
    """Every entry under root (links not followed): content hash, link target or 'dir'."""
    out = {}
    for p in sorted(root.rglob("*")):
        if p.is_symlink():
            out[p.relative_to(root).as_posix()] = "-> " + os.readlink(p)
        elif p.is_file():
            out[p.relative_to(root).as_posix()] = hashlib.sha256(p.read_bytes()).hexdigest()
        else:
            out[p.relative_to(root).as_posix()] = "dir"
    return out


def diff(a: Path, b: Path) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "stageb_pool.app.cli", "diff", str(a), str(b)],
                          env=dict(os.environ, PYTHONPATH=str(REPO)), capture_output=True, text=True, timeout=60)


@pytest.fixture
def inputs(tmp_path):
    cfg = search_inputs(tmp_path / "in", out=str(tmp_path / "out"))
    return cfg, tmp_path / "out" / MISSION / "run"


# ----------------------------------------------------------------------------- one owner

def test_a_second_process_is_refused_at_once_and_waits_only_when_asked(tmp_path, inputs):
    cfg, run = inputs
    marker = tmp_path / "blocked"
    first = cli_process("--gpus", "cpu:2", cfg, hang_at=2, marker=marker)
    try:
        wait_for(marker, first)
        for extra in (["--resume"], ["--overwrite"]):
            t0 = time.monotonic()
            code, err = finished(cli_process("--gpus", "cpu:2", cfg, *extra), timeout=60)
            assert code == 2, err[-2000:]
            assert time.monotonic() - t0 < 30  # at once: no model was loaded, nothing waited
            assert f"in use by another stageb-pool run (pid {first.pid})" in err and str(run) in err, err
            assert "Traceback" not in err
        lock = str(run.parent / ".run.lock")
        assert lock in open_files(first.pid)
        helpers = descendants(first.pid)
        assert len(helpers) >= 3  # the zygote and two workers, forked after the lock was taken
        assert all(lock not in open_files(pid) for pid in helpers)
        # The live run survived the refused --overwrite: its directory is the one it writes.
        assert first.poll() is None and (run / "run.json").is_file() and (run / "state.json").is_file()
        assert not [p for p in run.parent.iterdir() if ".replaced-" in p.name]

        waiting = cli_process("--gpus", "cpu:2", cfg, "--resume", "--wait")
        wait_for_line(waiting, f"waiting for pid {first.pid}")
        assert waiting.poll() is None
        first.send_signal(signal.SIGKILL)  # its workers die after it: they must not hold the lock
        first.wait(timeout=30)
        code, err = finished(waiting)
        assert code == 0, err[-2000:]
        assert json.loads((run / "state.json").read_text())["stop_reason"] is not None
        assert (run.parent / ".run.lock").read_text().strip() == str(waiting.pid)
    finally:
        if first.poll() is None:
            first.kill()
            first.wait()


def test_wait_says_whom_it_waits_for_at_every_log_level_and_a_bound_ends_it_with_exit_2(inputs):
    """This test process holds the run directory; the CLI with ``--wait 0.5`` under
    ``--log-level warning`` says whom it waits for, then gives up with one line."""
    cfg, run = inputs
    with run_owner.RunDir(run).lock():
        code, err = finished(cli_process("--gpus", "cpu:2", cfg, "--wait", "0.5", "--log-level", "warning"))
    assert code == 2, err[-2000:]
    assert err.strip().splitlines() == [
        f"stageb-pool: waiting for at most 0.5 s for pid {os.getpid()}, which holds the run directory {run} "
        "(--wait); nothing is started until it ends",
        f"stageb-pool: error: {run}: the run directory is still in use by another stageb-pool run (pid {os.getpid()}) "
        "after waiting 0.5 s (--wait 0.5): nothing was started; wait longer, or without a bound (--wait)"]
    assert not run.exists()


@pytest.mark.parametrize("stop, code", [(signal.SIGTERM, 143), (signal.SIGINT, 130)])
def test_a_stop_while_waiting_says_that_nothing_was_started(inputs, stop, code):
    """Plain ``--wait`` (before the config: it is not taken for SECONDS) waits without a bound
    until a signal; the signal's line says nothing was started, not how to resume."""
    cfg, run = inputs
    with run_owner.RunDir(run).lock():
        waiting = cli_process("--gpus", "cpu:2", "--wait", cfg, "--log-level", "error")
        watchdog = threading.Timer(120, waiting.kill)  # a wait that says nothing fails the test, never hangs it
        watchdog.start()
        try:
            wait_for_line(waiting, f"stageb-pool: waiting for pid {os.getpid()}, which holds the run directory {run}")
        finally:
            watchdog.cancel()
        waiting.send_signal(stop)
        status, err = finished(waiting, timeout=60)
    assert status == code, err[-2000:]
    assert err.strip().splitlines() == [f"stageb-pool: stopped by {signal.Signals(stop).name} while waiting for pid "
                                        f"{os.getpid()} (--wait): nothing was started"]
    assert not run.exists()


def test_wait_takes_a_number_of_seconds_or_nothing(tmp_path, inputs, capsys):
    cfg, _ = inputs
    for bad in ("0", "-5", "1e999"):
        assert cli.main(["--gpus", "cpu:2", cfg, "--wait", bad]) == 2
        err = capsys.readouterr().err.strip()
        assert f"error: argument --wait: SECONDS must be a number above 0, got {bad!r}" in err, err


def test_the_lock_is_refused_in_process_and_free_after_release(tmp_path):
    run = tmp_path / "m" / "r"
    held = run_owner.RunDir(run).lock()
    with pytest.raises(InputError, match=f"pid {os.getpid()}") as err:
        run_owner.RunDir(run).lock()  # flock is per open file: a second open is refused even here
    assert err.value.location == str(run)
    held.release()
    with run_owner.RunDir(run).lock() as again:
        assert again.phase is run_owner.Phase.LOCKED
    assert not run.exists()  # the lock file lives beside the run directory, which it does not make


def test_a_linked_lock_file_is_refused(tmp_path):
    run = tmp_path / "m" / "r"
    run.parent.mkdir(parents=True)
    elsewhere = tmp_path / "elsewhere"
    elsewhere.write_text("precious\n")
    run_owner.lock_path(run).symlink_to(elsewhere)
    with pytest.raises(InputError, match="symbolic link"):
        run_owner.acquire(run)
    run_owner.lock_path(run).unlink()
    os.link(elsewhere, run_owner.lock_path(run))
    with pytest.raises(InputError, match="hard link"):
        run_owner.acquire(run)
    assert elsewhere.read_text() == "precious\n"


# ----------------------------------------------------------------------------- links

def interrupted_run(tmp_path, cfg: str, run: Path) -> None:
    """A run killed inside its second iteration (one committed, rows of the second appended)."""
    marker = tmp_path / "blocked"
    proc = cli_process("--gpus", "cpu:2", cfg, hang_at=2, marker=marker)
    wait_for(marker, proc)
    proc.kill()
    proc.wait(timeout=30)
    assert json.loads((run / "state.json").read_text())["iteration"] == 1


def test_resume_never_writes_through_hard_links_or_a_symlinked_artifact(tmp_path, inputs):
    cfg, run = inputs
    interrupted_run(tmp_path, cfg, run)
    backup = tmp_path / "backup"
    subprocess.run(["cp", "-al", str(run), str(backup)], check=True)  # every file shares its inode
    outside = tmp_path / "outside"
    outside.mkdir()
    shutil.move(run / "benchmarks.jsonl", outside / "benchmarks.jsonl")
    (run / "benchmarks.jsonl").symlink_to(outside / "benchmarks.jsonl")
    before = tree(backup), tree(outside)

    code, err = finished(cli_process("--gpus", "cpu:2", cfg, "--resume"))
    assert code == 0, err[-2000:]
    assert (tree(backup), tree(outside)) == before
    assert not (run / "benchmarks.jsonl").is_symlink()
    changed = [name for name, digest in tree(run).items() if before[0].get(name) not in (None, digest)]
    assert "state.json" in changed and "rule_search_iterations.jsonl" in changed
    for name in changed:  # every file the resume wrote is its own now; the others still share the backup's
        assert (run / name).stat().st_nlink == 1, name
    code, err = finished(cli_process("--gpus", "cpu:2", cfg, "--set", "output.run_name=straight"))
    assert code == 0, err[-2000:]
    result = diff(run, run.parent / "straight")  # the copies changed nothing the run decided
    assert result.returncode == 0, result.stdout + result.stderr


@pytest.mark.parametrize("folder", ["reflection_cache", "snapshots"])
def test_a_symlinked_folder_in_the_run_is_refused_before_any_write(tmp_path, inputs, folder):
    cfg, run = inputs
    interrupted_run(tmp_path, cfg, run)
    outside = tmp_path / "outside"
    shutil.move(run / folder, outside) if (run / folder).exists() else outside.mkdir()
    (outside / "guidance-step0000.json").write_text("not ours\n")
    (run / folder).symlink_to(outside, target_is_directory=True)
    before = tree(tmp_path / "out"), tree(outside)
    code, err = finished(cli_process("--gpus", "cpu:2", cfg, "--resume"), timeout=60)
    assert code == 2, err[-2000:]
    assert f"{run / folder}: {folder} in the run directory is a symbolic link" in err
    assert (tree(tmp_path / "out"), tree(outside)) == before


def test_snapshot_pruning_deletes_only_regular_snapshot_files(tmp_path):
    store = GuidanceStore(tmp_path / "run", "m", retention=0)
    store.snapshot_dir.mkdir(parents=True)
    theirs = tmp_path / "theirs.json"
    theirs.write_text("keep\n")
    (store.snapshot_dir / "guidance-step0001.json").symlink_to(theirs)
    (store.snapshot_dir / "guidance-step0002.json").write_text("{}\n")
    store._prune()
    assert [p.name for p in store.snapshot_dir.iterdir()] == ["guidance-step0001.json"]
    assert theirs.read_text() == "keep\n"


def test_appends_make_a_linked_file_private_first(tmp_path):
    target = tmp_path / "elsewhere.jsonl"
    target.write_bytes(b'{"a":1}\n')
    hard, soft = tmp_path / "hard.jsonl", tmp_path / "soft.jsonl"
    os.link(target, hard)
    soft.symlink_to(target)
    for path in (hard, soft):
        fileio.append_jsonl(path, [{"b": 2}])
        assert path.read_bytes() == b'{"a":1}\n{"b":2}\n'
        assert not path.is_symlink() and path.stat().st_nlink == 1
    assert target.read_bytes() == b'{"a":1}\n' and target.stat().st_nlink == 1


# ----------------------------------------------------------------------------- --overwrite

def overwrite_in_process(cfg: str, *extra: str) -> int:
    return cli.main(["--gpus", "cpu:1", "--debug", cfg, "--overwrite", *extra])


@pytest.fixture
def finished_run(inputs, monkeypatch):
    cfg, run = inputs
    monkeypatch.setattr(job, "engine_factory_for", lambda model, path: se.scripted_factory())
    assert cli.main(["--gpus", "cpu:1", "--debug", cfg, "--set", "runner.epochs=1"]) == 0
    return cfg, run, tree(run)


def test_an_overwrite_that_cannot_move_the_old_run_aside_changes_nothing(finished_run, monkeypatch, capsys):
    cfg, run, before = finished_run

    def refuse(src, dst):
        raise PermissionError(13, "Permission denied")

    monkeypatch.setattr(os, "rename", refuse)
    assert overwrite_in_process(cfg) == 2
    err = capsys.readouterr().err
    assert "cannot move the old run aside (Permission denied); the old run is unchanged" in err
    assert tree(run) == before
    assert sorted(p.name for p in run.parent.iterdir()) == [".run.lock", "run"]


def test_an_overwrite_whose_start_fails_puts_the_old_run_back(finished_run, monkeypatch, capsys):
    cfg, run, before = finished_run

    def full_disk(path, data):
        raise fileio.OutputError(path, OSError(28, "No space left on device"))

    monkeypatch.setattr(run_owner, "atomic_write_bytes", full_disk)
    assert overwrite_in_process(cfg) == 1
    err = capsys.readouterr().err
    assert f"--overwrite failed: the old run is back, unchanged, in {run}" in err
    assert tree(run) == before
    assert sorted(p.name for p in run.parent.iterdir()) == [".run.lock", "run"]


def test_an_overwrite_whose_old_run_cannot_be_deleted_goes_on_and_names_the_leftover(finished_run, monkeypatch,
                                                                                      capsys):
    cfg, run, before = finished_run
    real_rmtree = shutil.rmtree

    def stuck(path, *a, **kw):
        raise PermissionError(1, "Operation not permitted")

    monkeypatch.setattr(shutil, "rmtree", stuck)
    assert overwrite_in_process(cfg, "--set", "runner.epochs=2") == 0
    err = capsys.readouterr().err
    [leftover] = [p for p in run.parent.iterdir() if ".replaced-" in p.name]
    assert f"what is left of it is in {leftover}" in err
    assert tree(leftover) == before  # nothing of it was lost either
    assert json.loads((run / "state.json").read_text())["iteration"] == 2
    real_rmtree(leftover)


# ----------------------------------------------------------------------------- modes, distillation

def test_every_artifact_follows_the_umask(inputs, monkeypatch):
    cfg, run = inputs
    monkeypatch.setattr(job, "engine_factory_for", lambda model, path: se.scripted_factory())
    old = os.umask(0o007)
    try:
        assert cli.main(["--gpus", "cpu:1", "--debug", cfg, "--set", "runner.epochs=2"]) == 0
    finally:
        os.umask(old)
    modes = {p.relative_to(run).as_posix(): oct(p.stat().st_mode & 0o777) for p in run.rglob("*") if p.is_file()}
    assert "state.json" in modes and "benchmarks.jsonl" in modes
    assert set(modes.values()) == {oct(0o660)}, modes


def test_an_unrelated_distillation_file_needs_overwrite(tmp_path, monkeypatch, capsys):
    theirs = tmp_path / "theirs.jsonl"
    theirs.write_text("someone's export\n")
    extra = f"stage_b_distillation: {{distill_size: 8, log_chatml_path: {theirs}}}\n"
    cfg = search_inputs(tmp_path / "in", out=str(tmp_path / "out"), epochs=1, extra=extra)
    monkeypatch.setattr(job, "engine_factory_for", lambda model, path: se.scripted_factory())
    assert cli.main(["--gpus", "cpu:1", "--debug", cfg]) == 2
    err = capsys.readouterr().err
    assert f"stage_b_distillation.log_chatml_path: {theirs} exists and is not this run's own earlier output" in err
    assert theirs.read_text() == "someone's export\n" and not (tmp_path / "out").exists()
    assert cli.main(["--gpus", "cpu:1", "--debug", cfg, "--overwrite"]) == 0
    assert theirs.read_text() != "someone's export\n"
    # Its own earlier output: a resume of the run that wrote it needs nothing more.
    assert cli.main(["--gpus", "cpu:1", "--debug", cfg, "--resume"]) == 0
