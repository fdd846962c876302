"""The generation engine: chunk rollouts, seeds, drops, stops, chat, loading, and byte-identical
results for any number of workers. Everything runs on the tiny model except the slow test."""

import json
import math
import subprocess
import sys

import msgspec
import pytest
import torch
from processes import CORES, ONE_CORE, pinned

from stageb_pool.app.config import ModelConfig
from stageb_pool.engine.models import check_model_path
from stageb_pool.engine.registry import build_engine
from stageb_pool.engine.records import (
    ChatRequest,
    ChunkResult,
    Decode,
    RolloutChunk,
    TicketText,
    VerdictChunk,
    VerdictChunkResult,
)
from stageb_pool.engine import chat_text, verdict_scoring
from stageb_pool.engine.transformers_engine import TransformersEngine
from stageb_pool.pool import cancellation, protocol
from stageb_pool.pool.devices import Device
from stageb_pool.pool.errors import TaskCancelled
from stageb_pool.stageb import prompts
from stageb_pool.stageb.errors import InputError

MISSION = "Rooftop antenna mount inspection"
GUIDANCE = {
    "G0": "Confirm that the antenna mount is installed securely, with all of its fittings in order.",
    "S1": "If no photo shows the antenna mount, the verdict is fail.",
}
SAMPLED = Decode(temperature=0.8, top_p=0.9, max_new_tokens=12, repetition_penalty=1.05, seed=43)
GREEDY = Decode(temperature=0.0, max_new_tokens=12)
# Threads stay at 1 in this process: a parent that computed with more OpenMP threads makes
# later forked workers hang (see conftest.py).
CPU = Device("cpu", 0, 0, threads=1)
TINY = check_model_path("tiny")
MODEL = ModelConfig(path="tiny")  # the config's model section: transformers, its defaults


def ticket(i: int, extra: int = 0) -> TicketText:
    parts = ["antenna mount", "mounting bolt", "weatherproof seal", "grounding cable", "cable tie"]
    per_image = {
        f"image_{n + 1}": json.dumps({"stats": [{"category": parts[(i + n) % 5], "condition": {"tight": i + n}}],
                                      "notes": ["close-up"] * ((i + n) % 3) + ["note"] * extra})
        for n in range(1 + i % 3)
    }
    return TicketText(f"T{i:03d}", MISSION, per_image)


TICKETS = [ticket(i) for i in range(10)]


def chunk(index, tickets, grid=(SAMPLED,), *, seed_key="7/train", spd=1, limit=None, ids=True,
          constrain=False) -> RolloutChunk:
    return RolloutChunk(seed_key, index, list(tickets), list(grid), spd, limit, ids, constrain)


def chunks_of(tickets, size=4, **kw) -> list[RolloutChunk]:
    return [chunk(i // size, tickets[i:i + size], **kw) for i in range(0, len(tickets), size)]


def stable(result: ChunkResult) -> bytes:
    """Everything but the wall-clock field, as bytes."""
    return msgspec.json.encode(msgspec.structs.replace(result, elapsed_s=0.0))


@pytest.fixture(scope="module")
def profile():
    return prompts.load_profile("generic", mission=MISSION)


@pytest.fixture(scope="module")
def engine():
    return build_engine(CPU, TINY, MODEL)


def rollout(engine, ch, profile, guidance=GUIDANCE) -> ChunkResult:
    return engine.rollout(ch, guidance=guidance, profile=profile)


def ids_of(result: ChunkResult) -> list:
    return [[s.token_ids for s in t.samples] for t in result.tickets]


# ---------------------------------------------------------------- rollout results


def test_rollout_answers_every_ticket_in_order_with_all_candidates(engine, profile):
    grid = [SAMPLED, GREEDY]
    result = rollout(engine, chunk(3, TICKETS[:3], grid, spd=2), profile)
    assert result.chunk_index == 3
    assert [t.key for t in result.tickets] == [t.key for t in TICKETS[:3]]
    total = 0
    for t in result.tickets:
        assert not t.dropped and t.prompt_tokens > 50
        assert [(s.decode_index, s.sample_index) for s in t.samples] == [(0, 0), (0, 1), (1, 0), (1, 1)]
        for s in t.samples:
            assert len(s.token_ids) == s.completion_tokens <= grid[s.decode_index].max_new_tokens
            if s.finish_reason == "length":
                assert s.completion_tokens == grid[s.decode_index].max_new_tokens
            else:
                assert s.finish_reason == "stop" and s.token_ids[-1] in engine.text.stop_ids
            total += s.completion_tokens
    assert result.generated_tokens == total
    assert result.elapsed_s > 0


def test_a_rollout_the_parent_cancels_stops_at_its_next_decode_step(engine, profile, channel, monkeypatch):
    _, parent = channel
    steps = []
    forward = engine.model.forward
    monkeypatch.setattr(engine.model, "forward", lambda *a, **kw: steps.append(1) or forward(*a, **kw))
    ch = chunk(0, TICKETS[:2], [SAMPLED])
    with cancellation.running(5):
        before = rollout(engine, ch, profile)  # no Cancel: every step, the same tokens as anywhere
        full = len(steps)
        parent.sendall(protocol.frame(protocol.Cancel(5)))
        with pytest.raises(TaskCancelled):
            rollout(engine, ch, profile)
    assert full > 2 and len(steps) == full + 1  # the prefill, then the check
    assert ids_of(before) == ids_of(rollout(engine, ch, profile))


def test_token_ids_only_when_asked(engine, profile):
    result = rollout(engine, chunk(0, TICKETS[:2], ids=False), profile)
    assert all(s.token_ids is None and s.completion_tokens > 0 for t in result.tickets for s in t.samples)


def test_chunk_results_do_not_depend_on_order_or_interleaving(profile):
    """What a worker did before (other chunks, chats, other guidance) never changes a chunk."""
    chunks = chunks_of(TICKETS, 4, grid=[SAMPLED, GREEDY], spd=2)
    first = build_engine(CPU, TINY, MODEL)
    in_order = [stable(rollout(first, c, profile)) for c in chunks]
    second = build_engine(CPU, TINY, MODEL)
    shuffled = {}
    for c in (chunks[2], chunks[0]):
        shuffled[c.chunk_index] = stable(rollout(second, c, profile))
    second.chat(ChatRequest("sys", "head", ["ex"], "tail", SAMPLED, "7/proposer/it1"))
    rollout(second, chunks[1], profile, guidance={"G0": "another rule"})
    shuffled[1] = stable(rollout(second, chunks[1], profile))
    assert [shuffled[i] for i in range(3)] == in_order


def test_seed_parts_change_sampled_outputs(engine, profile):
    base = ids_of(rollout(engine, chunk(0, TICKETS[:4]), profile))
    assert ids_of(rollout(engine, chunk(0, TICKETS[:4]), profile)) == base
    assert ids_of(rollout(engine, chunk(0, TICKETS[:4], seed_key="8/train"), profile)) != base
    assert ids_of(rollout(engine, chunk(1, TICKETS[:4]), profile)) != base
    reseeded = msgspec.structs.replace(SAMPLED, seed=44)
    assert ids_of(rollout(engine, chunk(0, TICKETS[:4], [reseeded]), profile)) != base


def test_samples_of_one_decode_differ(engine, profile):
    result = rollout(engine, chunk(0, TICKETS[:4], spd=2), profile)
    assert any(t.samples[0].token_ids != t.samples[1].token_ids for t in result.tickets)


def test_greedy_ignores_the_seed_but_follows_the_prompt(engine, profile):
    a = ids_of(rollout(engine, chunk(0, TICKETS[:4], [GREEDY]), profile))
    b = ids_of(rollout(engine, chunk(5, TICKETS[:4], [GREEDY], seed_key="other"), profile))
    assert a == b
    assert len({json.dumps(x) for x in a}) > 1  # different tickets, different answers


# ---------------------------------------------------------------- drops


class GenerateSpy:
    """Wraps model.generate and records the batch size of every call."""

    def __init__(self, engine, monkeypatch):
        self.batches = []
        real = engine.model.generate

        def spy(*args, **kwargs):
            self.batches.append(kwargs["input_ids"].shape[0])
            return real(*args, **kwargs)

        monkeypatch.setattr(engine.model, "generate", spy)


def test_overlength_tickets_are_dropped_with_their_count_and_never_generated(engine, profile, monkeypatch):
    tickets = [TICKETS[0], ticket(1, extra=40), TICKETS[2], ticket(3, extra=60)]
    counts = [t.prompt_tokens for t in rollout(engine, chunk(0, tickets, ids=False), profile).tickets]
    limit = max(counts[0], counts[2])
    assert counts[1] > limit and counts[3] > limit
    spy = GenerateSpy(engine, monkeypatch)
    result = rollout(engine, chunk(0, tickets, [SAMPLED, GREEDY], spd=2, limit=limit), profile)
    assert [t.dropped for t in result.tickets] == [False, True, False, True]
    assert [t.prompt_tokens for t in result.tickets] == counts
    assert [len(t.samples) for t in result.tickets] == [4, 0, 4, 0]
    assert spy.batches == [2, 2, 2, 2]  # one batch per (decode, sample), kept tickets only


def test_a_chunk_with_only_overlength_tickets_never_calls_generate(engine, profile, monkeypatch):
    spy = GenerateSpy(engine, monkeypatch)
    result = rollout(engine, chunk(0, TICKETS[:3], limit=10), profile)
    assert spy.batches == []
    assert all(t.dropped and t.samples == [] and t.prompt_tokens > 10 for t in result.tickets)
    assert result.generated_tokens == 0


def test_samplers_cap_prompts_at_4096_tokens_unless_told_otherwise():
    """Upstream's rollout fell back to 4096: without a cap a long ticket can exhaust GPU memory."""
    from stageb_pool.engine.records import SamplerConfig

    assert msgspec.convert({"grid": [{"temperature": 0.5}]}, SamplerConfig).max_prompt_tokens == 4096
    assert msgspec.convert({"grid": [{"temperature": 0.5}], "max_prompt_tokens": None},
                           SamplerConfig).max_prompt_tokens is None


def test_out_of_memory_on_a_chunk_names_the_chunk_its_tickets_and_prompt_lengths(engine, profile, monkeypatch):
    from stageb_pool.engine.transformers_engine import ChunkOutOfMemory

    def exhausted(**kwargs):
        raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 20.00 GiB")

    monkeypatch.setattr(engine.model, "generate", exhausted)
    counts = [len(engine.text.prompt_ids(prompts.build_messages(profile, GUIDANCE, t)))
              for t in TICKETS[:3]]
    with pytest.raises(ChunkOutOfMemory) as info:
        rollout(engine, chunk(5, TICKETS[:3], seed_key="7/eval"), profile)
    text = str(info.value)
    assert "\n" not in text and "chunk 5" in text and "7/eval" in text and "20.00 GiB" in text
    for t, n in zip(TICKETS[:3], counts):
        assert f"{t.key} ({n} prompt tokens)" in text
    assert "max_prompt_tokens" in text and "chunk_size" in text
    with pytest.raises(ChunkOutOfMemory, match="proposer chat .*7/proposer/it1.* prompt tokens"):
        engine.chat(chat_request(EXAMPLES))


def test_prompt_of_exactly_the_limit_is_kept(engine, profile):
    count = rollout(engine, chunk(0, TICKETS[:1], limit=None), profile).tickets[0].prompt_tokens
    assert not rollout(engine, chunk(0, TICKETS[:1], limit=count), profile).tickets[0].dropped
    assert rollout(engine, chunk(0, TICKETS[:1], limit=count - 1), profile).tickets[0].dropped


# ---------------------------------------------------------------- stops and text


def test_a_configured_stop_token_ends_the_sample_and_the_text(profile):
    plain = build_engine(CPU, TINY, MODEL)
    greedy = rollout(plain, chunk(0, TICKETS[:1], [GREEDY]), profile).tickets[0].samples[0]
    assert greedy.finish_reason == "length"
    stop_token = plain.tokenizer.convert_ids_to_tokens(greedy.token_ids[4])
    stopping = build_engine(CPU, TINY, ModelConfig(stop=[stop_token]))
    assert stopping.text.stop_strings == ["<|im_end|>", "<|endoftext|>", stop_token]
    s = rollout(stopping, chunk(0, TICKETS[:1], [GREEDY]), profile).tickets[0].samples[0]
    first = greedy.token_ids.index(greedy.token_ids[4])
    assert s.finish_reason == "stop"
    assert s.token_ids == greedy.token_ids[: first + 1]
    assert s.completion_tokens == first + 1


def test_a_multi_token_stop_string_ends_the_sample_and_cuts_the_text(engine, profile):
    ids = rollout(engine, chunk(0, TICKETS[1:2], [GREEDY]), profile).tickets[0].samples[0].token_ids
    tok = engine.tokenizer
    # Two consecutive generated tokens whose text is clean and is not itself one token.
    candidates = [(a, tok.decode(ids[a:a + 2])) for a in range(2, 8)]
    a, stop = next((a, s) for a, s in candidates if "\ufffd" not in s and s.strip() and s not in tok.get_vocab())
    stopping = build_engine(CPU, TINY, ModelConfig(stop=[stop]))
    s = rollout(stopping, chunk(0, TICKETS[1:2], [GREEDY]), profile).tickets[0].samples[0]
    assert s.finish_reason == "stop"
    assert s.token_ids == ids[: a + 2] and s.completion_tokens == a + 2
    assert s.text == tok.decode(ids[:a], skip_special_tokens=True).strip()


@pytest.mark.parametrize("extra", [[], ["\n\n"], ["<|im_end|>", "Reason:"]], ids=["none", "newlines", "repeat"])
def test_configured_stops_add_to_the_end_of_turn_tokens(engine, profile, monkeypatch, extra):
    """model.stop adds stops (upstream): the end-of-turn tokens always stop generation."""
    stopping = build_engine(CPU, TINY, ModelConfig(stop=extra))
    defaults = ["<|im_end|>", "<|endoftext|>"]
    assert stopping.text.stop_strings == list(dict.fromkeys(defaults + extra))
    seen = []
    real = stopping.model.generate
    monkeypatch.setattr(stopping.model, "generate", lambda **kw: seen.append(kw["eos_token_id"]) or real(**kw))
    rollout(stopping, chunk(0, TICKETS[:1], [GREEDY]), profile)
    eos = engine.tokenizer.convert_tokens_to_ids(defaults)
    assert seen and set(eos) <= set(seen[0])


def test_default_stops_are_eos_im_end_and_endoftext(engine):
    assert engine.text.stop_strings == ["<|im_end|>", "<|endoftext|>"]
    assert engine.text.stop_ids == engine.tokenizer.convert_tokens_to_ids(["<|im_end|>", "<|endoftext|>"])
    assert engine.tokenizer.padding_side == "left"


@pytest.mark.parametrize(
    "raw, clean",
    [
        ("Verdict: pass\nReason: ok", "Verdict: pass\nReason: ok"),
        ("  Verdict: fail  \n", "Verdict: fail"),
        # a role echo is kept: the verdict parser is the one place that removes it
        ("assistant\nVerdict: pass", "assistant\nVerdict: pass"),
        ("Assistant: Verdict: pass", "Assistant: Verdict: pass"),
        ("Verdict: pass<|im_end|>more text", "Verdict: pass"),
        ("Verdict: pass<|endoftext|>x<|im_end|>y", "Verdict: pass"),
        ("the assistant\nsaid", "the assistant\nsaid"),
        ("", ""),
    ],
)
def test_texts_are_cut_at_the_first_stop_string_and_stripped(engine, raw, clean):
    assert chat_text.clean(raw, engine.text.stop_strings) == clean


def test_templates_without_enable_thinking_are_retried(engine, profile, monkeypatch):
    expected = stable(rollout(engine, chunk(0, TICKETS[:2]), profile))
    real = engine.tokenizer.apply_chat_template

    def strict(messages, **kwargs):
        if "enable_thinking" in kwargs:
            raise TypeError("unexpected keyword argument 'enable_thinking'")
        return real(messages, **kwargs)

    monkeypatch.setattr(engine.tokenizer, "apply_chat_template", strict)
    assert stable(rollout(engine, chunk(0, TICKETS[:2]), profile)) == expected


# ---------------------------------------------------------------- constrained verdict line


def decoded(engine, result: ChunkResult) -> list[str]:
    return [engine.tokenizer.decode(s.token_ids, skip_special_tokens=True) for t in result.tickets for s in t.samples]


@pytest.mark.parametrize("name, words", [("generic", ("pass", "fail")), ("bbu_rru", ("通过", "不通过"))])
def test_constrained_samples_follow_the_two_line_protocol(engine, name, words):
    """The random tiny model never writes the protocol by itself; constrained, every sample is
    exactly "Verdict: <word>" then "Reason: <one line>", ended by the end-of-turn token (or
    cut by max_new_tokens), and the parser accepts every finished one."""
    import re

    from stageb_pool.stageb import verdicts

    profile = prompts.load_profile(name, mission=MISSION, domain="bbu" if name == "bbu_rru" else None)
    grid = [msgspec.structs.replace(SAMPLED, max_new_tokens=40), msgspec.structs.replace(GREEDY, max_new_tokens=40)]
    free = decoded(engine, rollout(engine, chunk(0, TICKETS[:4], grid, spd=2), profile))
    assert not any(text.startswith("Verdict") for text in free)
    held = rollout(engine, chunk(0, TICKETS[:4], grid, spd=2, constrain=True), profile)
    samples = [s for t in held.tickets for s in t.samples]
    texts = decoded(engine, held)
    assert len(texts) == 16 and len(set(texts)) > 1
    two_lines = "|".join(f"Verdict: {w}\nReason: [^\n]*" for w in words)
    assert all(re.fullmatch(two_lines, x) for x in texts), texts  # never a third line
    assert all(verdicts.parse_verdict(s.text, profile.verdict).verdict in ("pass", "fail")
               for s in samples if len(s.text) > len(texts[0].split("\n")[0]) + 10)


def _tiny_tokenizer(*, decoder=None, normalizer=None):
    from stageb_pool.engine import tiny

    tok = tiny.build_tokenizer()
    if decoder is not None:
        tok.backend_tokenizer.decoder = decoder
    if normalizer is not None:
        tok.backend_tokenizer.normalizer = normalizer
    return tok


def test_a_byte_level_tokenizer_behind_a_decoder_sequence_is_read_as_bytes(profile):
    """transformers 5.17 converts the embedded GGUF's tokenizer with the decoder sequence
    below; llguidance then read 'Ġpass' as the bytes C4 A0 'pass', and the first token after a
    space failed the grammar mid-generation (found on a GPU machine). The grammar must accept
    the tokenizer's own encoding of a valid verdict line."""
    from tokenizers import decoders

    from stageb_pool.engine.constrained import Grammars, verdict_line_regex

    tok = _tiny_tokenizer(decoder=decoders.Sequence([decoders.ByteFallback(), decoders.Fuse(),
                                           decoders.Replace("▁", " "), decoders.ByteLevel()]))
    width = len(tok)
    line = tok("Verdict: pass\nReason: the bolt is tight", add_special_tokens=False)["input_ids"]
    processor = Grammars(tok, width).processor(1, 0, regex=verdict_line_regex(profile.verdict))
    for n in range(len(line)):
        scores = processor(torch.tensor([line[:n]]), torch.zeros(1, width))
        assert torch.isfinite(scores[0, line[n]]), tok.decode(line[: n + 1])


def test_a_tokenizer_whose_bytes_llguidance_cannot_read_is_refused_in_plain_words():
    from tokenizers import normalizers

    from stageb_pool.engine.constrained import Grammars

    tok = _tiny_tokenizer(normalizer=normalizers.Lowercase())  # its ids spell "verdict: pass"
    with pytest.raises(ValueError, match="constrained decoding cannot use this tokenizer.*constrain_verdict"):
        Grammars(tok, len(tok))


def test_after_the_reason_line_only_the_end_of_turn_token_may_follow_a_newline(engine, profile):
    """The random tiny model never picks eos by itself: check the mask at the end of a reason."""
    from stageb_pool.engine.constrained import Grammars, verdict_line_regex

    tok = engine.tokenizer
    width = engine.model.get_output_embeddings().weight.shape[0]
    prompt = tok("<|im_start|>assistant\n", add_special_tokens=False)["input_ids"]
    done = tok("Verdict: pass\nReason: the bolt is tight", add_special_tokens=False)["input_ids"]
    processor = Grammars(tok, width).processor(1, len(prompt), regex=verdict_line_regex(profile.verdict))
    allowed = None
    for n in range(len(done) + 1):
        scores = torch.zeros(1, width)
        processor(torch.tensor([prompt + done[:n]]), scores)
        allowed = torch.isfinite(scores[0])
        if n < len(done):
            assert allowed[done[n]], tok.decode(done[: n + 1])
    newline = tok("\n", add_special_tokens=False)["input_ids"][0]
    assert allowed[tok.eos_token_id] and not allowed[newline] and allowed[tok(" and", add_special_tokens=False)["input_ids"][0]]
    assert not processor.free[0]
    processor(torch.tensor([prompt + done + [tok.eos_token_id]]), torch.zeros(1, width))
    assert processor.free[0]  # finished: later pads are not fed to the matcher


def test_constrained_rollouts_are_seeded_like_the_others(engine, profile):
    a = rollout(engine, chunk(0, TICKETS[:4], constrain=True), profile)
    assert stable(rollout(engine, chunk(0, TICKETS[:4], constrain=True), profile)) == stable(a)
    assert ids_of(rollout(engine, chunk(1, TICKETS[:4], constrain=True), profile)) != ids_of(a)


def test_the_constraint_option_is_in_the_config_hash_and_the_rollout_cache_key(profile):
    """A rollout with the option on is never served from one made with it off, and a run
    resumed with the other setting is refused (its identity differs)."""
    from pathlib import Path

    from stageb_pool import Pool
    from stageb_pool.pool import Inline
    from stageb_pool.app.config import load_config
    from stageb_pool.app.identity import identity_document
    from stageb_pool.search.rollout import RolloutRunner, RolloutSpec
    from stageb_pool.stageb.hashing import content_hash
    from stageb_pool.stageb.tickets import Ticket

    demo = Path(__file__).resolve().parents[1] / "configs" / "demo.yaml"
    key = "rule_search.train_sampler.constrain_verdict"
    identities = [identity_document(load_config(demo, [f"{key}={v}"]), seed_guidance={}, profile=profile,
                                    proposer_system=None) for v in ("false", "true")]
    assert identities[0] != identities[1]
    sampler = load_config(demo, [f"{key}=false"]).rule_search.train_sampler
    tickets = [Ticket(t.key, t.key, t.mission, "pass", t.per_image) for t in TICKETS[:2]]
    with Pool(tiny_factory, gpus="cpu:1", backend=Inline()) as pool:
        runner = RolloutRunner(pool, profile, chunk_size=2)
        for on in (False, True, False):
            runner.run(RolloutSpec("r", "7/train", tickets, GUIDANCE,
                                   msgspec.structs.replace(sampler, constrain_verdict=on), content_hash(GUIDANCE)))
        assert pool.stats.items[0] == 2  # off, then on; the second "off" came from the cache


# ---------------------------------------------------------------- chat


def chat_request(examples, limit=None, seed_key="7/proposer/it1", decode=SAMPLED) -> ChatRequest:
    return ChatRequest("You propose rules.", "Current rules: G0.", examples, "Answer with JSON.", decode, seed_key, limit)


EXAMPLES = [f"Example {i}: ticket T{i:03d} was judged wrong; " + "mount bolt loose. " * (i + 1) for i in range(4)]


def test_chat_uses_all_examples_without_a_budget_and_is_seeded_by_the_request(engine):
    a = engine.chat(chat_request(EXAMPLES))
    assert a.examples_used == 4 and a.text is not None and a.completion_tokens > 0
    assert a.finish_reason in ("stop", "length")
    assert engine.chat(chat_request(EXAMPLES)) == a
    assert engine.chat(chat_request(EXAMPLES, seed_key="7/proposer/it2")).text != a.text


def test_chat_drops_examples_from_the_end_until_the_prompt_fits(engine):
    sizes = [engine.chat(chat_request(EXAMPLES[:k], decode=GREEDY)).prompt_tokens for k in range(5)]
    assert sizes == sorted(sizes) and len(set(sizes)) == 5
    fitted = engine.chat(chat_request(EXAMPLES, limit=sizes[2] + 1, decode=GREEDY))
    assert (fitted.examples_used, fitted.prompt_tokens) == (2, sizes[2])
    assert fitted == engine.chat(chat_request(EXAMPLES[:2], decode=GREEDY))  # same prompt, same answer


def test_chat_stops_at_one_example_and_returns_no_text_when_that_does_not_fit(engine, monkeypatch):
    """Upstream never asks the proposer without an example: when even one does not fit, the
    call fails (the search logs prompt_overlength) with the one-example count."""
    sizes = [engine.chat(chat_request(EXAMPLES[:k], decode=GREEDY)).prompt_tokens for k in (0, 1)]
    spy = GenerateSpy(engine, monkeypatch)
    for limit in (sizes[1] - 1, sizes[0] - 1):  # the head alone fits / nothing fits
        none_fit = engine.chat(chat_request(EXAMPLES, limit=limit))
        assert none_fit.text is None and none_fit.completion_tokens == 0
        assert (none_fit.examples_used, none_fit.prompt_tokens) == (1, sizes[1])
    assert spy.batches == []
    one = engine.chat(chat_request(EXAMPLES, limit=sizes[1], decode=GREEDY))
    assert (one.examples_used, one.prompt_tokens) == (1, sizes[1]) and one.text is not None


def test_chat_without_examples_is_one_prompt(engine):
    size = engine.chat(chat_request([], decode=GREEDY)).prompt_tokens
    assert engine.chat(chat_request([], limit=size, decode=GREEDY)).text is not None
    refused = engine.chat(chat_request([], limit=size - 1))
    assert (refused.text, refused.examples_used, refused.prompt_tokens) == (None, 0, size)


PROPOSER_GUIDANCE = {**GUIDANCE, "G1": "If any photo is blurry, the verdict is fail."}


def proposer_schema_text(profile) -> str:
    from stageb_pool.stageb.proposer_schema import proposer_schema

    return json.dumps(proposer_schema(PROPOSER_GUIDANCE, profile.verdict, max_operations=2))


def test_a_constrained_proposer_answer_is_json_of_the_schema_that_ends_at_its_brace(engine, profile):
    """Even the random tiny model writes an answer that parses: the grammar forces the shape,
    the bounded strings force an end, and the end-of-turn token follows the closing brace."""
    from stageb_pool.stageb import proposer

    decode = Decode(temperature=0.8, top_p=0.9, max_new_tokens=1500, seed=43)
    for seed_key in ("7/proposer/it1", "7/proposer/it2", "7/proposer/it3"):
        request = msgspec.structs.replace(chat_request(EXAMPLES, seed_key=seed_key, decode=decode),
                                          json_schema=proposer_schema_text(profile))
        answer = engine.chat(request)
        assert answer.finish_reason == "stop" and answer.text.endswith("}"), answer
        obj = json.loads(answer.text)
        accepted, rejected = proposer.parse_candidates(obj, PROPOSER_GUIDANCE, vocab=profile.verdict, limit=2)
        assert 1 <= len(accepted) + len(rejected) <= 2
        assert all(r["reason"] not in ("missing text", "unknown op") for r in rejected)
        assert engine.chat(request) == answer  # seeded like any chat


def test_after_a_complete_json_answer_only_the_end_of_turn_token_may_follow(engine, profile):
    """llguidance stops a JSON grammar at the closing brace, before any end token: the row must
    then be held to the end token, not released (the model would write on)."""
    from stageb_pool.engine.constrained import Grammars

    tok = engine.tokenizer
    width = engine.model.get_output_embeddings().weight.shape[0]
    prompt = tok("<|im_start|>assistant\n", add_special_tokens=False)["input_ids"]
    answer = '{"operations":[{"op":"upsert","text":"If the seal is cracked, judge fail.","rationale":"Leaks."}]}'
    done = tok(answer, add_special_tokens=False)["input_ids"]
    processor = Grammars(tok, width).processor(1, len(prompt), json_schema=proposer_schema_text(profile))
    for n in range(len(done) + 1):
        scores = torch.zeros(1, width)
        processor(torch.tensor([prompt + done[:n]]), scores)
        if n < len(done):
            assert torch.isfinite(scores[0, done[n]]), tok.decode(done[: n + 1])
    assert torch.isfinite(scores[0]).nonzero().flatten().tolist() == [tok.eos_token_id]
    processor(torch.tensor([prompt + done + [tok.eos_token_id]]), torch.zeros(1, width))
    assert processor.free[0]  # finished: later pads are not fed to the matcher


# ---------------------------------------------------------------- verdict probabilities (judge headroom)


def verdicts_of(engine, tickets, profile, *, index=0, limit=None, guidance=GUIDANCE) -> VerdictChunkResult:
    return engine.verdict_probabilities(VerdictChunk(index, list(tickets), limit), guidance=guidance, profile=profile)


def plain_answer_logprob(engine, ticket, profile, word: str) -> float:
    """The summed log-probability of "Verdict: <word>" after the ticket's prompt, from one
    unbatched, unpadded forward pass over the whole sequence (the engine's code not used)."""
    messages = prompts.build_messages(profile, GUIDANCE, ticket)
    text = engine.tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    prompt = engine.tokenizer(text, add_special_tokens=False)["input_ids"]
    answer = engine.tokenizer("Verdict: " + word, add_special_tokens=False)["input_ids"]
    with torch.inference_mode():
        logits = engine.model(torch.tensor([prompt + answer])).logits[0].double()
    logprobs = logits.log_softmax(-1)
    return sum(float(logprobs[len(prompt) + j - 1, token]) for j, token in enumerate(answer))


@pytest.mark.parametrize("name, words", [("generic", None), ("bbu_rru", None), ("bbu_rru", ("通过", "驳回"))])
def test_p_pass_is_the_softmax_of_the_two_answers_full_sequence_logprobs(engine, name, words):
    """For every ticket of a padded batch of prompts of different lengths: P(pass) equals
    softmax(log P("Verdict: pass"), log P("Verdict: fail")) from a plain forward pass. With the
    Chinese words each takes several tokens of the byte-level tokenizer (通过 / 不通过: the
    longer fail answer is far less likely for the random model, so P(pass) is 1; 通过 / 驳回
    have the same length)."""
    profile = prompts.load_profile(name, mission=MISSION, domain="bbu" if name == "bbu_rru" else None)
    if words is not None:
        vocab = msgspec.structs.replace(profile.verdict, pass_text=words[0], fail_text=words[1])
        profile = msgspec.structs.replace(profile, verdict=vocab)
    words = (profile.verdict.pass_text, profile.verdict.fail_text)
    if name == "bbu_rru":
        assert all(len(engine.tokenizer(w, add_special_tokens=False)["input_ids"]) > 1 for w in words)
    tickets = [ticket(i, extra=i) for i in range(5)]
    result = verdicts_of(engine, tickets, profile)
    assert [t.key for t in result.tickets] == [t.key for t in tickets]
    assert len({t.prompt_tokens for t in result.tickets}) > 1  # the batch really is padded
    for t, scored in zip(tickets, result.tickets):
        lp, lf = (plain_answer_logprob(engine, t, profile, w) for w in words)
        assert 0.0 <= scored.p_pass <= 1.0 and not scored.dropped
        assert scored.p_pass == pytest.approx(1 / (1 + math.exp(lf - lp)), abs=1e-5)
        assert scored.p_pass == round(scored.p_pass, 6)
    if words != ("通过", "不通过"):
        assert len({t.p_pass for t in result.tickets}) > 1  # the random model's answer depends on the ticket


def test_p_pass_prompts_are_the_rollout_prompts(engine, profile):
    scored = verdicts_of(engine, TICKETS[:4], profile)
    rolled = rollout(engine, chunk(0, TICKETS[:4], [GREEDY]), profile)
    assert [t.prompt_tokens for t in scored.tickets] == [t.prompt_tokens for t in rolled.tickets]


def test_a_verdict_chunk_does_not_depend_on_what_the_worker_did_before(profile):
    """The same chunk on a fresh engine and on one that ran rollouts, chats and other verdict
    chunks first gives the same bytes (wall clock aside): one batch, in its own order."""
    target = VerdictChunk(1, TICKETS[4:8], None)
    fresh = build_engine(CPU, TINY, MODEL).verdict_probabilities(target, guidance=GUIDANCE, profile=profile)
    busy = build_engine(CPU, TINY, MODEL)
    rollout(busy, chunk(0, TICKETS[:4], [SAMPLED]), profile)
    busy.chat(ChatRequest("sys", "head", ["ex"], "tail", SAMPLED, "7/proposer/it1"))
    verdicts_of(busy, TICKETS[:4], profile, guidance={"G0": "another rule"})
    again = busy.verdict_probabilities(target, guidance=GUIDANCE, profile=profile)
    assert stable(again) == stable(fresh)


def test_a_ticket_scores_nearly_the_same_alone_as_in_a_batch(engine, profile):
    """Padding changes low bits only (documented: identical results come from a fixed chunk
    geometry, not from batch invariance)."""
    batch = verdicts_of(engine, TICKETS[:4], profile)
    for t, scored in zip(TICKETS[:4], batch.tickets):
        (alone,) = verdicts_of(engine, [t], profile).tickets
        assert alone.p_pass == pytest.approx(scored.p_pass, abs=1e-5)


def test_overlength_tickets_come_back_dropped_and_unscored(engine, profile, monkeypatch):
    sizes = [t.prompt_tokens for t in verdicts_of(engine, TICKETS[:3], profile).tickets]
    limit = sorted(sizes)[1]
    result = verdicts_of(engine, TICKETS[:3], profile, limit=limit)
    for size, scored in zip(sizes, result.tickets):
        assert scored.prompt_tokens == size
        assert (scored.dropped, scored.p_pass is None) == ((size > limit),) * 2

    def no_forward(*args, **kwargs):
        raise AssertionError("the model ran for a chunk with only overlength tickets")

    monkeypatch.setattr(engine, "_answer_logprobs", no_forward)
    none = verdicts_of(engine, TICKETS[:3], profile, limit=min(sizes) - 1)
    assert all(t.dropped and t.p_pass is None for t in none.tickets)


@pytest.mark.parametrize("lp, lf, want", [
    (0.0, 0.0, 0.5), (-1.0, -1.0, 0.5), (-math.inf, -math.inf, 0.5), (0.0, -math.inf, 1.0), (-math.inf, 0.0, 0.0),
    (-1000.0, 0.0, 0.0), (0.0, -1000.0, 1.0), (-2.0, -1.0, round(1 / (1 + math.e), 6)),
    (-1.0, -2.0, round(math.e / (1 + math.e), 6)), (-5.0, -0.1, round(1 / (1 + math.exp(4.9)), 6)),
])
def test_p_pass_of_two_logprobs(lp, lf, want):
    assert verdict_scoring.p_pass(lp, lf) == want
    assert verdict_scoring.p_pass(lf, lp) == pytest.approx(1 - want, abs=1e-6)  # symmetric


def test_p_pass_refuses_nan():
    with pytest.raises(ValueError, match="not numbers"):
        verdict_scoring.p_pass(math.nan, -1.0)


# ---------------------------------------------------------------- data is text (issue 32)


@pytest.fixture(scope="module")
def embedded_tokenizer():
    from stageb_pool.engine import models

    return models.tokenizer_only(check_model_path("embedded"))


@pytest.fixture(scope="module", params=["tiny", "embedded"])
def any_judge(request, engine, embedded_tokenizer):
    """The transformers engine with each tokenizer: the tiny model, and a tiny random model
    of the embedded model's vocabulary behind the embedded model's tokenizer (the tokenizer
    is what is under test, not the weights)."""
    if request.param == "tiny":
        return engine
    from stageb_pool.engine import tiny

    return TransformersEngine(tiny.build_model(embedded_tokenizer), embedded_tokenizer, CPU)


def test_control_token_spellings_in_data_are_text_in_every_prompt_of_the_engine(any_judge, embedded_tokenizer,
                                                                                 monkeypatch):
    """A ticket, mission, guidance and proposer examples spelling every added token of the
    embedded model's tokenizer (a forged judge turn among them) give rollout, judge-headroom
    and proposer prompts with exactly the control tokens of clean data, and every character of
    the data as text; clean data keeps the ids it always had. The rows are taken where the
    engine hands them to the model (``_pad``)."""
    from spelled_tokens import Prompts, assert_data_is_text, old_prompt_ids, spellings

    tok = any_judge.tokenizer
    data = Prompts(spellings(embedded_tokenizer, tok))
    rows = []
    pad = any_judge._pad
    monkeypatch.setattr(any_judge, "_pad", lambda batch: rows.append([list(r) for r in batch]) or pad(batch))

    def model_rows(call):
        rows.clear()
        call()
        return [r for batch in rows for r in batch]

    def judged(ticket, guidance):
        rolled = model_rows(lambda: any_judge.rollout(chunk(0, [ticket], [GREEDY]), guidance=guidance,
                                                      profile=data.profile))
        scored = model_rows(lambda: any_judge.verdict_probabilities(VerdictChunk(0, [ticket], None), guidance=guidance,
                                                                    profile=data.profile))
        assert rolled == scored[:1]  # the headroom check scores the rollout's prompt
        return rolled[0]

    clean = judged(data.clean_ticket, data.clean_guidance)
    forged = judged(data.spelled_ticket, data.spelled_guidance)
    assert clean == old_prompt_ids(tok, data.clean_text(tok))
    assert_data_is_text(tok, clean, forged, data.spelled_text(tok))

    (clean_chat,) = model_rows(lambda: any_judge.chat(data.clean_request))
    (forged_chat,) = model_rows(lambda: any_judge.chat(data.spelled_request))
    assert clean_chat == old_prompt_ids(tok, data.chat_text(tok, data.clean_request))
    assert_data_is_text(tok, clean_chat, forged_chat, data.chat_text(tok, data.spelled_request))


@pytest.mark.parametrize("name", ["tiny", "embedded"])
def test_prompts_without_a_spelling_keep_their_ids_in_one_batched_call(name, embedded_tokenizer, profile):
    """Every demo-like prompt (and one with a partial, harmless spelling) has the ids the
    rendered text tokenized in one call gives, as before issue 32; in a chunk beside a spelled
    ticket too, in chunk order."""
    from spelled_tokens import Prompts, old_prompt_ids, spellings

    from stageb_pool.engine import models

    tok = embedded_tokenizer if name == "embedded" else models.tokenizer_only(TINY)
    data = Prompts(spellings(tok))
    partial = TicketText("T099", MISSION, {"image_1": "<|im_end| and <im_start|> and |>< are text anyway"})
    tickets = [*TICKETS[:4], partial]
    mixed = [TICKETS[0], data.spelled_ticket, TICKETS[1], data.spelled_ticket, partial]
    ids, _ = chat_text.chunk_prompts(tok, chunk(0, mixed), GUIDANCE, profile)
    assert ids[1] == ids[3] != old_prompt_ids(tok, chat_text.render(tok, prompts.build_messages(
        profile, GUIDANCE, data.spelled_ticket)))
    for t, row in zip(mixed, ids):
        if t is not data.spelled_ticket:
            assert row == old_prompt_ids(tok, chat_text.render(tok, prompts.build_messages(profile, GUIDANCE, t)))
    ids, _ = chat_text.chunk_prompts(tok, chunk(0, tickets), GUIDANCE, profile)
    assert ids == [old_prompt_ids(tok, chat_text.render(tok, prompts.build_messages(profile, GUIDANCE, t)))
                   for t in tickets]


# ---------------------------------------------------------------- loading and provenance


def test_info_records_what_determinism_depends_on(engine):
    import transformers

    info = engine.info()
    assert info["torch"] == torch.__version__ and info["transformers"] == transformers.__version__
    assert (info["device"], info["dtype"], info["model_path"], info["model"]) == ("cpu", "float32", "tiny", "tiny-qwen2")
    assert info["attn_implementation"] == "sdpa"
    msgspec.json.encode(info)  # travels over the pool as JSON


def fake_cuda(monkeypatch):
    """torch's CUDA facts as a GPU worker would read them, on a machine without one."""
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda index=0: "Fake GPU")
    monkeypatch.setattr(torch.version, "cuda", "12.8")
    monkeypatch.setattr(torch.backends.cudnn, "version", lambda: 91002)


def test_the_transformers_provenance_keeps_its_keys_values_and_order(engine, monkeypatch):
    """info() is hashed into every rollout cache key and written to run.json: its keys, values
    and their order are pinned (a reorder alone would change every cache key)."""
    import importlib.metadata

    import transformers

    versions = {"torch": str(torch.__version__), "transformers": transformers.__version__}
    stop = engine.text.stop_strings
    llguidance = importlib.metadata.version("llguidance")
    assert list(engine.info().items()) == [
        ("engine", "transformers"), *versions.items(), ("device", "cpu"), ("dtype", "float32"),
        ("model_path", "tiny"), ("model", "tiny-qwen2"), ("attn_implementation", "sdpa"), ("stop", stop),
        ("llguidance", llguidance)]
    fake_cuda(monkeypatch)
    grouped = TransformersEngine(engine.model, engine.tokenizer, Device("cuda", 0, 0, group=(0, 1)), model_path="/m",
                     model_name="m")
    assert list(grouped.info().items()) == [
        ("engine", "transformers"), *versions.items(), ("device", "Fake GPU"), ("cuda", "12.8"), ("cudnn", 91002),
        ("dtype", "float32"), ("model_path", "/m"), ("model", "m"), ("attn_implementation", "sdpa"),
        ("stop", stop), ("llguidance", llguidance), ("gpus_per_worker", 2), ("sharding", "layers")]


def test_the_vllm_provenance_keeps_its_keys_values_and_order(engine, monkeypatch):
    """The same pin for the vLLM engine, with a stand-in vllm module (info() reads only its
    version), so it holds where vllm is not installed."""
    import importlib.metadata
    import types

    import transformers

    from stageb_pool.engine.vllm_engine import VllmEngine

    monkeypatch.setitem(sys.modules, "vllm", types.SimpleNamespace(__version__="0.0.test"))
    versions = {"vllm": "0.0.test", "torch": str(torch.__version__), "transformers": transformers.__version__}
    llguidance = importlib.metadata.version("llguidance")
    settings = {"dtype": "float32", "max_model_len": 512, "kv_cache_gib": 1.0, "threads": 1}
    one = VllmEngine(None, engine.tokenizer, CPU, model_path="tiny", model_name="tiny-qwen2-h32", settings=settings)
    stop = one.text.stop_strings
    assert list(one.info().items()) == [
        ("engine", "vllm"), *versions.items(), ("device", "cpu"), ("dtype", "float32"), ("model_path", "tiny"),
        ("model", "tiny-qwen2-h32"), ("stop", stop), ("llguidance", llguidance), ("vllm_settings", settings)]
    fake_cuda(monkeypatch)
    grouped = VllmEngine(None, engine.tokenizer, Device("cuda", 0, 0, group=(0, 1)), model_path="/m", model_name="m",
                         stop=["END"], settings=dict(settings, dtype="bfloat16", tensor_parallel_size=2))
    assert list(grouped.info().items()) == [
        ("engine", "vllm"), *versions.items(), ("device", "Fake GPU"), ("cuda", "12.8"), ("cudnn", 91002),
        ("dtype", "bfloat16"), ("model_path", "/m"), ("model", "m"), ("stop", grouped.text.stop_strings),
        ("llguidance", llguidance), ("vllm_settings", dict(settings, dtype="bfloat16", tensor_parallel_size=2)),
        ("gpus_per_worker", 2), ("sharding", "tensor_parallel")]
    assert grouped.text.stop_strings[-1] == "END"


def test_a_saved_checkpoint_directory_loads_and_generates_like_the_original(engine, profile, tmp_path):
    engine.model.save_pretrained(tmp_path)
    engine.tokenizer.save_pretrained(tmp_path)
    loaded = build_engine(CPU, check_model_path(str(tmp_path)), MODEL)
    assert loaded.info()["model_path"] == str(tmp_path.resolve())
    ch = chunk(0, TICKETS[:3], [SAMPLED, GREEDY])
    assert stable(rollout(loaded, ch, profile)) == stable(rollout(engine, ch, profile))


@pytest.mark.parametrize("weights", [None, b"not safetensors at all"], ids=["no-weights", "corrupt-weights"])
def test_a_corrupt_checkpoint_fails_construction_with_a_line_naming_the_path(engine, tmp_path, weights):
    engine.model.config.save_pretrained(tmp_path)
    engine.tokenizer.save_pretrained(tmp_path)
    if weights is not None:
        (tmp_path / "model.safetensors").write_bytes(weights)
    with pytest.raises(InputError) as info:
        build_engine(CPU, check_model_path(str(tmp_path)), MODEL)
    assert str(tmp_path) in str(info.value) and "\n" not in str(info.value)


def test_a_checkpoint_without_chat_template_is_refused_at_construction(engine, tmp_path):
    engine.model.save_pretrained(tmp_path)
    engine.tokenizer.save_pretrained(tmp_path)
    (tmp_path / "chat_template.jinja").unlink()
    with pytest.raises(InputError, match="chat template") as info:
        build_engine(CPU, check_model_path(str(tmp_path)), MODEL)
    assert str(tmp_path) in str(info.value)


def test_an_injected_model_generates_like_the_built_engine(engine, profile):
    """TransformersEngine(model, tokenizer, device) takes any loaded model; build_engine only loads."""
    from stageb_pool.engine import tiny

    model, tokenizer = tiny.build()
    injected = TransformersEngine(model, tokenizer, CPU, model_path="tiny", model_name=TINY.name)
    ch = chunk(0, TICKETS[:3], [SAMPLED, GREEDY])
    assert stable(rollout(injected, ch, profile)) == stable(rollout(engine, ch, profile))
    assert injected.info() == engine.info()


def test_unknown_dtype_is_an_input_error():
    with pytest.raises(InputError, match="dtype"):
        build_engine(CPU, TINY, ModelConfig(dtype="float13"))


# ---------------------------------------------------------------- engine choice (parent side)


def test_the_vllm_engine_needs_vllm_installed_and_says_where_to_get_it(monkeypatch):
    from stageb_pool.engine import vllm_engine
    from stageb_pool.engine.registry import check_engine

    assert check_engine("transformers") == "transformers"
    monkeypatch.setattr(vllm_engine.importlib.util, "find_spec", lambda name: None)
    with pytest.raises(InputError, match="bin/setup-vllm") as info:
        check_engine("vllm")
    assert "model.engine" in str(info.value)


def test_a_run_with_mixed_engines_or_versions_is_refused_and_other_differences_warned(caplog):
    import logging

    from stageb_pool.engine.registry import engine_agreement

    base = {"engine": "vllm", "vllm": "0.32.0", "torch": "2.13.0", "transformers": "5.19.0", "device": "A"}
    names = ["cuda:0", "cuda:1", "cuda:2"]
    for key, other in [("engine", "transformers"), ("vllm", "0.32.1"), ("torch", "2.13.1")]:
        with pytest.raises(InputError, match="another engine or version") as info:
            engine_agreement(ray=False).check(dict(enumerate([base, base, dict(base, **{key: other})])), names)
        assert "[2]" in str(info.value) and info.value.location == "--gpus"
    with caplog.at_level(logging.WARNING):
        engine_agreement(ray=False).check(dict(enumerate([base, dict(base, device="B")])), names)
    assert "different engine" in caplog.text


def test_model_engine_is_a_checked_config_key():
    from pathlib import Path

    from stageb_pool.app.config import load_config

    demo = Path(__file__).resolve().parents[1] / "configs" / "demo.yaml"
    cfg = load_config(demo, ["model.engine=vllm", "model.vllm.kv_cache_gib=2"])
    assert (cfg.model.engine, cfg.model.vllm.kv_cache_gib) == ("vllm", 2.0)
    assert load_config(demo).model.engine == "transformers"
    with pytest.raises(InputError, match="model.engine"):
        load_config(demo, ["model.engine=tensorrt"])


# ---------------------------------------------------------------- through the pool


def tiny_factory(device):
    # Inline engines run in this test process: keep it single-threaded (see CPU above).
    if device.kind == "cpu":
        device = msgspec.structs.replace(device, threads=1)
    return build_engine(device, TINY, MODEL)


def pool_rollout(gpus, chunks, profile, *, inline=False, cores=CORES) -> list[bytes]:
    """The rollouts of ``chunks`` on a pool of ``gpus`` whose workers may use only ``cores``."""
    from stageb_pool import Pool
    from stageb_pool.pool import Fork, Inline

    with pinned(cores), Pool(tiny_factory if inline else (lambda d: build_engine(d, TINY, MODEL)), gpus=gpus,
                             backend=Inline() if inline else Fork()) as pool:
        results = pool.map("rollout", chunks, guidance=GUIDANCE, profile=profile, result_type=ChunkResult)
        assert all(info["model"] == "tiny-qwen2" for info in pool.worker_info)
    return [stable(r) for r in results]


def test_rollouts_are_byte_identical_on_1_2_3_workers_and_inline(engine, profile):
    tickets = [ticket(i, extra=i % 4) for i in range(14)]
    chunks = chunks_of(tickets, 4, grid=[SAMPLED, GREEDY], spd=2, limit=10_000)
    chunks[1] = msgspec.structs.replace(chunks[1], constrain_verdict=True)  # the constraint too
    direct = [stable(rollout(engine, c, profile)) for c in chunks]
    runs = {
        "cpu:1": pool_rollout("cpu:1", chunks, profile),
        "cpu:2": pool_rollout("cpu:2", chunks, profile),
        "cpu:3 on one core": pool_rollout("cpu:3", chunks, profile, cores=ONE_CORE),
        "inline": pool_rollout("cpu:1", chunks, profile, inline=True),
    }
    for name, got in runs.items():
        assert got == direct, name
    assert not torch.cuda.is_initialized()  # the parent never started CUDA


def test_a_bad_model_path_fails_the_pool_naming_the_path(tmp_path):
    from stageb_pool import Pool, WorkerError

    (tmp_path / "config.json").write_text(json.dumps({"model_type": "qwen2"}))
    model = check_model_path(str(tmp_path))  # a checkpoint by its config.json: the worker's load fails
    with pytest.raises(WorkerError) as info:
        Pool(lambda d: build_engine(d, model, MODEL), gpus="cpu:1", start_timeout=120)
    assert str(tmp_path) in str(info.value)


# ---------------------------------------------------------------- the embedded model


@pytest.mark.slow
def test_embedded_model_end_to_end_identical_on_1_and_2_workers(model_cache, profile):
    """Two workers convert the GGUF at once (the lock makes one wait), then both generate;
    a 1-worker pool then loads the cached copy and must give the same bytes."""
    tickets = [ticket(i) for i in range(4)]
    grid = [Decode(temperature=0.7, top_p=0.9, max_new_tokens=24, repetition_penalty=1.05, seed=43)]
    chunks = chunks_of(tickets, 2, grid=grid, limit=4096)
    from stageb_pool import Pool

    results = {}
    for gpus in ("cpu:2", "cpu:1"):
        with Pool(lambda d: build_engine(d, check_model_path("embedded"), MODEL), gpus=gpus, start_timeout=600) as pool:
            info = pool.worker_info[0]
            results[gpus] = pool.map("rollout", chunks, guidance=GUIDANCE, profile=profile, result_type=ChunkResult)
    assert info["model"] == "SmolLM2-135M-Instruct" and info["dtype"] == "float32"
    assert [stable(r) for r in results["cpu:2"]] == [stable(r) for r in results["cpu:1"]]
    samples = [s for r in results["cpu:1"] for t in r.tickets for s in t.samples]
    assert len(samples) == 4 and all(s.text.strip() for s in samples)
    assert all(0 < s.completion_tokens <= 24 and s.finish_reason in ("stop", "length") for s in samples)
    # converted once into the session's cache (which other tests may also fill, e.g. the tiny checkpoint)
    converted = [p for p in model_cache.iterdir() if p.is_dir() and p.name.startswith("smollm2-")]
    assert len(converted) == 1 and (converted[0] / "model.safetensors").is_file()


def test_the_vllm_engine_module_does_not_import_torch():
    """vLLM's CPU worker takes its thread count from OMP_NUM_THREADS, set by
    prepare_environment before torch's import: a module-level torch import reached through
    the engine module (the verdict constraint's) would undo model.vllm.cpu_threads."""
    code = "import sys, stageb_pool.engine.vllm_engine; print('torch' in sys.modules)"
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert proc.stdout.strip() == "False"


# ---------------------------------------------------------------- GPU groups (issue 25)


def test_the_tiny_model_split_over_a_device_map_gives_the_same_bytes(engine, profile):
    """The group path (a layer map, accelerate's hooks forced) on CPU: the same bytes as the
    model loaded whole. On GPUs the split moves work between devices of one kind, which the
    determinism contract allows to differ between group sizes (docs/usage.md)."""
    from stageb_pool.engine import models, sharding

    model, tokenizer = models.load(TINY, dtype="float32", attn_implementation="sdpa",
                                         shard_over=["cpu", "cpu"])
    assert set(sharding.layer_split_map(model, ["cpu:a", "cpu:b"]).items()) >= {
        ("model.layers.0", "cpu:a"), ("model.layers.1", "cpu:b"), ("model.embed_tokens", "cpu:a"),
        ("model.norm", "cpu:b"), ("lm_head", "cpu:a")}  # the tied head stays with the embeddings
    assert hasattr(model.model.layers[0], "_hf_hook")  # dispatched, not merely moved
    sharded = TransformersEngine(model, tokenizer, CPU, model_name=TINY.name)
    for ch in chunks_of(TICKETS[:6], size=3, grid=(SAMPLED, GREEDY)):
        assert stable(rollout(sharded, ch, profile)) == stable(rollout(engine, ch, profile))


def test_layer_maps_split_the_layers_into_equal_runs_in_group_order():
    from stageb_pool.engine import sharding, tiny

    model, _ = tiny.build(attn_implementation="sdpa")
    model.model.layers.extend([model.model.layers[0]] * 5)  # 7 layers, weights shared: only names count
    layers = [sharding.layer_split_map(model, ["g0", "g1", "g2"])[f"model.layers.{i}"] for i in range(7)]
    assert layers == ["g0", "g0", "g0", "g1", "g1", "g2", "g2"]


def test_the_group_size_is_in_the_engine_identity_and_the_resume_identity(engine, profile):
    from pathlib import Path

    from stageb_pool.app.config import load_config
    from stageb_pool.app.identity import identity_document
    from stageb_pool.stageb.hashing import content_hash

    from stageb_pool.engine import provenance, sharding

    assert "gpus_per_worker" not in engine.info()  # one device: as before
    assert provenance.group_facts(engine.device, sharding.SHARDING) == {}
    group = provenance.group_facts(Device("cuda", 0, 0, group=(0, 1)), sharding.SHARDING)
    assert group == {"gpus_per_worker": 2, "sharding": "layers"}
    info = {k: v for k, v in engine.info().items()}
    assert content_hash({**info, **group}) != content_hash(info)  # the rollout cache key
    demo = Path(__file__).resolve().parents[1] / "configs" / "demo.yaml"
    docs = [identity_document(load_config(demo, [f"model.gpus_per_worker={g}"]), seed_guidance={}, profile=profile,
                              proposer_system=None) for g in (1, 2)]
    assert "gpus_per_worker" not in docs[0]["model"] and docs[1]["model"]["gpus_per_worker"] == 2


def group_engine_on_cpu(device):
    """A group worker's engine, on CPU: the tiny model through the layer map over one "cpu"
    per GPU of the worker's group (a faked GPU listing: no GPU is touched)."""
    from stageb_pool.engine import models

    model, tokenizer = models.load(TINY, dtype="float32", attn_implementation="sdpa",
                                         shard_over=["cpu"] * device.group_size)
    return TransformersEngine(model, tokenizer, Device("cpu", device.index, device.rank, device.threads), model_name=TINY.name)


def test_a_group_size_gives_the_same_bytes_on_one_group_and_on_two(engine, profile, monkeypatch):
    """The determinism contract per group size: 1 group of 2 and 2 groups of 2 (forked, each
    with its own CUDA_VISIBLE_DEVICES) give the bytes of the model loaded whole on CPU."""
    from stageb_pool import Pool

    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "0,1,2,3")
    chunks = chunks_of([ticket(i) for i in range(8)], 2, grid=[SAMPLED, GREEDY])
    direct = [stable(rollout(engine, c, profile)) for c in chunks]
    for gpus in ("0-1", "0-3"):
        with Pool(group_engine_on_cpu, gpus=gpus, gpus_per_worker=2) as pool:
            results = pool.map("rollout", chunks, guidance=GUIDANCE, profile=profile, result_type=ChunkResult)
            assert [d.visible_devices() for d in pool.devices] == ["0,1", "2,3"][:pool.size]
        assert [stable(r) for r in results] == direct, gpus


def test_vllm_takes_the_group_as_its_tensor_parallel_size():
    from stageb_pool.engine.vllm_engine import VllmSettings, llm_args

    one = llm_args(Device("cuda", 3, 0), VllmSettings(), "bfloat16")
    assert "tensor_parallel_size" not in one and "distributed_executor_backend" not in one  # as before groups
    group = llm_args(Device("cuda", 0, 0, group=(0, 1, 2, 3)), VllmSettings(), "bfloat16")
    assert group == {**one, "tensor_parallel_size": 4, "distributed_executor_backend": "mp"}


def _gpus_here() -> int:
    from stageb_pool.pool.devices import count_gpus  # the driver's listing: CUDA is never initialised here

    return count_gpus()


@pytest.mark.skipif(_gpus_here() == 0, reason="needs a GPU: the layer-map path on real GPUs against one GPU per worker "
                                                "(bench/gpu_groups_check.py, run in a child process)")
def test_the_layer_map_on_the_gpus_gives_the_bytes_of_one_gpu_per_worker():
    from pathlib import Path

    root = Path(__file__).resolve().parents[1]
    proc = subprocess.run([sys.executable, str(root / "bench" / "gpu_groups_check.py"), "--tickets", "8", "--chunk", "4",
                           "--max-new-tokens", "8"], capture_output=True, text=True, timeout=900, cwd=root)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert "IDENTICAL" in proc.stdout
