"""The simulated engine (``model.engine: simulated``): a benchmarking tool, a latency model
and not a model. It answers every request a real engine answers, with verdicts from
``rule_judge``, and takes (``seconds x time_scale``, its own work included: it sleeps the rest)
what a GPU serving a 7-8B model would take, so the rule search runs at the pace of N GPUs on a machine that has none (a sleeping
worker uses no CPU). Its proposer suggests rules on the rarest words of the falsely passed
examples (``proposed_rules``): some pass the gate, others do not. The latency model, its
defaults and the token counting: docs/performance.md ("The latency model").
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

from ..pool import cancellation
from ..pool.devices import Device
from ..stageb import prompts
from ..stageb.hashing import stable_seed
from . import chat_text, model_cache, rule_judge
from .models import ModelRef
from .records import ChatRequest, ChatResult, ChunkResult, RolloutChunk, Sample, VerdictChunk, VerdictChunkResult

NAME = "simulated"  # model.engine, and the section of its latency model
DESCRIBE = "a latency model for benchmarks, not a model; only its tokenizer counts the prompt tokens"

# ChatML's tokens around each message and of the generation prompt, counted rather than
# rendered (the chat template needs transformers: seconds of CPU in every worker).
CHAT_TOKENS_PER_MESSAGE = 5
GENERATION_PROMPT_TOKENS = 3
PROPOSED_RULES = 3
_EXAMPLE = re.compile(r"gt_label=(\w+); baseline_majority=(\w+)")
_WORD = re.compile(r"[a-z]{4,}")


class SimulatedSettings(msgspec.Struct, forbid_unknown_fields=True, kw_only=True, frozen=True):
    """``model.simulated`` (docs/performance.md): none of these changes a result's bytes."""

    prefill_tokens_per_s: Annotated[float, Meta(gt=0, le=1e9)] = 20_000.0  # prompt tokens read per second
    decode_step_s: Annotated[float, Meta(gt=0, le=3600)] = 0.009  # one decoding step of a small batch
    decode_tokens_per_s: Annotated[float, Meta(gt=0, le=1e9)] = 12_000.0  # generated tokens per second of a full batch
    request_overhead_s: Annotated[float, Meta(ge=0, le=3600)] = 0.02  # fixed cost of every request (scheduling, sampling)
    time_scale: Annotated[float, Meta(ge=0, le=1e6)] = 1.0  # slept = modelled x this (0: no sleep, for tests)
    noise: Annotated[float, Meta(ge=0, le=1)] = 0.05  # probability that a sample's verdict flips


def batch_seconds(settings: SimulatedSettings, prompt_tokens: list[int], new_tokens: int) -> float:
    """Modelled seconds of one generate batch: its prompts prefilled, ``new_tokens`` steps."""
    rows = len(prompt_tokens)
    if rows == 0:
        return 0.0
    step = max(settings.decode_step_s, rows / settings.decode_tokens_per_s)
    return sum(prompt_tokens) / settings.prefill_tokens_per_s + new_tokens * step


def rollout_seconds(settings: SimulatedSettings, chunk: RolloutChunk, kept_prompt_tokens: list[int]) -> float:
    batches = sum(batch_seconds(settings, kept_prompt_tokens, decode.max_new_tokens) * chunk.samples_per_decode
                  for decode in chunk.grid)
    return settings.request_overhead_s + batches


def chat_seconds(settings: SimulatedSettings, prompt_tokens: int, new_tokens: int) -> float:
    return settings.request_overhead_s + batch_seconds(settings, [prompt_tokens], new_tokens)


# A line break between two non-space characters is a word boundary of GPT-2's byte-level
# pre-tokenizer, which no BPE merge crosses: a text's tokens are the sum of its lines'.
_LINE_BOUNDARY = re.compile(r"(?<=\S\n)(?=\S)")
MEMO_LIMIT = 200_000  # distinct pieces a counter remembers (then it starts over)


class TokenCounter:
    """``count(texts) -> [tokens per text]`` with ``encode_len(text)``, each distinct piece
    encoded once per process: with ``split_lines`` (exact: ``splits_exactly``) a prompt is
    counted line by line, so a rule or a summary is encoded once however many prompts hold it."""

    def __init__(self, encode_len, *, split_lines: bool):
        self.encode_len = encode_len
        self.split_lines = split_lines
        self.memo: dict[str, int] = {}
        self.encoded = 0  # pieces encoded so far (the rest came from the memo)

    def __call__(self, texts) -> list[int]:
        if not self.split_lines:
            return [self._piece(text) for text in texts]
        return [sum(self._piece(piece) for piece in _LINE_BOUNDARY.split(text)) for text in texts]

    def _piece(self, text: str) -> int:
        n = self.memo.get(text)
        if n is None:
            if len(self.memo) >= MEMO_LIMIT:
                self.memo.clear()
            n = self.memo[text] = self.encode_len(text)
            self.encoded += 1
        return n


def splits_exactly(fast) -> bool:
    """Whether ``_LINE_BOUNDARY`` holds: no normaliser, no added token across a line break."""
    from tokenizers import pre_tokenizers

    pre = fast.pre_tokenizer
    return (fast.normalizer is None and isinstance(pre, pre_tokenizers.ByteLevel) and pre.use_regex
            and not any("\n" in token.content for token in fast.get_added_tokens_decoder().values()))


def fast_counter(fast) -> TokenCounter:
    """A ``TokenCounter`` over a ``tokenizers.Tokenizer``. ``encode``, never ``encode_batch``
    (a thread pool): the parent may load it before it forks (``preloaded_counter``)."""
    return TokenCounter(lambda text: len(fast.encode(text, add_special_tokens=False).ids),
                        split_lines=splits_exactly(fast))


def tokenizer_file(model: ModelRef) -> Path | None:
    """The ``tokenizer.json`` of ``model`` if already on disk (nothing converted or loaded)."""
    if model.kind == "embedded":
        path = model_cache.embedded_cache_dir() / "tokenizer.json"
    elif model.kind == "checkpoint":
        path = Path(model.path) / "tokenizer.json"
    else:
        return None
    return path if path.is_file() else None


def token_counter(model: ModelRef) -> TokenCounter:
    """The counter of ``model``'s tokenizer: the bare ``tokenizers`` BPE, but for a .gguf file."""
    from tokenizers import Tokenizer

    from . import models, tiny

    if model.kind == "tiny":
        return fast_counter(tiny.build_bpe())
    if model.kind == "embedded":
        model_cache.ensure_embedded()  # converted once, in the user cache
    path = tokenizer_file(model)
    if path is not None:
        return fast_counter(Tokenizer.from_file(str(path)))
    slow = models.tokenizer_only(model)
    return TokenCounter(lambda text: len(slow(text, add_special_tokens=False)["input_ids"]), split_lines=False)


def messages_tokens(count, conversations: list[list[dict]]) -> list[int]:
    """Prompt tokens of each conversation: its contents' plus the chat template's."""
    contents = [m["content"] for messages in conversations for m in messages]
    counts = iter(count(contents))
    return [sum(next(counts) + CHAT_TOKENS_PER_MESSAGE for _ in messages) + GENERATION_PROMPT_TOKENS
            for messages in conversations]


_preloaded: dict[ModelRef, TokenCounter] = {}


def preloaded_counter(model: ModelRef) -> TokenCounter | None:
    """The counter of ``model``, loaded once by the parent before the fork and inherited, when
    a ``tokenizer.json`` is on disk (reading it starts no thread; training the tiny BPE does,
    and a conversion imports torch). None: each worker loads its own."""
    if model not in _preloaded:
        path = tokenizer_file(model)
        if path is None:
            return None
        from tokenizers import Tokenizer

        _preloaded[model] = fast_counter(Tokenizer.from_file(str(path)))
    return _preloaded[model]


class SimulatedEngine:
    """``count``: a ``TokenCounter`` (or any ``count(texts) -> [tokens]``)."""

    def __init__(self, device: Device, count, *, settings: SimulatedSettings = SimulatedSettings(),
                 model_path: str = ""):
        self.device = device
        self.count = count
        self.settings = settings
        self.model_path = model_path
        self.modelled_s = 0.0  # unscaled modelled seconds of every request so far

    def info(self) -> dict:
        return {"engine": NAME, "model": "none: the simulated engine (a latency model, not a model)",
                "model_path": self.model_path, NAME: msgspec.to_builtins(self.settings)}

    def _prompt_tokens(self, chunk, guidance: dict[str, str], profile) -> tuple[list[int], list[int]]:
        lengths = messages_tokens(self.count, [prompts.build_messages(profile, guidance, t) for t in chunk.tickets])
        return lengths, chat_text.kept_positions(lengths, chunk.max_prompt_tokens)

    def _sleep(self, seconds: float, started: float) -> None:
        """Until ``seconds`` (modelled) x ``time_scale`` after ``started`` (``perf_counter`` when
        the request began): the request's own CPU work (rendering, counting, judging) is part
        of its modelled time, not added to it, so workers that share a few cores are not slowed
        by each other's simulation work. ``modelled_s`` counts the whole modelled time. A task the
        parent cancels meanwhile ends here (``TaskCancelled``), as a GPU's would at its
        next decode step."""
        self.modelled_s += seconds
        if self.settings.time_scale > 0:
            remaining = seconds * self.settings.time_scale - (time.perf_counter() - started)
            if remaining > 0:
                cancellation.sleep(remaining)

    def rollout(self, chunk: RolloutChunk, *, guidance: dict[str, str], profile: prompts.PromptProfile) -> ChunkResult:
        start = time.perf_counter()
        lengths, kept = self._prompt_tokens(chunk, guidance, profile)
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
        self._sleep(rollout_seconds(self.settings, chunk, [lengths[i] for i in kept]), start)
        return chat_text.rollout_result(chunk, lengths, kept, samples, start)

    def verdict_probabilities(self, chunk: VerdictChunk, *, guidance: dict[str, str],
                              profile: prompts.PromptProfile) -> VerdictChunkResult:
        """P(pass) 0.8 or 0.2 by the rule judge's verdict, jittered by the ticket key."""
        start = time.perf_counter()
        lengths, kept = self._prompt_tokens(chunk, guidance, profile)
        conditions = rule_judge.fail_conditions(guidance)
        p_pass = {}
        for i in kept:
            verdict, _ = rule_judge.judge(conditions, rule_judge.ticket_text(chunk.tickets[i]))
            jitter = random.Random(stable_seed("simulated p_pass", chunk.tickets[i].key)).random() * 0.1
            p_pass[i] = round((0.8 if verdict == "pass" else 0.2) + jitter - 0.05, 6)
        self._sleep(self.settings.request_overhead_s + batch_seconds(self.settings, [lengths[i] for i in kept], 0), start)
        return chat_text.verdict_result(chunk, lengths, p_pass, start)

    def chat(self, request: ChatRequest) -> ChatResult:
        start = time.perf_counter()
        # fit_examples wants the prompt's ids; only their number matters here.
        k, row, fits = chat_text.fit_examples(request, lambda messages: range(messages_tokens(self.count, [messages])[0]))
        if not fits:
            return ChatResult(None, k, len(row))
        text = proposed_rules(request.examples[:k], request.seed_key)
        # The answer's own tokens (a real engine stops at its end), at most the budget.
        completion = self.count([text])[0]
        self._sleep(chat_seconds(self.settings, len(row), min(completion, request.decode.max_new_tokens)), start)
        return ChatResult(text, k, len(row), completion, "stop")


def proposed_rules(examples: list[str], seed_key: str) -> str:
    """``PROPOSED_RULES`` rules on the words the fewest falsely passed examples share, as JSON."""
    wrongly_passed = [block for block in examples
                      if (m := _EXAMPLE.search(block)) and m.group(1) == "fail" and m.group(2) == "pass"]
    summaries = [" ".join(line for line in block.lower().splitlines() if line.startswith("  - "))
                 for block in wrongly_passed]
    words = [set(_WORD.findall(text)) for text in summaries]
    # A word every example shares is the summaries' structure, not a defect. A seeded draw
    # orders the ties, drawn over the sorted words: a set's order changes with the hash seed
    # (a Ray actor is not forked from the parent).
    rng = random.Random(stable_seed(seed_key, "simulated proposer"))
    draws = {w: rng.random() for w in sorted({w for ws in words for w in ws})}
    ranked = sorted(draws, key=lambda w: (sum(w in ws for ws in words), draws[w], w))
    picked = ranked[:PROPOSED_RULES]
    return json.dumps({"operations": [
        {"op": "upsert", "text": f"If any photo shows {word}, the verdict is fail.",
         "rationale": f"the falsely passed tickets show {word}"} for word in picked]})


def build_simulated_engine(device: Device, model: ModelRef, config,
                           count: TokenCounter | None = None) -> SimulatedEngine:
    """``model`` only chooses the tokenizer that counts (``count``: preloaded, or None)."""
    return SimulatedEngine(device, count or token_counter(model), settings=config.simulated,
                           model_path=model.path)
