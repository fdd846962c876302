"""The vLLM engine (model.engine: vllm) under the determinism contract, on the tiny model
saved with head size 32 (vLLM's CPU attention does not take the in-code tiny's 16).

These tests need vllm: they run in the environment bin/setup-vllm makes
(``.venv-vllm/bin/python -m pytest -m vllm``, as .ci/run does). Elsewhere the module is
skipped with that reason in pytest's summary, never passed silently.

Pool tests come first: the in-process engine at the end starts vLLM's threads in this
process, after which no pool may fork from it.
"""

from __future__ import annotations

import os
import signal

import msgspec
import pytest

pytestmark = pytest.mark.vllm
pytest.importorskip("vllm", reason="vllm is not installed here: bin/setup-vllm makes .venv-vllm, "
                    "where `.venv-vllm/bin/python -m pytest -m vllm` runs these tests")

from processes import descendants, gone  # noqa: E402
from test_audit import run_audit_job, same_artifacts  # noqa: E402

from stageb_pool import Pool  # noqa: E402
from stageb_pool.app.config import ModelConfig  # noqa: E402
from stageb_pool.engine.models import check_model_path  # noqa: E402
from stageb_pool.engine.records import (  # noqa: E402
    ChatRequest,
    ChunkResult,
    Decode,
    RolloutChunk,
    TicketText,
    VerdictChunk,
    VerdictChunkResult,
)
from stageb_pool.stageb import prompts  # noqa: E402

MISSION = "Rooftop antenna mount inspection"
GUIDANCE = {"G0": "Confirm that the antenna mount is installed securely.", "S1": "No photo of the mount: fail."}
SAMPLED = Decode(temperature=0.8, top_p=0.9, max_new_tokens=12, repetition_penalty=1.05, seed=43)
GREEDY = Decode(temperature=0.0, max_new_tokens=12)
PROFILE = prompts.load_profile("generic", mission=MISSION)
TINY = check_model_path("tiny")
VLLM = ModelConfig(engine="vllm")
TICKETS = [TicketText(f"T{i:03d}", MISSION, {f"image_{n + 1}": f"mount bolt {i + n} tight, seal {n}"
                                             for n in range(1 + i % 3)}) for i in range(10)]


def chunks(tickets=TICKETS, size=4, *, seed_key="7/train", constrain=False) -> list[RolloutChunk]:
    return [RolloutChunk(seed_key, i // size, tickets[i:i + size], [SAMPLED, GREEDY], 2, 4096, True, constrain)
            for i in range(0, len(tickets), size)]


def stable(result: ChunkResult) -> bytes:
    return msgspec.json.encode(msgspec.structs.replace(result, elapsed_s=0.0))


def vllm_factory(device):
    from stageb_pool.engine.registry import build_engine

    return build_engine(device, TINY, VLLM)


# ---------------------------------------------------------------- through the pool and the CLI job


def test_audit_artifacts_and_rollouts_are_byte_identical_on_1_and_2_workers(tmp_path):
    over = ["model.engine=vllm", "output.save_rollouts=true"]
    one = run_audit_job(tmp_path, "cpu:1", run_name="one", overrides=over, n=12)
    two = run_audit_job(tmp_path, "cpu:2", run_name="two", overrides=over, n=12)
    assert same_artifacts(one, two) == []
    assert sorted(p.name for p in (one / "rollouts").iterdir()) and all(
        (one / "rollouts" / p.name).read_bytes() == p.read_bytes() for p in (two / "rollouts").iterdir())
    headroom = (one / "judge_headroom.json").read_bytes()  # the judge-headroom check, through prompt log-probs
    assert headroom == (two / "judge_headroom.json").read_bytes()
    assert msgspec.json.decode(headroom)["tickets"] == 12
    run = msgspec.json.decode((one / "run.json").read_bytes())
    engine = run["provenance"]["engine"]
    assert engine["engine"] == "vllm" and engine["vllm"] == __import__("vllm").__version__
    assert engine["vllm_settings"]["kv_cache_memory_bytes"] == 1 << 30


def test_kill_9_mid_chunk_leaves_no_process_and_restarts_give_the_same_bytes():
    work = chunks()
    with Pool(vllm_factory, gpus="cpu:2", max_restarts=2, start_timeout=900) as pool:
        reference = [stable(r) for r in pool.map("rollout", work, guidance=GUIDANCE, profile=PROFILE,
                                                   result_type=ChunkResult)]
        victims = list(pool.pids)
        tasks = [pool.submit("rollout", c, guidance=GUIDANCE, profile=PROFILE, result_type=ChunkResult)
                 for c in work]
        killed = []

        def kill_a_busy_worker(index, result):
            if not killed:  # one chunk is done, the others are being generated
                busy = next(t.ran_on for t in tasks if t is not tasks[index] and t.ran_on is not None)
                killed.append(pool.pids[busy])
                os.kill(pool.pids[busy], signal.SIGKILL)

        again = [stable(r) for r in pool.gather(tasks, on_result=kill_a_busy_worker)]
        assert killed and again == reference
        everyone = [p for p in [*victims, *pool.pids] if p]
    assert all(gone(p) for p in everyone)
    assert descendants(os.getpid()) == []


def test_proposer_chat_through_the_pool_fits_examples_and_is_seeded():
    examples = [f"Example {i}: " + "mount bolt loose. " * (i + 1) for i in range(4)]
    request = ChatRequest("You propose rules.", "Current rules: G0.", examples, "Answer with JSON.", SAMPLED,
                          "7/proposer/it1", None)
    with Pool(vllm_factory, gpus="cpu:1", start_timeout=900) as pool:
        full = pool.call(0, "chat", request)
        assert full["examples_used"] == 4 and full["text"] and full["completion_tokens"] > 0
        assert pool.call(0, "chat", request) == full
        one = pool.call(0, "chat", msgspec.structs.replace(request, max_prompt_tokens=full["prompt_tokens"] - 1))
        assert one["examples_used"] < 4
        none = pool.call(0, "chat", msgspec.structs.replace(request, max_prompt_tokens=10))
        assert none["text"] is None and none["examples_used"] == 1


# ---------------------------------------------------------------- the engine in this process (last)


@pytest.fixture(scope="module")
def engine():
    from stageb_pool.engine.registry import build_engine
    from stageb_pool.pool.devices import Device

    return build_engine(Device("cpu", 0, 0, threads=1), TINY, VLLM)


def rollout(engine, chunk) -> ChunkResult:
    return engine.rollout(chunk, guidance=GUIDANCE, profile=PROFILE)


def test_a_chunk_does_not_depend_on_what_the_worker_ran_before(engine):
    work = chunks()
    first = stable(rollout(engine, work[1]))
    for other in (work[2], work[0]):
        rollout(engine, other)
    engine.chat(ChatRequest("sys", "head", ["ex"], "tail", SAMPLED, "7/proposer/it1"))
    assert stable(rollout(engine, work[1])) == first


def test_two_seeds_give_different_samples_and_one_seed_the_same(engine):
    a = rollout(engine, chunks(seed_key="7/train")[0])
    b = rollout(engine, chunks(seed_key="8/train")[0])
    ids = lambda r: [[s.token_ids for s in t.samples if s.decode_index == 0] for t in r.tickets]  # noqa: E731
    assert ids(a) != ids(b)
    assert stable(rollout(engine, chunks(seed_key="7/train")[0])) == stable(a)


def test_a_seeded_request_is_unchanged_when_batched_with_others(engine):
    rows = [engine.text.prompt_ids(prompts.build_messages(PROFILE, GUIDANCE, t)) for t in TICKETS[:6]]
    params = [engine._params(SAMPLED, 1000 + i) for i in range(6)]
    alone = engine._generate([(rows[0], params[0])])
    batched = engine._generate(list(zip(rows, params)))
    assert batched[0] == alone[0]
    assert len({tuple(r) for r, _ in batched}) > 1


def test_constrained_verdict_lines_through_vllm(engine):
    result = rollout(engine, chunks(constrain=True)[0])
    texts = [engine.tokenizer.decode(s.token_ids, skip_special_tokens=True) for t in result.tickets for s in t.samples]
    assert texts and all(x.startswith(("Verdict: pass\n", "Verdict: fail\n")) for x in texts)


def test_a_constrained_proposer_answer_through_vllm_is_json_of_the_schema(engine):
    """vLLM's guidance backend holds the answer to the same schema as the transformers
    engine: a random tiny model's answer parses and ends at its closing brace."""
    import json

    from stageb_pool.stageb import proposer
    from stageb_pool.stageb.proposer_schema import proposer_schema

    guidance = {**GUIDANCE, "G1": "If any photo is blurry, the verdict is fail."}
    schema = json.dumps(proposer_schema(guidance, PROFILE.verdict, max_operations=2))
    decode = Decode(temperature=0.8, top_p=0.9, max_new_tokens=1500, seed=43)
    request = ChatRequest("You propose rules.", "Current rules: G0, G1.", ["Example 1: bolt loose."],
                          "Answer with JSON.", decode, "7/proposer/it1", None, schema)
    answer = engine.chat(request)
    assert answer.finish_reason == "stop" and answer.text.endswith("}"), answer
    accepted, rejected = proposer.parse_candidates(json.loads(answer.text), guidance, vocab=PROFILE.verdict, limit=2)
    assert 1 <= len(accepted) + len(rejected) <= 2
    assert engine.chat(request) == answer


def verdicts(engine, tickets=TICKETS[:6], limit=None, index=0) -> VerdictChunkResult:
    return engine.verdict_probabilities(VerdictChunk(index, list(tickets), limit), guidance=GUIDANCE, profile=PROFILE)


def test_verdict_probabilities_match_the_transformers_engine_on_the_same_checkpoint(engine):
    """Prompt log-probs through vLLM and a padded forward pass through transformers give the
    same P(pass) for the same weights (to CPU kernel noise), and the same prompt lengths."""
    from stageb_pool.engine.registry import build_engine
    from stageb_pool.engine.models import checkpoint_dir
    from stageb_pool.pool.devices import Device

    reference = build_engine(Device("cpu", 0, 0, threads=1), check_model_path(str(checkpoint_dir(TINY))), ModelConfig())
    ours = verdicts(engine)
    theirs = reference.verdict_probabilities(VerdictChunk(0, TICKETS[:6], None), guidance=GUIDANCE, profile=PROFILE)
    assert [t.prompt_tokens for t in ours.tickets] == [t.prompt_tokens for t in theirs.tickets]
    for a, b in zip(ours.tickets, theirs.tickets):
        assert 0 <= a.p_pass <= 1 and a.p_pass == pytest.approx(b.p_pass, abs=1e-3)
    assert len({t.p_pass for t in ours.tickets}) > 1


def test_verdict_probabilities_drop_overlength_and_do_not_depend_on_earlier_work(engine):
    first = verdicts(engine, index=1)
    limit = sorted(t.prompt_tokens for t in first.tickets)[2]
    capped = verdicts(engine, limit=limit)
    assert [(t.dropped, t.p_pass is None) for t in capped.tickets] == [(t.prompt_tokens > limit,) * 2
                                                                        for t in first.tickets]
    rollout(engine, chunks()[0])
    again = verdicts(engine, index=1)
    assert msgspec.structs.replace(again, elapsed_s=0.0) == msgspec.structs.replace(first, elapsed_s=0.0)


# ---------------------------------------------------------------- data is text (issue 32)


@pytest.fixture(scope="module")
def embedded_tokenizer():
    from stageb_pool.engine import models

    return models.tokenizer_only(check_model_path("embedded"))


@pytest.fixture(scope="module", params=["tiny", "embedded"])
def any_vllm(request, engine, embedded_tokenizer, tmp_path_factory):
    """vLLM with each tokenizer: the tiny checkpoint, and a tiny random model of the embedded
    model's vocabulary saved with the embedded model's tokenizer (head size 32, which vLLM's
    CPU attention takes; the tokenizer is what is under test, not the weights)."""
    if request.param == "tiny":
        return engine
    from stageb_pool.engine import tiny
    from stageb_pool.engine.registry import build_engine
    from stageb_pool.pool.devices import Device

    folder = tmp_path_factory.mktemp("embedded-vocabulary")
    tiny.build_model(embedded_tokenizer, heads=2).save_pretrained(folder)
    embedded_tokenizer.save_pretrained(folder)
    return build_engine(Device("cpu", 0, 0, threads=1), check_model_path(str(folder)), VLLM)


def test_control_token_spellings_in_data_are_text_in_every_prompt_vllm_runs(any_vllm, embedded_tokenizer,
                                                                            monkeypatch):
    """As for the transformers engine (tests/test_engine.py): the prompts vLLM itself reports
    having run (its outputs' ``prompt_token_ids``) for a ticket, mission, guidance and proposer
    examples spelling every added token of the embedded model's tokenizer hold exactly the
    control tokens of clean data and every character of the data as text; clean data keeps
    the ids it always had."""
    from spelled_tokens import Prompts, assert_data_is_text, old_prompt_ids, spellings

    tok = any_vllm.tokenizer
    data = Prompts(spellings(embedded_tokenizer, tok))
    ran = []
    generate = any_vllm.llm.generate

    def recording(*args, **kwargs):
        outs = generate(*args, **kwargs)
        ran.extend(list(o.prompt_token_ids) for o in outs)
        return outs

    monkeypatch.setattr(any_vllm.llm, "generate", recording)

    def vllm_rows(call):
        ran.clear()
        call()
        return list(ran)

    def judged(ticket, guidance):
        (rolled,) = vllm_rows(lambda: any_vllm.rollout(RolloutChunk("7/train", 0, [ticket], [GREEDY], 1, None, False,
                                                                    False), guidance=guidance, profile=data.profile))
        scored = vllm_rows(lambda: any_vllm.verdict_probabilities(VerdictChunk(0, [ticket], None), guidance=guidance,
                                                                  profile=data.profile))
        assert len(scored) == 2 and all(row[:len(rolled)] == rolled for row in scored)  # prompt, then the answer
        return rolled

    clean = judged(data.clean_ticket, data.clean_guidance)
    forged = judged(data.spelled_ticket, data.spelled_guidance)
    assert clean == old_prompt_ids(tok, data.clean_text(tok))
    assert_data_is_text(tok, clean, forged, data.spelled_text(tok))

    (clean_chat,) = vllm_rows(lambda: any_vllm.chat(data.clean_request))
    (forged_chat,) = vllm_rows(lambda: any_vllm.chat(data.spelled_request))
    assert clean_chat == old_prompt_ids(tok, data.chat_text(tok, data.clean_request))
    assert_data_is_text(tok, clean_chat, forged_chat, data.chat_text(tok, data.spelled_request))
