"""What a worker gets of a chunk, made once: each ticket's text (and its summaries' characters,
for the cost) once per run, and each rollout chunk's encoded item once per distinct chunk. A
baseline and its candidates judge the same chunks under different guidance, which travels as a
shared value, so they send the very same item bytes.
"""

from __future__ import annotations

import msgspec

from ..engine.records import RolloutChunk, SamplerConfig
from ..stageb.tickets import Ticket, TicketText
from .chunk_cost import summary_chars

# Encoded chunk items kept (then the memo starts over): an iteration reuses its own pool's
# chunks and the eval pool's, about 100 at most (an item of 16 demo tickets is 8.5 KB).
ITEM_MEMO_LIMIT = 1024


class ChunkItems:
    """``save_rollouts``: the items ask the engine for token ids too."""

    def __init__(self, *, save_rollouts: bool):
        self.save_rollouts = save_rollouts
        self._texts: dict[str, tuple[Ticket, TicketText, int]] = {}  # ticket key -> (ticket, its text, chars)
        self._items: dict[tuple, tuple[msgspec.Raw, int]] = {}

    def texts(self, tickets: list[Ticket]) -> tuple[list[TicketText], list[int]]:
        """Each ticket's text for a worker and its summaries' characters."""
        texts, chars = [], []
        for ticket in tickets:
            known = self._texts.get(ticket.key)
            if known is None or known[0] is not ticket:
                known = self._texts[ticket.key] = (ticket, ticket.text(), summary_chars(ticket))
            texts.append(known[1])
            chars.append(known[2])
        return texts, chars

    def rollout(self, seed_key: str, index: int, tickets: list[Ticket], keys: tuple[str, ...],
                sampler: SamplerConfig, sampler_json: bytes) -> tuple[msgspec.Raw, int]:
        """Chunk ``index`` of a rollout of ``seed_key`` encoded (a ``RolloutChunk``), and its tickets'
        summary characters; ``keys``: the tickets' keys, ``sampler_json``: the sampler's canonical JSON."""
        memo_key = (keys, seed_key, index, sampler_json)
        known = self._items.get(memo_key)
        if known is None:
            if len(self._items) >= ITEM_MEMO_LIMIT:
                self._items.clear()
            texts, chars = self.texts(tickets)
            chunk = RolloutChunk(seed_key=seed_key, chunk_index=index, tickets=texts, grid=list(sampler.grid),
                                 samples_per_decode=sampler.samples_per_decode,
                                 max_prompt_tokens=sampler.max_prompt_tokens, return_token_ids=self.save_rollouts,
                                 constrain_verdict=sampler.constrain_verdict)
            known = self._items[memo_key] = (msgspec.Raw(msgspec.json.encode(chunk)), sum(chars))
        return known
