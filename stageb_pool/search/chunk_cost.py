"""What a chunk of tickets costs to judge, as the pool orders its queue: the most expensive
chunks start first (longest-processing-time-first; seeds never depend on the order), so the
tail after the last start is short. An estimate from characters: no tokenizer in the parent.
"""

from __future__ import annotations

from ..engine.records import SamplerConfig
from ..stageb.tickets import Ticket


def chunk_cost(tickets: list[Ticket], rules_chars: int, sampler: SamplerConfig) -> float:
    """A chunk's expected work, for the pool to start the most expensive chunks first (a
    shorter tail than submission order; seeds do not depend on the order): its prompt
    characters (``rules_chars``: the guidance's, ``guidance_chars``, counted once per
    rollout) times the samples it generates."""
    return tickets_prompt_chars(tickets, rules_chars) * len(sampler.grid) * sampler.samples_per_decode


def prompt_chars(tickets: list[Ticket], guidance: dict[str, str]) -> float:
    """The prompt characters of a chunk: each ticket's summaries plus the guidance."""
    return tickets_prompt_chars(tickets, guidance_chars(guidance))


def guidance_chars(guidance: dict[str, str]) -> int:
    return sum(len(rule) for rule in guidance.values())


def tickets_prompt_chars(tickets: list[Ticket], rules_chars: int) -> float:
    """``prompt_chars`` with the guidance's characters already counted."""
    return float(sum(sum(len(text) for text in t.per_image.values()) + rules_chars for t in tickets))
