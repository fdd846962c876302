"""The judge-headroom check: its pure parts (sample, AUC, shares, verdict, message) and the
run end to end with a judge that cannot separate the labels (the fake engine, like the
embedded model: the same low P(pass) for every ticket) and one that can (the scripted engine)."""

from __future__ import annotations

import itertools
import json
import logging
import random
from pathlib import Path

import pytest
from doubles import scripted_engine as se
from doubles.fake_engine import fake_factory
from doubles.run_inputs import MISSION, audit_inputs, missing_part_records, search_inputs
from processes import CORES, ONE_CORE, pinned

from stageb_pool.app.config import load_config
from stageb_pool.app.job import run_job
from stageb_pool.artifacts import HEADROOM
from stageb_pool.search import headroom as hr
from stageb_pool.stageb.tickets import Ticket


def tickets_of(labels: str) -> list[Ticket]:
    """One ticket per character: p = pass, f = fail."""
    return [Ticket(f"K{i:03d}::{'pass' if c == 'p' else 'fail'}", f"K{i:03d}", MISSION,
                   "pass" if c == "p" else "fail", {"image_1": f"view {i}"}) for i, c in enumerate(labels)]


def brute_auc(scores, labels):
    """The definition: over all (pass, fail) pairs, 1 when the pass ticket scores higher,
    1/2 on a tie."""
    pos = [s for s, label in zip(scores, labels) if label == "pass"]
    neg = [s for s, label in zip(scores, labels) if label == "fail"]
    if not pos or not neg:
        return None
    return sum(1.0 if p > n else 0.5 if p == n else 0.0 for p in pos for n in neg) / (len(pos) * len(neg))


# ---------------------------------------------------------------- AUC


@pytest.mark.parametrize("scores, labels, want", [
    ([0.9, 0.8, 0.1, 0.2], ["pass", "pass", "fail", "fail"], 1.0),  # perfect
    ([0.1, 0.2, 0.9, 0.8], ["pass", "pass", "fail", "fail"], 0.0),  # inverted
    ([0.008] * 6, ["pass", "fail"] * 3, 0.5),  # all tied: the embedded model
    ([0.5, 0.5, 0.2], ["pass", "fail", "fail"], 0.75),  # one tie (half) and one win
    ([0.3, 0.6, 0.6, 0.1], ["pass", "pass", "fail", "fail"], 0.625),
    ([0.4], ["pass"], None),  # one class
    ([0.4, 0.9], ["fail", "fail"], None),
    ([], [], None),  # empty
])
def test_auc_cases(scores, labels, want):
    assert hr.auc(scores, labels) == want


def test_auc_equals_the_pairwise_definition_on_every_small_case():
    """Every labelling of up to 6 tickets with scores from a 3-value set (many ties)."""
    values = (0.0, 0.5, 1.0)
    for n in range(7):
        for labels in itertools.product(("pass", "fail"), repeat=n):
            for scores in itertools.product(values, repeat=n):
                assert hr.auc(list(scores), list(labels)) == pytest.approx(brute_auc(scores, labels), abs=1e-12)


def test_auc_equals_the_pairwise_definition_on_random_larger_cases():
    rng = random.Random(3)
    for _ in range(200):
        n = rng.randint(2, 60)
        scores = [round(rng.random(), rng.choice((1, 2, 6))) for _ in range(n)]
        labels = [rng.choice(("pass", "fail")) for _ in range(n)]
        assert hr.auc(scores, labels) == pytest.approx(brute_auc(scores, labels), abs=1e-12)


def test_auc_refuses_mismatched_lengths():
    with pytest.raises(ValueError, match="2 scores for 1 labels"):
        hr.auc([0.1, 0.2], ["pass"])


# ---------------------------------------------------------------- shares, verdict, message


@pytest.mark.parametrize("scores, want", [([], None), ([0.5], 1.0), ([0.499999], 0.0), ([0.9, 0.1, 0.5, 0.2], 0.5)])
def test_pass_share_counts_the_greedy_pass_verdicts(scores, want):
    assert hr.pass_share(scores) == want


@pytest.mark.parametrize("value, want", [
    (None, None), (0.5, False), (0.59, False), (0.41, False), (0.6, True), (0.95, True), (0.4, False), (0.1, False),
])
def test_only_a_ranking_in_the_labels_direction_is_separation(value, want):
    assert hr.separates(value, 0.6) is want


def test_min_auc_of_one_half_counts_everything_measured_as_separation():
    assert hr.separates(0.5, 0.5) is True


@pytest.mark.parametrize("auc_value, share, labels, words", [
    (0.4729, 0.0, {"pass": 24, "fail": 24},
     "AUC 0.47 on 48 tickets: the judge's verdicts do not depend on the tickets (it says fail to 100%); "
     "no guidance rule is likely to help; try a larger model"),
    (0.52, 0.75, {"pass": 24, "fail": 24},
     "AUC 0.52 on 48 tickets: the judge's verdicts do not depend on the tickets (it says pass to 75%); "
     "no guidance rule is likely to help; try a larger model"),
    (0.81, 0.5, {"pass": 24, "fail": 24}, "AUC 0.81 on 48 tickets: the judge separates the labels; rules can move it"),
    (0.34, 0.0, {"pass": 24, "fail": 24},
     "AUC 0.34 on 48 tickets: the judge ranks the labels the wrong way round, favouring pass on the fail tickets "
     "(it says fail to 100%); no guidance rule is likely to help; try a larger model"),
    (None, 0.0, {"pass": 0, "fail": 48},
     "judge headroom not measured on 48 tickets: no judged ticket labelled pass (the AUC needs both labels)"),
    (None, None, {"pass": 0, "fail": 0},
     "judge headroom not measured on 48 tickets: no judged ticket labelled pass or fail (the AUC needs both labels)"),
])
def test_message(auc_value, share, labels, words):
    assert hr.message(auc_value=auc_value, tickets=48, share=share, labels=labels, min_auc=0.6) == words


def test_report_fields_and_rounding():
    rows = [{"key": "a", "label": "pass", "p_pass": 0.2}, {"key": "b", "label": "fail", "p_pass": 0.1},
            {"key": "c", "label": "fail", "p_pass": 0.3}]
    doc = hr.report(rows, min_auc=0.6, dropped=2, guidance_hash="g")
    assert list(doc) == ["auc", "tickets", "dropped", "pass_share", "labels", "mean_p_pass", "min_auc", "separates",
                         "message", "guidance_hash", "per_ticket"]
    assert doc["auc"] == 0.5 and doc["tickets"] == 3 and doc["dropped"] == 2 and doc["pass_share"] == 0.0
    assert doc["labels"] == {"pass": 1, "fail": 2} and doc["mean_p_pass"] == 0.2  # 0.6000000000000001 / 3 rounded
    assert doc["separates"] is False and doc["per_ticket"] == rows
    empty = hr.report([], min_auc=0.6, dropped=0, guidance_hash="g")
    assert (empty["auc"], empty["pass_share"], empty["mean_p_pass"], empty["separates"]) == (None,) * 4


@pytest.mark.parametrize("entry, line", [
    (None, None),
    ({"auc": 0.4729, "tickets": 48, "pass_share": 0.0, "separates": False},
     "  judge headroom: AUC 0.47 on 48 tickets; cannot separate the labels: no edit expected"),
    ({"auc": 0.9, "tickets": 40, "pass_share": 0.5, "separates": True},
     "  judge headroom: AUC 0.90 on 40 tickets; separates the labels: rules can move it"),
    ({"auc": None, "tickets": 3, "pass_share": 0.0, "separates": None},
     "  judge headroom: not measured on 3 tickets (one label missing)"),
])
def test_summary_line(entry, line):
    assert hr.summary_line({"judge_headroom": entry}) == line


# ---------------------------------------------------------------- the sample


def test_the_sample_is_balanced_in_key_order_and_seeded_by_the_run_seed():
    pool = tickets_of("p" * 30 + "f" * 20)
    sample = hr.sample_tickets(pool, 10, seed=7)
    assert [t.label for t in sample].count("pass") == 5 and len(sample) == 5 + 5
    assert [t.key for t in sample] == sorted(t.key for t in sample)
    assert hr.sample_tickets(list(reversed(pool)), 10, seed=7) == sample  # the input order does not matter
    assert hr.sample_tickets(pool, 10, seed=8) != sample
    assert hr.sample_tickets(pool, 10, seed=7) == sample


@pytest.mark.parametrize("labels, n, want", [
    ("p" * 30 + "f" * 3, 10, (7, 3)),  # the pass side tops up a short fail side
    ("p" * 2 + "f" * 30, 10, (2, 8)),  # and the other way round
    ("p" * 4 + "f" * 3, 10, (4, 3)),  # fewer tickets than asked: all of them
    ("p" * 5 + "f" * 5, 7, (4, 3)),  # an odd size: the extra one is a pass ticket
    ("f" * 9, 4, (0, 4)),
    ("", 4, (0, 0)),
])
def test_the_sample_sizes(labels, n, want):
    sample = hr.sample_tickets(tickets_of(labels), n, seed=1)
    assert (sum(t.label == "pass" for t in sample), sum(t.label == "fail" for t in sample)) == want


# ---------------------------------------------------------------- end to end


def test_the_check_is_counted_in_the_runners_rollout_time_and_per_worker_tickets(tmp_path):
    """The sample goes through the rollout runner's chunks: its tickets are credited to the
    worker that scored them and its gather is rollout time, like any rollout's."""
    from stageb_pool import Pool
    from stageb_pool.search.rollout import RolloutRunner
    from stageb_pool.stageb.prompts import load_profile

    with Pool(fake_factory(), "cpu:2") as pool:
        runner = RolloutRunner(pool, load_profile("generic", mission=MISSION), chunk_size=4)
        doc = hr.run_headroom(runner, tickets=tickets_of("pf" * 10), guidance={"G0": "Look for rust."},
                              settings=hr.HeadroomSettings(seed=1, tickets=12, min_auc=0.6, max_prompt_tokens=None),
                              run_dir=tmp_path,
                              log=logging.getLogger("test.headroom"))
        assert doc["tickets"] == 12
        assert [runner.tickets_by_rank.get(rank, 0) for rank in (0, 1)] == [4 * n for n in pool.stats.items]
        assert sum(runner.tickets_by_rank.values()) == 12 and runner.rollout_seconds > 0



def audit(tmp_path, gpus, run_name, *, factory, overrides=()) -> Path:
    config_path = Path(tmp_path) / "config.yaml"
    if not config_path.exists():
        audit_inputs(tmp_path, n_tickets=30, model="tiny")
    cfg = load_config(config_path, [f"output.run_name={run_name}", "headroom.tickets=12", *overrides])
    assert run_job(cfg, gpus, audit=True, engine_factory=factory, argv=["test"]) == 0
    return Path(cfg.output.root) / MISSION / run_name


def test_a_judge_that_says_fail_to_everything_is_reported_identically_on_1_and_2_workers(tmp_path, caplog):
    caplog.set_level(logging.INFO, logger="stageb_pool")
    one = audit(tmp_path, "cpu:1", "one", factory=fake_factory(p_pass=0.008))
    two = audit(tmp_path, "cpu:2", "two", factory=fake_factory(p_pass=0.008))
    data = (one / HEADROOM.name).read_bytes()
    assert data == (two / HEADROOM.name).read_bytes()
    doc = json.loads(data)
    assert (doc["auc"], doc["tickets"], doc["pass_share"], doc["separates"]) == (0.5, 12, 0.0, False)
    assert doc["labels"] == {"pass": 6, "fail": 6} and doc["mean_p_pass"] == 0.008
    assert doc["message"] == ("AUC 0.50 on 12 tickets: the judge's verdicts do not depend on the tickets (it says "
                              "fail to 100%); no guidance rule is likely to help; try a larger model")
    assert [r["key"] for r in doc["per_ticket"]] == sorted(r["key"] for r in doc["per_ticket"])
    warned = [r for r in caplog.records if r.levelno == logging.WARNING and "judge headroom" in r.getMessage()]
    assert len(warned) == 2 and doc["message"] in warned[0].getMessage()
    summary = json.loads((one / "summary.json").read_text())
    assert summary["judge_headroom"] == {"auc": 0.5, "tickets": 12, "pass_share": 0.0, "separates": False}
    assert summary["timing"]["headroom_s"] >= 0  # volatile, like every timing


def test_dropped_tickets_are_counted_and_left_out(tmp_path):
    keys = [f"{r['group_id']}::{r['label']}" for r in missing_part_records(30)]
    run = audit(tmp_path, "cpu:1", "drops", factory=fake_factory(drop_keys=keys[:15]))
    doc = json.loads((run / HEADROOM.name).read_text())
    assert doc["tickets"] + doc["dropped"] == 12 and doc["dropped"] > 0
    assert not {r["key"] for r in doc["per_ticket"]} & set(keys[:15])


def test_the_check_can_be_switched_off(tmp_path):
    run = audit(tmp_path, "cpu:1", "off", factory=fake_factory(), overrides=["headroom.enabled=false"])
    assert not (run / HEADROOM.name).exists()
    assert json.loads((run / "summary.json").read_text())["judge_headroom"] is None


def test_a_judge_that_reads_the_tickets_separates_and_the_search_summary_says_so(tmp_path, caplog, capsys):
    """The scripted judge's P(pass) falls with rust and crack, the features that make a ticket
    fail: AUC 1. The search logs the message as information and prints the summary line."""
    caplog.set_level(logging.INFO, logger="stageb_pool")
    engines: list = []
    cfg_path = search_inputs(tmp_path / "in", out=str(tmp_path / "out"), run_name="sep", epochs=1)
    cfg = load_config(cfg_path, ["headroom.tickets=20"])
    run_job(cfg, "cpu:1", debug=True, engine_factory=se.scripted_factory(engines))
    run = tmp_path / "out" / MISSION / "sep"
    doc = json.loads((run / HEADROOM.name).read_text())
    assert (doc["auc"], doc["tickets"], doc["separates"]) == (1.0, 20, True)
    assert doc["labels"] == {"pass": 10, "fail": 10}
    assert doc["message"] == "AUC 1.00 on 20 tickets: the judge separates the labels; rules can move it"
    said = [r for r in caplog.records if doc["message"] in r.getMessage()]
    assert [r.levelno for r in said] == [logging.INFO]
    assert json.loads((run / "summary.json").read_text())["judge_headroom"]["separates"] is True
    assert "  judge headroom: AUC 1.00 on 20 tickets; separates the labels: rules can move it" in capsys.readouterr().out


def test_the_tiny_model_check_is_byte_identical_on_1_and_2_workers(tmp_path):
    """The real engine (the tiny model) through forked workers: chunks of 4, 12 tickets; one
    worker seeing every core against two pinned to one core (the thread count follows neither)."""
    with pinned(CORES):
        one = audit(tmp_path, "cpu:1", "one", factory=None)
    with pinned(ONE_CORE):
        two = audit(tmp_path, "cpu:2", "two", factory=None)
    data = (one / HEADROOM.name).read_bytes()
    assert data == (two / HEADROOM.name).read_bytes()
    doc = json.loads(data)
    assert doc["tickets"] == 12 and all(0 <= r["p_pass"] <= 1 for r in doc["per_ticket"])


# ---------------------------------------------------------------- config


@pytest.mark.parametrize("override, key", [
    ("headroom.tickets=1", "headroom.tickets"), ("headroom.tickets=100001", "headroom.tickets"),
    ("headroom.min_auc=0.4", "headroom.min_auc"), ("headroom.min_auc=1.5", "headroom.min_auc"),
    ("headroom.enabled=1", "headroom.enabled"), ("headroom.sample=3", "headroom.sample"),
])
def test_bad_headroom_settings_are_located_errors(tmp_path, override, key):
    from stageb_pool.stageb.errors import InputError

    audit_inputs(tmp_path)
    with pytest.raises(InputError) as info:
        load_config(tmp_path / "config.yaml", [override])
    assert key in str(info.value)


def test_the_headroom_section_is_not_part_of_the_run_identity(tmp_path):
    """The check only reports, so changing it never blocks a --resume."""
    from stageb_pool.app.identity import run_identity
    from stageb_pool.app.plan import load_inputs

    audit_inputs(tmp_path)
    base = load_config(tmp_path / "config.yaml", ["mode=search"])
    changed = load_config(tmp_path / "config.yaml", ["mode=search", "headroom.enabled=false", "headroom.tickets=5"])
    assert run_identity(base, load_inputs(base)).config_hash == run_identity(changed, load_inputs(changed)).config_hash
