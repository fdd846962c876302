"""check's prompt measure (app/prompt_budget.py): bounded by the caps (issue 21)."""

from __future__ import annotations


import pytest

from stageb_pool.app import prompt_budget
from stageb_pool.engine import tiny
from stageb_pool.stageb import prompts
from stageb_pool.stageb.tickets import TicketText

MISSION = "Rooftop antenna mount inspection"
GUIDANCE = {"G0": "The antenna mount is complete.", "G1": "Blurry photos fail."}


class Counting:
    """The tiny tokenizer, counting the characters it is asked to tokenise."""

    def __init__(self):
        self.inner = tiny.build_tokenizer()
        self.chars = 0

    def __call__(self, texts, **kwargs):
        self.chars += sum(len(t) for t in texts)
        return self.inner(texts, **kwargs)

    def __getattr__(self, name):
        return getattr(self.inner, name)


@pytest.fixture(scope="module")
def profile():
    return prompts.load_profile("generic", mission=MISSION, domain=None)


def ticket(key: str, summary: str) -> TicketText:
    return TicketText(key, MISSION, {"image_1": summary})


def test_max_token_chars_bounds_every_token_of_the_vocabulary():
    tok = tiny.build_tokenizer()
    n = prompt_budget.max_token_chars(tok)
    assert n >= 1 and all(len(tok.decode([i])) <= n for i in range(len(tok.get_vocab())))


def test_a_prompt_too_long_in_characters_is_over_without_being_tokenised(profile):
    tok = Counting()
    cap = 200
    per_token = prompt_budget.max_token_chars(tok.inner)
    huge = ticket("huge", "the mount bolt is loose " * (cap * per_token))  # far over in characters alone
    small = ticket("small", "a clear photo")
    lengths = prompt_budget.prompt_lengths(tok, [huge, small], GUIDANCE, profile, cap=cap)
    assert lengths["huge"] > cap
    assert tok.chars < 10_000  # only the small prompt was tokenised
    exact = prompt_budget.prompt_lengths(tiny.build_tokenizer(), [small], GUIDANCE, profile)
    assert lengths["small"] == exact["small"]


@pytest.mark.parametrize("words", [1, 50, 150, 400])
def test_the_character_bound_never_calls_a_prompt_that_fits_over(profile, words):
    """Safety of the bound: whatever the ticket, a prompt given the lower bound is truly over."""
    tok = tiny.build_tokenizer()
    t = ticket("t", "rust " * words)
    exact = prompt_budget.prompt_lengths(tok, [t], GUIDANCE, profile)["t"]
    for cap in (exact - 1, exact, exact + 1, 10):
        bounded = prompt_budget.prompt_lengths(tok, [t], GUIDANCE, profile, cap=cap)["t"]
        assert (bounded > cap) == (exact > cap)
