"""Upgrades keep runs resumable (issue 32 item 5; docs/rule_search.md, "Upgrades").

run.json and state.json record the package version and the run directory's format. A rule
search written by an earlier version (tests/data/run_before_versions: 0.1.0 at 1793fe9, before
versions were recorded, interrupted after iteration 1) resumes with today's code to exactly the
artifacts of an uninterrupted run of today's code, although the config gained keys since
(``ingest.max_line_bytes``, ``rule_search.constrain_proposer``, ``pool.threads_per_worker``) at values that compute what
that version did; a config that differs in a key that matters is refused with one line naming
the version that wrote the run, the keys and the way out. A resume also gives every file of the
run the mode a run writes (earlier versions wrote whole files 0600).
"""

from __future__ import annotations

import json
import os
import shutil
import stat
from pathlib import Path

import pytest
from doubles import scripted_engine as se
from doubles.run_inputs import MISSION, search_inputs

from stageb_pool import __version__
from stageb_pool.app import cli, job
from stageb_pool.app.diff import diff_runs, format_differences
from stageb_pool.search import rundir
from stageb_pool.search.fileio import file_mode

FIXTURE = Path(__file__).resolve().parent / "data" / "run_before_versions"
# The whole files version 0.1.0 wrote through mkstemp without a chmod (git keeps no modes).
WRITTEN_0600 = ("run.json", "state.json", "guidance.json", "snapshots/guidance-step0000.json")


def tree(root: Path) -> dict[str, bytes]:
    return {p.relative_to(root).as_posix(): p.read_bytes() for p in sorted(root.rglob("*")) if p.is_file()}


def modes(root: Path) -> dict[str, int]:
    return {p.relative_to(root).as_posix(): stat.S_IMODE(p.lstat().st_mode) for p in root.rglob("*") if p.is_file()}


@pytest.fixture
def old_run(tmp_path, monkeypatch):
    """A copy of the fixture (inputs and run directory) in tmp_path, its 0.1.0 modes restored,
    and the CLI's engine replaced by the scripted engine; returns (config path, run dir)."""
    shutil.copytree(FIXTURE, tmp_path / "fx")
    run_dir = tmp_path / "fx" / "out" / MISSION / "run"
    for name in WRITTEN_0600:
        os.chmod(run_dir / name, 0o600)
    monkeypatch.setattr(job, "engine_factory_for", lambda *args, **kwargs: se.scripted_factory())
    return str(tmp_path / "fx" / "config.yaml"), run_dir


def cli_run(config: str, *args: str) -> int:
    return cli.main(["--gpus", "cpu:1", "--debug", config, *args])


def test_a_run_before_versions_resumes_to_the_result_of_an_uninterrupted_run(old_run, capsys):
    config, run_dir = old_run
    assert json.loads((run_dir / "state.json").read_text())["iteration"] == 1
    assert cli_run(config, "--resume", "--log-level", "warning") == 0
    said = [line for line in capsys.readouterr().err.splitlines() if "WARNING resume:" in line]
    # One line on the resume (the scripted proposer's cut-off answer of iteration 2 warns too).
    assert len(said) == 1, said
    assert ("WARNING resume: state.json was written by stageb-pool 0.1.0 or earlier (before versions; state "
            "format 2), whose 1 committed iteration(s)" in said[0] and "are redone" in said[0]), said
    assert cli_run(config, "--set", "output.run_name=straight") == 0
    straight = run_dir.parent / "straight"
    differences = diff_runs(run_dir, straight, limit=None)
    assert not differences, format_differences(differences, str(run_dir), str(straight))
    # The resumed run is today's in every byte the diff calls a result, and records today's version.
    state = json.loads((run_dir / "state.json").read_text())
    assert (state["version"], state["tool_version"]) == (rundir.FORMAT_VERSION, __version__)
    assert json.loads((run_dir / "run.json").read_text())["tool"]["version"] == __version__
    assert set(modes(run_dir).values()) == {file_mode()}


@pytest.mark.parametrize("setting, keys", [
    ("rule_search.constrain_proposer=true", "rule_search.constrain_proposer"),  # a key added since, at a new value
    ("pool.threads_per_worker=2", "pool.threads_per_worker"),  # added since, in a section that version left out
    ("rule_search.reflect_size=5", "rule_search.reflect_size"),  # a key that version had
])
def test_a_run_before_versions_with_a_config_that_matters_is_refused_in_one_line(old_run, capsys, setting, keys):
    config, run_dir = old_run
    before = tree(run_dir)
    assert cli_run(config, "--resume", "--set", setting) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1, err
    assert err.endswith(
        f"state.json: cannot resume: the config differs from the interrupted run's at {keys} (input files are "
        "compared by content); state.json was written by stageb-pool 0.1.0 or earlier (before versions; state "
        "format 2): start the run again with --overwrite, or resume it with that version"), err
    assert tree(run_dir) == before
    assert cli_run(config, "--overwrite", "--set", setting) == 0  # the way out it names


def test_a_state_of_an_unknown_format_is_refused_naming_its_writer(old_run, capsys):
    config, run_dir = old_run
    state = json.loads((run_dir / "state.json").read_text())
    (run_dir / "state.json").write_text(json.dumps({**state, "version": 9, "tool_version": "7.0.0"}))
    assert cli_run(config, "--resume") == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and err.endswith(
        f"cannot resume: state.json was written by stageb-pool 7.0.0 (state format 9), which stageb-pool "
        f"{__version__} (state format {rundir.FORMAT_VERSION}) cannot continue: start the run again with "
        "--overwrite, or resume it with that version"), err


def test_run_json_and_state_json_record_the_version_and_the_format(tmp_path):
    cfg = search_inputs(tmp_path / "in", out=str(tmp_path / "out"), epochs=1)
    from stageb_pool.app import config as config_mod

    job.run_job(config_mod.load_config(cfg), "cpu:1", debug=True, engine_factory=se.scripted_factory())
    run_dir = tmp_path / "out" / MISSION / "run"
    assert json.loads((run_dir / "run.json").read_text())["tool"] == {
        "name": "stageb_pool", "version": __version__, "format": rundir.FORMAT_VERSION}
    state = json.loads((run_dir / "state.json").read_text())
    assert (state["version"], state["tool_version"]) == (rundir.FORMAT_VERSION, __version__)


def test_a_resume_gives_the_files_an_earlier_version_wrote_the_mode_of_a_run(tmp_path):
    """A run of this format resumed (continued, not redone) after its files were made 0600, as
    versions before 0.2.0 wrote them: the files it only appends to, and the snapshot it never
    rewrites, get ``0666 & ~umask`` too."""
    from stageb_pool.app import config as config_mod

    cfg = config_mod.load_config(search_inputs(tmp_path / "in", out=str(tmp_path / "out")))
    with pytest.raises(se.ScriptedCrash):
        job.run_job(cfg, "cpu:1", debug=True, engine_factory=se.scripted_factory(crash_at=2))
    run_dir = tmp_path / "out" / MISSION / "run"
    for path in run_dir.rglob("*"):
        if path.is_file():
            os.chmod(path, 0o600)
    job.run_job(cfg, "cpu:1", debug=True, engine_factory=se.scripted_factory(), resume=True)
    found = modes(run_dir)
    assert "snapshots/guidance-step0000.json" in found and "rule_search_hard_cases.jsonl" in found
    assert {name: mode for name, mode in found.items() if mode != file_mode()} == {}
