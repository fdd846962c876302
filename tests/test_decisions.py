"""Every iteration explains itself (search/decisions.py): the decision row's counts and
reasons, the terminal line, and the summary's sentence, on hand-made outcomes."""

import msgspec
import pytest

from stageb_pool.search import decisions
from stageb_pool.search.iteration import Evaluated, IterationOutcome
from stageb_pool.artifact_rows import ProposerAnswerRow
from stageb_pool.stageb.gate import GateResult
from stageb_pool.stageb.guidance import Guidance, Operation
from stageb_pool.stageb.proposer import Candidate
from stageb_pool.stageb.verdicts import Metrics

G = Guidance(step=2, updated_at="t", experiences={"G0": "Check the mount.", "G1": "If blurry, judge fail."})


def metrics(acc: float, n: int = 40) -> Metrics:
    return Metrics(n=n, acc=acc, tp=0, fp=0, fn=0, tn=0, fn_rate=0.0, fp_rate=0.1, fn_over_tp=None, fp_over_tp=None,
                   false_release_rate=0.1, false_block_rate=0.0)


def evaluated(index: int, cid: str, rer: float, reason: str | None, applied: bool = False) -> Evaluated:
    cand = Candidate(candidate_id=cid, op="upsert", text="x", rationale=None, signature="x", target_signature=None,
                     target_signatures=[], source="proposer", operation=Operation(op="upsert", text="x"))
    gate = GateResult(passed=reason is None, reason=reason, n_common=40, relative_error_reduction=rer,
                      changed_fraction=0.1, bootstrap_prob=0.5, base_acc=0.4, cand_acc=0.4 + rer / 10,
                      base_fp_rate=0.1, cand_fp_rate=0.1, d_acc=0.0, d_fp_rate=0.0, regression_count=0)
    after = msgspec.structs.replace(G, step=3, experiences={**G.experiences, "G2": cid})
    return Evaluated(index=index, candidate=cand, guidance=after if applied else G, reflection_id="r", gate=gate,
                     train_metrics=metrics(0.4 + rer / 10), decision="promoted" if applied else "rejected",
                     reason=reason, applied=applied)


def outcome(candidates=(), *, answer=None, rejections=(), ablation_note=None) -> IterationOutcome:
    candidates = list(candidates)
    applied = next((c for c in candidates if c.applied), None)
    return IterationOutcome(iteration=2, guidance=G, pool_keys=["a", "b"], base_metrics=metrics(0.4),
                            eval_base_metrics=metrics(0.5, 24), example_keys=["a"], candidates=candidates,
                            applied=applied, rejected_ids=[], proposers=[answer] if answer is not None else [],
                            rejections=list(rejections),
                            ablation_note=ablation_note)


PARSED = ProposerAnswerRow(iteration=2, mission="m", constrained=True, parsed=True, operations=3,
                           finish_reason="stop", text="{}")
TRUNCATED = ProposerAnswerRow(iteration=2, mission="m", constrained=False, parsed=False, finish_reason="length",
                              error="truncated at proposer_max_new_tokens=200", text="{")


@pytest.mark.parametrize("reason, kind", [
    ("duplicate of existing rule G3", "duplicate of existing rule"),
    ("third-state wording 'uncertain'", "third-state wording"),
    ("target signature not found: 'abc'", "target signature not found"),
    ("no binary outcome (needs pass/fail)", "no binary outcome (needs pass/fail)"),
    ("conflicts with scaffold S1", "conflicts with scaffold"),
    ("cannot apply: unknown key G9", "cannot apply"),
    ("previously rejected candidate", "previously rejected candidate"),
])
def test_rejections_count_by_kind(reason, kind):
    assert decisions.reason_kind(reason) == kind


def test_an_accepted_edit_names_its_candidate_and_every_evaluated_one_has_a_reason():
    out = outcome([evaluated(1, "upsert:a", 0.02, "RER 0.020 < 0.050"), evaluated(2, "upsert:b", 0.3, None, True)],
                  answer=PARSED, rejections=["duplicate of existing rule G1"])
    row = decisions.iteration_row(out, "m")
    assert (row.decision, row.accepted_candidate, row.guidance_step, row.guidance_step_after) == (
        "accepted", "upsert:b", 2, 3)
    assert (row.proposer_calls, row.proposer_parsed) == (1, 1)
    assert (row.candidates_proposed, row.candidates_evaluated, row.candidates_rejected) == (
        3, 2, {"duplicate of existing rule": 1})
    assert row.reasons == ["cand1 upsert:a: RER 0.020 < 0.050", "cand2 upsert:b: accepted"]
    assert row.best_candidate["candidate_id"] == "upsert:b" and row.baseline["train"]["acc"] == 0.4
    line = decisions.iteration_line(row)
    assert line.startswith("iteration 2: proposer answer parsed; 3 proposed, 1 rejected (duplicate of existing rule)")
    assert "2 evaluated: accepted upsert:b (RER 0.300)" in line and line.endswith("train acc 0.400 -> 0.430")


def test_a_passing_candidate_that_lost_to_a_better_one_says_so():
    out = outcome([evaluated(1, "upsert:a", 0.2, None), evaluated(2, "upsert:b", 0.3, None, True)], answer=PARSED)
    assert decisions.iteration_row(out, "m").reasons[0] == (
        "cand1 upsert:a: passed the gate, but another candidate had a larger RER")


def test_a_rejected_iteration_shows_the_best_candidates_gate_reason():
    out = outcome([evaluated(1, "remove:g1", 0.0, "RER 0.000 < 0.050"), evaluated(2, "upsert:b", 0.021,
                                                                              "RER 0.021 < 0.050")], answer=PARSED)
    row = decisions.iteration_row(out, "m")
    assert row.decision == "rejected" and row.accepted_candidate is None
    assert row.best_candidate["candidate_id"] == "upsert:b" and row.guidance_step_after == 2
    assert "2 evaluated: rejected (RER 0.021 < 0.050)" in decisions.iteration_line(row)


def test_no_candidates_says_why_the_proposer_and_the_ablation_gave_nothing():
    row = decisions.iteration_row(outcome(answer=TRUNCATED, ablation_note="ablation of G1 already rejected earlier "
                                          "in the run"), "m")
    assert row.decision == "no_candidates" and (row.candidates_proposed, row.proposer_parsed) == (0, 0)
    assert row.reasons == ["proposer answer unusable: truncated at proposer_max_new_tokens=200",
                           "ablation of G1 already rejected earlier in the run"]
    assert "no candidates (proposer answer unusable: truncated" in decisions.iteration_line(row)


def test_no_candidates_when_every_operation_was_rejected():
    row = decisions.iteration_row(outcome(answer=PARSED, rejections=["Stage-A summary leak"] * 2 + [
        "no binary outcome (needs pass/fail)"]), "m")
    assert row.reasons == ["all 3 proposer operation(s) rejected: 2 Stage-A summary leak, "
                           "1 no binary outcome (needs pass/fail)"]
    assert row.candidates_proposed == 3 == sum(row.candidates_rejected.values())


def test_no_proposer_call_when_nothing_was_wrong():
    row = decisions.iteration_row(outcome(ablation_note="no learnable rule besides G0 to ablate"), "m")
    assert row.proposer_calls == 0 and row.reasons[0].startswith("no proposer call")
    assert decisions.iteration_line(row).startswith("iteration 2: no proposer call; 0 proposed")


def rows_of(*outs) -> list[dict]:
    return [msgspec.to_builtins(decisions.iteration_row(o, "m")) for o in outs]


def test_the_run_sentence_names_the_condition_that_failed_when_the_rer_passed():
    rows = rows_of(outcome([evaluated(1, "upsert:a", 0.478, "changed fraction 0.400 > 0.300")], answer=PARSED))
    assert "(best: RER 0.478 but changed fraction 0.400 > 0.300)" in decisions.run_sentence(
        rows, edits=0, stop_reason="epochs")


def test_the_run_sentence_names_the_accepted_edits():
    rows = rows_of(outcome([evaluated(1, "upsert:b", 0.3, None, True)], answer=PARSED))
    sentence = decisions.run_sentence(rows, edits=1, stop_reason="epochs")
    assert sentence.startswith("1 edit(s) accepted in 1 iteration(s)") and "upsert:b (iteration 2, RER 0.300)" in sentence


def test_the_run_sentence_without_edits_gives_the_gate_the_proposer_and_the_judge():
    rows = rows_of(outcome([evaluated(1, "upsert:a", 0.021, "RER 0.021 < 0.050")], answer=PARSED),
                   outcome(answer=TRUNCATED))
    sentence = decisions.run_sentence(rows, edits=0, stop_reason="early_stop",
                                      headroom={"auc": 0.47, "separates": False})
    assert sentence == ("No edit accepted in 2 iteration(s): none of the 1 A/B-evaluated candidate(s) passed the "
                        "gate (best: RER 0.021 < 0.050); 1 of 2 proposer answers parsed; the judge cannot separate the labels "
                        "(AUC 0.47), so no rule was expected to help; stopped early.")
    nothing = decisions.run_sentence(rows_of(outcome(answer=TRUNCATED)), edits=0, stop_reason="epochs")
    assert nothing == "No edit accepted in 1 iteration(s): no candidate reached the A/B test (0 of 1 proposer answers parsed)."


@pytest.mark.parametrize("label", ["pass", "fail"])
def test_the_run_sentence_says_that_the_auc_needs_both_labels_when_the_sample_had_one(label):
    # judge_headroom.json of a sample whose tickets all carry one label: no AUC, separates null
    headroom = {"auc": None, "tickets": 8, "pass_share": 1.0 if label == "pass" else 0.0, "separates": None}
    sentence = decisions.run_sentence(rows_of(outcome(answer=TRUNCATED)), edits=0, stop_reason="epochs",
                                      headroom=headroom)
    assert "cannot separate" not in sentence
    assert sentence.endswith("; the judge headroom was not measured (its AUC needs tickets of both labels).")
