"""The A/B metric gate of the rule search (upstream 3.7, formulas exact; docs/rule_search.md,
"The gate"). Unlike upstream, the FP-rate cap applies to every op and a churn cap of 0 means 0."""

from __future__ import annotations

import functools
import random
from typing import Mapping, Sequence

import msgspec

from .verdicts import compute_metrics

EPS = 1e-12
REGRESSION_LIST_CAP = 50
LIFECYCLE_OPS = frozenset({"update", "merge", "remove"})


class GateResult(msgspec.Struct):
    """``reason``: the first failing condition (None when passed); at most 50 ``regressions``."""

    passed: bool
    reason: str | None
    n_common: int
    relative_error_reduction: float
    changed_fraction: float
    bootstrap_prob: float
    base_acc: float
    cand_acc: float
    base_fp_rate: float
    cand_fp_rate: float
    d_acc: float
    d_fp_rate: float
    regression_count: int
    regressions: list[dict] = []


def relative_error_reduction(base_acc: float, cand_acc: float) -> float:
    base_err = max(0.0, 1.0 - base_acc)
    cand_err = max(0.0, 1.0 - cand_acc)
    return (base_err - cand_err) / max(base_err, EPS)


def bootstrap_probability(
    base_correct: Sequence[int], cand_correct: Sequence[int], *, threshold: float, iterations: int, seed: int
) -> float:
    """Share of paired resamples whose RER reaches ``threshold``, drawn as upstream draws them."""
    if iterations <= 0:
        raise ValueError("bootstrap iterations must be > 0")
    n = len(base_correct)
    if n != len(cand_correct):
        raise ValueError("paired correctness lists differ in length")
    if n == 0:
        return 0.0
    hits = 0
    for indices in _resamples(int(seed), n, iterations):
        sum_b = sum(map(base_correct.__getitem__, indices))
        sum_c = sum(map(cand_correct.__getitem__, indices))
        if relative_error_reduction(sum_b / n, sum_c / n) >= threshold:
            hits += 1
    return hits / iterations


@functools.lru_cache(maxsize=4)
def _resamples(seed: int, n: int, iterations: int) -> tuple[tuple[int, ...], ...]:
    """Drawn once and shared by every candidate of an iteration (the draws cost more than the sums)."""
    rng = random.Random(seed)
    # ``randrange(n)`` is ``_randbelow(n)`` after checking its argument (CPython's random.py):
    # the same draws, without the checks, 51,200 times an iteration in the bench.
    draw = rng._randbelow
    return tuple(tuple(draw(n) for _ in range(n)) for _ in range(iterations))


def _regression_row(key: str, b, c) -> dict:
    return {
        "ticket_key": key,
        "gt_label": b.gt_label,
        "base_pred": b.majority,
        "cand_pred": c.majority,
        "base_agreement": b.agreement,
        "cand_agreement": c.agreement,
        "base_pass_count": b.pass_count,
        "base_fail_count": b.fail_count,
        "cand_pass_count": c.pass_count,
        "cand_fail_count": c.fail_count,
    }


def find_regressions(base: Mapping, cand: Mapping, keys: Sequence[str]) -> list[dict]:
    """Base-correct -> candidate-wrong rows by ``(cand_agreement, base_agreement)`` desc, then key."""
    rows = [_regression_row(k, base[k], cand[k]) for k in keys if base[k].correct and not cand[k].correct]
    rows.sort(key=lambda r: r["ticket_key"])
    rows.sort(key=lambda r: (r["cand_agreement"], r["base_agreement"]), reverse=True)
    return rows


def _first_failure(op, rer, chi, p, d_fp, d_acc, gate) -> str | None:
    tau = gate.min_relative_error_reduction
    if not rer >= tau:
        return f"RER {rer:.3f} < {tau:.3f}"
    if not chi <= gate.max_changed_fraction:
        return f"changed fraction {chi:.3f} > {gate.max_changed_fraction:.3f}"
    if not p >= gate.bootstrap.min_prob:
        return f"bootstrap prob {p:.3f} < {gate.bootstrap.min_prob:.3f}"
    if not d_fp <= gate.max_fp_rate_increase + EPS:
        return f"FP rate rise {d_fp:+.3f} > {gate.max_fp_rate_increase:.3f}"
    if op in LIFECYCLE_OPS and not d_fp < -EPS:
        return f"{op} must lower the FP rate (d_fp {d_fp:+.3f})"
    if op in LIFECYCLE_OPS and not d_acc > EPS:
        return f"{op} must raise accuracy (d_acc {d_acc:+.3f})"
    return None


def evaluate_gate(base: Mapping, cand: Mapping, *, op: str, gate, iteration: int) -> GateResult:
    """``base``, ``cand``: ticket key -> ``TicketStats``; resamples use ``bootstrap.seed + iteration``."""
    bootstrap_seed = gate.bootstrap.seed
    if bootstrap_seed is None:
        raise ValueError("bootstrap seed is unresolved: the config fills it in from the run seed")
    keys = sorted(set(base) & set(cand))
    n = len(keys)
    if n == 0:
        return GateResult(
            passed=False, reason="no common tickets", n_common=0, relative_error_reduction=0.0,
            changed_fraction=0.0, bootstrap_prob=0.0, base_acc=0.0, cand_acc=0.0, base_fp_rate=0.0,
            cand_fp_rate=0.0, d_acc=0.0, d_fp_rate=0.0, regression_count=0,
        )
    base_m = compute_metrics([base[k] for k in keys])
    cand_m = compute_metrics([cand[k] for k in keys])
    base_acc, cand_acc, base_fp, cand_fp = base_m.acc, cand_m.acc, base_m.fp_rate, cand_m.fp_rate
    base_correct = [int(base[k].correct) for k in keys]
    cand_correct = [int(cand[k].correct) for k in keys]
    rer = relative_error_reduction(base_acc, cand_acc)
    chi = sum(base[k].majority != cand[k].majority for k in keys) / n
    tau = gate.min_relative_error_reduction
    p = bootstrap_probability(
        base_correct, cand_correct, threshold=tau, iterations=gate.bootstrap.iterations,
        seed=int(bootstrap_seed) + int(iteration),
    )
    d_acc, d_fp = cand_acc - base_acc, cand_fp - base_fp
    reason = _first_failure(op, rer, chi, p, d_fp, d_acc, gate)
    regressions = find_regressions(base, cand, keys)
    return GateResult(
        passed=reason is None, reason=reason, n_common=n, relative_error_reduction=rer,
        changed_fraction=chi, bootstrap_prob=p, base_acc=base_acc, cand_acc=cand_acc,
        base_fp_rate=base_fp, cand_fp_rate=cand_fp, d_acc=d_acc, d_fp_rate=d_fp,
        regression_count=len(regressions), regressions=regressions[:REGRESSION_LIST_CAP],
    )


def select_best(results: Sequence[GateResult]) -> int | None:
    """Index of the passing result with the largest RER, the earliest on ties; None if none passed."""
    passing = [index for index, result in enumerate(results) if result.passed]
    return max(passing, key=lambda index: results[index].relative_error_reduction, default=None)


def eval_veto(base_eval_acc: float | None, cand_eval_acc: float | None, max_acc_drop: float | None) -> tuple[bool, float | None]:
    """``(vetoed, base - cand)``; never vetoed with ``max_acc_drop`` None (upstream: log only)."""
    if base_eval_acc is None or cand_eval_acc is None:
        return False, None
    drop = base_eval_acc - cand_eval_acc
    return max_acc_drop is not None and drop > max_acc_drop + EPS, drop
