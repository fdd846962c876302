"""The engine contract: what the pool calls on an engine in a worker, and what each call keeps.

An engine lives in one worker (a forked process, a Ray actor, or the parent with
``--debug``): its registry entry's builder (``registry.py``) makes it there from the
``ModelRef`` the parent checked and the config's model section. The parent sends it one
request at a time through the pool; the pool decodes each request into the types the method
declares (``pool/calls.py`` reads the annotations, so an engine never converts untyped
values itself) and encodes what it returns. The requests and results are the records of
``records.py``. An engine builds each ticket's prompt from the guidance and the profile it
is sent (``stageb.prompts``) and returns texts; the parent parses every answer itself.

The methods (``Engine``):

- ``info() -> dict``: the facts the results' bytes depend on (the engine's name, its library
  versions, the device, dtype, model, pinned settings), JSON values in a fixed key order.
  Rank 0's goes into run.json and, hashed, into every rollout cache key; workers whose
  facts differ are refused or warned about (``registry.engine_agreement``).
- ``rollout(chunk: RolloutChunk, *, guidance, profile) -> ChunkResult``: every sample of
  every ticket of the chunk (``len(grid) x samples_per_decode``, in (decode, sample) order)
  under ``guidance`` (rule key -> text), the prompts built by ``stageb.prompts`` from
  ``profile``.
- ``verdict_probabilities(chunk: VerdictChunk, *, guidance, profile) -> VerdictChunkResult``:
  the judge's P(pass) of each ticket (the judge-headroom check), nothing sampled.
- ``chat(request: ChatRequest) -> ChatResult``: one free-form answer (the rule proposer).

What every engine keeps, so that a run gives the same bytes on 1 or N workers:

- every random draw is seeded from the work alone: a rollout sample's from
  ``stable_seed(chunk.seed_key, chunk.chunk_index, decode index, decode.seed, sample index)``
  (an engine may add the ticket's position in the chunk), a chat's from
  ``request.seed_key``; never from the worker's rank or device, the process, the clock, or
  what the worker ran before;
- a chunk is computed as one unit, in its own ticket order: the chunk, not the worker,
  fixes the batch (and so the low bits of a model's arithmetic);
- a ticket whose prompt is longer than the chunk's ``max_prompt_tokens`` comes back
  ``dropped`` with its prompt length, never cut and never generated
  (``chat_text.kept_positions``); a chat drops examples from the end, down to one, until
  its prompt fits, and answers ``text=None`` when even one does not
  (``chat_text.fit_examples``);
- results come back in the request's ticket order; ``elapsed_s`` (wall clock) is the only
  field that may differ between two runs of the same request.

A method may raise: the pool reports the error as that task's failure. A method that can stop
early calls ``pool.cancellation.checkpoint()`` between steps (or waits with its ``sleep``): it
raises ``TaskCancelled`` once the parent no longer wants the task (a discarded speculation), so
the work the loop waits for does not queue behind it. Adding an engine:
its module, with a builder, and its entry in ``registry.ENGINES``.
"""

from __future__ import annotations

from typing import Protocol

from ..stageb.prompts import PromptProfile
from .records import ChatRequest, ChatResult, ChunkResult, RolloutChunk, VerdictChunk, VerdictChunkResult


class Engine(Protocol):
    """The methods the pool calls (see the module docstring for what each keeps)."""

    def info(self) -> dict: ...

    def rollout(self, chunk: RolloutChunk, *, guidance: dict[str, str], profile: PromptProfile) -> ChunkResult: ...

    def verdict_probabilities(self, chunk: VerdictChunk, *, guidance: dict[str, str],
                              profile: PromptProfile) -> VerdictChunkResult: ...

    def chat(self, request: ChatRequest) -> ChatResult: ...
