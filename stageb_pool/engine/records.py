"""The engine's requests and results as they travel between the parent and the workers (the
one definition of each; how the pool encodes and decodes them: ``contract.py``).
"""

from __future__ import annotations

from typing import Annotated

import msgspec
from msgspec import Meta

from ..stageb.tickets import TicketText  # what a worker needs of a ticket (no label)

DEFAULT_MAX_PROMPT_TOKENS = 4096


class Decode(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    """One entry of a sampling grid (``temperature <= 0``: greedy; ``seed``: ``contract.py``)."""

    temperature: float
    top_p: float = 1.0
    max_new_tokens: int = 256
    repetition_penalty: float = 1.0
    seed: int | None = None


class SamplerConfig(msgspec.Struct, forbid_unknown_fields=True, kw_only=True):
    """A rollout's sampling settings (the config's ``train_sampler`` / ``eval_sampler``)."""

    grid: Annotated[list[Decode], Meta(min_length=1)]  # decodes; each ticket gets len(grid) * samples_per_decode samples
    samples_per_decode: Annotated[int, Meta(ge=1)] = 1  # samples drawn per grid entry
    # Tickets whose prompt is longer are dropped (never truncated). 4096 as upstream's rollout
    # fallback: without a cap one long ticket can exhaust GPU memory. None: no limit.
    max_prompt_tokens: Annotated[int, Meta(ge=1)] | None = DEFAULT_MAX_PROMPT_TOKENS
    constrain_verdict: bool = False


class RolloutChunk(msgspec.Struct, frozen=True):
    """One unit of rollout work (its seeds: ``contract.py``). ``seed_key`` names the rollout's
    ticket pool (e.g. ``"1234/train"``), not the guidance, so a baseline and its candidates
    draw the same random numbers."""

    seed_key: str
    chunk_index: int
    tickets: list[TicketText]
    grid: list[Decode]
    samples_per_decode: int = 1
    max_prompt_tokens: int | None = None
    return_token_ids: bool = False
    constrain_verdict: bool = False  # first line held to the profile's verdict words


class Sample(msgspec.Struct, frozen=True):
    """One generated candidate. ``finish_reason`` is ``"stop"`` or ``"length"``."""

    decode_index: int
    sample_index: int
    text: str
    completion_tokens: int
    finish_reason: str
    token_ids: list[int] | None = None


class TicketRollout(msgspec.Struct, frozen=True):
    """All candidates of one ticket, in (decode, sample) order, or ``dropped`` (no samples)."""

    key: str
    prompt_tokens: int
    dropped: bool = False
    samples: list[Sample] = []


class ChunkResult(msgspec.Struct, frozen=True):
    chunk_index: int
    tickets: list[TicketRollout]
    generated_tokens: int = 0
    elapsed_s: float = 0.0  # wall clock: volatile, never part of a deterministic artifact


class ChatRequest(msgspec.Struct, frozen=True):
    """A free-form generation (the rule proposer): the user message is ``user_head``,
    ``examples[:k]`` and ``user_tail`` joined by blank lines (``k``: ``contract.py``)."""

    system: str
    user_head: str
    examples: list[str]
    user_tail: str
    decode: Decode
    seed_key: str
    max_prompt_tokens: int | None = None
    # A JSON schema (as JSON text) the answer is held to by constrained decoding; None: free.
    json_schema: str | None = None


class ChatResult(msgspec.Struct, frozen=True):
    """``text`` is None when even one example does not fit; the rest then describe that try."""

    text: str | None
    examples_used: int
    prompt_tokens: int
    completion_tokens: int = 0
    finish_reason: str = ""


class VerdictChunk(msgspec.Struct, frozen=True):
    """One batch of the judge-headroom check, in this order: nothing is sampled, so no seed,
    but the chunk still fixes the batch, and with it the low bits."""

    chunk_index: int
    tickets: list[TicketText]
    max_prompt_tokens: int | None = None


class TicketVerdictProbability(msgspec.Struct, frozen=True):
    """``p_pass``: P(``Verdict: <pass_text>``) against ``<fail_text>``, rounded to
    ``P_PASS_DECIMALS``; None when ``dropped``."""

    key: str
    prompt_tokens: int
    dropped: bool = False
    p_pass: float | None = None


class VerdictChunkResult(msgspec.Struct, frozen=True):
    chunk_index: int
    tickets: list[TicketVerdictProbability]
    elapsed_s: float = 0.0  # wall clock: volatile, never part of a deterministic artifact
