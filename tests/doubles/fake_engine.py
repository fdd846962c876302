"""Test doubles for the model engine: deterministic canned verdicts without a model.

``FakeEngine`` judges a ticket from its text: it fails a ticket whose summaries contain one
of its ``fail_words`` (default: "missing") or a word named by a guidance rule of the form
"fail if <word>" / "fail when <word>", and passes it otherwise. Sampling noise is simulated:
each sample flips its verdict with probability ``flip * temperature``, drawn from the
chunk's work-derived seed plus the ticket key, so results never depend on a rank or on
which worker ran the chunk. Tickets listed in ``drop_keys`` come back dropped (as if
overlength), ``invalid_keys`` answer unparseable text, and ``max_prompt_tokens`` is
honoured with a made-up token count (``prompt_tokens``). ``verdict_probabilities`` gives
every ticket the same low P(pass), ``p_pass``: the judge of the embedded model, whose answer
does not depend on the ticket.
"""

from __future__ import annotations

import random
import re

import msgspec

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
                 invalid_keys=(), chat_text: str = '{"operations": []}', fail_on=None, p_pass: float = 0.008):
        self.device = device
        self.fail_words = tuple(w.lower() for w in fail_words)
        self.flip = flip
        self.drop_keys = set(drop_keys)
        self.invalid_keys = set(invalid_keys)
        self.chat_text = chat_text
        self.fail_on = fail_on  # a ticket key whose rollout raises (error-path tests)
        self.p_pass = p_pass
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


# ----------------------------------------------------------------- small run inputs for tests

MISSION = "Demo mission"


def demo_ticket_records(n: int = 24) -> list[dict]:
    """``n`` Stage-A records: every third ticket has a missing part and is labelled fail.
    A few are mislabelled so that a FakeEngine run (which judges the text) makes both
    kinds of error: intact but labelled fail (i % 7 == 5: NG, a false release) and broken
    but labelled pass (i % 5 == 3: NP, a false block). Every fifth mentions a scratch."""
    records = []
    for i in range(n):
        broken = i % 3 == 0
        label = "fail" if broken else "pass"
        if i % 7 == 5 and not broken:
            label = "fail"
        if i % 5 == 3 and broken:
            label = "pass"
        per_image = {f"image_{j + 1}": f"cabinet {i} view {j}: bolts present" for j in range(1 + i % 3)}
        if broken:
            per_image["image_1"] = f"cabinet {i}: cover missing, cable loose"
        if i % 5 == 2:
            per_image["image_1"] += ", small scratch on door"
        records.append({"mission": MISSION, "group_id": f"QC-{i:04d}", "label": label, "per_image": per_image})
    return records


def write_run_inputs(root, *, n_tickets: int = 24, model: str = "tiny", extra: str = "", records=None) -> str:
    """Write tickets, seed guidance, a proposer prompt and an audit config under ``root``;
    return the config path."""
    import json
    from pathlib import Path

    root = Path(root)
    root.mkdir(parents=True, exist_ok=True)
    rows = demo_ticket_records(n_tickets) if records is None else records
    (root / "tickets.jsonl").write_text("".join(json.dumps(r, ensure_ascii=False) + "\n" for r in rows))
    guidance = {MISSION: {"step": 0, "updated_at": "2026-01-01T00:00:00Z",
                          "experiences": {"G0": "Check every cabinet for missing or loose parts."}}}
    (root / "guidance.json").write_text(json.dumps(guidance))
    (root / "proposer.txt").write_text("Propose rules as JSON.\n")
    (root / "config.yaml").write_text(f"""\
seed: 17
mode: audit
stage_a_paths: tickets.jsonl
model: {{path: {model}}}
prompt: {{profile: generic}}
guidance: {{path: guidance.json}}
output: {{root: out, run_name: run1}}
runner: {{chunk_size: 4, logging_steps: 5}}
rule_search:
  proposer_prompt_path: proposer.txt
  reflect_size: 4
  train_sampler:
    grid:
      - {{temperature: 0.7, top_p: 0.9, max_new_tokens: 12, seed: 3}}
      - {{temperature: 0.3, top_p: 0.9, max_new_tokens: 12}}
    samples_per_decode: 2
  eval_sampler:
    grid: [{{temperature: 0.5, max_new_tokens: 12}}]
{extra}""")
    return str(root / "config.yaml")
