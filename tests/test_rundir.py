"""Run directory: fresh / refuse / overwrite / resume, run.json, and validation before any
disk write or fork."""

from __future__ import annotations

import hashlib
import json
import logging
import os
from pathlib import Path

import msgspec
import pytest
from doubles.fake_engine import fake_factory
from doubles.run_inputs import MISSION, SEED, audit_inputs, missing_part_records

from stageb_pool import PoolError, __version__
from stageb_pool.app.describe import describe
from stageb_pool.app.config import load_config
from stageb_pool.app.job import run_job
from stageb_pool.app.plan import load_inputs, plan_command
from stageb_pool.pool.devices import parse_gpus
from stageb_pool.search.fileio import read_json
from stageb_pool.search.run_owner import RunDir
from stageb_pool.search.rundir import (
    FORMAT_VERSION,
    NAME_MAX_BYTES,
    RunJson,
    gpus_spec,
    rollouts_path,
    safe_name,
)
from stageb_pool.stageb.errors import InputError
from stageb_pool.stageb.hashing import tickets_hash


def tree_digest(root: Path) -> dict:
    """Every file and directory under root with its bytes' hash and mtime."""
    out = {}
    for p in sorted(root.rglob("*")):
        st = p.stat()
        out[p.relative_to(root).as_posix()] = (
            hashlib.sha256(p.read_bytes()).hexdigest() if p.is_file() else "dir", st.st_mtime_ns
        )
    return out


def prepare_run_dir(path, **flags) -> Path:
    """The run directory's life without a run: planned, locked, started."""
    with RunDir(path, **flags).lock() as run:
        run.start()
    return run.path


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


def test_the_run_directory_takes_its_steps_in_order_only(tmp_path):
    run = RunDir(tmp_path / "r")
    with pytest.raises(RuntimeError, match="planned, not locked"):
        run.start()  # never made without its lock
    with run.lock():
        run.start()
        with pytest.raises(RuntimeError, match="committed, not planned"):
            run.lock()
    assert run.phase.value == "committed" and (tmp_path / "r").is_dir()


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


def test_run_json_records_the_worker_layout_of_gpu_groups():
    doc = RunJson(config={}, devices=parse_gpus("0-3", gpu_count=4, gpus_per_worker=2), debug=False, started_at="t",
                  argv=[], model_path="m", chunk_size=1, profile_hash="p", tickets_hash="t").document()
    inv = doc["invocation"]
    assert inv["gpus"] == "0,1,2,3" and inv["workers"] == 2 and inv["gpus_per_worker"] == 2
    assert inv["layout"] == [{"rank": 0, "device": "cuda:0,1", "gpus": [0, 1]},
                             {"rank": 1, "device": "cuda:2,3", "gpus": [2, 3]}]


def test_gpus_spec_and_rollouts_path():
    assert gpus_spec(parse_gpus("cpu:3")) == "cpu:3"
    assert gpus_spec(parse_gpus("0,2,5-6", gpu_count=8)) == "0,2,5,6"
    assert gpus_spec(parse_gpus("0,2,5-6", gpu_count=8, gpus_per_worker=2)) == "0,2,5,6"  # every GPU of every group
    assert rollouts_path("/r", "train/it3/cand2") == Path("/r/rollouts/train-it3-cand2.jsonl")


# ------------------------------------------------------------------------------ run_job


def audit(cfg_path, gpus="cpu:1", **kw):
    return run_job(load_config(cfg_path), gpus, audit=True, argv=["stageb-pool", "--audit"], **kw)


def test_run_job_refuses_existing_run_untouched_and_without_workers(tmp_path):
    cfg = audit_inputs(tmp_path, n_tickets=9)
    assert audit(cfg, engine_factory=fake_factory()) == 0
    run = tmp_path / "out" / MISSION / "run"
    before = tree_digest(tmp_path / "out")
    with pytest.raises(InputError, match="--overwrite"):
        audit(cfg, engine_factory=never_called, debug=True)
    assert tree_digest(tmp_path / "out") == before
    assert (run / "baseline_metrics.json").is_file()


def test_run_job_overwrite_replaces_the_run(tmp_path):
    cfg = audit_inputs(tmp_path, n_tickets=9)
    assert audit(cfg, engine_factory=fake_factory()) == 0
    run = tmp_path / "out" / MISSION / "run"
    (run / "stale.txt").write_text("from an older run")
    assert audit(cfg, engine_factory=fake_factory(), overwrite=True) == 0
    assert not (run / "stale.txt").exists()
    assert read_json(run / "baseline_metrics.json")["n_total"] == 9


def test_run_job_resume_keeps_the_run_guidance(tmp_path):
    cfg = audit_inputs(tmp_path, n_tickets=9)
    assert audit(cfg, engine_factory=fake_factory()) == 0
    run = tmp_path / "out" / MISSION / "run"
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
    cfg = audit_inputs(tmp_path, n_tickets=6)
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
    cfg_path = audit_inputs(tmp_path, n_tickets=6)
    assert audit(cfg_path, "cpu:2", engine_factory=fake_factory()) == 0
    doc = read_json(tmp_path / "out" / MISSION / "run" / "run.json")
    assert doc["tool"] == {"name": "stageb_pool", "version": __version__, "format": FORMAT_VERSION}
    assert doc["config"]["seed"] == SEED and doc["config"]["mode"] == "audit"
    assert doc["config"]["runner"]["chunk_size"] == 4
    prov = doc["provenance"]
    assert prov["model_path"] == "tiny" and prov["chunk_size"] == 4
    assert len(prov["profile_hash"]) == 16 and len(prov["tickets_hash"]) == 16
    assert prov["python"].count(".") == 2 and prov["torch"] and prov["transformers"]
    assert prov["engine"]["engine"] == "fake"
    inv = doc["invocation"]
    assert (inv["gpus"], inv["workers"], inv["debug"], inv["argv"]) == ("cpu:2", 2, False, ["stageb-pool", "--audit"])
    assert inv["gpus_per_worker"] == 1 and inv["layout"] == [{"rank": 0, "device": "cpu:0", "gpus": []},
                                                             {"rank": 1, "device": "cpu:1", "gpus": []}]
    assert inv["started_at"].endswith("Z")


def test_resume_with_changed_config_refused_before_anything_is_written(tmp_path):
    cfg = audit_inputs(tmp_path, n_tickets=12)
    over = ["mode=search", "rule_search.eval_pool_size=4", "rule_search.train_pool_size=4", "runner.epochs=1"]
    assert run_job(load_config(cfg, over), "cpu:1", engine_factory=fake_factory(), debug=True) == 0
    run = tmp_path / "out" / MISSION / "run"
    assert (run / "state.json").is_file()
    before = tree_digest(tmp_path / "out")
    with pytest.raises(InputError, match="rule_search.reflect_size"):
        run_job(load_config(cfg, over + ["rule_search.reflect_size=7"]), "cpu:1", resume=True,
                engine_factory=never_called, debug=True)
    assert tree_digest(tmp_path / "out") == before


def test_failed_start_leaves_a_run_that_overwrite_may_replace(tmp_path):
    cfg = audit_inputs(tmp_path, n_tickets=6)
    with pytest.raises(PoolError, match="no engine may be built"):
        audit(cfg, engine_factory=never_called, debug=True)
    run = tmp_path / "out" / MISSION / "run"
    assert read_json(run / "run.json")["provenance"]["engine"] == {}
    assert audit(cfg, engine_factory=fake_factory(), overwrite=True) == 0


def test_workers_with_different_engines_are_reported(caplog):
    from stageb_pool.app.job import engine_agreement

    same = [{"device": "NVIDIA H200", "dtype": "bfloat16"}] * 3
    names = ["cuda:0", "cuda:1", "cuda:2"]
    with caplog.at_level(logging.WARNING, logger="stageb_pool"):
        engine_agreement(ray=False).check(dict(enumerate(same)), names)
        assert not caplog.records
        engine_agreement(ray=False).check(dict(enumerate(same[:2] + [{"device": "NVIDIA H100", "dtype": "bfloat16"}])),
                                          names)
    [record] = caplog.records
    assert record.name == "stageb_pool"
    assert "workers [2]" in record.getMessage() and "H100" in record.getMessage()


def differing_on_cpu1(**facts):
    """Fake engines whose worker on cpu:1 reports ``facts`` over the others' info."""

    def build(device):
        engine = fake_factory()(device)
        info = engine.info()
        if device.index == 1:
            engine.info = lambda: {**info, **facts}
        return engine

    return build


def test_a_run_on_workers_of_another_engine_version_is_refused_at_gpus_and_another_device_warned(tmp_path, caplog):
    cfg = audit_inputs(tmp_path, n_tickets=6)
    with pytest.raises(InputError) as info:
        audit(cfg, gpus="cpu:2", engine_factory=differing_on_cpu1(torch="2.12.0"))
    assert str(info.value) == ("--gpus: workers [1] run another engine or version than worker 0 ({'engine': 'fake', "
                               "'vllm': None, 'torch': '2.12.0', 'transformers': None} vs {'engine': 'fake', "
                               "'vllm': None, 'torch': None, 'transformers': None}): results would depend on which "
                               "worker ran which chunk")
    run = tmp_path / "out" / MISSION / "run"
    assert read_json(run / "run.json")["provenance"]["engine"] == {}  # refused before rank 0's facts were recorded
    with caplog.at_level(logging.WARNING, logger="stageb_pool"):
        assert audit(cfg, gpus="cpu:2", engine_factory=differing_on_cpu1(device="other"), overwrite=True) == 0
    [warning] = [r.getMessage() for r in caplog.records if "report a different engine" in r.getMessage()]
    assert warning.startswith("workers [1] report a different engine than worker 0 ({'engine': 'fake', "
                              "'device': 'other',")


def test_run_json_hashes_the_ticket_set_and_state_json_the_run_order(tmp_path):
    """run.json's tickets_hash names the judged set (file order does not matter); state.json's
    names the run order a resume must reproduce (a reordered file changes it)."""
    over = ["mode=search", "rule_search.eval_pool_size=0", "rule_search.train_pool_size=4", "runner.epochs=1"]
    hashes = []
    for name, reverse in (("a", False), ("b", True)):
        cfg = audit_inputs(tmp_path / name, n_tickets=12)
        tickets = Path(cfg).parent / "tickets.jsonl"
        lines = tickets.read_text().splitlines(keepends=True)
        tickets.write_text("".join(reversed(lines) if reverse else lines))
        assert run_job(load_config(cfg, over), "cpu:1", engine_factory=fake_factory(), debug=True) == 0
        run = Path(cfg).parent / "out" / MISSION / "run"
        inputs = load_inputs(load_config(cfg, over))
        prov = read_json(run / "run.json")["provenance"]["tickets_hash"]
        state = read_json(run / "state.json")["tickets_hash"]
        assert prov == tickets_hash(sorted(inputs.tickets, key=lambda t: t.key))
        assert state == tickets_hash(inputs.tickets)  # run order
        hashes.append((prov, state))
    (prov_a, state_a), (prov_b, state_b) = hashes
    assert prov_a == prov_b and state_a != state_b


# ------------------------------------------------------------------------------ run directory names


@pytest.mark.parametrize("mission, name", [
    ("BBU安装方式检查（正装）", "BBU安装方式检查（正装）"),
    ("Rooftop antenna mount inspection", "Rooftop antenna mount inspection"),
    ("../../escaped_mission", "..%2F..%2Fescaped_mission"),
    ("..", "%2E%2E"),
    (".", "%2E"),
    ("/etc/passwd", "%2Fetc%2Fpasswd"),
    ("a\\b", "a%5Cb"),
    ("50% off", "50%25 off"),
    ("tab\there\nnew", "tab%09here%0Anew"),
    ("bell\x07\x00", "bell%07%00"),
    ("zero\u200bwidth", "zero%E2%80%8Bwidth"),
    ("\ud800", "%ED%A0%80"),
    ("", "%"),
])
def test_safe_name_escapes_what_could_leave_or_break_the_directory(mission, name):
    assert safe_name(mission) == name


def test_safe_name_bounds_long_missions_and_keeps_them_apart():
    a, b = "x" * 4096, "x" * 4095 + "y"
    for long in (a, b, "检" * 3000, "/" * 1000):
        name = safe_name(long)
        assert len(name.encode()) <= NAME_MAX_BYTES and "/" not in name
        assert name.rsplit("~", 1)[1] == hashlib.sha256(long.encode()).hexdigest()[:12]
    assert safe_name(a) != safe_name(b)
    assert safe_name("检" * 3000).startswith("检" * 62)  # cut at a character boundary


@pytest.mark.parametrize("mission", ["../../escaped_mission", "..", "/tmp/abs_mission", "m" * 4096])
def test_ticket_data_cannot_move_the_run_outside_output_root(tmp_path, mission):
    records = [dict(r, mission=mission) for r in missing_part_records(6)]
    cfg_path = audit_inputs(tmp_path / "in", records=records)  # its seed guidance: for this mission
    root = tmp_path / "in" / "out"
    naive = Path(os.path.normpath(root / mission / "run"))  # where the raw mission would lead
    escapes = len(mission) < 255 and root not in naive.parents
    before = {p for p in tmp_path.rglob("*")}
    assert audit(cfg_path, engine_factory=fake_factory(), debug=True) == 0
    [run] = [p.parent for p in root.rglob("run.json")]
    assert run.parent.parent == root and run.parent.name == safe_name(mission)
    created = {p for p in tmp_path.rglob("*")} - before
    assert all(root in p.parents or p == root for p in created), sorted(created)
    assert not (escapes and naive.exists()), naive
    # (the mission is in every prompt: a 5,000-character one is over the default token cap)
    assert str(run) in describe(plan_command(cfg_path, ["rule_search.train_sampler.max_prompt_tokens=null"], audit=True))


def test_a_run_directory_behind_a_symlink_out_of_output_root_is_refused(tmp_path):
    cfg_path = audit_inputs(tmp_path / "in", n_tickets=6)
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    (tmp_path / "in" / "out").mkdir()
    (tmp_path / "in" / "out" / MISSION).symlink_to(elsewhere, target_is_directory=True)
    with pytest.raises(InputError, match="outside output.root"):
        audit(cfg_path, engine_factory=never_called, debug=True)
    assert list(elsewhere.iterdir()) == []


# ------------------------------------------------------------------------------ outputs never overwrite inputs

SEARCH = ["mode=search", "rule_search.eval_pool_size=4", "rule_search.train_pool_size=4", "runner.epochs=1",
          "stage_b_distillation.enabled=true", "stage_b_distillation.distill_size=5"]


def _link(root: Path, kind: str) -> str:
    if kind == "hardlink":
        (root / "tickets-link.jsonl").hardlink_to(root / "tickets.jsonl")
        return "tickets-link.jsonl"
    (root / "tickets-sym.jsonl").symlink_to(root / "tickets.jsonl")
    return "tickets-sym.jsonl"


@pytest.mark.parametrize("target, message", [
    ("tickets.jsonl", "the export would overwrite it"),
    ("guidance.json", "the export would overwrite it"),
    ("proposer.txt", "the export would overwrite it"),
    ("config.yaml", "the export would overwrite it"),
    ("hardlink", "the export would overwrite it"),
    ("symlink", "the export would overwrite it"),
    (f"out/{MISSION}/run/state.json", "a file the run itself writes"),
    (f"out/{MISSION}/run/report.html", "a file the run itself writes"),  # every file of artifacts.ARTIFACTS
    (".", "is a directory"),
    # folders the run itself creates: refused before they exist, not at the end of the run
    ("out", "a folder that holds the run directory"),
    (f"out/{MISSION}", "a folder that holds the run directory"),
    (f"out/{MISSION}/run", "is the run directory"),
])
def test_the_distillation_file_may_not_be_an_input_or_a_run_file(tmp_path, target, message):
    cfg = audit_inputs(tmp_path, n_tickets=12)
    if target in ("hardlink", "symlink"):
        target = _link(tmp_path, target)
    before = tree_digest(tmp_path)
    with pytest.raises(InputError, match=message) as err:
        run_job(load_config(cfg, SEARCH + [f"stage_b_distillation.log_chatml_path={target}"]), "cpu:1",
                engine_factory=never_called, debug=True, config_path=cfg)
    assert err.value.location == "stage_b_distillation.log_chatml_path"
    assert tree_digest(tmp_path) == before  # nothing created, nothing changed


def test_the_distillation_file_may_be_written_outside_the_run_directory(tmp_path):
    cfg = audit_inputs(tmp_path, n_tickets=12)
    over = SEARCH + [f"stage_b_distillation.log_chatml_path={tmp_path / 'exports' / 'chatml.jsonl'}"]
    assert run_job(load_config(cfg, over), "cpu:1", engine_factory=fake_factory(), debug=True, config_path=cfg) == 0
    assert (tmp_path / "exports" / "chatml.jsonl").read_text().count("\n") > 0


@pytest.mark.parametrize("flag", ["overwrite", "resume"])
def test_an_input_inside_the_run_directory_is_refused(tmp_path, flag):
    cfg = audit_inputs(tmp_path, n_tickets=12)
    assert audit(cfg, engine_factory=fake_factory()) == 0
    run = tmp_path / "out" / MISSION / "run"
    (run / "seed.json").write_text((tmp_path / "guidance.json").read_text())
    before = tree_digest(tmp_path)
    with pytest.raises(InputError, match="lies inside the run directory"):
        run_job(load_config(cfg, [f"guidance.path=out/{MISSION}/run/seed.json"]), "cpu:1", audit=True,
                engine_factory=never_called, debug=True, **{flag: True})
    assert tree_digest(tmp_path) == before


def test_resume_cuts_artifacts_back_through_a_new_file_never_in_place(tmp_path):
    from stageb_pool.search.state import truncate_artifacts

    path = tmp_path / "rule_candidates.jsonl"
    path.write_bytes(b"row 1\nrow 2\ntorn")
    (tmp_path / "elsewhere.jsonl").hardlink_to(path)  # e.g. a backup made with cp -l
    assert truncate_artifacts(tmp_path, {"rule_candidates.jsonl": 6}) == {"rule_candidates.jsonl": 10}
    assert path.read_bytes() == b"row 1\n"
    assert (tmp_path / "elsewhere.jsonl").read_bytes() == b"row 1\nrow 2\ntorn"


# ------------------------------------------------------------------------------ a failed start never blocks a rerun


def test_a_value_that_cannot_be_written_is_refused_before_the_run_directory_exists(tmp_path):
    """A lone surrogate (valid in Python, not in UTF-8) in a config value: before, the run
    created its directory and guidance.json, then died on run.json, and neither a rerun nor
    --overwrite nor --resume could get past the half-made directory."""
    cfg = audit_inputs(tmp_path, n_tickets=6)
    with pytest.raises(InputError, match="lone surrogate"):  # the config check refuses it first
        load_config(cfg, ['model.stop=["\\ud800"]'])
    good = load_config(cfg)  # a value that got past the checks (a caller building a Config)
    bad = msgspec.structs.replace(good, model=msgspec.structs.replace(good.model, stop=["\ud800"]))
    for flags in ({}, {"overwrite": True}, {"resume": True}):
        with pytest.raises(InputError) as info:
            run_job(bad, "cpu:1", audit=True, engine_factory=never_called, debug=True, **flags)
        assert "config.model.stop[0] is not valid text ('\\ud800': a lone surrogate" in info.value.message
        assert not (tmp_path / "out").exists()
    assert audit(cfg, engine_factory=fake_factory()) == 0  # the fixed config runs


def test_a_run_whose_workers_fail_to_start_can_be_overwritten_and_resumed(tmp_path):
    cfg = audit_inputs(tmp_path, n_tickets=12)
    over = ["mode=search", "rule_search.eval_pool_size=4", "rule_search.train_pool_size=4", "runner.epochs=1"]

    def broken(device):
        raise RuntimeError("no such GPU")

    with pytest.raises(PoolError, match="no such GPU"):
        run_job(load_config(cfg, over), "cpu:1", engine_factory=broken, debug=True)
    run = tmp_path / "out" / MISSION / "run"
    assert sorted(p.name for p in run.iterdir()) == ["guidance.json", "run.json"]
    with pytest.raises(InputError, match="already exists"):
        run_job(load_config(cfg, over), "cpu:1", engine_factory=never_called, debug=True)
    assert run_job(load_config(cfg, over), "cpu:1", engine_factory=fake_factory(), debug=True, resume=True) == 0
    assert run_job(load_config(cfg, over), "cpu:1", engine_factory=fake_factory(), debug=True, overwrite=True) == 0
    assert (run / "summary.json").is_file()
