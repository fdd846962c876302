"""What a chunk of tickets costs to judge, as the pool orders its queue: the most expensive
chunks start first (longest-processing-time-first; seeds never depend on the order), so the
tail after the last start is short. An estimate from characters: no tokenizer in the parent.
"""

from __future__ import annotations

from ..stageb.tickets import Ticket


def chunk_cost(ticket_chars: int, tickets: int, rules_chars: int, samples: int = 1) -> float:
    """A chunk's expected work: its prompt characters (its ``tickets``' ``summary_chars``, summed
    in ``ticket_chars``, plus the guidance's ``rules_chars`` per ticket; each counted once per
    value, not per chunk) times the samples it generates per ticket (1 for a verdict chunk, a
    prefill only)."""
    return float(ticket_chars + rules_chars * tickets) * samples


def summary_chars(ticket: Ticket) -> int:
    return sum(len(text) for text in ticket.per_image.values())


def guidance_chars(guidance: dict[str, str]) -> int:
    return sum(len(rule) for rule in guidance.values())
