"""What the two model engines share: ``contract.Engine``'s methods but ``info``, written once
around each engine's own steps (prompts, drops and results are the text layer's, ``self.text``):

- ``_sample(chunk, ids, kept, regex)``: every (kept ticket, decode, sample) of a rollout chunk
  as ``chat_text.Completion``s, in (decode, sample, ticket) order (the result's);
- ``_score_answers(chunk, ids, kept, answers)``: per kept ticket, the summed log-probability
  of each answer's tokens after its prompt;
- ``_complete(request, row)``: the proposer's completion ``(ids, finish reason)`` of ``row``.
"""

from __future__ import annotations

import time

from ..stageb.prompts import PromptProfile
from . import chat_text, verdict_scoring
from .constrained import verdict_line_regex
from .records import ChatRequest, ChatResult, ChunkResult, RolloutChunk, VerdictChunk, VerdictChunkResult


class ModelEngine:
    """An engine with a model, its ``tokenizer`` and a text layer ``text`` (module docstring)."""

    tokenizer: object
    text: chat_text.ChatText

    def rollout(self, chunk: RolloutChunk, *, guidance: dict[str, str], profile: PromptProfile) -> ChunkResult:
        """A chunk with no ticket kept never reaches the model."""
        start = time.perf_counter()
        ids, kept = self.text.chunk_prompts(chunk, guidance, profile)
        regex = verdict_line_regex(profile.verdict) if chunk.constrain_verdict else None
        completions = self._sample(chunk, ids, kept, regex) if kept else []
        return self.text.rollout_result(chunk, ids, kept, completions, start)

    def verdict_probabilities(self, chunk: VerdictChunk, *, guidance: dict[str, str],
                              profile: PromptProfile) -> VerdictChunkResult:
        """P(pass) from the two verdict answers' summed log-probabilities (``verdict_scoring``)."""
        start = time.perf_counter()
        ids, kept = self.text.chunk_prompts(chunk, guidance, profile)
        answers = verdict_scoring.answer_ids(self.tokenizer, profile.verdict)
        scores = self._score_answers(chunk, ids, kept, answers) if kept else []
        p_pass = {i: verdict_scoring.p_pass(lp, lf) for i, (lp, lf) in zip(kept, scores)}
        return chat_text.verdict_result(chunk, [len(row) for row in ids], p_pass, start)

    def chat(self, request: ChatRequest) -> ChatResult:
        k, row, fits = self.text.fit_examples(request)
        if not fits:
            return ChatResult(None, k, len(row))
        out, reason = self._complete(request, row)
        (text,) = self.text.texts([out])
        return ChatResult(text, k, len(row), len(out), reason)
