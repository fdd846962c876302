"""The judge-headroom check: can the judge tell the labels apart at all? (docs/rule_search.md)

Contracts kept here: the sample is seeded by the run seed and ``"headroom"`` (never a rank),
stratified by label (balanced classes give the AUC its smallest variance), in key order, in
chunks of the runner's ``chunk_size``, one batch each; an inverted AUC does NOT count as
separation; ``separates`` is None when the AUC cannot be measured (no judged ticket of one
label). Everything written is computed in key order and rounded, with no timestamps, so
``judge_headroom.json`` is byte-identical for any worker count.
"""

from __future__ import annotations

import itertools
import logging
import random
from pathlib import Path

import msgspec

from ..artifacts import HEADROOM
from ..stageb.hashing import content_hash, stable_seed
from ..stageb.tickets import Ticket
from .fileio import write_json
from .rollout import RolloutRunner

DECIMALS = 6  # rounding of every derived number in the file (the engine rounds P(pass) too)
SUMMARY_KEYS = ("auc", "tickets", "pass_share", "separates")  # what summary.json repeats


class HeadroomSettings(msgspec.Struct, frozen=True, kw_only=True):
    """The plain values the check reads (from the config's ``headroom`` section, the run
    seed and the train sampler's prompt cap)."""

    seed: int
    tickets: int
    min_auc: float
    max_prompt_tokens: int | None


def sample_tickets(tickets: list, n: int, seed: int) -> list:
    """``n`` tickets (all when there are fewer), half of each label where possible, in key
    order. Depends on the ticket set and the seed only, not on the order given."""
    by_label = {label: sorted((t for t in tickets if t.label == label), key=lambda t: t.key)
                for label in ("pass", "fail")}
    k_fail = min(len(by_label["fail"]), n // 2)
    k_pass = min(len(by_label["pass"]), n - k_fail)
    k_fail = min(len(by_label["fail"]), n - k_pass)  # the fail side tops up a short pass side
    rng = random.Random(stable_seed(seed, "headroom"))
    chosen = rng.sample(by_label["pass"], k_pass) + rng.sample(by_label["fail"], k_fail)
    return sorted(chosen, key=lambda t: t.key)


def auc(scores: list[float], labels: list[str]) -> float | None:
    """The probability that a pass ticket scores higher than a fail ticket (Mann-Whitney U
    over all pass x fail pairs, a tie counting half), from average ranks in O(n log n).
    None when either label is missing."""
    if len(scores) != len(labels):
        raise ValueError(f"{len(scores)} scores for {len(labels)} labels")
    n_pass = sum(1 for label in labels if label == "pass")
    n_fail = len(labels) - n_pass
    if n_pass == 0 or n_fail == 0:
        return None
    rank_sum = 0.0  # sum of the pass tickets' ranks (1-based; tied scores share their mean rank)
    below = 0  # tickets scoring lower than the current group of ties
    for _, group in itertools.groupby(sorted(zip(scores, labels)), key=lambda pair: pair[0]):
        tied = [label for _, label in group]
        rank_sum += (below + (len(tied) + 1) / 2) * tied.count("pass")
        below += len(tied)
    u = rank_sum - n_pass * (n_pass + 1) / 2
    return u / (n_pass * n_fail)


def pass_share(scores: list[float]) -> float | None:
    """The share of tickets the judge would pass when answering greedily (P(pass) >= 0.5)."""
    return sum(1 for p in scores if p >= 0.5) / len(scores) if scores else None


def separates(value: float | None, min_auc: float) -> bool | None:
    """Whether an AUC shows separation a rule search can use (see the module docstring)."""
    return None if value is None else value >= min_auc


def message(*, auc_value: float | None, tickets: int, share: float | None, labels: dict[str, int],
            min_auc: float) -> str:
    """One plain sentence for the log and the file."""
    if auc_value is None:
        missing = [label for label in ("pass", "fail") if not labels.get(label)]
        return (f"judge headroom not measured on {tickets} tickets: no judged ticket labelled "
                f"{' or '.join(missing)} (the AUC needs both labels)")
    head = f"AUC {auc_value:.2f} on {tickets} tickets"
    if auc_value >= min_auc:
        return f"{head}: the judge separates the labels; rules can move it"
    says = f"it says pass to {share:.0%}" if share >= 0.5 else f"it says fail to {1 - share:.0%}"
    if auc_value <= 1 - min_auc:
        why = f"the judge ranks the labels the wrong way round, favouring pass on the fail tickets ({says})"
    else:
        why = f"the judge's verdicts do not depend on the tickets ({says})"
    return f"{head}: {why}; no guidance rule is likely to help; try a larger model"


def report(per_ticket: list[dict], *, min_auc: float, dropped: int, guidance_hash: str) -> dict:
    """``judge_headroom.json``'s content from ``[{"key", "label", "p_pass"}]`` (key order)."""
    scores = [row["p_pass"] for row in per_ticket]
    labels = [row["label"] for row in per_ticket]
    counts = {"pass": labels.count("pass"), "fail": labels.count("fail")}
    value, share = auc(scores, labels), pass_share(scores)
    return {
        "auc": _round(value),
        "tickets": len(per_ticket),
        "dropped": dropped,
        "pass_share": _round(share),
        "labels": counts,
        "mean_p_pass": _round(sum(scores) / len(scores)) if scores else None,
        "min_auc": min_auc,
        "separates": separates(value, min_auc),
        "message": message(auc_value=value, tickets=len(per_ticket), share=share, labels=counts, min_auc=min_auc),
        "guidance_hash": guidance_hash,
        "per_ticket": per_ticket,
    }


def summary_line(summary: dict) -> str | None:
    """The line of the printed summary, from summary.json's ``judge_headroom`` (None: no check)."""
    h = summary.get("judge_headroom")
    if not h:
        return None
    if h["auc"] is None:
        return f"  judge headroom: not measured on {h['tickets']} tickets (one label missing)"
    verdict = "separates the labels: rules can move it" if h["separates"] else \
        "cannot separate the labels: no edit expected"
    return f"  judge headroom: AUC {h['auc']:.2f} on {h['tickets']} tickets; {verdict}"


def _round(value: float | None) -> float | None:
    return None if value is None else round(value, DECIMALS)


def run_headroom(runner: RolloutRunner, *, tickets: list[Ticket], guidance: dict[str, str],
                 settings: HeadroomSettings, run_dir: Path, log: logging.Logger) -> dict:
    """Score the sample on the pool through ``runner`` (its chunks, progress and rollout
    accounting), write ``judge_headroom.json`` and log its message (a warning when the judge
    cannot separate the labels). Returns the report."""
    sample = sample_tickets(tickets, settings.tickets, settings.seed)
    scored = runner.verdict_probabilities(sample, guidance, settings.max_prompt_tokens,
                                          label="headroom", phase="judge headroom")
    per_ticket = [{"key": ticket.key, "label": ticket.label, "p_pass": result.p_pass}
                  for ticket, result in zip(sample, scored) if not result.dropped]
    dropped = len(sample) - len(per_ticket)
    doc = report(per_ticket, min_auc=settings.min_auc, dropped=dropped, guidance_hash=content_hash(guidance))
    write_json(Path(run_dir) / HEADROOM.name, doc)
    if dropped:
        log.warning("judge headroom: %d sampled ticket(s) dropped, prompt over the sampler's max_prompt_tokens",
                    dropped)
    (log.info if doc["separates"] else log.warning)("judge headroom: %s", doc["message"])
    return doc


def summary_entry(doc: dict) -> dict:
    return {key: doc[key] for key in SUMMARY_KEYS}
