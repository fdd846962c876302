"""ScriptedEngine: an engine double that obeys the guidance's rules and follows a proposer script.

For the rule search end to end (tests/test_search.py, and the report, resume, interrupt,
signal, run-owner, headroom and fuzz tests that need a real search to act on): a search
with it accepts and rejects edits for real reasons, the same on any number of workers.

Its tickets (``run_inputs.feature_records``, the inputs of ``run_inputs.search_inputs``)
carry hidden features in their summaries (rust, crack, dust, clean); a ticket's ground
truth is fail iff it shows rust or crack. The verdicts are the package's rule judge
(``stageb_pool.engine.rule_judge``, shared with the simulated engine): *fail* when a rule of
the guidance says "If any photo shows <feature>, the verdict is fail." and the ticket shows
that feature, else *pass*; then each sample flips with probability ``noise``, drawn from
the chunk's work-derived seed and the ticket key (never from a rank, never from the
guidance, so a baseline and its candidates see the same flips). A good rule (rust) really
lowers the error, a harmful one (clean) really raises it. With a sampler's
``max_prompt_tokens`` a ticket whose text plus guidance (a token per 4 characters) is longer
is dropped, so a longer guidance drops more tickets.

``chat`` answers the proposer with a script keyed by iteration (read from the request's
seed key ``.../proposer/it<N>``), so the answer does not depend on which worker took the
call. ``hang_at`` / ``crash_at`` make the proposer call of one iteration block (after
touching ``marker``) or end the run (``ScriptedCrash``, a BaseException that the inline pool
does not turn into a worker error): the kill/resume tests use them to stop a run
mid-iteration. ``raise_at`` makes the call raise an ordinary exception (a proposer failure,
which the search survives).

``verdict_probabilities`` is a judge that reads the tickets: P(pass) is lower the more
damage features (rust, crack) a ticket shows, plus a little noise from the ticket key, so
it separates the labels (the judge-headroom check says rules can move it).

How it differs from the other doubles: the fake engine (``fake_engine``) judges by fixed
words in the ticket text and its own "fail if <word>" rules (not the rule judge's), proposes
no edit unless told what to answer, and has knobs for dropped, unparseable and failing
chunks; the pool engines (``pool_engines``) have no engine protocol, only methods for
``Pool.map``.
"""

from __future__ import annotations

import json
import random
import re
import time
from pathlib import Path

import msgspec

from stageb_pool.engine import rule_judge
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
from stageb_pool.stageb.hashing import content_hash, stable_seed

_ITERATION = re.compile(r"/proposer/it(\d+)(?:/call\d+)?$")  # every call of rule_search.proposer_calls


def rule(feature: str) -> str:
    """A rule text the engine obeys and the proposer validation accepts."""
    return f"If any photo shows {feature}, the verdict is fail."


def op(text: str, rationale: str = "confidently wrong tickets share this feature", **extra) -> dict:
    return {"op": "upsert", "text": text, "rationale": rationale, **extra}


def proposal(*ops) -> str:
    return json.dumps({"operations": list(ops)})


# The default script: it1 proposes a good rule (rust), a harmful one (clean), a duplicate of
# the seed rule G1 and an invalid op; it2 answers malformed JSON; it3 proposes crack (good);
# it4 re-proposes the rejected clean rule; later iterations propose nothing.
DEFAULT_SCRIPT = {
    1: proposal(op(rule("rust")), op(rule("clean")), op(rule("dust")), {"op": "frobnicate", "text": "x"}),
    2: 'Sure! Here are my rules: {"operations": [{"op": "upsert", "text": "If any photo shows',
    3: proposal(op(rule("crack"))),
    4: proposal(op(rule("clean"))),
}
EMPTY = '{"operations": []}'


class ScriptedCrash(BaseException):
    """Ends the run from inside the engine (like a kill, but catchable by the test)."""


class ScriptedEngine:
    """Engine double with the real engine's ``rollout`` / ``chat`` signatures.

    ``calls`` records every generated chunk as ``(seed_key, chunk_index, guidance_hash)``
    (visible to tests with an inline pool, where the engine lives in the parent)."""

    def __init__(self, device=None, *, script=None, noise: float = 0.05, hang_at: int | None = None,
                 raise_at: int | None = None, crash_at: int | None = None, marker: str | None = None):
        self.device = device
        self.script = DEFAULT_SCRIPT if script is None else script
        self.noise = noise
        self.hang_at = hang_at
        self.raise_at = raise_at
        self.crash_at = crash_at
        self.marker = marker
        self.calls: list[tuple[str, int, str]] = []
        self.generations = 0
        self.chats: list[int] = []

    def info(self) -> dict:
        return {"engine": "scripted", "model": "scripted"}

    def rollout(self, chunk, *, guidance, profile=None) -> ChunkResult:
        chunk = msgspec.convert(chunk, RolloutChunk)
        self.calls.append((chunk.seed_key, chunk.chunk_index, content_hash(guidance)))
        self.generations += len(chunk.tickets) * len(chunk.grid) * chunk.samples_per_decode
        conditions = rule_judge.fail_conditions(guidance)
        guidance_tokens = sum(len(text) for text in guidance.values()) // 4
        out = []
        for ticket in chunk.tickets:
            text = rule_judge.ticket_text(ticket)
            if chunk.max_prompt_tokens is not None:  # the prompt is the ticket plus the guidance
                tokens = 20 + len(text) // 4 + guidance_tokens
                if tokens > chunk.max_prompt_tokens:
                    out.append(TicketRollout(key=ticket.key, prompt_tokens=tokens, dropped=True))
                    continue
            verdict, why = rule_judge.judge(conditions, text)
            samples = []
            for d, decode in enumerate(chunk.grid):
                for s in range(chunk.samples_per_decode):
                    flipped = rule_judge.sample_verdict(verdict, self.noise, chunk.seed_key, chunk.chunk_index, d,
                                                        decode.seed, s, ticket.key)
                    body = rule_judge.answer_text(flipped, why)
                    samples.append(Sample(decode_index=d, sample_index=s, text=body,
                                          completion_tokens=len(body) // 4, finish_reason="stop"))
            out.append(TicketRollout(key=ticket.key, prompt_tokens=20 + len(text) // 4, samples=samples))
        return ChunkResult(chunk_index=chunk.chunk_index, tickets=out)

    def verdict_probabilities(self, chunk, *, guidance, profile=None) -> VerdictChunkResult:
        chunk = msgspec.convert(chunk, VerdictChunk)
        out = []
        for ticket in chunk.tickets:
            text = " ".join(ticket.per_image.values()).lower()
            damage = sum(1 for f in ("rust", "crack") if re.search(rf"\b{f}\b", text))
            jitter = random.Random(stable_seed("p_pass", ticket.key)).random() * 0.2
            out.append(TicketVerdictProbability(ticket.key, 20 + len(text) // 4,
                                                p_pass=round(0.7 - 0.5 * min(damage, 1) + jitter, 6)))
        return VerdictChunkResult(chunk.chunk_index, out)

    def chat(self, request) -> ChatResult:
        request = msgspec.convert(request, ChatRequest)
        match = _ITERATION.search(request.seed_key)
        it = int(match.group(1)) if match else 0
        self.chats.append(it)
        if it == self.raise_at:
            raise RuntimeError(f"scripted failure in the proposer call of iteration {it}")
        if it == self.crash_at:
            raise ScriptedCrash(f"scripted crash in the proposer call of iteration {it}")
        if it == self.hang_at:
            if self.marker:
                Path(self.marker).write_text(str(it))
            while True:  # the engine hangs here until the test kills the process
                time.sleep(0.05)
        text = self.script.get(it, EMPTY)
        # A script answer that stops mid-JSON (iteration 2's) is what a model cut off at its
        # token budget writes: it comes back as one.
        cut_off = "{" in text and not text.rstrip().endswith("}")
        return ChatResult(text=text, examples_used=len(request.examples),
                          prompt_tokens=10 + sum(len(e) for e in request.examples) // 4,
                          completion_tokens=len(text) // 4, finish_reason="length" if cut_off else "stop")


def scripted_factory(holder: list | None = None, **kwargs):
    """An engine factory; with ``holder`` the built engines are appended to it (inline pools)."""

    def build(device):
        engine = ScriptedEngine(device, **kwargs)
        if holder is not None:
            holder.append(engine)
        return engine

    return build
