"""Run directory: fresh / refuse / overwrite / resume, run.json, and validation before any
disk write or fork."""

from __future__ import annotations

import logging
import hashlib
import json
from pathlib import Path

import pytest

from fake_engines import MISSION, fake_factory, write_run_inputs
from stageb_pool import PoolError, __version__
from stageb_pool.app.config import load_config
from stageb_pool.stageb.errors import InputError
from stageb_pool.search.fileio import read_json
from stageb_pool.stageb.hashing import tickets_hash
from stageb_pool.app.job import load_inputs, run_job
from stageb_pool.search.rundir import gpus_spec, prepare_run_dir, rollouts_path
from stageb_pool.pool.devices import parse_gpus


def tree_digest(root: Path) -> dict:
    """Every file and directory under root with its bytes' hash and mtime."""
    out = {}
    for p in sorted(root.rglob("*")):
        st = p.stat()
        out[p.relative_to(root).as_posix()] = (
            hashlib.sha256(p.read_bytes()).hexdigest() if p.is_file() else "dir", st.st_mtime_ns
        )
    return out


def never_called(device):
    raise AssertionError("no engine may be built for a refused run")


def test_fresh_directory_is_created(tmp_path):
    path = prepare_run_dir(tmp_path / "out" / "m" / "r")
    assert path.is_dir() and not any(path.iterdir())


def test_existing_directory_refused_untouched(tmp_path):
    run = tmp_path / "r"
    (run / "sub").mkdir(parents=True)
    (run / "run.json").write_text("{}")
    (run / "sub" / "x.jsonl").write_bytes(b"keep me\n")
    before = tree_digest(tmp_path)
    with pytest.raises(InputError) as err:
        prepare_run_dir(run)
    assert "--overwrite" in str(err.value) and "--resume" in str(err.value) and str(run) in str(err.value)
    assert tree_digest(tmp_path) == before


def test_overwrite_replaces_and_resume_keeps(tmp_path):
    run = tmp_path / "r"
    run.mkdir()
    (run / "run.json").write_text("{}")
    (run / "old.jsonl").write_text("old\n")
    assert prepare_run_dir(run, resume=True) == run
    assert (run / "old.jsonl").read_text() == "old\n"
    prepare_run_dir(run, overwrite=True)
    assert run.is_dir() and list(run.iterdir()) == []


@pytest.mark.parametrize("setup,kw,message", [
    ("none", {"resume": True}, "nothing to resume"),
    ("run", {"resume": True, "overwrite": True}, "exclude each other"),
    ("file", {}, "not a directory"),
    ("foreign", {"overwrite": True}, "does not look like a stageb-pool run"),
])
def test_refusals(tmp_path, setup, kw, message):
    run = tmp_path / "r"
    if setup == "run":
        run.mkdir()
        (run / "run.json").write_text("{}")
    elif setup == "file":
        run.write_text("a file")
    elif setup == "foreign":
        run.mkdir()
        (run / "thesis.tex").write_text("precious")
    before = tree_digest(tmp_path)
    with pytest.raises(InputError, match=message):
        prepare_run_dir(run, **kw)
    assert tree_digest(tmp_path) == before


def test_gpus_spec_and_rollouts_path():
    assert gpus_spec(parse_gpus("cpu:3")) == "cpu:3"
    assert gpus_spec(parse_gpus("0,2,5-6", gpu_count=8)) == "0,2,5,6"
    assert rollouts_path("/r", "train/it3/cand2") == Path("/r/rollouts/train-it3-cand2.jsonl")


# ------------------------------------------------------------------------------ run_job


def audit(cfg_path, gpus="cpu:1", **kw):
    return run_job(load_config(cfg_path), gpus, audit=True, argv=["stageb-pool", "--audit"], **kw)


def test_run_job_refuses_existing_run_untouched_and_without_workers(tmp_path):
    cfg = write_run_inputs(tmp_path, n_tickets=9)
    assert audit(cfg, engine_factory=fake_factory()) == 0
    run = tmp_path / "out" / MISSION / "run1"
    before = tree_digest(tmp_path / "out")
    with pytest.raises(InputError, match="--overwrite"):
        audit(cfg, engine_factory=never_called, debug=True)
    assert tree_digest(tmp_path / "out") == before
    assert (run / "baseline_metrics.json").is_file()


def test_run_job_overwrite_replaces_the_run(tmp_path):
    cfg = write_run_inputs(tmp_path, n_tickets=9)
    assert audit(cfg, engine_factory=fake_factory()) == 0
    run = tmp_path / "out" / MISSION / "run1"
    (run / "stale.txt").write_text("from an older run")
    assert audit(cfg, engine_factory=fake_factory(), overwrite=True) == 0
    assert not (run / "stale.txt").exists()
    assert read_json(run / "baseline_metrics.json")["n_total"] == 9


def test_run_job_resume_keeps_the_run_guidance(tmp_path):
    cfg = write_run_inputs(tmp_path, n_tickets=9)
    assert audit(cfg, engine_factory=fake_factory()) == 0
    run = tmp_path / "out" / MISSION / "run1"
    seed_hash = read_json(run / "baseline_metrics.json")["guidance_hash"]
    guidance = read_json(run / "guidance.json")
    guidance[MISSION]["experiences"]["G1"] = "Fail if scratch on the door."
    (run / "guidance.json").write_text(json.dumps(guidance))
    assert audit(cfg, engine_factory=fake_factory(), resume=True) == 0
    assert read_json(run / "guidance.json")[MISSION]["experiences"]["G1"].startswith("Fail if scratch")
    assert read_json(run / "baseline_metrics.json")["guidance_hash"] != seed_hash


@pytest.mark.parametrize("break_it,location", [
    ("tickets", "tickets.jsonl:2"),
    ("guidance", "guidance.json"),
    ("model", "no-such-model.gguf"),
])
def test_bad_input_stops_before_disk_or_fork(tmp_path, break_it, location):
    cfg = write_run_inputs(tmp_path, n_tickets=6)
    if break_it == "tickets":
        lines = (tmp_path / "tickets.jsonl").read_text().splitlines()
        lines[1] = lines[1].replace('"label": "pass"', '"label": "maybe"')
        (tmp_path / "tickets.jsonl").write_text("\n".join(lines) + "\n")
    elif break_it == "guidance":
        (tmp_path / "guidance.json").write_text(json.dumps({MISSION: {"step": 0}}))
    else:
        text = Path(cfg).read_text().replace("path: tiny", "path: ./no-such-model.gguf")
        Path(cfg).write_text(text)
    with pytest.raises(InputError) as err:
        run_job(load_config(cfg, check_files=False), "cpu:1", audit=True, engine_factory=never_called, debug=True)
    assert location in str(err.value)
    assert not (tmp_path / "out").exists()


def test_run_json_content(tmp_path):
    cfg_path = write_run_inputs(tmp_path, n_tickets=6)
    assert audit(cfg_path, "cpu:2", engine_factory=fake_factory()) == 0
    doc = read_json(tmp_path / "out" / MISSION / "run1" / "run.json")
    assert doc["tool"] == {"name": "stageb_pool", "version": __version__}
    assert doc["config"]["seed"] == 17 and doc["config"]["mode"] == "audit"
    assert doc["config"]["runner"]["chunk_size"] == 4
    prov = doc["provenance"]
    assert prov["model_path"] == "tiny" and prov["chunk_size"] == 4
    assert len(prov["profile_hash"]) == 16 and len(prov["tickets_hash"]) == 16
    assert prov["python"].count(".") == 2 and prov["torch"] and prov["transformers"]
    assert prov["engine"]["engine"] == "fake"
    inv = doc["invocation"]
    assert (inv["gpus"], inv["workers"], inv["debug"], inv["argv"]) == ("cpu:2", 2, False, ["stageb-pool", "--audit"])
    assert inv["started_at"].endswith("Z")


def test_resume_with_changed_config_refused_before_anything_is_written(tmp_path):
    cfg = write_run_inputs(tmp_path, n_tickets=12)
    over = ["mode=search", "rule_search.eval_pool_size=4", "rule_search.train_pool_size=4", "runner.epochs=1"]
    assert run_job(load_config(cfg, over), "cpu:1", engine_factory=fake_factory(), debug=True) == 0
    run = tmp_path / "out" / MISSION / "run1"
    assert (run / "state.json").is_file()
    before = tree_digest(tmp_path / "out")
    with pytest.raises(InputError, match="rule_search.reflect_size"):
        run_job(load_config(cfg, over + ["rule_search.reflect_size=7"]), "cpu:1", resume=True,
                engine_factory=never_called, debug=True)
    assert tree_digest(tmp_path / "out") == before


def test_failed_start_leaves_a_run_that_overwrite_may_replace(tmp_path):
    cfg = write_run_inputs(tmp_path, n_tickets=6)
    with pytest.raises(PoolError, match="no engine may be built"):
        audit(cfg, engine_factory=never_called, debug=True)
    run = tmp_path / "out" / MISSION / "run1"
    assert read_json(run / "run.json")["provenance"]["engine"] == {}
    assert audit(cfg, engine_factory=fake_factory(), overwrite=True) == 0


def test_workers_with_different_engines_are_reported(caplog):
    from stageb_pool.app.job import warn_if_workers_differ

    log = logging.getLogger("stageb_pool.test")
    same = [{"device": "NVIDIA H200", "dtype": "bfloat16"}] * 3
    with caplog.at_level(logging.WARNING, logger="stageb_pool.test"):
        warn_if_workers_differ(same, log)
        assert not caplog.records
        warn_if_workers_differ(same[:2] + [{"device": "NVIDIA H100", "dtype": "bfloat16"}], log)
    [record] = caplog.records
    assert "workers [2]" in record.getMessage() and "H100" in record.getMessage()


def test_run_json_hashes_the_ticket_set_and_state_json_the_run_order(tmp_path):
    """run.json's tickets_hash names the judged set (file order does not matter); state.json's
    names the run order a resume must reproduce (a reordered file changes it)."""
    over = ["mode=search", "rule_search.eval_pool_size=0", "rule_search.train_pool_size=4", "runner.epochs=1"]
    hashes = []
    for name, reverse in (("a", False), ("b", True)):
        cfg = write_run_inputs(tmp_path / name, n_tickets=12)
        tickets = Path(cfg).parent / "tickets.jsonl"
        lines = tickets.read_text().splitlines(keepends=True)
        tickets.write_text("".join(reversed(lines) if reverse else lines))
        assert run_job(load_config(cfg, over), "cpu:1", engine_factory=fake_factory(), debug=True) == 0
        run = Path(cfg).parent / "out" / MISSION / "run1"
        inputs = load_inputs(load_config(cfg, over))
        prov = read_json(run / "run.json")["provenance"]["tickets_hash"]
        state = read_json(run / "state.json")["tickets_hash"]
        assert prov == tickets_hash(sorted(inputs.tickets, key=lambda t: t.key))
        assert state == tickets_hash(inputs.tickets)  # run order
        hashes.append((prov, state))
    (prov_a, state_a), (prov_b, state_b) = hashes
    assert prov_a == prov_b and state_a != state_b
