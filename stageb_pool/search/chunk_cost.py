"""What a chunk of tickets costs to judge, as the pool orders its queue: the most expensive
chunks start first (longest-processing-time-first; seeds never depend on the order), so the
tail after the last start is short. An estimate from characters: no tokenizer in the parent.
"""

from __future__ import annotations

from ..stageb.tickets import Ticket


def chunk_cost(tickets: list[Ticket], rules_chars: int, samples: int = 1) -> float:
    """A chunk's expected work: its prompt characters (each ticket's summaries plus the
    guidance's ``rules_chars``, counted once per rollout by ``guidance_chars``) times the
    samples it generates per ticket (1 for a verdict chunk, a prefill only)."""
    return float(sum(sum(len(text) for text in t.per_image.values()) + rules_chars for t in tickets)) * samples


def guidance_chars(guidance: dict[str, str]) -> int:
    return sum(len(rule) for rule in guidance.values())
