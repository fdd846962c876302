"""The baseline audit end to end: run_job in audit mode, its artifacts and their determinism."""

from __future__ import annotations

from pathlib import Path

import pytest
from doubles.fake_engine import fake_factory
from doubles.run_inputs import MISSION, SEED_RULES, audit_inputs
from processes import CORES, ONE_CORE, pinned

from stageb_pool.app.config import load_config
from stageb_pool.app.diff import diff_runs
from stageb_pool.app.job import run_job
from stageb_pool.search.fileio import read_json, read_jsonl

ARTIFACTS = [
    "baseline_metrics.json",
    "baseline_ticket_stats.jsonl",
    "baseline_wrong_cases.jsonl",
    "baseline_np_cases.jsonl",
    "baseline_ng_cases.jsonl",
    "baseline_metrics_steps.jsonl",
    "rule_search_hard_cases.jsonl",
    "guidance.json",
]


def run_audit_job(tmp_path, gpus="cpu:1", *, engine=None, extra="", n=24, model="tiny", run_name="run1",
                  overrides=(), **kw):
    config_path = Path(tmp_path) / "config.yaml"
    if not config_path.exists():
        audit_inputs(tmp_path, n_tickets=n, model=model, extra=extra)
    cfg = load_config(config_path, [f"output.run_name={run_name}", *overrides])
    assert run_job(cfg, gpus, audit=True, engine_factory=engine, argv=["test"], **kw) == 0
    return Path(cfg.output.root) / MISSION / cfg.output.run_name


def same_artifacts(a: Path, b: Path) -> list[str]:
    """Differences beyond the documented volatile fields (stageb_pool.app.diff)."""
    return [f"{d.file} {d.where} {d.key}: {d.a!r} != {d.b!r}" for d in diff_runs(a, b)]


def fake_audit(tmp_path, **kw):
    return run_audit_job(tmp_path, engine=fake_factory(**kw.pop("engine_kw", {})), **kw)


def test_fake_audit_metrics_and_case_split(tmp_path):
    run = fake_audit(tmp_path, n=24)
    for name in ARTIFACTS + ["run.json", "summary.json"]:
        assert (run / name).is_file(), name
    metrics = read_json(run / "baseline_metrics.json")
    ghash = metrics["guidance_hash"]
    assert len(ghash) == 16
    # missing-part tickets (see run_inputs.missing_part_records): 24 tickets, the fake engine judges
    # the text; mislabelled: NG (intact, labelled fail) i = 5, 19; NP (broken, labelled pass) i = 3, 18
    assert metrics["mode"] == "audit" and metrics["mission"] == MISSION
    assert (metrics["n_total"], metrics["n_used"], metrics["n_dropped_overlength"]) == (24, 24, 0)
    assert (metrics["np"], metrics["ng"], metrics["fn"], metrics["fp"]) == (2, 2, 2, 2)
    assert metrics["acc"] == pytest.approx(20 / 24)
    assert metrics["tp"] + metrics["tn"] == 20
    assert metrics["fn_rate"] == pytest.approx(2 / 24) and metrics["fp_rate"] == pytest.approx(2 / 24)

    np_rows = read_jsonl(run / "baseline_np_cases.jsonl")
    ng_rows = read_jsonl(run / "baseline_ng_cases.jsonl")
    wrong = read_jsonl(run / "baseline_wrong_cases.jsonl")
    assert [r["ticket_key"] for r in np_rows] == ["QC-0003::pass", "QC-0018::pass"]
    assert [r["ticket_key"] for r in ng_rows] == ["QC-0005::fail", "QC-0019::fail"]
    assert [r["ticket_key"] for r in wrong] == sorted(r["ticket_key"] for r in np_rows + ng_rows)
    for r in np_rows:
        assert (r["gt_label"], r["majority_pred"], r["group_id"], r["mission"]) == ("pass", "fail", r["ticket_key"][:7], MISSION)
        assert len(r["reason_samples"]) == 4 and len(r["verdict_samples"]) == 4  # K = 4 (<= 5 kept)
        assert r["per_image"]["image_1"].startswith("cabinet")
    assert all(len(r["reason_samples"]) == 3 for r in wrong)  # first 3 for wrong cases

    stats = read_jsonl(run / "baseline_ticket_stats.jsonl")
    assert [r["ticket_key"] for r in stats] == sorted(r["ticket_key"] for r in stats)
    assert len(stats) == 24
    row = next(r for r in stats if r["ticket_key"] == "QC-0002::pass")
    assert row["n_images"] == 3 and row["total_samples"] == 4 and row["pass_count"] == 4 and row["agreement"] == 1.0

    hard = read_jsonl(run / "rule_search_hard_cases.jsonl")
    assert sorted(r["ticket_key"] for r in hard) == sorted(r["ticket_key"] for r in wrong)
    assert [r["rank"] for r in hard] == [1, 2, 3, 4]
    assert {(r["sampler"], r["iteration"]) for r in hard} == {("baseline", 1)}
    assert all(r["majority_reason"] and r["reason_counts"] for r in hard)

    rows = [metrics] + stats + wrong + np_rows + ng_rows + hard + read_jsonl(run / "baseline_metrics_steps.jsonl")
    assert all(r["guidance_hash"] == ghash for r in rows)
    guidance = read_json(run / "guidance.json")[MISSION]
    assert guidance["experiences"] == SEED_RULES

    summary = read_json(run / "summary.json")
    assert summary["mode"] == "audit" and summary["generations_done"] == 24 * 4
    assert summary["generations_saved"] == 0 and "timing" in summary and "workers" in summary


def test_metrics_steps_are_prefixes_of_the_run_order(tmp_path):
    run = fake_audit(tmp_path, n=24)
    steps = read_jsonl(run / "baseline_metrics_steps.jsonl")
    # logging_steps 5 over 24 tickets: 5, 10, 15, 20, 24; n_total and label as upstream
    assert [r["n_done"] for r in steps] == [5, 10, 15, 20, 24]
    assert {r["n_total"] for r in steps} == {24} and {r["label"] for r in steps} == {"jump_reflection baseline"}
    assert [r["batch_index"] for r in steps] == [1, 2, 3, 4, 5]
    assert {r["total_batches"] for r in steps} == {5}
    final = read_json(run / "baseline_metrics.json")
    assert (steps[-1]["acc"], steps[-1]["fn"], steps[-1]["fp"]) == (final["acc"], final["fn"], final["fp"])
    assert all(r["elapsed_sec"] >= 0 for r in steps)
    assert [r["elapsed_sec"] for r in steps] == sorted(r["elapsed_sec"] for r in steps)


def test_dropped_and_invalid_tickets(tmp_path):
    drop = {"QC-0001::pass", "QC-0005::fail"}
    run = fake_audit(tmp_path, n=24, engine_kw={"drop_keys": drop, "invalid_keys": {"QC-0004::pass"}})
    metrics = read_json(run / "baseline_metrics.json")
    assert (metrics["n_total"], metrics["n_used"], metrics["n_dropped_overlength"]) == (24, 22, 2)
    keys = {r["ticket_key"] for r in read_jsonl(run / "baseline_ticket_stats.jsonl")}
    assert not keys & drop
    # the all-invalid GT-pass ticket is a false block: in metrics and in the NP file
    np_keys = [r["ticket_key"] for r in read_jsonl(run / "baseline_np_cases.jsonl")]
    assert "QC-0004::pass" in np_keys and metrics["np"] == len(np_keys) == 3
    hard = {r["ticket_key"] for r in read_jsonl(run / "rule_search_hard_cases.jsonl")}
    assert "QC-0004::pass" not in hard  # hard cases need a valid majority (upstream 3.6)


def test_save_rollouts_writes_every_candidate(tmp_path):
    run = fake_audit(tmp_path / "a", n=12)  # default: off
    assert not (run / "rollouts").exists()
    cfg_path = audit_inputs(tmp_path / "c", n_tickets=12)
    assert run_job(load_config(cfg_path, ["output.save_rollouts=true"]), "cpu:1", audit=True,
                   engine_factory=fake_factory()) == 0
    rows = read_jsonl(tmp_path / "c" / "out" / MISSION / "run" / "rollouts" / "audit.jsonl")
    assert len(rows) == 12 * 4
    assert [r["ticket_key"] for r in rows] == sorted(r["ticket_key"] for r in rows)
    first = rows[0]
    assert set(first) >= {"ticket_key", "decode_index", "sample_index", "text", "completion_tokens",
                          "finish_reason", "token_ids", "guidance_hash"}
    assert first["text"].startswith("Verdict:") and first["token_ids"]
    assert [(r["decode_index"], r["sample_index"]) for r in rows[:4]] == [(0, 0), (0, 1), (1, 0), (1, 1)]


def test_fake_audit_identical_on_one_and_three_workers(tmp_path):
    a = run_audit_job(tmp_path, "cpu:1", engine=fake_factory(flip=0.4), run_name="one")
    b = run_audit_job(tmp_path, "cpu:3", engine=fake_factory(flip=0.4), run_name="three")
    c = run_audit_job(tmp_path, "cpu:2", engine=fake_factory(flip=0.4), run_name="debug", debug=True)
    assert same_artifacts(a, b) == []
    assert same_artifacts(a, c) == []
    assert read_json(c / "run.json")["invocation"]["workers"] == 1
    assert (a / "baseline_ticket_stats.jsonl").read_bytes() == (b / "baseline_ticket_stats.jsonl").read_bytes()


def test_tiny_model_audit_identical_on_one_and_three_workers(tmp_path):
    """One worker seeing every core against three pinned to one (a worker's thread count must
    follow neither): the same artifacts, the headroom's P(pass) compared as exact floats."""
    save = ["output.save_rollouts=true", "headroom.tickets=12"]
    with pinned(CORES):
        a = run_audit_job(tmp_path, "cpu:1", n=12, run_name="one", overrides=save)
    with pinned(ONE_CORE):
        b = run_audit_job(tmp_path, "cpu:3", n=12, run_name="three", overrides=save)
    assert same_artifacts(a, b) == []
    p_one, p_three = ([r["p_pass"] for r in read_json(run / "judge_headroom.json")["per_ticket"]] for run in (a, b))
    assert len(p_one) == 12 and len(set(p_one)) > 1  # real, varied probabilities were compared
    assert [x.hex() for x in p_one] == [x.hex() for x in p_three]
    texts = [r["text"] for r in read_jsonl(a / "rollouts" / "audit.jsonl")]
    assert len(texts) == 12 * 4 and len(set(texts)) > 1  # real, varied generations were compared
    stats = read_jsonl(a / "baseline_ticket_stats.jsonl")
    assert len(stats) + read_json(a / "baseline_metrics.json")["n_dropped_overlength"] == 12
    run_json = read_json(a / "run.json")
    assert run_json["provenance"]["model_path"] == "tiny"
    assert run_json["invocation"]["workers"] == 1 and read_json(b / "run.json")["invocation"]["workers"] == 3
    assert run_json["provenance"] == read_json(b / "run.json")["provenance"]


def test_the_audit_exports_the_distillation_with_its_guidance(tmp_path, caplog):
    """Upstream's production runs (audit plus distillation) exported it after the baseline; a
    distill_size alone turns the export on, as upstream's default."""
    caplog.set_level("INFO", logger="stageb_pool")
    run = fake_audit(tmp_path, n=12, overrides=["stage_b_distillation.distill_size=8"])
    rows = read_jsonl(run / "distill_chatml.jsonl")
    assert 0 < len(rows) <= 8 and len({r["ticket_key"] for r in rows}) == len(rows)
    guidance = read_json(run / "guidance.json")[MISSION]["experiences"]
    for row in rows:
        assert [m["role"] for m in row["messages"]] == ["system", "user", "assistant"]
        assert guidance["G0"] in row["messages"][1]["content"]
        assert row["messages"][2]["content"].startswith("Verdict: ")
    summary = read_json(run / "summary.json")
    assert summary["distillation"] == {"path": "distill_chatml.jsonl", "tickets": 8, "rows": len(rows),
                                       "guidance_hash": summary["guidance_hash"]}
    assert f"distillation: {len(rows)} of 8 tickets exported to {run / 'distill_chatml.jsonl'}" in caplog.text


def test_without_a_distill_size_the_log_says_the_export_is_off(tmp_path, caplog):
    caplog.set_level("INFO", logger="stageb_pool")
    run = fake_audit(tmp_path, n=6)
    assert not (run / "distill_chatml.jsonl").exists() and read_json(run / "summary.json")["distillation"] is None
    assert "distillation: off" in caplog.text


def test_a_cli_run_checks_the_model_path_once_in_the_parent(tmp_path):
    """model.path is checked once per run, in the parent (the plan's config load); the prompt
    check's helper and the workers load the ModelRef they are given. A whole CLI audit with the
    tiny model on two forked workers, each call of check_model_path in any process written down
    with its pid."""
    import os
    import subprocess
    import sys

    config = audit_inputs(tmp_path / "in", n_tickets=8)
    calls = tmp_path / "calls.txt"
    script = f"""
import os, sys
from stageb_pool.engine import models

checked = models.check_model_path

def counted(path):
    with open({str(calls)!r}, "a") as f:
        f.write(f"{{os.getpid()}}\\n")
    return checked(path)

models.check_model_path = counted  # before any other module of ours is imported: all see it
from stageb_pool.app import cli
print(os.getpid(), flush=True)
sys.exit(cli.main(["--gpus", "cpu:2", {config!r}, "--audit", "--log-level", "warning"]))
"""
    repo = Path(__file__).resolve().parents[1]
    proc = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=600,
                          env=dict(os.environ, PYTHONPATH=str(repo)))
    assert proc.returncode == 0, proc.stderr[-3000:]
    parent = proc.stdout.split()[0]
    assert calls.read_text().split() == [parent]
