"""The A/B gate against hand-computed cases (upstream 3.7 formulas)."""

from __future__ import annotations

import random
from types import SimpleNamespace

import pytest

from stageb_pool.stageb.gate import (
    GateResult,
    bootstrap_probability,
    eval_veto,
    evaluate_gate,
    relative_error_reduction,
    select_best,
)

from stageb_pool.stageb.verdicts import TicketStats, compute_metrics


def st(key, gt, majority, agreement=1.0):
    pass_count = 3 if majority == "pass" else 0
    fail_count = 3 if majority == "fail" else 0
    fields = dict(key=key, gt_label=gt, majority=majority, agreement=agreement, pass_count=pass_count,
                  fail_count=fail_count)
    total = pass_count + fail_count
    return TicketStats(**fields, invalid_count=0 if total else 3, total_samples=3,
                       difficulty=1 - agreement if total else 0.5,
                       hard_wrong=agreement if majority not in (None, gt) else 0.0,
                       verdicts=[majority] * 3, reasons=[None] * 3)


def gate(tau=0.1, chi=0.05, fp=0.01, iterations=200, min_prob=0.8, seed=None):
    return SimpleNamespace(min_relative_error_reduction=tau, max_changed_fraction=chi, max_fp_rate_increase=fp,
                           bootstrap=SimpleNamespace(iterations=iterations, min_prob=min_prob, seed=seed),
                           eval_max_acc_drop=None)


def pair(rows):
    """rows: (gt, base_majority, cand_majority) -> (base, cand) stat maps keyed k000.."""
    base = {f"k{i:03d}": st(f"k{i:03d}", g, b) for i, (g, b, _) in enumerate(rows)}
    cand = {f"k{i:03d}": st(f"k{i:03d}", g, c) for i, (g, _, c) in enumerate(rows)}
    return base, cand


OPEN = dict(tau=0.0, chi=1.0, fp=1.0, min_prob=0.0)  # every threshold wide open


def run(base, cand, op="upsert", iteration=1, seed=0, **kw):
    return evaluate_gate(base, cand, op=op, gate=gate(seed=seed, **kw), iteration=iteration)


def test_hand_computed_statistics():
    # 10 tickets: base 6 correct (err .4), cand 8 correct (err .2): RER .5.
    # k0,k1 false blocks fixed; k2 a false release fixed, k3 a correct pass broken -> 4 changes.
    rows = [("pass", "fail", "pass"), ("pass", "fail", "pass"), ("fail", "pass", "fail"), ("pass", "pass", "fail")]
    rows += [("pass", "pass", "pass")] * 3 + [("fail", "fail", "fail")] * 2 + [("fail", "pass", "pass")]
    r = run(*pair(rows), **OPEN)
    assert r.n_common == 10
    assert r.base_acc == pytest.approx(0.6) and r.cand_acc == pytest.approx(0.8)
    assert r.relative_error_reduction == pytest.approx(0.5)
    assert r.changed_fraction == pytest.approx(0.4)
    assert r.base_fp_rate == pytest.approx(0.2) and r.cand_fp_rate == pytest.approx(0.1)
    assert r.d_acc == pytest.approx(0.2) and r.d_fp_rate == pytest.approx(-0.1)
    assert r.regression_count == 1 and r.regressions[0]["ticket_key"] == "k003"
    assert r.passed and r.reason is None
    assert isinstance(r, GateResult)


def test_rates_agree_with_compute_metrics():
    rows = [("pass", "fail", "pass"), ("fail", None, "pass"), ("fail", "fail", None), ("pass", None, "fail")]
    base, cand = pair(rows + [("fail", "pass", "fail"), ("pass", "pass", "pass")])
    r = run(base, cand, **OPEN)
    mb, mc = compute_metrics(base), compute_metrics(cand)
    assert (r.base_acc, r.cand_acc, r.base_fp_rate, r.cand_fp_rate) == (mb.acc, mc.acc, mb.fp_rate, mc.fp_rate)


def test_rer_formula_table():
    assert relative_error_reduction(0.8, 0.9) == pytest.approx(0.5)
    assert relative_error_reduction(0.5, 0.4) == pytest.approx(-0.2)
    assert relative_error_reduction(1.0, 1.0) == 0.0
    assert relative_error_reduction(1.0, 0.9) == pytest.approx(-0.1 / 1e-12)
    assert relative_error_reduction(0.0, 1.0) == 1.0


def test_baseline_error_zero_cannot_pass_a_positive_threshold():
    rows = [("pass", "pass", "pass"), ("fail", "fail", "fail")] * 5
    r = run(*pair(rows), tau=0.1, chi=1.0, fp=1.0, min_prob=0.0)
    assert r.relative_error_reduction == 0.0 and not r.passed
    assert r.reason == "RER 0.000 < 0.100"
    assert r.bootstrap_prob == 0.0


def test_empty_common_set():
    base, _ = pair([("pass", "pass", "pass")])
    _, cand = pair([("pass", "pass", "pass")] * 2)
    cand = {"other": cand["k000"]}
    r = run(base, cand, **OPEN)
    assert not r.passed and r.reason == "no common tickets" and r.n_common == 0
    assert r.bootstrap_prob == 0.0 and r.regression_count == 0


def test_only_common_tickets_count():
    base, cand = pair([("pass", "fail", "pass")] + [("pass", "pass", "pass")] * 3)
    base["extra"] = st("extra", "pass", "fail")  # dropped from the candidate rollout
    r = run(base, cand, **OPEN)
    assert r.n_common == 4 and r.base_acc == pytest.approx(0.75)


def fixes(n_fixed, n_total, wrong_left=4):
    """n_fixed false blocks fixed, wrong_left still wrong, the rest correct in both."""
    rows = [("pass", "fail", "pass")] * n_fixed + [("pass", "fail", "fail")] * wrong_left
    return pair(rows + [("pass", "pass", "pass")] * (n_total - n_fixed - wrong_left))


def test_churn_exactly_at_cap_passes():
    r = run(*fixes(1, 20), tau=0.0, chi=0.05, fp=1.0, min_prob=0.0)
    assert r.changed_fraction == pytest.approx(0.05) and r.passed


def test_churn_above_cap_fails_with_reason():
    r = run(*fixes(2, 20), tau=0.0, chi=0.05, fp=1.0, min_prob=0.0)
    assert not r.passed and r.reason == "changed fraction 0.100 > 0.050"


def test_churn_cap_zero_means_zero():
    r = run(*fixes(1, 20), tau=0.0, chi=0.0, fp=1.0, min_prob=0.0)
    assert not r.passed and r.reason == "changed fraction 0.050 > 0.000"
    r = run(*fixes(0, 20), tau=0.0, chi=0.0, fp=1.0, min_prob=0.0)
    assert r.changed_fraction == 0.0 and r.passed


def fp_rise_case():
    # 2 false blocks fixed, 1 correct block turned into a release: acc .7 -> .8, fp .0 -> .1
    rows = [("pass", "fail", "pass")] * 2 + [("fail", "fail", "pass")] + [("pass", "fail", "fail")]
    return pair(rows + [("pass", "pass", "pass")] * 6)


def test_fp_rise_rejected_for_upsert_too():
    r = run(*fp_rise_case(), tau=0.0, chi=1.0, fp=0.01, min_prob=0.0)
    assert r.d_fp_rate == pytest.approx(0.1) and r.relative_error_reduction > 0
    assert not r.passed and r.reason == "FP rate rise +0.100 > 0.010"
    assert run(*fp_rise_case(), tau=0.0, chi=1.0, fp=0.1, min_prob=0.0).passed  # within the allowance


def test_lifecycle_ops_need_strict_fp_improvement():
    base, cand = fixes(2, 10)  # fixes false blocks only: d_fp = 0, d_acc = +.2
    assert run(base, cand, op="upsert", **OPEN).passed
    for op in ("update", "merge", "remove"):
        r = run(base, cand, op=op, **OPEN)
        assert not r.passed and r.reason == f"{op} must lower the FP rate (d_fp +0.000)"


def test_lifecycle_ops_need_strict_accuracy_improvement():
    # one false release fixed, one false block introduced: d_fp -.1, d_acc 0
    rows = [("fail", "pass", "fail"), ("pass", "pass", "fail")] + [("pass", "pass", "pass")] * 8
    base, cand = pair(rows)
    r = run(base, cand, op="remove", tau=-1.0, chi=1.0, fp=1.0, min_prob=0.0)
    assert r.d_fp_rate == pytest.approx(-0.1) and r.d_acc == 0.0
    assert not r.passed and r.reason == "remove must raise accuracy (d_acc +0.000)"


def test_lifecycle_op_passes_when_both_improve():
    rows = [("fail", "pass", "fail")] + [("pass", "pass", "pass")] * 9
    assert run(*pair(rows), op="merge", **OPEN).passed


def test_rer_reason_comes_first():
    r = run(*fixes(1, 20, wrong_left=3), tau=0.5, chi=0.0, fp=1.0, min_prob=0.9)  # err .2 -> .15
    assert r.reason == "RER 0.250 < 0.500"


def test_bootstrap_reason():
    r = run(*fixes(1, 20), tau=0.1, chi=1.0, fp=1.0, min_prob=1.01)
    assert r.reason.startswith("bootstrap prob ") and r.reason.endswith("< 1.010")


def test_none_majority_counts_as_change_and_as_error():
    rows = [("pass", None, "pass"), ("fail", None, "fail"), ("fail", "fail", None)] + [("pass", "pass", "pass")] * 7
    r = run(*pair(rows), **OPEN)
    assert r.changed_fraction == pytest.approx(0.3)
    assert r.base_fp_rate == pytest.approx(0.1) and r.cand_fp_rate == pytest.approx(0.1)  # None on fail = release
    assert r.base_acc == pytest.approx(0.8) and r.cand_acc == pytest.approx(0.9)
    assert r.regression_count == 1


def test_bootstrap_deterministic_and_seeded_by_seed_plus_iteration():
    base, cand = fixes(3, 40, wrong_left=6)
    a = run(base, cand, iteration=3, seed=10, tau=0.3, chi=1, fp=1, min_prob=0)
    b = run(base, cand, iteration=3, seed=10, tau=0.3, chi=1, fp=1, min_prob=0)
    c = run(base, cand, iteration=1, seed=12, tau=0.3, chi=1, fp=1, min_prob=0)
    d = run(base, cand, iteration=4, seed=10, tau=0.3, chi=1, fp=1, min_prob=0)
    assert a == b == c  # only seed + iteration matters
    assert 0.0 < a.bootstrap_prob < 1.0 and d.bootstrap_prob != a.bootstrap_prob
    keys = sorted(base)
    direct = bootstrap_probability([int(base[k].majority == "pass") for k in keys],
                                   [int(cand[k].majority == "pass") for k in keys],
                                   threshold=0.3, iterations=200, seed=13)
    assert a.bootstrap_prob == direct


def test_an_unresolved_bootstrap_seed_is_refused():
    base, cand = fixes(3, 40, wrong_left=6)
    with pytest.raises(ValueError):
        evaluate_gate(base, cand, op="upsert", gate=gate(), iteration=3)


def test_bootstrap_hand_checkable_small_case():
    # n = 2: base wrong on both, candidate fixes ticket 0 only. A resample's RER is
    # (#draws of ticket 0) / 2, so RER* >= 1 iff both draws hit ticket 0 (prob 1/4).
    base, cand = [0, 0], [1, 0]
    assert bootstrap_probability(base, cand, threshold=0.0, iterations=50, seed=1) == 1.0
    assert bootstrap_probability(base, cand, threshold=1.01, iterations=50, seed=1) == 0.0
    # replay the draws by hand: per resample two randrange(2) calls, both must be 0
    rng = random.Random(5)
    hits = 0
    for _ in range(400):
        draws = [rng.randrange(2), rng.randrange(2)]
        hits += draws == [0, 0]
    p = bootstrap_probability(base, cand, threshold=1.0, iterations=400, seed=5)
    assert p == hits / 400 and 0.18 < p < 0.32
    assert bootstrap_probability([], [], threshold=0.1, iterations=10, seed=0) == 0.0
    with pytest.raises(ValueError):
        bootstrap_probability([1], [1], threshold=0.1, iterations=0, seed=0)


def test_regression_count_is_full_list_is_capped_and_sorted():
    rows = [("pass", "pass", "fail")] * 60 + [("pass", "fail", "pass")] * 70 + [("pass", "pass", "pass")] * 70
    base, cand = pair(rows)
    for i, key in enumerate(sorted(base)[:60]):
        cand[key] = st(key, "pass", "fail", agreement=[1.0, 0.5, 2 / 3][i % 3])
    r = run(base, cand, **OPEN)
    assert r.regression_count == 60 and len(r.regressions) == 50
    order = [(-row["cand_agreement"], -row["base_agreement"], row["ticket_key"]) for row in r.regressions]
    assert order == sorted(order)
    assert r.regressions[0]["cand_agreement"] == 1.0 and r.regressions[0]["ticket_key"] == "k000"
    assert set(r.regressions[0]) == {"ticket_key", "gt_label", "base_pred", "cand_pred", "base_agreement",
                                     "cand_agreement", "base_pass_count", "base_fail_count", "cand_pass_count",
                                     "cand_fail_count"}


def result(passed, rer):
    return GateResult(passed=passed, reason=None, n_common=1, relative_error_reduction=rer, changed_fraction=0,
                      bootstrap_prob=1, base_acc=0, cand_acc=0, base_fp_rate=0, cand_fp_rate=0, d_acc=0,
                      d_fp_rate=0, regression_count=0)


def test_select_best_largest_rer_earliest_on_ties():
    assert select_best([result(True, 0.2), result(True, 0.3), result(True, 0.3)]) == 1
    assert select_best([result(False, 0.9), result(True, 0.1)]) == 1
    assert select_best([result(False, 0.9)]) is None
    assert select_best([]) is None
    assert select_best([result(True, 0.2), result(True, 0.2)]) == 0


def test_eval_veto():
    assert eval_veto(0.8, 0.7, None) == (False, pytest.approx(0.1))
    assert eval_veto(0.8, 0.7, 0.05) == (True, pytest.approx(0.1))
    assert eval_veto(0.8, 0.79, 0.01)[0] is False  # drop == allowance (+eps) passes
    assert eval_veto(0.8, 0.9, 0.0)[0] is False
    assert eval_veto(None, None, 0.01) == (False, None)
