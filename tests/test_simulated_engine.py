"""The simulated engine (``model.engine: simulated``): its latency model in exact numbers, its
determinism (same request -> same verdicts, same modelled time, on any instance), the sleep
it takes (scaled, never slept here: ``time.sleep`` is replaced), and the whole search on 1
and 8 simulated workers giving identical artifacts."""

from __future__ import annotations

import json

import msgspec
import pytest

from doubles import scripted_engine as se
from doubles.run_inputs import MISSION, feature_records, search_inputs

from stageb_pool.app import config as config_mod
from stageb_pool.app import job
from stageb_pool.app.diff import diff_runs, format_differences
from stageb_pool.engine import simulated_engine as sim
from stageb_pool.engine.models import check_model_path
from stageb_pool.engine.records import ChatRequest, Decode, RolloutChunk
from stageb_pool.engine.registry import engine_factory_for
from stageb_pool.engine.simulated_engine import SimulatedSettings
from stageb_pool.pool import Device
from stageb_pool.stageb import prompts
from stageb_pool.stageb.tickets import TicketText

SETTINGS = SimulatedSettings(prefill_tokens_per_s=1000.0, decode_step_s=0.01, decode_tokens_per_s=400.0,
                             request_overhead_s=0.5, time_scale=0.0, noise=0.0)


def tickets(n: int = 12) -> list[TicketText]:
    return [msgspec.convert({"key": f"{r['group_id']}::{r['label']}", **r}, TicketText, strict=False)
            for r in feature_records(n)]


def chunk(grid=(Decode(0.7, max_new_tokens=20),), samples: int = 1, **kw) -> RolloutChunk:
    return RolloutChunk(seed_key="11/train/x", chunk_index=3, tickets=tickets(), grid=list(grid),
                        samples_per_decode=samples, **kw)


@pytest.fixture(scope="module")
def profile():
    return prompts.load_profile("generic", mission=MISSION)


@pytest.fixture(scope="module")
def count():
    return sim.token_counter(check_model_path("tiny"))


def engine(count, settings=SETTINGS):
    return sim.SimulatedEngine(Device("cpu", 0, 0), count, settings=settings, model_path="tiny")


def test_the_latency_model_in_numbers():
    # Two rows: 400 prompt tokens at 1000/s, then 20 steps of max(0.01, 2/400) s.
    assert sim.batch_seconds(SETTINGS, [100, 300], 20) == pytest.approx(0.4 + 20 * 0.01, rel=1e-12)
    # Eight rows: a step takes 8/400 = 0.02 s, the full batch's rate, not the small batch's step.
    assert sim.batch_seconds(SETTINGS, [100] * 8, 20) == pytest.approx(0.8 + 20 * 0.02, rel=1e-12)
    assert sim.batch_seconds(SETTINGS, [100, 300], 0) == pytest.approx(0.4, rel=1e-12)  # prefill only
    assert sim.batch_seconds(SETTINGS, [], 20) == 0.0  # every ticket dropped: nothing to generate
    # A chunk: one batch per (decode, sample), plus one request overhead.
    grid = [Decode(0.7, max_new_tokens=20), Decode(0.3, max_new_tokens=10)]
    expected = 0.5 + 2 * (0.4 + 20 * 0.01) + 2 * (0.4 + 10 * 0.01)
    assert sim.rollout_seconds(SETTINGS, chunk(grid, samples=2), [100, 300]) == pytest.approx(expected, rel=1e-12)
    # The proposer: one row, its own prompt and answer budget.
    assert sim.chat_seconds(SETTINGS, 500, 100) == pytest.approx(0.5 + 0.5 + 100 * 0.01, rel=1e-12)


def test_the_defaults_model_a_7_8b_model_on_one_h100():
    # docs/performance.md cites these; a chunk of 16 tickets of 300 prompt tokens and 20 new
    # tokens takes about half a second, the proposer's 512 tokens about 5 s.
    d = SimulatedSettings()
    assert (d.prefill_tokens_per_s, d.decode_step_s, d.decode_tokens_per_s, d.request_overhead_s) == (
        20_000.0, 0.009, 12_000.0, 0.02)
    assert sim.rollout_seconds(d, chunk(), [300] * 16) == pytest.approx(0.02 + 4800 / 20_000 + 20 * 0.009)
    assert sim.chat_seconds(d, 3000, 512) == pytest.approx(0.02 + 0.15 + 512 * 0.009)


def test_same_request_same_verdicts_and_same_modelled_time(count, profile):
    guidance = {"G0": "Check the cabinet for damage.", "G1": se.rule("rust")}
    a, b = engine(count), engine(count)
    first = a.rollout(chunk(), guidance=guidance, profile=profile)
    again = a.rollout(chunk(), guidance=guidance, profile=profile)
    other = b.rollout(chunk(), guidance=guidance, profile=profile)
    strip = lambda r: msgspec.json.encode(msgspec.structs.replace(r, elapsed_s=0.0))  # noqa: E731
    assert strip(first) == strip(again) == strip(other)
    assert a.modelled_s == pytest.approx(2 * b.modelled_s, rel=1e-12)
    # The modelled time is the latency model of the prompts' own token counts.
    assert b.modelled_s == pytest.approx(
        sim.rollout_seconds(SETTINGS, chunk(), [t.prompt_tokens for t in first.tickets]), rel=1e-12)
    # noise 0: a ticket fails exactly when it shows rust, the rule the guidance states.
    for ticket, source in zip(first.tickets, tickets()):
        rust = "rust" in " ".join(source.per_image.values())
        assert ticket.samples[0].text.startswith("Verdict: fail" if rust else "Verdict: pass"), ticket
    # A longer guidance makes every prompt longer, so the chunk costs more.
    longer = engine(count)
    longer.rollout(chunk(), guidance={**guidance, "G2": "Look at every photo closely. " * 20}, profile=profile)
    assert longer.modelled_s > b.modelled_s


def test_noise_flips_by_the_work_never_by_the_guidance(count, profile):
    noisy = msgspec.structs.replace(SETTINGS, noise=0.5)
    base = engine(count, noisy).rollout(chunk(), guidance={"G0": "Check."}, profile=profile)
    with_rule = engine(count, noisy).rollout(chunk(), guidance={"G0": "Check.", "G1": se.rule("dust")},
                                             profile=profile)
    # Tickets the rule does not touch keep their (flipped or not) verdicts: common random numbers.
    for b, w, source in zip(base.tickets, with_rule.tickets, tickets()):
        if "dust" not in " ".join(source.per_image.values()):
            assert b.samples[0].text == w.samples[0].text


def test_overlength_tickets_are_dropped_and_cost_nothing(count, profile):
    e = engine(count)
    result = e.rollout(chunk(max_prompt_tokens=1), guidance={"G0": "Check."}, profile=profile)
    assert all(t.dropped and not t.samples for t in result.tickets)
    assert e.modelled_s == pytest.approx(SETTINGS.request_overhead_s)


class Clock:
    """The engine module's ``time`` and ``cancellation`` (which sleeps for it): ``perf_counter``
    moves ``step`` seconds a call; ``sleep`` records."""

    def __init__(self, step: float):
        self.now, self.step, self.slept = 100.0, step, []

    def perf_counter(self) -> float:
        self.now += self.step
        return self.now

    def sleep(self, seconds: float) -> None:
        self.slept.append(seconds)


def test_a_request_takes_the_modelled_time_times_the_scale_its_own_work_included(count, profile, monkeypatch):
    # The request's start and its end of work are one step apart: only the rest is slept.
    clock = Clock(step=0.05)
    monkeypatch.setattr(sim, "time", clock)
    monkeypatch.setattr(sim, "cancellation", clock)
    e = engine(count, msgspec.structs.replace(SETTINGS, time_scale=0.25))
    e.rollout(chunk(), guidance={"G0": "Check."}, profile=profile)
    assert clock.slept == [pytest.approx(e.modelled_s * 0.25 - 0.05, rel=1e-12)]
    e.chat(ChatRequest("Propose.", "Rules:", ["Example 1"], "Answer.", Decode(0.7, max_new_tokens=50), "s"))
    assert len(clock.slept) == 2
    # Work that took longer than the modelled time: no sleep at all, the request is late.
    late = Clock(step=1e6)
    monkeypatch.setattr(sim, "time", late)
    monkeypatch.setattr(sim, "cancellation", late)
    e.rollout(chunk(), guidance={"G0": "Check."}, profile=profile)
    assert late.slept == []
    engine(count).rollout(chunk(), guidance={"G0": "Check."}, profile=profile)  # time_scale 0: no sleep
    assert late.slept == [] and len(clock.slept) == 2


def test_the_proposer_proposes_rules_on_the_falsely_passed_examples(count):
    examples = [
        "Sample1: ticket_key=A::fail; gt_label=fail; baseline_majority=pass; agreement=1.000; difficulty=0.9\n"
        "stage_a_summaries:\n  - image_1: cabinet front view, rust seen\n  - image_2: cabinet side view",
        "Sample2: ticket_key=B::fail; gt_label=fail; baseline_majority=pass; agreement=1.000; difficulty=0.9\n"
        "stage_a_summaries:\n  - image_1: cabinet front view, crack seen",
        "Sample3: ticket_key=C::pass; gt_label=pass; baseline_majority=fail; agreement=1.000; difficulty=0.9\n"
        "stage_a_summaries:\n  - image_1: cabinet front view, dust seen",
    ]
    request = ChatRequest(system="You learn rules.", user_head="Mission", examples=examples, user_tail="Answer.",
                          decode=Decode(0.4, max_new_tokens=100), seed_key="11/proposer/it1")
    e = engine(count)
    first, again = e.chat(request), engine(count).chat(request)
    assert first == again
    texts = [op["text"] for op in json.loads(first.text)["operations"]]
    # Words only one falsely passed example shows come first; the falsely failed one is not read.
    assert set(texts) == {se.rule("rust"), se.rule("side"), se.rule("crack")}
    assert first.examples_used == 3 and first.finish_reason == "stop"
    # It takes the time of the tokens it answers (a real engine stops at the answer's end),
    # not its budget; never more than the budget (here 100, fewer than the answer's tokens).
    assert first.completion_tokens > 100
    assert e.modelled_s == pytest.approx(sim.chat_seconds(SETTINGS, first.prompt_tokens, 100), rel=1e-12)
    roomy = engine(count)
    answer = roomy.chat(msgspec.structs.replace(request, decode=Decode(0.4, max_new_tokens=5000)))
    assert answer == first
    assert roomy.modelled_s == pytest.approx(sim.chat_seconds(SETTINGS, first.prompt_tokens, first.completion_tokens),
                                             rel=1e-12)


@pytest.mark.parametrize("model", ["tiny", "embedded"])
def test_token_counts_by_lines_are_the_tokenizers_counts_and_each_line_is_encoded_once(model, profile):
    counter = sim.token_counter(check_model_path(model))
    fast = counter.encode_len
    assert counter.split_lines  # both are byte-level BPEs: prompts are counted line by line
    guidances = [{"G0": "Check the cabinet.\nThen   the door.", "G1": "If any photo shows rust, the verdict is fail."},
                 {"G0": "Check the cabinet.", "G1": "Rule 2:\n\n  indented\tline \n\nend.\n"}]
    texts = [m["content"] for g in guidances for t in tickets(24) for m in prompts.build_messages(profile, g, t)]
    texts += ["a\nb", "a \nb", "a\n b", "\n\nx\n", "x.\n\ny", "123\n456", "<|im_start|>\nuser", "", "\u00e9t\u00e9\nok"]
    assert counter(texts) == [fast(t) for t in texts]  # exact: the same counts as the whole texts
    encoded = counter.encoded
    assert counter(texts) == [fast(t) for t in texts]
    assert counter.encoded == encoded  # the second time, every line came from the memo
    fresh = sim.token_counter(check_model_path(model))
    fresh([m["content"] for t in tickets(24) for m in prompts.build_messages(profile, guidances[0], t)])
    # 48 prompts of 24 tickets: the system prompt, the template's and guidance's lines once,
    # each ticket's summary lines once; far fewer encodes than prompts x lines.
    assert fresh.encoded < 24 * 6


def test_info_says_it_is_a_simulation(count):
    info = engine(count).info()
    assert info["engine"] == "simulated" and "not a model" in info["model"]


def test_one_and_eight_simulated_workers_give_identical_artifacts(tmp_path):
    runs = []
    for gpus in ("cpu:1", "cpu:8"):
        name = gpus.replace(":", "")
        path = search_inputs(tmp_path / "in", out=str(tmp_path / "out"), run_name=name, epochs=3,
                               train_pool_size=40)
        cfg = config_mod.load_config(path, ["model.engine=simulated", "model.simulated.time_scale=0"])
        # The job's own engine factory; passing it skips only the guidance-versus-prompt-cap
        # check, which loads the transformers tokenizer (seconds of CPU) and has its own tests.
        job.run_job(cfg, gpus, engine_factory=engine_factory_for(cfg.model, check_model_path("tiny")))
        runs.append(tmp_path / "out" / MISSION / name)
    assert json.loads((runs[1] / "run.json").read_text())["provenance"]["engine"]["engine"] == "simulated"
    summary = json.loads((runs[0] / "summary.json").read_text())
    assert summary["edits_accepted"] >= 1  # the gate saw a real gain
    differences = diff_runs(*runs)
    assert differences == [], format_differences(differences, *map(str, runs))


def test_the_proposer_does_not_depend_on_the_process_hash_seed():
    # Ray actors are not forked from the parent: each has its own string hash seed, so an
    # answer that followed a set's order would differ between workers (the bench found it).
    import os
    import subprocess
    import sys

    code = ("from stageb_pool.engine.simulated_engine import proposed_rules\n"
            "blocks = [f'S{i}: ticket_key=K{i}::fail; gt_label=fail; baseline_majority=pass\\n'\n"
            "          f'stage_a_summaries:\\n  - image_1: ' + ' '.join(f'word{j}x' for j in range(i, i + 9))\n"
            "          for i in range(6)]\n"
            "print(proposed_rules(blocks, '7/proposer/it1'))\n")
    answers = {subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True,
                              env={**os.environ, "PYTHONHASHSEED": seed},
                              cwd=os.path.dirname(__file__)).stdout for seed in ("1", "2", "3")}
    assert len(answers) == 1


def test_the_latency_models_rates_are_part_of_a_runs_identity_only_on_the_simulated_engine():
    """A run made before the simulated engine existed keeps its config hash (and can be
    resumed): the demo's hash is still the one its state.json recorded then."""
    from pathlib import Path

    from stageb_pool.app.config import load_config
    from stageb_pool.app.identity import identity_document
    from stageb_pool.stageb.hashing import content_hash

    demo = Path(__file__).resolve().parents[1] / "configs" / "demo.yaml"

    def doc(*overrides):
        return identity_document(load_config(demo, list(overrides)), seed_guidance={}, profile={}, proposer_system=None)

    assert "simulated" not in doc()["model"]
    assert content_hash(doc("model.simulated.decode_step_s=0.05")) == content_hash(doc())
    simulated = doc("model.engine=simulated")
    assert simulated["model"]["simulated"]["decode_step_s"] == 0.009
    assert content_hash(doc("model.engine=simulated", "model.simulated.decode_step_s=0.05")) != content_hash(simulated)
