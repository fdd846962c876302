"""The prompts against each sampler's ``max_prompt_tokens``, rendered and tokenized as the
engines do (``chat_text.chunk_prompts``) with the model's tokenizer, loaded without weights.

A run drops (never truncates) a ticket whose prompt exceeds its cap; ``check`` names those
tickets beforehand (``measure_lines``). That the run could judge nothing is bad input, an
InputError at the cap's key: every ticket over its cap, the guidance alone over it, the
proposer's prompt over its cap even with the shortest example. ``run`` asks the same before the
run directory is touched (``refuse_unusable_prompts``). A tokenizer that cannot be loaded skips
the measure, never fails. A prompt longer than ``cap * max_token_chars`` characters is over the
cap without being tokenised.
"""

from __future__ import annotations

import functools
import statistics
from typing import TYPE_CHECKING, NamedTuple

import msgspec

from ..engine.models import one_line
from ..stageb.errors import InputError
from ..stageb.tickets import TicketText

if TYPE_CHECKING:  # the plan imports this module
    from .config import Config
    from .plan import RunInputs

SHOWN = 3  # tickets and rules named per line
BATCH = 256  # tickets rendered and tokenized per call (bounds the memory of a huge ticket file)
PROPOSER_KEY = "rule_search.proposer_max_prompt_tokens"
# The proposer's prompt is measured with this many of the examples shortest in characters:
# tokens follow characters closely, and measuring every ticket would cost seconds for nothing.
PROPOSER_EXAMPLES_MEASURED = 8
# Tickets whose prompts ``run`` counts before the fork with a token counter the workers inherit
# (about 0.4 ms each, once): beyond them each worker counts the lines it meets itself.
PRECOUNTED_TICKETS = 1024


class Measured(msgspec.Struct, frozen=True):
    """One sampler's cap (at config ``key``) and the tickets it judges; ``label``: train, eval, audit."""

    label: str
    key: str
    cap: int | None
    tickets: list


def measure_lines(cfg: Config, inputs: RunInputs, measured: list[Measured]) -> list[tuple[str, str]]:
    """``check``'s lines about prompt lengths (InputError for the decisions in the module docstring)."""
    train, measured = _capped(measured)
    try:
        from ..engine import models

        tokenizer = models.tokenizer_only(inputs.model, cfg.model.trust_remote_code)
    except Exception as err:  # noqa: BLE001 - a report, never a failure of check
        return [("prompt tokens", f"not measured: cannot load the tokenizer of {cfg.model.path} "
                                  f"({type(err).__name__}: {one_line(err)})")]
    # a model without a chat template (a base model's GGUF) is bad input, not a failed render
    models.require_chat_template(tokenizer, f"{cfg.model.path}")
    if not measured:
        return [("prompt tokens", "not measured: no cap (max_prompt_tokens is null)"),
                *_proposer_lines(tokenizer, cfg, inputs, train)]
    guidance = dict(inputs.seed_guidance.experiences)
    alone = guidance_verdict(tokenizer, cfg, inputs, measured)
    everyone = {t.key: t for m in measured for t in m.tickets}
    lengths = prompt_lengths(tokenizer, [t.text() for t in everyone.values()], guidance, inputs.profile,
                             cap=max(m.cap for m in measured))
    values = sorted(lengths.values())
    lines = [("prompt tokens", f"min {values[0]}, median {int(statistics.median(values))}, max {values[-1]} "
                               f"(the guidance alone: {alone}), with the model's tokenizer")]
    for m in measured:
        over = [(t.key, lengths[t.key]) for t in m.tickets if lengths[t.key] > m.cap]
        if len(over) == len(m.tickets):
            raise InputError(f"every one of the {len(over)} {m.label} tickets has a prompt over this cap of {m.cap} "
                             f"tokens (the shortest: {min(n for _, n in over)}), so the run would judge none; "
                             f"{_guidance_part(cfg, inputs, alone, m.cap)}", m.key)
        text = f"{m.cap} ({m.key}): no {m.label} ticket over"
        if over:
            text = (f"{m.cap} ({m.key}): {len(over)} of {len(m.tickets)} {m.label} tickets over, dropped by the run: "
                    + ", ".join(f"{key} ({n} tokens)" for key, n in over[:SHOWN]) + (", ..." if len(over) > SHOWN else ""))
        lines.append((f"  {m.label} cap", text))
    return lines + _proposer_lines(tokenizer, cfg, inputs, train)


def sampler_caps(cfg: Config, tickets: list) -> list[Measured]:
    """The audit's one rollout, or the search's train and eval pools (its own split)."""
    from ..stageb.ticket_pools import split_eval_pool

    rs = cfg.rule_search
    if cfg.mode == "audit":
        return [Measured("audit", "rule_search.train_sampler.max_prompt_tokens", rs.train_sampler.max_prompt_tokens,
                         tickets)]
    train, held = split_eval_pool(tickets, rs.eval_pool_size, cfg.seed)
    return [Measured("train", "rule_search.train_sampler.max_prompt_tokens", rs.train_sampler.max_prompt_tokens, train),
            Measured("eval", "rule_search.eval_sampler.max_prompt_tokens", rs.eval_sampler.max_prompt_tokens, held)]


def refuse_unusable_prompts(cfg: Config, inputs: RunInputs) -> None:
    """``run``'s copy of ``check``'s decisions. The tokenizer is loaded in a child so that this
    process imports no torch before it forks its workers. An engine with a ``token_counter``
    (simulated) measures the guidance, and counts the tickets' prompts, here with the counter
    its workers inherit (``preload``), or in the child when that cannot load without threads
    (the tiny model's BPE)."""
    from ..engine.registry import entry
    from ..pool.fork import call_in_child

    train, measured = _capped(sampler_caps(cfg, inputs.tickets))
    engine = entry(cfg.model.engine)
    token_counter = engine.token_counter
    if token_counter is not None and engine.preload is not None:
        counter = engine.preload(inputs.model)
        if counter is not None:
            lengths = counted_lengths(counter)
            guidance_verdict(None, cfg, inputs, measured, lengths=lengths)
            # The tickets' prompts counted here, once: each distinct line's count is then
            # inherited by every worker, which would otherwise encode the lines of each ticket
            # it meets (at 64 workers 0.6 ms of CPU in every chunk, on the cores the others share).
            lengths([t.text() for t in inputs.tickets[:PRECOUNTED_TICKETS]], dict(inputs.seed_guidance.experiences),
                    inputs.profile)
            return

    def helper() -> _Refusal | None:
        try:
            from ..engine import models

            if token_counter is not None:
                guidance_verdict(None, cfg, inputs, measured, lengths=counted_lengths(token_counter(inputs.model)))
            else:
                tokenizer = models.tokenizer_only(inputs.model, cfg.model.trust_remote_code)
                models.require_chat_template(tokenizer, cfg.model.path)
                guidance_verdict(tokenizer, cfg, inputs, measured)
                proposer_verdict(tokenizer, cfg, inputs, train)
        except InputError as err:
            return _Refusal(err.message, err.location)
        except Exception:  # noqa: BLE001 - no tokenizer, no verdict: the workers report their own load errors
            pass
        return None

    refusal = call_in_child(helper, _Refusal | None)
    if refusal is not None:
        raise InputError(refusal.message, refusal.location)


class _Refusal(msgspec.Struct, frozen=True):
    # an InputError crossing the process boundary
    message: str
    location: str | None


def guidance_verdict(tokenizer, cfg: Config, inputs: RunInputs, measured: list[Measured], lengths=None) -> int:
    """The tokens of a prompt without any ticket; InputError at the first cap it exceeds (every
    prompt holds the whole guidance). ``lengths``: how the workers measure prompts (default:
    ``prompt_lengths`` with ``tokenizer``)."""
    guidance = dict(inputs.seed_guidance.experiences)
    lengths = lengths or functools.partial(prompt_lengths, tokenizer)
    alone = lengths([TicketText("", inputs.mission, {})], guidance, inputs.profile)[""]
    for m in measured:
        if m.cap is not None and alone > m.cap:
            raise InputError(f"the prompt with no ticket at all is over this cap of {m.cap} tokens, so every one of "
                             f"the {len(m.tickets)} {m.label} tickets would be dropped and none judged; "
                             f"{_guidance_part(cfg, inputs, alone, m.cap)}", m.key)
    return alone


def proposer_verdict(tokenizer, cfg: Config, inputs: RunInputs, train: list) -> tuple[int, str] | None:
    """``(tokens, ticket key)`` of the proposer's prompt with its shortest example (among
    ``PROPOSER_EXAMPLES_MEASURED``); None in an audit or without train tickets. InputError at
    ``PROPOSER_KEY`` when it is over that cap: examples are dropped down to one, never to none,
    so every proposer call would come back unusable."""
    if cfg.mode != "search" or not train or inputs.proposer_system is None:
        return None
    from ..engine.chat_text import PromptEncoder, chat_messages, render
    from ..stageb import proposer

    cap = cfg.rule_search.proposer_max_prompt_tokens
    lang = proposer.proposer_language(inputs.profile.verdict)
    head = proposer.build_proposer_prompt(inputs.proposer_system, inputs.mission,
                                          dict(inputs.seed_guidance.experiences), [], lang=lang)
    def example(t):
        return proposer.render_example(1, _WrongVote("fail" if t.label == "pass" else "pass"), t, lang=lang)

    per_token = max_token_chars(tokenizer)
    encoder = PromptEncoder(tokenizer)
    shortest = None
    for _, key, t in sorted((len(example(t)), t.key, t) for t in train)[:PROPOSER_EXAMPLES_MEASURED]:
        messages = chat_messages(msgspec.structs.replace(head, examples=[example(t)]), 1)
        chars = len(render(tokenizer, messages))
        # over in characters alone, and so is every later (longer) one: the lower bound stands
        bounded = chars > cap * per_token
        tokens = -(-chars // per_token) if bounded else len(encoder.encode([messages])[0])
        shortest = min(shortest or (tokens, key), (tokens, key))
        if bounded:
            break
    if shortest[0] > cap:
        size = f"at least {shortest[0]}" if bounded else f"{shortest[0]}"
        system = cfg.rule_search.proposer_prompt_path or f"proposer.txt of profile {cfg.prompt.profile}"
        rules = inputs.seed_guidance.experiences
        raise InputError(f"the proposer's prompt is over this cap of {cap} tokens even with one example "
                         f"({size} tokens with the shortest example, ticket {shortest[1]}), and the proposer is "
                         f"never asked without one, so no proposer call of the search could be made; the prompt holds "
                         f"the proposer's system prompt ({len(inputs.proposer_system)} characters, {system}), the "
                         f"mission name ({len(inputs.mission)} characters) and the guidance {cfg.guidance.path}: "
                         f"{rules_summary(rules)}; largest " + _largest_rules(rules), PROPOSER_KEY)
    return shortest


class _WrongVote(NamedTuple):
    """A stand-in vote as long as any: the proposer is shown wrong tickets only, and 1.000 is as
    long as any agreement and difficulty."""

    majority: str
    agreement: float = 1.0
    difficulty: float = 1.0


def _capped(measured: list[Measured]) -> tuple[list, list[Measured]]:
    """The train tickets of a search (the proposer's examples, else none), and the samplers to measure."""
    train = next((m.tickets for m in measured if m.label == "train"), [])
    return train, [m for m in measured if m.cap is not None and m.tickets]


def _proposer_lines(tokenizer, cfg: Config, inputs: RunInputs, train: list) -> list[tuple[str, str]]:
    measured = proposer_verdict(tokenizer, cfg, inputs, train)
    if measured is None:
        return []
    # "proposer": no longer than the other labels, so the table's column does not move.
    return [("proposer", f"prompt of {measured[0]} tokens with one example (the shortest, ticket {measured[1]}); "
                         f"cap {cfg.rule_search.proposer_max_prompt_tokens} ({PROPOSER_KEY})")]


def counted_lengths(counter):
    """``prompt_lengths`` as the workers of an engine with a token counter measure prompts."""
    from ..engine.simulated_engine import messages_tokens
    from ..stageb import prompts

    def lengths(tickets: list[TicketText], guidance: dict[str, str], profile, cap: int | None = None):
        conversations = [prompts.build_messages(profile, guidance, t) for t in tickets]
        return dict(zip([t.key for t in tickets], messages_tokens(counter, conversations)))

    return lengths


def max_token_chars(tokenizer) -> int:
    """The longest vocabulary entry (added and special tokens too: a text spelling one becomes it)."""
    return max((len(token) for token in tokenizer.get_vocab()), default=1) or 1


def prompt_lengths(tokenizer, tickets: list[TicketText], guidance: dict[str, str], profile,
                   cap: int | None = None) -> dict[str, int]:
    """Ticket key -> the token count of its prompt. With ``cap``: a prompt too long in characters
    gets the lower bound ``ceil(characters / max_token_chars)`` instead, itself over the cap."""
    from ..engine.chat_text import chunk_prompts, render
    from ..engine.records import RolloutChunk
    from ..stageb import prompts

    out = {}
    per_token = max_token_chars(tokenizer) if cap is not None else 0
    for start in range(0, len(tickets), BATCH):
        batch = tickets[start : start + BATCH]
        if cap is not None:
            fits = []
            for t in batch:
                chars = len(render(tokenizer, prompts.build_messages(profile, guidance, t)))
                if chars > cap * per_token:
                    out[t.key] = -(-chars // per_token)
                else:
                    fits.append(t)
            batch = fits
        if batch:
            ids, _ = chunk_prompts(tokenizer, RolloutChunk("check", 0, batch, []), guidance, profile)
            out.update((t.key, len(row)) for t, row in zip(batch, ids))
    return out


def _guidance_part(cfg: Config, inputs: RunInputs, alone: int, cap: int) -> str:
    rules = inputs.seed_guidance.experiences
    verdict = "already over the cap" if alone > cap else "within the cap"
    return (f"a prompt without its ticket takes {alone} tokens ({verdict}): the prompt profile, the mission name "
            f"({len(inputs.mission)} characters) and the guidance {cfg.guidance.path}: {rules_summary(rules)}; "
            f"largest " + _largest_rules(rules))


def _largest_rules(rules: dict[str, str]) -> str:
    """The usual culprits of a prompt over a cap."""
    largest = sorted(rules, key=lambda k: -len(rules[k]))[:SHOWN]
    return ", ".join(f"{k} ({len(rules[k])} characters)" for k in largest)


def rules_summary(rules: dict[str, str]) -> str:
    """``N rules, C characters`` (a guidance may hold thousands of rules: never list them all)."""
    return f"{len(rules)} rule{'s' if len(rules) != 1 else ''}, {sum(len(t) for t in rules.values())} characters"
