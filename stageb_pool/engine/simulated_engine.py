"""The simulated engine (``model.engine: simulated``): a latency model, not a model. It is a
benchmarking tool: it answers every request the real engines answer, with deterministic
verdicts, and sleeps the time a GPU serving a 7-8B model would take, so the whole rule search
runs at the pace of N GPUs on a machine that has none (a sleeping worker uses no CPU, so 64
of them fit two cores).

Verdicts: ``rule_judge`` (the guidance's "If any photo shows X, the verdict is fail." rules,
each sample flipped with probability ``noise`` by a work-derived seed), so a rule on a
feature that goes with the labels really lowers the error and the gate accepts it.

The proposer: from the examples it is shown (the most confidently wrong tickets), the
``PROPOSED_RULES`` words of the falsely passed tickets' summaries that the fewest of them
share (a word every example has is the summaries' structure, not a defect; ties ordered by a
draw seeded by the request's seed key), each as "If any photo shows <word>, the verdict is
fail.". Some are real defects and pass the gate, others are rejected: the loop does the work
of a real search.

The latency model, its formula and the sources of its defaults: docs/performance.md ("The
latency model"). Per request, its generate batches' prompts are prefilled and their
new tokens decoded (``batch_seconds``); prompt tokens are counted with the configured model's
own tokenizer (``TokenCounter``) plus the chat template's few tokens per message. The engine
sleeps ``seconds x time_scale``; ``modelled_s`` adds up the unscaled seconds.
"""

from __future__ import annotations

import json
import random
import re
import time
from pathlib import Path
from typing import Annotated

import msgspec
from msgspec import Meta

from ..pool.devices import Device
from ..stageb import prompts
from ..stageb.hashing import stable_seed
from . import chat_text, model_cache, rule_judge
from .models import ModelRef
from .records import ChatRequest, ChatResult, ChunkResult, RolloutChunk, Sample, VerdictChunk, VerdictChunkResult

NAME = "simulated"  # model.engine, and the section of its latency model
# What ``check`` says of it on the model line.
DESCRIBE = "a latency model for benchmarks, not a model; only its tokenizer counts the prompt tokens"

# ChatML wraps a message as "<|im_start|>role\n" ... "<|im_end|>\n" and the generation prompt
# is "<|im_start|>assistant\n": a few tokens that rendering through the chat template (with
# transformers, seconds of CPU in every worker) would count exactly.
CHAT_TOKENS_PER_MESSAGE = 5
GENERATION_PROMPT_TOKENS = 3
PROPOSED_RULES = 3
_EXAMPLE = re.compile(r"gt_label=(\w+); baseline_majority=(\w+)")
_WORD = re.compile(r"[a-z]{4,}")




class SimulatedSettings(msgspec.Struct, forbid_unknown_fields=True, kw_only=True, frozen=True):
    """The simulated engine's latency model (the config's ``model.simulated``; see the module
    docstring and docs/performance.md for the formula and where the defaults come from: a
    vLLM-served 7-8B model on one H100). None of these changes a result's bytes."""

    prefill_tokens_per_s: Annotated[float, Meta(gt=0, le=1e9)] = 20_000.0  # prompt tokens read per second
    decode_step_s: Annotated[float, Meta(gt=0, le=3600)] = 0.009  # one decoding step of a small batch
    decode_tokens_per_s: Annotated[float, Meta(gt=0, le=1e9)] = 12_000.0  # generated tokens per second of a full batch
    request_overhead_s: Annotated[float, Meta(ge=0, le=3600)] = 0.02  # fixed cost of every request (scheduling, sampling)
    time_scale: Annotated[float, Meta(ge=0, le=1e6)] = 1.0  # slept = modelled x this (0: no sleep, for tests)
    noise: Annotated[float, Meta(ge=0, le=1)] = 0.05  # probability that a sample's verdict flips


# ----------------------------------------------------------------------------- cost model


def batch_seconds(settings: SimulatedSettings, prompt_tokens: list[int], new_tokens: int) -> float:
    """Modelled seconds of one generate batch: its rows' prompts prefilled, then
    ``new_tokens`` decoding steps of ``len(prompt_tokens)`` rows (``new_tokens=0``: prefill only)."""
    rows = len(prompt_tokens)
    if rows == 0:
        return 0.0
    step = max(settings.decode_step_s, rows / settings.decode_tokens_per_s)
    return sum(prompt_tokens) / settings.prefill_tokens_per_s + new_tokens * step


def rollout_seconds(settings: SimulatedSettings, chunk: RolloutChunk, kept_prompt_tokens: list[int]) -> float:
    """Modelled seconds of a rollout chunk whose kept tickets have ``kept_prompt_tokens``."""
    batches = sum(batch_seconds(settings, kept_prompt_tokens, decode.max_new_tokens) * chunk.samples_per_decode
                  for decode in chunk.grid)
    return settings.request_overhead_s + batches


def chat_seconds(settings: SimulatedSettings, prompt_tokens: int, new_tokens: int) -> float:
    """Modelled seconds of the proposer call: one row, its prompt, ``new_tokens`` steps."""
    return settings.request_overhead_s + batch_seconds(settings, [prompt_tokens], new_tokens)


# ----------------------------------------------------------------------------- token counts


# A line break between two non-space characters is a boundary of the byte-level BPE's
# pre-tokenizer (GPT-2's split pattern makes "\n" a word of its own there, at the end of a
# text as inside one), and BPE merges never cross a word: the text's tokens are its pieces'
# tokens, split after each such line break.
_LINE_BOUNDARY = re.compile(r"(?<=\S\n)(?=\S)")
MEMO_LIMIT = 200_000  # distinct pieces a counter remembers (then it starts over)


class TokenCounter:
    """``count(texts) -> [tokens per text]`` with a tokenizer's ``encode_len(text)``, each
    distinct piece of text encoded once per process: a prompt is split into lines where that
    is exact (``split_lines``: a byte-level BPE without a normaliser), so the guidance's
    rules, the template and a ticket's summaries are each encoded once, however many prompts
    and guidances they appear in; a text that cannot be split is remembered whole. The
    simulated worker's CPU per chunk is then a few dictionary look-ups, not the tokenizer."""

    def __init__(self, encode_len, *, split_lines: bool):
        self.encode_len = encode_len
        self.split_lines = split_lines
        self.memo: dict[str, int] = {}
        self.encoded = 0  # pieces encoded so far (the rest came from the memo)

    def __call__(self, texts) -> list[int]:
        return [self.count(text) for text in texts]

    def count(self, text: str) -> int:
        if not self.split_lines:
            return self._piece(text)
        return sum(self._piece(piece) for piece in _LINE_BOUNDARY.split(text))

    def _piece(self, text: str) -> int:
        n = self.memo.get(text)
        if n is None:
            if len(self.memo) >= MEMO_LIMIT:
                self.memo.clear()
            n = self.memo[text] = self.encode_len(text)
            self.encoded += 1
        return n


def splits_exactly(fast) -> bool:
    """Whether counting a text's lines apart gives its token count (``_LINE_BOUNDARY``): no
    normaliser, GPT-2's byte-level pre-tokenizer, and no added token spanning a line break."""
    from tokenizers import pre_tokenizers

    pre = fast.pre_tokenizer
    return (fast.normalizer is None and isinstance(pre, pre_tokenizers.ByteLevel) and pre.use_regex
            and not any("\n" in token.content for token in fast.get_added_tokens_decoder().values()))


def fast_counter(fast) -> TokenCounter:
    """A ``TokenCounter`` over a ``tokenizers.Tokenizer``. ``encode``, never ``encode_batch``:
    a batch starts the library's thread pool, and the parent loads the counter before it
    forks (``preloaded_counter``), when no thread may exist."""
    return TokenCounter(lambda text: len(fast.encode(text, add_special_tokens=False).ids),
                        split_lines=splits_exactly(fast))


def tokenizer_file(model: ModelRef) -> Path | None:
    """The ``tokenizer.json`` of ``model`` when it is already on disk (a checkpoint's, or the
    embedded model's converted copy), without converting or loading anything."""
    if model.kind == "embedded":
        path = model_cache.embedded_cache_dir() / "tokenizer.json"
    elif model.kind == "checkpoint":
        path = Path(model.path) / "tokenizer.json"
    else:
        return None
    return path if path.is_file() else None


def token_counter(model: ModelRef) -> TokenCounter:
    """The counter with the tokenizer of ``model`` (``model.path`` as the parent checked it),
    loaded cheaply: the bare ``tokenizers`` BPE of the tiny model or a checkpoint's
    ``tokenizer.json`` (the embedded model's converted copy included); only a model without
    one (a .gguf file) loads the transformers tokenizer."""
    from tokenizers import Tokenizer

    from . import models, tiny

    if model.kind == "tiny":
        return fast_counter(tiny.build_bpe())
    path = tokenizer_file(model)
    if path is None and model.kind == "embedded":
        path = model_cache.ensure_embedded() / "tokenizer.json"
    if path is not None and path.is_file():
        return fast_counter(Tokenizer.from_file(str(path)))
    slow = models.tokenizer_only(model)
    return TokenCounter(lambda text: len(slow(text, add_special_tokens=False)["input_ids"]), split_lines=False)


def messages_tokens(count, conversations: list[list[dict]]) -> list[int]:
    """Prompt tokens of each conversation as the simulated engine measures them (its contents,
    plus the chat template's tokens), with ``count`` (a ``TokenCounter``)."""
    contents = [m["content"] for messages in conversations for m in messages]
    counts = iter(count(contents))
    return [sum(next(counts) + CHAT_TOKENS_PER_MESSAGE for _ in messages) + GENERATION_PROMPT_TOKENS
            for messages in conversations]


_preloaded: dict[ModelRef, TokenCounter] = {}


def preloaded_counter(model: ModelRef) -> TokenCounter | None:
    """The counter of ``model``, loaded once in this process (the parent, before it forks the
    pool: every simulated worker inherits it instead of loading the tokenizer itself, 0.13 s
    of CPU each) when that is safe and cheap: a ``tokenizer.json`` already on disk, read by
    the ``tokenizers`` library, which starts no thread for it (the tiny model's BPE is
    trained, which does, and a conversion would import torch). None otherwise: each worker
    loads its own."""
    if model not in _preloaded:
        path = tokenizer_file(model)
        if path is None:
            return None
        from tokenizers import Tokenizer

        _preloaded[model] = fast_counter(Tokenizer.from_file(str(path)))
    return _preloaded[model]


# ----------------------------------------------------------------------------- the engine


class SimulatedEngine:
    """The simulated engine on one (pretend) device: the real engines' methods, verdicts from
    ``rule_judge``, a sleep from the latency model. ``count`` is a ``TokenCounter`` (or any
    ``count(texts) -> [tokens]``)."""

    def __init__(self, device: Device, count, *, settings: SimulatedSettings = SimulatedSettings(),
                 model_path: str = ""):
        self.device = device
        self.count = count
        self.settings = settings
        self.model_path = model_path
        self.modelled_s = 0.0  # unscaled modelled seconds of every request so far

    def info(self) -> dict:
        """Provenance recorded in run.json: that this is a simulation, and its latency model."""
        return {"engine": NAME, "model": "none: the simulated engine (a latency model, not a model)",
                "model_path": self.model_path, NAME: msgspec.to_builtins(self.settings)}

    def _prompt_tokens(self, tickets, guidance: dict[str, str], profile) -> list[int]:
        return messages_tokens(self.count, [prompts.build_messages(profile, guidance, t) for t in tickets])

    def _sleep(self, seconds: float) -> None:
        self.modelled_s += seconds
        if self.settings.time_scale > 0:
            time.sleep(seconds * self.settings.time_scale)

    def rollout(self, chunk: RolloutChunk, *, guidance: dict[str, str], profile: prompts.PromptProfile) -> ChunkResult:
        """Every sample of every kept ticket of ``chunk`` judged by ``rule_judge``; tickets over
        ``max_prompt_tokens`` come back dropped. Sleeps the chunk's modelled time."""
        start = time.perf_counter()
        lengths = self._prompt_tokens(chunk.tickets, guidance, profile)
        kept = chat_text.kept_positions(lengths, chunk.max_prompt_tokens)
        conditions = rule_judge.fail_conditions(guidance)
        samples: list[list[Sample]] = [[] for _ in chunk.tickets]
        for i in kept:
            ticket = chunk.tickets[i]
            verdict, why = rule_judge.judge(conditions, rule_judge.ticket_text(ticket))
            texts = [rule_judge.answer_text(rule_judge.sample_verdict(verdict, self.settings.noise, chunk.seed_key,
                                                                      chunk.chunk_index, d, decode.seed, s, ticket.key),
                                            why, profile.verdict)
                     for d, decode in enumerate(chunk.grid) for s in range(chunk.samples_per_decode)]
            samples[i] = [Sample(n // chunk.samples_per_decode, n % chunk.samples_per_decode, text, tokens, "stop")
                          for n, (text, tokens) in enumerate(zip(texts, self.count(texts)))]
        self._sleep(rollout_seconds(self.settings, chunk, [lengths[i] for i in kept]))
        return chat_text.rollout_result(chunk, lengths, kept, samples, start)

    def verdict_probabilities(self, chunk: VerdictChunk, *, guidance: dict[str, str],
                              profile: prompts.PromptProfile) -> VerdictChunkResult:
        """P(pass) from the rule judge's verdict (0.8 pass, 0.2 fail) plus a little noise from
        the ticket key; a prefill of the kept prompts."""
        start = time.perf_counter()
        lengths = self._prompt_tokens(chunk.tickets, guidance, profile)
        kept = chat_text.kept_positions(lengths, chunk.max_prompt_tokens)
        conditions = rule_judge.fail_conditions(guidance)
        p_pass = {}
        for i in kept:
            verdict, _ = rule_judge.judge(conditions, rule_judge.ticket_text(chunk.tickets[i]))
            jitter = random.Random(stable_seed("simulated p_pass", chunk.tickets[i].key)).random() * 0.1
            p_pass[i] = round((0.8 if verdict == "pass" else 0.2) + jitter - 0.05, 6)
        self._sleep(self.settings.request_overhead_s + batch_seconds(self.settings, [lengths[i] for i in kept], 0))
        return chat_text.verdict_result(chunk, lengths, p_pass, start)

    def chat(self, request: ChatRequest) -> ChatResult:
        """The proposer: rules on words of the falsely passed examples (module docstring).
        Examples are dropped from the end until the prompt fits, as the real engines do."""
        # fit_examples wants the prompt's ids; only their number matters here.
        k, row, fits = chat_text.fit_examples(request, lambda messages: range(messages_tokens(self.count, [messages])[0]))
        if not fits:
            return ChatResult(None, k, len(row))
        text = proposed_rules(request.examples[:k], request.seed_key)
        # The answer's own tokens (a real engine stops at its end), at most the budget.
        completion = self.count([text])[0]
        self._sleep(chat_seconds(self.settings, len(row), min(completion, request.decode.max_new_tokens)))
        return ChatResult(text, k, len(row), completion, "stop")


def proposed_rules(examples: list[str], seed_key: str) -> str:
    """The simulated proposer's JSON answer for these example blocks (``proposer.render_example``)."""
    wrongly_passed = [block for block in examples
                      if (m := _EXAMPLE.search(block)) and m.group(1) == "fail" and m.group(2) == "pass"]
    summaries = [" ".join(line for line in block.lower().splitlines() if line.startswith("  - "))
                 for block in wrongly_passed]
    words = [set(_WORD.findall(text)) for text in summaries]
    # The fewer examples share a word, the more it looks like a defect than like the
    # summaries' structure; a seeded draw orders the words that tie.
    # The draws follow the sorted words, never a set's order (which changes with each process's
    # hash seed: a Ray actor is not forked from the parent, and would draw in another order).
    rng = random.Random(stable_seed(seed_key, "simulated proposer"))
    draws = {w: rng.random() for w in sorted({w for ws in words for w in ws})}
    ranked = sorted(draws, key=lambda w: (sum(w in ws for ws in words), draws[w], w))
    picked = ranked[:PROPOSED_RULES]
    return json.dumps({"operations": [
        {"op": "upsert", "text": f"If any photo shows {word}, the verdict is fail.",
         "rationale": f"the falsely passed tickets show {word}"} for word in picked]})


def build_simulated_engine(device: Device, model: ModelRef, config,
                           count: TokenCounter | None = None) -> SimulatedEngine:
    """The engine for a worker: ``model`` only chooses the tokenizer that counts the tokens
    (``count``: its counter, already loaded by the parent; None: loaded here); the model
    section ``config``'s ``simulated`` is the latency model."""
    return SimulatedEngine(device, count or token_counter(model), settings=config.simulated,
                           model_path=model.path)
