"""A judge that follows the guidance's rules literally (the simulated engine's and the tests'
scripted engine's): a ticket fails when an "If any/no photo shows X, the verdict is fail."
rule holds for its summaries (X as whole words, any case); other rules are ignored. Each
sample's verdict flips with probability ``noise``, drawn from the work's seed and the ticket
key, never the guidance: a baseline and its candidates see the same flips, so the gate
measures what a rule changes.
"""

from __future__ import annotations

import random
import re

import msgspec

from ..stageb.hashing import stable_seed

_RULE = re.compile(r"\bif (any|no) photo (?:shows|is) (?:(?:an?|the) )?([^,.]+?),? the verdict is fail\b",
                   re.IGNORECASE)


class FailCondition(msgspec.Struct, frozen=True):
    """Fail when ``feature`` is present ("any photo shows") or absent ("no photo shows")."""

    feature: str  # lower case
    present: bool


def fail_conditions(guidance: dict[str, str]) -> list[FailCondition]:
    """The rules of ``guidance`` the judge obeys, without repeats, sorted."""
    found = {FailCondition(m.group(2).strip().lower(), m.group(1).lower() == "any")
             for text in guidance.values() for m in _RULE.finditer(text)}
    return sorted(found, key=lambda c: (c.feature, c.present))


def ticket_text(ticket) -> str:
    return " ".join(ticket.per_image.values()).lower()


def shows(text: str, feature: str) -> bool:
    return re.search(rf"\b{re.escape(feature)}\b", text) is not None


def judge(conditions: list[FailCondition], text: str) -> tuple[str, str]:
    """``(verdict, why)``: ``fail`` naming the first condition that holds, else ``pass``."""
    hits = [c for c in conditions if shows(text, c.feature) == c.present]
    if not hits:
        return "pass", "nothing wrong"
    first = hits[0]
    return "fail", f"shows {first.feature}" if first.present else f"no {first.feature}"


def sample_verdict(verdict: str, noise: float, *seed_parts) -> str:
    """``verdict``, flipped with probability ``noise`` by a draw seeded by ``seed_parts``."""
    if random.Random(stable_seed(*seed_parts)).random() < noise:
        return "pass" if verdict == "fail" else "fail"
    return verdict


def answer_text(verdict: str, why: str, vocab=None) -> str:
    """The two-line answer, the verdict in ``vocab``'s words (a ``VerdictVocab``; None: pass/fail)."""
    word = verdict if vocab is None else (vocab.pass_text if verdict == "pass" else vocab.fail_text)
    return f"Verdict: {word}\nReason: {why}"
