"""FakeEngine: an engine double whose verdicts follow the ticket text, with knobs for odd cases.

For the audit, run-directory, headroom and rollout-runner tests (tests/test_audit.py,
test_rundir.py, test_headroom.py, test_rollout.py), which need a judge without a model
whose answers they can predict ticket by ticket, and cases a model rarely gives on demand.

``FakeEngine`` judges a ticket from its text: it fails a ticket whose summaries contain one
of its ``fail_words`` (default: "missing") or a word named by a guidance rule of the form
"fail if <word>" / "fail when <word>", and passes it otherwise. Sampling noise is simulated:
each sample flips its verdict with probability ``flip * temperature``, drawn from the
chunk's work-derived seed plus the ticket key, so results never depend on a rank or on
which worker ran the chunk. Tickets listed in ``drop_keys`` come back dropped (as if
overlength), ``invalid_keys`` answer unparseable text, ``fail_on`` makes a chunk raise, and
``max_prompt_tokens`` is honoured with a made-up token count (``prompt_tokens``), and
``rollout_s`` makes each rollout chunk take that long, as a GPU's would, unless the parent
cancels it meanwhile (``pool.cancellation.sleep``).
``verdict_probabilities`` gives every ticket the same low P(pass), ``p_pass``: the judge of
the embedded model, whose answer does not depend on the ticket. ``chat`` always answers
``chat_text`` (default: no operations), so a rule search with it edits nothing by default.

How it differs from the other doubles: the scripted engine (``scripted_engine``) obeys the
rule judge's "If any photo shows X, the verdict is fail." rules and follows a proposer
script, for the rule search end to end; the pool engines (``pool_engines``) have no engine
protocol at all, only methods for ``Pool.map``. Its tickets are
``run_inputs.missing_part_records`` (the inputs of ``run_inputs.audit_inputs``).
"""

from __future__ import annotations

import random
import re

import msgspec

from stageb_pool.pool import cancellation
from stageb_pool.stageb.hashing import stable_seed
from stageb_pool.engine.records import (
    ChatRequest,
    ChatResult,
    ChunkResult,
    RolloutChunk,
    Sample,
    TicketRollout,
    TicketVerdictProbability,
    VerdictChunk,
    VerdictChunkResult,
)

_RULE = re.compile(r"fail (?:if|when) (\w+)", re.IGNORECASE)


def prompt_tokens(ticket, guidance: dict) -> int:
    """A deterministic stand-in for the rendered prompt length (about 4 chars a token)."""
    chars = len(ticket.key) + sum(len(v) for v in ticket.per_image.values())
    chars += sum(len(v) for v in guidance.values())
    return 20 + chars // 4


class FakeEngine:
    """Engine double: ``rollout`` and ``chat`` with the real engine's signatures."""

    def __init__(self, device=None, *, fail_words=("missing",), flip: float = 0.0, drop_keys=(),
                 invalid_keys=(), chat_text: str = '{"operations": []}', fail_on=None, p_pass: float = 0.008,
                 rollout_s: float = 0.0):
        self.device = device
        self.fail_words = tuple(w.lower() for w in fail_words)
        self.flip = flip
        self.drop_keys = set(drop_keys)
        self.invalid_keys = set(invalid_keys)
        self.chat_text = chat_text
        self.fail_on = fail_on  # a ticket key whose rollout raises (error-path tests)
        self.p_pass = p_pass
        self.rollout_s = rollout_s
        self.calls = 0

    def info(self) -> dict:
        return {"engine": "fake", "device": "fake", "dtype": "none", "model": "fake"}

    def rollout(self, chunk, *, guidance, profile=None) -> ChunkResult:
        chunk = msgspec.convert(chunk, RolloutChunk)
        self.calls += 1
        words = self.fail_words + tuple(m.lower() for text in guidance.values() for m in _RULE.findall(text))
        out = []
        for ticket in chunk.tickets:
            if ticket.key == self.fail_on:
                raise RuntimeError(f"fake engine told to fail on {ticket.key}")
            tokens = prompt_tokens(ticket, guidance)
            limit = chunk.max_prompt_tokens
            if ticket.key in self.drop_keys or (limit is not None and tokens > limit):
                out.append(TicketRollout(key=ticket.key, prompt_tokens=tokens, dropped=True))
                continue
            text = " ".join(ticket.per_image.values()).lower()
            hit = next((w for w in words if w in text), None)
            samples = []
            for d, decode in enumerate(chunk.grid):
                for s in range(chunk.samples_per_decode):
                    seed = stable_seed(chunk.seed_key, chunk.chunk_index, d, decode.seed, s, ticket.key)
                    samples.append(self._sample(ticket.key, hit, d, s, decode.temperature, random.Random(seed),
                                                chunk.return_token_ids))
            out.append(TicketRollout(key=ticket.key, prompt_tokens=tokens, samples=samples))
        if self.rollout_s:
            cancellation.sleep(self.rollout_s)
        return ChunkResult(chunk_index=chunk.chunk_index, tickets=out,
                           generated_tokens=sum(s.completion_tokens for t in out for s in t.samples))

    def _sample(self, key, hit, d, s, temperature, rng, token_ids) -> Sample:
        if key in self.invalid_keys:
            text = "I cannot decide."
        else:
            verdict = "fail" if hit else "pass"
            if rng.random() < self.flip * max(temperature, 0.0):
                verdict = "pass" if verdict == "fail" else "fail"
            why = f"found '{hit}'" if hit else "everything present"
            text = f"Verdict: {verdict}\nReason: {why} ({key}, sample {d}.{s})"
        ids = [ord(c) % 256 for c in text] if token_ids else None
        return Sample(decode_index=d, sample_index=s, text=text, completion_tokens=len(text) // 4,
                      finish_reason="stop", token_ids=ids)

    def verdict_probabilities(self, chunk, *, guidance, profile=None) -> VerdictChunkResult:
        chunk = msgspec.convert(chunk, VerdictChunk)
        out = []
        for ticket in chunk.tickets:
            tokens = prompt_tokens(ticket, guidance)
            limit = chunk.max_prompt_tokens
            if ticket.key in self.drop_keys or (limit is not None and tokens > limit):
                out.append(TicketVerdictProbability(ticket.key, tokens, dropped=True))
            else:
                out.append(TicketVerdictProbability(ticket.key, tokens, p_pass=self.p_pass))
        return VerdictChunkResult(chunk.chunk_index, out)

    def chat(self, request) -> ChatResult:
        request = msgspec.convert(request, ChatRequest)
        return ChatResult(text=self.chat_text, examples_used=len(request.examples),
                          prompt_tokens=10 + sum(len(e) for e in request.examples) // 4,
                          completion_tokens=len(self.chat_text) // 4, finish_reason="stop")


def fake_factory(**kwargs):
    """An engine factory for ``Pool`` / ``run_job(engine_factory=...)``."""

    def build(device):
        return FakeEngine(device, **kwargs)

    return build
