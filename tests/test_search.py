"""The rule search end to end, driven by the scripted engine (tests/doubles/scripted_engine.py).

The scripted engine obeys the guidance rules, so a good rule really lowers the error and a
harmful one really raises it; its proposer answers follow a script keyed by iteration.
Default script (see scripted_engine.DEFAULT_SCRIPT), 60 train / 20 eval tickets, whole
train set as the pool:
  it1: rust (good, accepted), clean (harmful, rejected), dust (duplicate of G1), bad op;
       ablation remove G1 (rejected: FP rate rises)
  it2: malformed JSON; ablation remove rust (rejected)
  it3: crack (good, accepted)
  it4: clean again (remembered as rejected); ablation remove crack (rejected)
  it5: nothing new -> second no-gain round -> early stop (patience 2)
"""

from __future__ import annotations

import json
import math
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from doubles import scripted_engine as se
from doubles.run_inputs import MISSION, SEED, feature_records, search_inputs

from stageb_pool.app import config as config_mod
from stageb_pool.app import job, plan
from stageb_pool.app.diff import diff_runs, format_differences, is_volatile_file
from stageb_pool.app.identity import run_identity
from stageb_pool.search import state as state_mod
from stageb_pool.search.distill import distill_sampler
from stageb_pool.search.guidance_store import GuidanceStore
from stageb_pool.search.run_format import differing_keys
from stageb_pool.stageb.errors import InputError
from stageb_pool.stageb.hashing import content_hash
from stageb_pool.stageb.ticket_pools import split_eval_pool

TESTS = Path(__file__).resolve().parent


def run(tmp_path, name="run", *, gpus="cpu:1", overrides=(), engine=None, resume=False, **inputs):
    """Write the inputs under tmp_path/in and run the search; returns (run_dir, engines)."""
    cfg_path = search_inputs(tmp_path / "in", out=str(tmp_path / "out"), run_name=name, **inputs)
    cfg = config_mod.load_config(cfg_path, list(overrides))
    engines: list = []
    factory = se.scripted_factory(engines, **(engine or {}))
    job.run_job(cfg, gpus, debug=(gpus == "cpu:1"), engine_factory=factory, resume=resume)
    return tmp_path / "out" / MISSION / name, engines


def rows(run_dir, name):
    path = Path(run_dir) / name
    return [json.loads(line) for line in path.read_text().splitlines()] if path.exists() else []


def doc(run_dir, name):
    return json.loads((Path(run_dir) / name).read_text())


def experiences(run_dir):
    return doc(run_dir, "guidance.json")[MISSION]["experiences"]


def assert_same_run(a, b):
    diffs = diff_runs(a, b, limit=None)
    assert not diffs, format_differences(diffs, str(a), str(b))


class Reference:
    """The uninterrupted inline run of the default script. Runs compared with it use the same
    input files (``root``) under other run names: run.json and state.json hold the input paths."""

    def __init__(self, root):
        self.root = root
        self.run_dir, engines = run(root)
        self.engine = engines[0]

    def __iter__(self):
        return iter((self.run_dir, self.engine))


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    return Reference(tmp_path_factory.mktemp("reference"))


# ----------------------------------------------------------------------------- the loop


def test_accepts_good_rules_rejects_harmful_and_early_stops(reference):
    run_dir, _ = reference
    bench = rows(run_dir, "benchmarks.jsonl")
    assert [(b["iteration"], b["text"]) for b in bench] == [(1, se.rule("rust")), (3, se.rule("crack"))]
    assert [b["guidance_step_after"] for b in bench] == [1, 2]
    assert bench[0]["accepted_key"] == "G2" and bench[0]["relative_error_reduction"] >= 0.1
    assert len(bench[0]["reflect_ticket_keys"]) == 4
    exp = experiences(run_dir)
    assert exp["G2"].startswith("If any photo shows rust") and exp["G3"].startswith("If any photo shows crack")
    assert exp["G1"] == se.rule("dust")  # the seed rule could not be ablated (FP rate would rise)

    summary = doc(run_dir, "summary.json")
    assert summary["stop_reason"] == "early_stop" and summary["iterations"] == 5
    assert [e["iteration"] for e in summary["edits"]] == [1, 3]
    assert summary["final"]["train"]["acc"] > summary["baseline"]["train"]["acc"]
    assert summary["final"]["eval"]["fp_rate"] < summary["baseline"]["eval"]["fp_rate"]
    assert summary["final"]["train"]["n"] == summary["baseline"]["train"]["n"] == 60
    st = doc(run_dir, "state.json")
    assert st["iteration"] == 5 and st["no_gain"] == 2 and st["stop_reason"] == "early_stop"
    assert st["guidance_step"] == 2 and st["guidance_hash"] == content_hash(exp)
    assert sorted((run_dir / "snapshots").iterdir())[-1].name == "guidance-step0001.json"


def test_candidate_rows_carry_gate_statistics_and_decisions(reference):
    run_dir, _ = reference
    cands = rows(run_dir, "rule_candidates.jsonl")
    by = {(c["iteration"], c["candidate_id"]): c for c in cands}
    assert [(c["iteration"], c["candidate_index"]) for c in cands] == [(1, 1), (1, 2), (1, 3), (2, 1), (3, 1), (4, 1)]
    rust = by[(1, "upsert:if any photo shows rust the verdict is fail")]
    clean = by[(1, "upsert:if any photo shows clean the verdict is fail")]
    ablate = by[(1, "remove:if any photo shows dust the verdict is fail")]
    assert (rust["decision"], rust["applied"], rust["reason"]) == ("promoted", True, None)
    assert clean["decision"] == "rejected" and clean["reason"].startswith("RER")
    assert clean["relative_error_reduction"] < 0 and clean["regression_count"] > 0
    assert ablate["source"] == "ablation" and ablate["op"] == "remove"
    assert ablate["decision"] == "rejected" and ablate["reason"].startswith("FP rate rise")
    assert ablate["d_fp_rate"] > 0.05
    for c in cands:
        # the gate statistics upstream did not log, both guidance hashes, eval only on passes
        for key in ("relative_error_reduction", "changed_fraction", "bootstrap_prob", "d_acc", "d_fp_rate",
                    "base_fp_rate", "cand_fp_rate", "regression_count", "base_guidance_hash",
                    "cand_guidance_hash", "reflection_id", "train_n", "eval_n"):
            assert c[key] is not None, key
        assert c["cand_guidance_hash"] != c["base_guidance_hash"]
        assert (c["eval_cand_acc"] is not None) == (c["decision"] == "promoted")
        assert 0 <= c["changed_fraction"] <= 1 and 0 <= c["bootstrap_prob"] <= 1
    # RER recomputed from the logged accuracies (same common tickets)
    for c in cands:
        e_b, e_c = 1 - (c["cand_acc"] - c["d_acc"]), 1 - c["cand_acc"]
        assert math.isclose(c["relative_error_reduction"], (e_b - e_c) / max(e_b, 1e-12), abs_tol=1e-9)
    regs = rows(run_dir, "rule_search_candidate_regressions.jsonl")
    assert {(r["iteration"], r["candidate_id"]) for r in regs} == {
        (c["iteration"], c["candidate_id"]) for c in cands if c["regression_count"]}
    for r in regs:
        assert r["regression_count"] == by[(r["iteration"], r["candidate_id"])]["regression_count"]
        assert len(r["regressions"]) == min(50, r["regression_count"])


def test_target_signatures_are_null_unless_a_merge_as_upstream(reference):
    """Downstream scripts read upstream's rows: target_signatures is null for every non-merge
    candidate in rule_candidates and the regressions, and the stored list ([]) in benchmarks."""
    run_dir, _ = reference
    for name in ("rule_candidates.jsonl", "rule_search_candidate_regressions.jsonl"):
        found = rows(run_dir, name)
        assert found and all(r["op"] != "merge" for r in found)
        assert all(r["target_signatures"] is None for r in found), name
    removes = [r for r in rows(run_dir, "rule_candidates.jsonl") if r["op"] == "remove"]
    assert removes and all(r["target_signature"] and r["text"] is None for r in removes)
    assert all(b["target_signatures"] == [] for b in rows(run_dir, "benchmarks.jsonl"))


def test_rejected_candidates_are_remembered_for_the_rest_of_the_run(reference):
    run_dir, _ = reference
    cands = rows(run_dir, "rule_candidates.jsonl")
    ids = [c["candidate_id"] for c in cands]
    assert len(ids) == len(set(ids))  # nothing rejected is evaluated twice
    failures = rows(run_dir, "reflection_cache/rule_search_proposer_failures.jsonl")
    assert any(f["iteration"] == 4 and f["error"] == "previously rejected candidate" for f in failures)
    assert "upsert:if any photo shows clean the verdict is fail" in doc(run_dir, "state.json")["rejected_ids"]


def test_proposer_failures_are_logged_with_their_reason(reference):
    run_dir, _ = reference
    failures = rows(run_dir, "reflection_cache/rule_search_proposer_failures.jsonl")
    got = [(f["iteration"], f["stage"], f["error"]) for f in failures]
    assert (1, "validate", "duplicate of existing rule G1") in got
    assert (1, "validate", "unknown op 'frobnicate'") in got
    parse = [f for f in failures if f["stage"] == "parse"]
    assert [f["iteration"] for f in parse] == [2]
    assert parse[0]["raw_response_prefix"].startswith("Sure! Here are my rules")
    assert len(parse[0]["raw_response_prefix"]) <= 400 and parse[0]["examples"] == 4
    assert parse[0]["prompt_tokens"] > 0


def test_every_proposer_answer_is_kept_whole_and_a_cut_off_one_is_named_truncated(reference):
    run_dir, _ = reference
    answers = rows(run_dir, "reflection_cache/proposer_answers.jsonl")
    assert [(a["iteration"], a["parsed"], a["finish_reason"]) for a in answers] == [
        (1, True, "stop"), (2, False, "length"), (3, True, "stop"), (4, True, "stop"), (5, True, "stop")]
    assert answers[0]["text"] == se.DEFAULT_SCRIPT[1] and answers[0]["operations"] == 4
    assert answers[1]["error"] == "truncated at proposer_max_new_tokens=2048"  # not the inner object's error
    assert answers[1]["text"] == se.DEFAULT_SCRIPT[2] and answers[1]["completion_tokens"] > 0
    parse = [f for f in rows(run_dir, "reflection_cache/rule_search_proposer_failures.jsonl") if f["stage"] == "parse"]
    assert [f["error"] for f in parse] == ["truncated at proposer_max_new_tokens=2048"]


def test_every_iteration_records_its_decision_and_why(reference, capfd):
    run_dir, _ = reference
    its = rows(run_dir, "rule_search_iterations.jsonl")
    assert [(r["iteration"], r["decision"], r["candidates_proposed"], r["candidates_evaluated"]) for r in its] == [
        (1, "accepted", 5, 3), (2, "rejected", 1, 1), (3, "accepted", 1, 1), (4, "rejected", 2, 1),
        (5, "no_candidates", 0, 0)]
    first = its[0]
    assert first["candidates_rejected"] == {"duplicate of existing rule": 1, "unknown op": 1}
    assert first["accepted_candidate"] == "upsert:if any photo shows rust the verdict is fail"
    assert first["reasons"][0] == "cand1 upsert:if any photo shows rust the verdict is fail: accepted"
    assert first["reasons"][1].startswith("cand2 upsert:if any photo shows clean the verdict is fail: RER -")
    assert [r["proposer_parsed"] for r in its] == [1, 0, 1, 1, 1]
    assert [(r["guidance_step"], r["guidance_step_after"]) for r in its] == [(0, 1), (1, 1), (1, 2), (2, 2), (2, 2)]
    assert its[4]["reasons"] == ["the proposer answer held no operation",
                                 "ablation of G1, G2, G3 already rejected earlier in the run"]
    for r in its:
        assert r["candidates_proposed"] == r["candidates_evaluated"] + sum(r["candidates_rejected"].values())
    bench = rows(run_dir, "benchmarks.jsonl")
    assert its[0]["best_candidate"]["relative_error_reduction"] == bench[0]["relative_error_reduction"]
    summary = doc(run_dir, "summary.json")
    assert summary["why"].startswith("2 edit(s) accepted in 5 iteration(s) because they passed the gate")


@pytest.mark.parametrize("gpus", ["cpu:1", "cpu:2"])
def test_a_raising_proposer_call_leaves_the_iteration_its_ablation_candidates(tmp_path, gpus):
    """Upstream catches a failed proposer call: no proposer candidates, the ablation fill,
    the gate and the no-gain count go on. The eval baseline shares the call's gather and
    must still be complete."""
    run_dir, _ = run(tmp_path, gpus=gpus, engine={"raise_at": 1})
    failures = rows(run_dir, "reflection_cache/rule_search_proposer_failures.jsonl")
    (generate,) = [f for f in failures if f["stage"] == "generate"]
    assert generate["iteration"] == 1 and generate["examples"] == 4 and generate["prompt_tokens"] is None
    # the engine's error, never which worker ran it (the same bytes on any worker count)
    assert generate["error"] == "chat(): RuntimeError: scripted failure in the proposer call of iteration 1"
    first = [c for c in rows(run_dir, "rule_candidates.jsonl") if c["iteration"] == 1]
    assert [(c["source"], c["op"]) for c in first] == [("ablation", "remove")]
    assert first[0]["eval_n"] == 20 and first[0]["eval_base_acc"] is not None
    summary = doc(run_dir, "summary.json")
    assert summary["baseline"]["eval"]["n"] == 20
    assert summary["iterations"] == 2 and summary["stop_reason"] == "early_stop"  # two no-gain rounds


def test_hard_cases_are_written_for_every_train_baseline(reference):
    run_dir, _ = reference
    hard = rows(run_dir, "rule_search_hard_cases.jsonl")
    assert sorted({h["iteration"] for h in hard}) == [1, 2, 3, 4, 5]
    for it in range(1, 6):
        mine = [h for h in hard if h["iteration"] == it]
        assert [h["rank"] for h in mine] == list(range(1, len(mine) + 1))
        assert all(h["sampler"] == "train" and h["majority_pred"] != h["gt_label"] for h in mine)
        keys = [(h["hard_wrong"], h["difficulty"]) for h in mine]
        assert keys == sorted(keys, reverse=True)


def test_nothing_is_generated_twice_and_the_eval_baseline_once_per_guidance(reference):
    run_dir, engine = reference
    assert len(engine.calls) == len(set(engine.calls))  # the cache serves every repeat
    g = doc(run_dir, "state.json")["guidance_hash"]
    eval_chunks = math.ceil(20 / 8)
    eval_key = f"{SEED}/eval"
    # step-2 guidance is needed by the it3 candidate eval, the it4 and it5 eval baselines and
    # the final eval: generated once
    assert sum(1 for key, _, h in engine.calls if key == eval_key and h == g) == eval_chunks
    # the train baseline of it2 is it1's accepted candidate rollout (same pool, same seeds)
    step1 = rows(run_dir, "benchmarks.jsonl")[0]["guidance_hash"]
    train_keys = {key for key, _, _ in engine.calls if "/train/" in key}
    assert len(train_keys) == 1  # the whole train set every iteration: one pool identity
    assert sum(1 for key, _, h in engine.calls if key in train_keys and h == step1) == math.ceil(60 / 8)
    summary = doc(run_dir, "summary.json")
    assert summary["generations_done"] == engine.generations  # every generation is counted once
    assert summary["generations_saved"] > summary["generations_done"]


def test_common_random_numbers_candidates_share_the_baseline_seed(reference):
    _, engine = reference
    train_calls = [(key, h) for key, _, h in engine.calls if "/train/" in key]
    # baseline and every candidate guidance of the pool ran under one seed key
    assert len({key for key, _ in train_calls}) == 1 and len({h for _, h in train_calls}) >= 5


# ----------------------------------------------------------------------------- determinism


def test_artifacts_identical_on_cpu1_inline_and_cpu3(reference):
    run_dir, _ = reference
    other, _ = run(reference.root, "cpu3", gpus="cpu:3")
    assert_same_run(run_dir, other)
    a, b = doc(run_dir, "state.json"), doc(other, "state.json")
    assert a["artifacts"] == b["artifacts"]  # byte lengths too: timestamps are fixed-width


@pytest.mark.parametrize("gpus", ["cpu:2", "cpu:4"])
def test_speculation_on_and_off_give_the_same_bytes(reference, gpus):
    """Speculation (on by default) computes the next iteration's baseline and proposer calls
    ahead on idle workers: the artifacts are those of the inline run without it."""
    run_dir, _ = reference
    on, _ = run(reference.root, f"spec-on-{gpus}", gpus=gpus)
    off, _ = run(reference.root, f"spec-off-{gpus}", gpus=gpus, overrides=["runner.speculate=false"])
    assert_same_run(run_dir, on)
    assert_same_run(run_dir, off)
    used = doc(on, "summary.json")["timing"]["speculation"]
    # it2 and it4 accept nothing: it3's and it5's baselines and proposer calls were speculated
    assert used["used"] >= 2 and used["tasks"] >= used["used"]
    assert doc(off, "summary.json")["timing"]["speculation"]["tasks"] == 0


def test_an_interrupted_speculating_run_resumes_to_the_same_bytes(monkeypatch, reference):
    """Ctrl-C at iteration 3's commit while speculation runs on 3 workers; resumed on 2."""
    ref_dir, _ = reference
    real, calls = state_mod.write_state, []

    def interrupted(run_dir, st):
        calls.append(st.iteration)
        if len(calls) == 3:
            raise KeyboardInterrupt
        real(run_dir, st)

    monkeypatch.setattr(state_mod, "write_state", interrupted)
    with pytest.raises(KeyboardInterrupt):
        run(reference.root, "spec-ctrl-c", gpus="cpu:3")
    monkeypatch.setattr(state_mod, "write_state", real)
    run_dir, _ = run(reference.root, "spec-ctrl-c", gpus="cpu:2", resume=True)
    timing = doc(run_dir, "summary.json")["timing"]
    assert timing["resumed"] is True and timing["speculation"]["used"] >= 1  # it4 accepts nothing: it5 speculated
    assert_same_run(ref_dir, run_dir)


def test_proposer_calls_fan_out_with_their_own_seeds_and_merge_without_duplicates(tmp_path):
    """Two proposer calls per iteration: the scripted proposer answers by iteration, so the
    second call repeats the first and its candidates are rejected as duplicates before any
    rollout; the same bytes on 1 (inline) and 3 workers."""
    one, engines = run(tmp_path, "k2", overrides=["rule_search.proposer_calls=2"])
    three, _ = run(tmp_path, "k2-cpu3", gpus="cpu:3", overrides=["rule_search.proposer_calls=2"])
    assert_same_run(one, three)
    answers = rows(one, "reflection_cache/proposer_answers.jsonl")
    assert [(a["iteration"], a["call"]) for a in answers[:4]] == [(1, 1), (1, 2), (2, 1), (2, 2)]
    first = [r for r in rows(one, "rule_search_iterations.jsonl") if r["iteration"] == 1][0]
    assert first["proposer_calls"] == 2
    assert first["candidates_rejected"]["duplicate of a candidate of an earlier proposer call"] == 2
    assert [e["iteration"] for e in doc(one, "summary.json")["edits"]] == [1, 3]


# ----------------------------------------------------------------------------- resume


def _wait_for(predicate, deadline_s=60.0):
    end = time.monotonic() + deadline_s
    while time.monotonic() < end:
        if predicate():
            return True
        time.sleep(0.02)
    return False


def test_resume_after_an_exception_mid_iteration_matches_uninterrupted(reference):
    ref_dir, _ = reference
    with pytest.raises(se.ScriptedCrash):
        run(reference.root, "exc", engine={"crash_at": 2})
    run_dir = reference.root / "out" / MISSION / "exc"
    assert doc(run_dir, "state.json")["iteration"] == 1
    committed = doc(run_dir, "state.json")["artifacts"]["rule_search_hard_cases.jsonl"]
    assert (run_dir / "rule_search_hard_cases.jsonl").stat().st_size > committed  # it2 rows, uncommitted
    run(reference.root, "exc", resume=True)
    assert_same_run(ref_dir, run_dir)


@pytest.mark.parametrize("fail_at_commit", [1, 3])
def test_resume_after_ctrl_c_between_guidance_and_state_write(monkeypatch, reference, fail_at_commit):
    """An interrupt after guidance.json got iteration N's edit but before state.json did:
    the resumed run restores the committed guidance and redoes iteration N."""
    ref_dir, _ = reference
    real = state_mod.write_state
    calls = []

    def interrupted(run_dir, st):
        calls.append(st.iteration)
        if len(calls) == fail_at_commit:
            raise KeyboardInterrupt
        real(run_dir, st)

    name = f"ctrl-c-{fail_at_commit}"
    monkeypatch.setattr(state_mod, "write_state", interrupted)
    with pytest.raises(KeyboardInterrupt):
        run(reference.root, name)
    monkeypatch.setattr(state_mod, "write_state", real)
    run_dir = reference.root / "out" / MISSION / name
    assert len(rows(run_dir, "benchmarks.jsonl")) == (1 if fail_at_commit == 1 else 2)  # ahead of the commit
    run(reference.root, name, resume=True)
    assert_same_run(ref_dir, run_dir)


def test_resume_after_sigkill_with_rolling_train_pools(tmp_path):
    """Kill -9 the parent while iteration 2 runs (its proposer call hangs), resume, and get
    exactly the uninterrupted run. Pools of 25 of 60 tickets roll, so the sampler state
    is part of what must survive."""
    ref_dir, _ = run(tmp_path, "ref", train_pool_size=25)
    cfg_path = search_inputs(tmp_path / "in", out=str(tmp_path / "out"), train_pool_size=25)
    marker = tmp_path / "hanging"
    code = (
        "import sys; sys.path[:0] = [{tests!r}]\n"
        "from doubles import scripted_engine as se\n"
        "from stageb_pool.app import config, job\n"
        "cfg = config.load_config({cfg!r})\n"
        "job.run_job(cfg, 'cpu:1', debug=True, engine_factory=se.scripted_factory(hang_at=2, marker={marker!r}))\n"
    ).format(tests=str(TESTS), cfg=cfg_path, marker=str(marker))
    proc = subprocess.Popen([sys.executable, "-c", code], cwd=str(TESTS.parent),
                            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    try:
        assert _wait_for(lambda: marker.exists() or proc.poll() is not None), "iteration 2 never started"
        assert proc.poll() is None, proc.stderr.read().decode()
        run_dir = tmp_path / "out" / MISSION / "run"
        assert doc(run_dir, "state.json")["iteration"] == 1
        os.kill(proc.pid, signal.SIGKILL)
        proc.wait(timeout=30)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
        proc.stderr.close()
    assert (run_dir / "rule_search_hard_cases.jsonl").stat().st_size > \
        doc(run_dir, "state.json")["artifacts"]["rule_search_hard_cases.jsonl"]
    cfg = config_mod.load_config(cfg_path)
    job.run_job(cfg, "cpu:1", debug=True, engine_factory=se.scripted_factory(), resume=True)
    assert_same_run(ref_dir, run_dir)
    pools = doc(run_dir, "state.json")["sampler"]
    assert pools["size"] == 25


def test_resume_of_a_finished_run_changes_nothing(tmp_path):
    run_dir, _ = run(tmp_path)

    def artifacts():  # the wall-clock pool_timeline.jsonl is the resumed process's own
        return {p: p.read_bytes() for p in run_dir.rglob("*.jsonl") if not is_volatile_file(p.name)}

    before = artifacts()
    _, engines = run(tmp_path, resume=True)
    assert artifacts() == before
    assert engines[0].chats == []  # no iteration was redone
    assert doc(run_dir, "summary.json")["stop_reason"] == "early_stop"


def test_resume_with_a_changed_config_is_refused_naming_the_key(tmp_path):
    with pytest.raises(se.ScriptedCrash):
        run(tmp_path, engine={"crash_at": 2})
    run_dir = tmp_path / "out" / MISSION / "run"
    before = (run_dir / "state.json").read_bytes()
    with pytest.raises(InputError, match=r"rule_search\.reflect_size"):
        run(tmp_path, resume=True, overrides=["rule_search.reflect_size=5"])
    with pytest.raises(InputError, match=r"rule_search\.gate\.bootstrap\.iterations"):
        run(tmp_path, resume=True, overrides=["rule_search.gate.bootstrap.iterations=99"])
    assert (run_dir / "state.json").read_bytes() == before


def test_resume_with_changed_tickets_is_refused(tmp_path):
    with pytest.raises(se.ScriptedCrash):
        run(tmp_path, engine={"crash_at": 2})
    tickets = tmp_path / "in" / "tickets.jsonl"
    cfg = config_mod.load_config(search_inputs(tmp_path / "in", out=str(tmp_path / "out")))
    tickets.write_text(tickets.read_text().replace("cabinet 3 front", "cabinet 3 top"))
    with pytest.raises(InputError, match="tickets differ"):
        job.run_job(cfg, "cpu:1", debug=True, engine_factory=se.scripted_factory(), resume=True)


def test_a_finished_run_is_extended_by_raising_the_epochs(tmp_path):
    ref_dir, _ = run(tmp_path, "four", epochs=4)
    run_dir, _ = run(tmp_path, "two", epochs=2)
    assert doc(run_dir, "summary.json")["stop_reason"] == "epochs"
    extended, engines = run(tmp_path, "two", epochs=4, resume=True)
    assert doc(extended, "summary.json")["iterations"] == 4
    assert engines[0].chats == [3, 4]  # only the new iterations were run
    assert_same_run(ref_dir, extended)


def _count_reads(monkeypatch, path: Path) -> list:
    """Record every opening of ``path`` for reading (``open``, ``io.open``, ``os.open``): the
    inline run (cpu:1) does all its file work in this process."""
    import builtins
    import io

    target, reads = os.path.abspath(path), []

    def reading(mode) -> bool:
        return isinstance(mode, str) and not any(c in mode for c in "wax+")

    def wrap(original, is_read):
        def opened(file, *args, **kwargs):
            mode = args[0] if args else kwargs.get("mode", kwargs.get("flags", "r"))
            if isinstance(file, (str, os.PathLike)) and os.path.abspath(file) == target and is_read(mode):
                reads.append(file)
            return original(file, *args, **kwargs)
        return opened

    monkeypatch.setattr(builtins, "open", wrap(builtins.open, reading))
    monkeypatch.setattr(io, "open", wrap(io.open, reading))
    monkeypatch.setattr(os, "open", wrap(os.open, lambda flags: flags & os.O_ACCMODE == os.O_RDONLY))
    return reads


def test_the_search_reads_guidance_json_only_on_resume(tmp_path, monkeypatch):
    """The committed guidance is held in memory: a search only writes guidance.json (two
    accepted edits in these 3 iterations, each with its snapshot); a resume reads it back.
    report.html's reads are not counted: its process (forked at the start) counts into its own
    copy, and the page is made from the run directory's files, as ``stageb-pool report`` makes it."""
    run_dir = tmp_path / "out" / MISSION / "three"
    reads = _count_reads(monkeypatch, run_dir / "guidance.json")
    run(tmp_path, "three", epochs=3)
    assert len(rows(run_dir, "benchmarks.jsonl")) == 2 and len(list((run_dir / "snapshots").iterdir())) == 2
    assert reads == []
    run(tmp_path, "three", epochs=3, resume=True)
    assert len(reads) >= 1


def test_resume_accepts_other_pool_settings_and_a_moved_data_folder(tmp_path):
    ref_dir, _ = run(tmp_path / "a", "ref")
    with pytest.raises(se.ScriptedCrash):
        run(tmp_path / "a", engine={"crash_at": 2})
    (tmp_path / "a" / "in").rename(tmp_path / "moved")  # the data folder moves; same content
    cfg_path = search_inputs(tmp_path / "moved", out=str(tmp_path / "a" / "out"))
    cfg = config_mod.load_config(cfg_path, ["pool.task_timeout=99", "pool.max_restarts=2"])
    job.run_job(cfg, "cpu:1", debug=True, engine_factory=se.scripted_factory(), resume=True)
    diffs = diff_runs(ref_dir, tmp_path / "a" / "out" / MISSION / "run", limit=None)
    # run.json records the pool settings the resumed process ran with; nothing else differs
    assert [(d.file, d.key) for d in diffs] == [("run.json", "config.pool.task_timeout"),
                                                ("run.json", "config.pool.max_restarts")]


def test_resume_with_a_changed_seed_guidance_is_refused(tmp_path):
    with pytest.raises(se.ScriptedCrash):
        run(tmp_path, engine={"crash_at": 2})
    guidance = tmp_path / "in" / "guidance.json"
    guidance.write_text(guidance.read_text().replace("Check the cabinet", "Inspect the cabinet"))
    with pytest.raises(InputError, match=r"differs from the interrupted run's at guidance\.path \(input files are"):
        job.run_job(config_mod.load_config(tmp_path / "in" / "config.yaml"), "cpu:1", debug=True,
                    engine_factory=se.scripted_factory(), resume=True)


def test_differing_keys_names_nested_paths():
    old = {"a": 1, "b": {"c": [1, 2], "d": "x"}, "e": None}
    new = {"a": 1, "b": {"c": [1, 3], "d": "x"}, "f": 2}
    assert differing_keys(old, new) == ["b.c", "e", "f"]
    assert differing_keys(old, old) == []


# ----------------------------------------------------------------------------- options


def _veto_records():
    """A 'moss' feature that marks fail tickets in the train split and pass tickets in the
    eval split: a moss rule helps on train and hurts on eval."""
    records = feature_records()

    class T:
        def __init__(self, r):
            self.key, self.label = f"{r['group_id']}::{r['label']}", r["label"]

    _, held = split_eval_pool([T(r) for r in records], 20, SEED)
    held_keys = {t.key for t in held}
    for r in records:
        key = f"{r['group_id']}::{r['label']}"
        has_rust_or_crack = r["label"] == "fail"
        if (key in held_keys and not has_rust_or_crack) or (key not in held_keys and has_rust_or_crack):
            r["per_image"]["image_2"] += ", moss seen"
    return records


@pytest.mark.parametrize("max_drop, decision", [(None, "promoted"), (0.05, "rejected_eval_veto")])
def test_eval_veto(tmp_path, max_drop, decision):
    script = {1: se.proposal(se.op(se.rule("moss")))}
    overrides = [] if max_drop is None else [f"rule_search.gate.eval_max_acc_drop={max_drop}"]
    run_dir, _ = run(tmp_path, overrides=overrides, engine={"script": script}, epochs=1, records=_veto_records())
    (moss,) = [c for c in rows(run_dir, "rule_candidates.jsonl") if "moss" in c["candidate_id"]]
    assert moss["decision"] == decision
    assert moss["eval_acc_drop"] > 0.05 and moss["eval_cand_acc"] < moss["eval_base_acc"]
    assert moss["applied"] == (decision == "promoted")
    assert ("moss" in json.dumps(experiences(run_dir))) == (decision == "promoted")


def test_eval_columns_compare_baseline_and_candidate_on_the_same_tickets(tmp_path):
    """The rust rule lengthens the prompt past the eval sampler's max_prompt_tokens for the 6
    longest eval tickets: baseline and candidate are compared on the 14 both judged."""
    run_dir, _ = run(tmp_path, overrides=["rule_search.eval_sampler.max_prompt_tokens=62"], epochs=1)
    cands = {c["candidate_id"].split()[4]: c for c in rows(run_dir, "rule_candidates.jsonl")
             if c["op"] == "upsert"}
    rust, clean = cands["rust"], cands["clean"]
    assert rust["decision"] == "promoted" and rust["eval_n"] == 14
    assert rust["eval_acc_drop"] == pytest.approx(rust["eval_base_acc"] - rust["eval_cand_acc"], abs=1e-12)
    assert clean["eval_cand_acc"] is None and clean["eval_n"] == 20  # no eval rollout: the whole baseline
    (bench,) = rows(run_dir, "benchmarks.jsonl")
    assert (bench["eval_n"], bench["eval_base_acc"], bench["eval_after_acc"]) == (
        14, rust["eval_base_acc"], rust["eval_cand_acc"])


def test_empty_eval_pool_runs(tmp_path):
    run_dir, engines = run(tmp_path, overrides=["rule_search.eval_pool_size=0"])
    summary = doc(run_dir, "summary.json")
    assert summary["baseline"]["eval"] is None and summary["final"]["eval"] is None
    assert summary["baseline"]["train"]["n"] == 80
    assert all(c["eval_cand_acc"] is None for c in rows(run_dir, "rule_candidates.jsonl"))
    assert not any("/eval" in key for key, _, _ in engines[0].calls)


def test_epochs_cap_the_iterations(tmp_path):
    run_dir, _ = run(tmp_path, epochs=2)
    summary = doc(run_dir, "summary.json")
    assert summary["iterations"] == 2 and summary["stop_reason"] == "epochs"


@pytest.mark.parametrize("enabled", [["stage_b_distillation.enabled=true"], []])  # on by default, as upstream
def test_distillation_runs_once_after_the_loop_with_the_final_guidance(tmp_path, enabled):
    overrides = [*enabled, "stage_b_distillation.distill_size=12", "stage_b_distillation.distill_temperature=0.1"]
    run_dir, engines = run(tmp_path, overrides=overrides)
    distill = rows(run_dir, "distill_chatml.jsonl")
    assert 0 < len(distill) <= 12
    final = experiences(run_dir)
    for row in distill:
        roles = [m["role"] for m in row["messages"]]
        assert roles == ["system", "user", "assistant"]
        assert row["ticket_key"] == f"{row['group_id']}::{row['label']}"
        assert row["messages"][2]["content"].startswith("Verdict: ")
        assert final["G3"] in row["messages"][1]["content"]  # the final guidance is in the prompt
    distill_calls = [c for c in engines[0].calls if c[0] == f"{SEED}/distill"]
    assert len(distill_calls) == math.ceil(12 / 8)  # one rollout, once
    assert doc(run_dir, "summary.json")["distillation"]["rows"] == len(distill)


def test_distill_sampler_picks_or_derives_the_decode():
    from stageb_pool.app.config import SamplerConfig
    from stageb_pool.engine.records import Decode

    sampler = SamplerConfig(grid=[Decode(temperature=0.3, seed=43), Decode(temperature=0.7)], samples_per_decode=3)
    assert distill_sampler(sampler, None).grid == [Decode(temperature=0.3, seed=43)]
    assert distill_sampler(sampler, 0.7).grid == [Decode(temperature=0.7)]
    derived = distill_sampler(sampler, 0.1)
    assert derived.grid == [Decode(temperature=0.1, seed=43)] and derived.samples_per_decode == 1


def test_state_truncation_cuts_an_artifact_back_to_its_committed_length(tmp_path):
    (tmp_path / "rule_candidates.jsonl").write_bytes(b"x" * 10)
    assert state_mod.truncate_artifacts(tmp_path, {"rule_candidates.jsonl": 4}) == {"rule_candidates.jsonl": 6}
    assert (tmp_path / "rule_candidates.jsonl").read_bytes() == b"xxxx"


def test_save_rollouts_writes_every_rollout_once_named_by_spec(tmp_path):
    run_dir, _ = run(tmp_path, overrides=["output.save_rollouts=true"], epochs=1)
    names = sorted(p.name for p in (run_dir / "rollouts").iterdir())
    assert names == ["eval-it1-base.jsonl", "eval-it1-cand1.jsonl", "final-eval.jsonl", "final-train.jsonl",
                     "train-it1-base.jsonl", "train-it1-cand1.jsonl", "train-it1-cand2.jsonl",
                     "train-it1-cand3.jsonl"]
    base = rows(run_dir, "rollouts/train-it1-base.jsonl")
    assert len(base) == 60 * 3 and all(r["text"].startswith("Verdict: ") for r in base)


def test_check_resume_checks_without_touching_anything(tmp_path):
    with pytest.raises(se.ScriptedCrash):
        run(tmp_path, engine={"crash_at": 2})
    run_dir = tmp_path / "out" / MISSION / "run"
    cfg_path = search_inputs(tmp_path / "in", out=str(tmp_path / "out"))
    cfg = config_mod.load_config(cfg_path)
    inputs = plan.load_inputs(cfg)
    train, _ = split_eval_pool(inputs.tickets, cfg.rule_search.eval_pool_size, cfg.seed)
    extra = dict(train_keys=[t.key for t in train], store=GuidanceStore(run_dir, MISSION),
                 start_sampler=state_mod.start_sampler(len(train), cfg.rule_search, cfg.seed))
    before = {p: p.read_bytes() for p in run_dir.rglob("*") if p.is_file()}
    point = state_mod.check_resume(run_dir, run_identity(cfg, inputs), **extra)
    assert point.continued and point.state.iteration == 1
    changed = run_identity(config_mod.load_config(cfg_path, ["seed=12"]), inputs)
    with pytest.raises(InputError, match=r"differs from the interrupted run's at rule_search.gate.bootstrap.seed, seed, "):
        state_mod.check_resume(run_dir, changed, **extra)
    assert state_mod.check_resume(tmp_path / "nothing-here", changed, **extra) == (None, False)  # no state: no check
    assert {p: p.read_bytes() for p in run_dir.rglob("*") if p.is_file()} == before


# ------------------------------------------------------------------ tampered state.json

def _state_edit(key, value):
    def edit(st, run_dir):
        st[key] = value
    return edit


def _length_mid_line(st, run_dir):
    st["artifacts"]["rule_candidates.jsonl"] -= 5


def _length_past_the_file(st, run_dir):
    st["artifacts"]["rule_candidates.jsonl"] += 10**6


def _rule_text_edited_guidance_json_deleted(st, run_dir):
    st["guidance"]["experiences"]["G1"] = "Anything goes."
    (run_dir / "guidance.json").unlink()


def _rule_text_and_hash_edited(st, run_dir):
    st["guidance"]["experiences"]["G1"] = "Anything goes."
    st["guidance_hash"] = content_hash(st["guidance"]["experiences"])


def _guidance_json_edited(st, run_dir):
    path = run_dir / "guidance.json"
    path.write_text(path.read_text().replace("rust", "moss"))


def _first_pool_key(st, run_dir):
    st["first_pool"][0] = "no-such-ticket"


def _edit_without_row(st, run_dir):
    st["edits"].append(dict(st["edits"][0], iteration=2))


TAMPERED = {
    "iteration -5": (_state_edit("iteration", -5), r"state\.json: iteration"),
    "iteration 10**30": (_state_edit("iteration", 10**30), r"state\.json: iteration"),
    "iteration ahead of the rows": (_state_edit("iteration", 3), r"state\.json: iteration"),
    "unknown stop_reason": (_state_edit("stop_reason", "bored"), r"state\.json: stop_reason"),
    "negative no_gain": (_state_edit("no_gain", -1), r"state\.json: no_gain"),
    "negative generations": (_state_edit("generations_done", -3), r"state\.json: generations_done"),
    "no_gain above iteration": (_state_edit("no_gain", 7), r"state\.json: no_gain"),
    "length mid-line": (_length_mid_line, r"state\.json: artifacts\.rule_candidates\.jsonl"),
    "length past the file": (_length_past_the_file, r"state\.json: artifacts\.rule_candidates\.jsonl"),
    "unknown artifact": (lambda st, d: st["artifacts"].update({"x.jsonl": 0}), r"state\.json: artifacts"),
    "an artifact's length dropped": (lambda st, d: st["artifacts"].pop("rule_candidates.jsonl"),
                                     r"state\.json: artifacts\.rule_candidates\.jsonl"),
    "unknown ticket key in first_pool": (_first_pool_key, r"state\.json: first_pool\[0\]"),
    "another train ticket in first_pool": (lambda st, d: st["first_pool"].reverse(), r"state\.json: first_pool\[0\]"),
    "a rejected id dropped": (lambda st, d: st["rejected_ids"].pop(), r"state\.json: rejected_ids"),
    "no_gain off the rows": (_state_edit("no_gain", 1), r"state\.json: no_gain"),
    "baseline off the rows": (lambda st, d: st["baseline"]["train"].update(acc=0.5), r"state\.json: baseline"),
    "edit off the rows": (lambda st, d: st["edits"][0].update(op="merge"), r"state\.json: edits"),
    "sampler advanced": (lambda st, d: st["sampler"].update(wraps=1, cursor=5), r"state\.json: sampler"),
    "baseline of the wrong shape": (_state_edit("baseline", {"train": 5}), r"state\.json: baseline\.train"),
    "edits of the wrong shape": (_state_edit("edits", [{"x": 1}]), r"state\.json: edits\[0\]"),
    "an edit without its row": (_edit_without_row, r"state\.json: edits"),
    "sampler cursor": (lambda st, d: st["sampler"].update(cursor=-1), r"state\.json: sampler\.cursor"),
    "rule text edited, guidance.json deleted": (_rule_text_edited_guidance_json_deleted, r"state\.json: guidance"),
    "rule text and its hash edited": (_rule_text_and_hash_edited, r"state\.json: guidance"),
    "guidance.json edited": (_guidance_json_edited, r"guidance\.json"),
    "guidance of the wrong shape": (_state_edit("guidance", {"step": 1}), r"state\.json: guidance: updated_at"),
}


@pytest.fixture(scope="module")
def crashed(tmp_path_factory):
    """A run stopped by an exception in iteration 2: state.json commits iteration 1 (an edit)."""
    root = tmp_path_factory.mktemp("crashed")
    with pytest.raises(se.ScriptedCrash):
        run(root, engine={"crash_at": 2})
    return root


@pytest.mark.parametrize("case", list(TAMPERED))
def test_a_tampered_state_is_refused_before_any_worker_starts(crashed, tmp_path, case):
    tamper, where = TAMPERED[case]
    shutil.copytree(crashed / "out", tmp_path / "out")
    run_dir = tmp_path / "out" / MISSION / "run"
    cfg = config_mod.load_config(search_inputs(tmp_path / "in", out=str(tmp_path / "out")))
    st = doc(run_dir, "state.json")
    tamper(st, run_dir)
    (run_dir / "state.json").write_text(json.dumps(st))
    before = {p: p.read_bytes() for p in run_dir.rglob("*") if p.is_file()}
    started = []
    with pytest.raises(InputError, match=where) as err:
        job.run_job(cfg, "cpu:1", debug=True, engine_factory=lambda *a, **k: started.append(1), resume=True)
    assert "cannot resume" in str(err.value)
    assert started == []  # refused before the pool built any engine
    assert {p: p.read_bytes() for p in run_dir.rglob("*") if p.is_file()} == before  # nothing touched


def test_the_untampered_crashed_state_resumes_to_the_uninterrupted_run(crashed, reference, tmp_path, monkeypatch):
    """The table's control: the same copy, untouched, is accepted (validated once, before the
    run directory is touched, not again when the search starts) and reaches the reference."""
    shutil.copytree(crashed / "out", tmp_path / "out")
    validated = []
    real = state_mod.validate_state
    monkeypatch.setattr(state_mod, "validate_state", lambda *a, **k: validated.append(1) or real(*a, **k))
    run_dir, _ = run(tmp_path, resume=True)
    assert validated == [1]
    assert_same_run(reference.run_dir, run_dir)
