"""The two-line parser, the vote and the metrics (upstream 2.3 / 2.4), as tables."""

from __future__ import annotations

import msgspec
import pytest

from stageb_pool.stageb import verdicts as verdicts_module
from stageb_pool.stageb.prompts import VerdictVocab, load_profile
from stageb_pool.stageb.verdicts import (
    Parsed,
    TicketTally,
    compute_metrics,
    majority_reason,
    parse_verdict,
    reason_counts,
    ticket_stats,
)

ZH = load_profile("bbu_rru", mission="BBU接地线检查").verdict
EN = load_profile("generic", mission="demo").verdict

# (text, vocab, expected verdict, expected reason); None verdict = invalid sample.
PARSE_TABLE = [
    # the plain protocol, both vocabularies
    ("Verdict: 通过\nReason: 螺丝齐全", ZH, "pass", "螺丝齐全"),
    ("Verdict: 不通过\nReason: 螺丝松动", ZH, "fail", "螺丝松动"),
    ("Verdict: 未通过\nReason: 缺失", ZH, "fail", "缺失"),
    ("Verdict: 通过。\nReason: ok", ZH, "pass", "ok"),
    ("Verdict: 不通过。\nReason: ok", ZH, "fail", "ok"),
    ("Verdict: 通過。\nReason: ok", ZH, "pass", "ok"),
    # upstream's grammar: no other trailing punctuation, no inner tab, nothing doubled
    ("Verdict: pass.\nReason: ok", ZH, None, None),
    ("Verdict: 通过.\nReason: ok", ZH, None, None),
    ("Verdict: 未通过。\nReason: ok", ZH, None, None),
    ("Verdict: 通过。。\nReason: ok", ZH, None, None),
    ("Verdict: pa\tss\nReason: ok", ZH, None, None),
    ("Verdict: Fail.\nReason: ok", EN, None, None),
    ("Verdict: p a s s\nReason: ok", EN, "pass", "ok"),
    ("Verdict: 不\t通过\nReason: ok", ZH, "fail", "ok"),
    ("Verdict: pass\nReason: ok", ZH, "pass", "ok"),
    ("Verdict: FAIL\nReason: ok", ZH, "fail", "ok"),
    ("Verdict: 通過\nReason: 繁体", ZH, "pass", "繁体"),
    ("Verdict: pass\nReason: all bolts present", EN, "pass", "all bolts present"),
    ("Verdict: fail\nReason: bolt missing", EN, "fail", "bolt missing"),
    ("Verdict: Pass\nReason: fine", EN, "pass", "fine"),
    ("Verdict: 通过\nReason: x", EN, None, None),  # not in the English vocabulary
    # spaces inside and around the verdict word are removed
    ("Verdict:  不 通 过 \nReason: 空格", ZH, "fail", "空格"),
    ("Verdict:\u3000通过\nReason: 全角空格", ZH, "pass", "全角空格"),
    # full-width colon, case of the field names
    ("Verdict：通过\nReason：全角冒号", ZH, "pass", "全角冒号"),
    ("VERDICT: fail\nREASON: caps", EN, "fail", "caps"),
    ("verdict: pass\nreason: lower", EN, "pass", "lower"),
    # split at the first colon only: the reason keeps its own colons
    ("Verdict: 通过\nReason: Image1: 完整; 总结: 通过", ZH, "pass", "Image1: 完整; 总结: 通过"),
    # blank lines between or around the two lines are tolerated
    ("\n\nVerdict: 通过\n\n\nReason: 空行\n\n", ZH, "pass", "空行"),
    ("Verdict: pass\r\nReason: crlf\r\n", EN, "pass", "crlf"),
    ("   Verdict: pass   \n   Reason: indented   ", EN, "pass", "indented"),
    # the word "assistant" inside the reason is kept (upstream cut there)
    ("Verdict: pass\nReason: the assistant saw every bolt", EN, "pass", "the assistant saw every bolt"),
    ("Verdict: fail\nReason: Assistant: cable missing", EN, "fail", "Assistant: cable missing"),
    # a leading assistant marker is removed
    ("assistant\nVerdict: 通过\nReason: 标记", ZH, "pass", "标记"),
    ("Assistant: Verdict: pass\nReason: marker", EN, "pass", "marker"),
    ("Assistant:\nVerdict: pass\nReason: marker", EN, "pass", "marker"),
    ("<|im_start|>assistant\nVerdict: fail\nReason: marker", EN, "fail", "marker"),
    ("<|im_start|>Assistant:Assistant: Verdict: fail\nReason: marker", EN, "fail", "marker"),
    # upstream's markers are case-sensitive: another spelling is a third line
    ("  ASSISTANT：\nVerdict: fail\nReason: marker", EN, None, None),
    # a marker that is not leading is just text: three lines -> invalid
    ("Verdict: pass\nassistant\nReason: late marker", EN, None, None),
    # third-state words in the reason are accepted (upstream smoke test)
    ("Verdict: 通过\nReason: 通过但待定，需复核", ZH, "pass", "通过但待定，需复核"),
    # invalid: wrong number of lines
    ("Verdict: pass", EN, None, None),
    ("", EN, None, None),
    ("   \n  ", EN, None, None),
    ("Verdict: pass\nReason: ok\nextra line", EN, None, None),
    ("Verdict: pass\nReason: ok\nVerdict: fail", EN, None, None),
    # invalid: wrong line order or field names
    ("Reason: ok\nVerdict: pass", EN, None, None),
    ("Decision: pass\nReason: ok", EN, None, None),
    ("Verdict: pass\nBecause: ok", EN, None, None),
    ("**Verdict**: pass\nReason: ok", EN, None, None),
    # invalid: missing colon, unknown or third-state verdict, empty reason
    ("Verdict pass\nReason: ok", EN, None, None),
    ("Verdict: pass\nReason ok", EN, None, None),
    ("Verdict: 待定\nReason: 看不清", ZH, None, None),
    ("Verdict: 通过/不通过\nReason: 两可", ZH, None, None),
    ("Verdict: maybe\nReason: unsure", EN, None, None),
    ("Verdict:\nReason: no word", EN, None, None),
    ("Verdict: pass\nReason:", EN, None, None),
    ("Verdict: pass\nReason:    ", EN, None, None),
    ("Verdict: 通过\nReason：", ZH, None, None),
    ('{"verdict": "pass", "reason": "json"}', EN, None, None),
]


@pytest.mark.parametrize("text,vocab,verdict,reason", PARSE_TABLE)
def test_parse_table(text, vocab, verdict, reason):
    parsed = parse_verdict(text, vocab)
    assert (parsed.verdict, parsed.reason) == (verdict, reason)
    assert (parsed.error is None) == (verdict is not None)


def test_parse_none_text_is_invalid():
    assert parse_verdict(None, EN).verdict is None


def test_vocabulary_comes_from_the_profile():
    vocab = VerdictVocab(pass_words=["OK"], fail_words=["NG"], pass_text="OK", fail_text="NG")
    assert parse_verdict("Verdict: ok\nReason: r", vocab).verdict == "pass"
    assert parse_verdict("Verdict: n g\nReason: r", vocab).verdict == "fail"
    assert parse_verdict("Verdict: ng.\nReason: r", vocab).verdict is None
    assert parse_verdict("Verdict: pass\nReason: r", vocab).verdict is None


@pytest.mark.parametrize("word, verdict", [
    ("pass.", "pass"), ("通过.", "pass"), ("未通过。", "fail"), ("通过。。", "pass"), ("pa\tss", "pass"),
    ("pass!", None),
])
def test_loose_words_are_an_explicit_profile_option(word, verdict):
    strict = VerdictVocab(pass_words=["通过", "pass"], fail_words=["不通过", "未通过"], pass_text="通过",
                          fail_text="不通过")
    loose = msgspec.structs.replace(strict, loose=True)
    assert parse_verdict(f"Verdict: {word}\nReason: r", strict).verdict is None
    assert parse_verdict(f"Verdict: {word}\nReason: r", loose).verdict == verdict


def test_error_says_why():
    assert "3" in parse_verdict("Verdict: pass\nReason: ok\nmore", EN).error
    assert parse_verdict("Verdict: pass\nReason:", EN).error == "empty reason"
    assert "maybe" in parse_verdict("Verdict: maybe\nReason: r", EN).error


# ----------------------------------------------------------------------------- vote

def P(*verdicts):
    return [Parsed(v, None if v is None else f"r-{v}") for v in verdicts]


# (verdicts, gt, majority, agreement, difficulty, hard_wrong, counts (P, F, I))
VOTE_TABLE = [
    (["pass"], "pass", "pass", 1.0, 0.0, 0.0, (1, 0, 0)),
    (["fail"], "pass", "fail", 1.0, 0.0, 1.0, (0, 1, 0)),
    (["pass", "fail"], "pass", "fail", 0.5, 0.5, 0.5, (1, 1, 0)),  # tie -> fail
    (["pass", "fail"], "fail", "fail", 0.5, 0.5, 0.0, (1, 1, 0)),
    (["pass", "fail", None], "pass", "fail", 0.5, 0.5, 0.5, (1, 1, 1)),  # upstream's verified case
    (["pass", "pass", "fail"], "fail", "pass", 2 / 3, 1 - 2 / 3, 2 / 3, (2, 1, 0)),
    (["pass", None, None], "fail", "pass", 1.0, 0.0, 1.0, (1, 0, 2)),  # invalid samples do not vote
    (["fail", "fail", "pass", "pass", "pass"], "pass", "pass", 0.6, 0.4, 0.0, (3, 2, 0)),
    ([None], "pass", None, 0.0, 0.5, 0.0, (0, 0, 1)),  # all invalid
    ([None, None, None], "fail", None, 0.0, 0.5, 0.0, (0, 0, 3)),
    ([], "pass", None, 0.0, 0.5, 0.0, (0, 0, 0)),
]


@pytest.mark.parametrize("verdicts,gt,majority,agreement,difficulty,hard_wrong,counts", VOTE_TABLE)
def test_vote_table(verdicts, gt, majority, agreement, difficulty, hard_wrong, counts):
    s = ticket_stats("g::" + gt, gt, P(*verdicts))
    assert s.majority == majority
    assert s.agreement == pytest.approx(agreement)
    assert s.difficulty == pytest.approx(difficulty)
    assert s.hard_wrong == pytest.approx(hard_wrong)
    assert (s.pass_count, s.fail_count, s.invalid_count) == counts
    assert s.total_samples == len(verdicts)
    assert s.verdicts == verdicts
    assert s.correct == (majority == gt)


def test_stats_are_json_encodable():
    s = ticket_stats("g::pass", "pass", P("pass", None))
    assert msgspec.json.decode(msgspec.json.encode(s), type=type(s)) == s


ANSWERS = ("Verdict: pass\nReason: tidy", "Verdict: fail\nReason: a part is missing", "no verdict at all")


@pytest.mark.parametrize("texts", [ANSWERS[:1], ANSWERS[1:2], ANSWERS, ANSWERS[::-1], (), ANSWERS[2:] * 2])
@pytest.mark.parametrize("gt", ["pass", "fail"])
def test_a_tally_is_the_vote_of_the_parsed_answers(texts, gt):
    tally = TicketTally(EN)
    want = ticket_stats("k", gt, [parse_verdict(t, EN) for t in texts])
    assert tally.stats("k", gt, texts) == want
    assert tally.stats("k", gt, texts) is tally.stats("k", gt, tuple(texts))  # tallied once


def test_a_tally_parses_each_answer_once_and_tells_tickets_labels_and_answers_apart(monkeypatch):
    parsed = []
    real = verdicts_module.parse_verdict
    monkeypatch.setattr(verdicts_module, "parse_verdict", lambda text, vocab: parsed.append(text) or real(text, vocab))
    tally = TicketTally(EN)
    a = tally.stats("a", "pass", ANSWERS[:2])
    assert tally.stats("b", "pass", ANSWERS[:2]).key == "b"  # another ticket, the same answers
    assert (a.hard_wrong, tally.stats("a", "fail", ANSWERS[:2]).hard_wrong) == (0.5, 0.0)  # another label
    assert tally.stats("a", "pass", ANSWERS[1:2]).majority == "fail"  # other answers
    assert tally.stats("a", "pass", ANSWERS[:2]) is a
    assert sorted(parsed) == sorted(ANSWERS[:2])
    with pytest.raises(AttributeError):  # shared by many rollouts: nobody may change one
        a.majority = "pass"


def test_a_full_tally_starts_over(monkeypatch):
    tally = TicketTally(EN, limit=2)
    first = tally.stats("a", "pass", ANSWERS[:1])
    tally.stats("b", "pass", ANSWERS[:1])
    tally.stats("c", "pass", ANSWERS[:1])  # the third entry: the memo started over
    again = tally.stats("a", "pass", ANSWERS[:1])
    assert again == first and again is not first


# ----------------------------------------------------------------------------- metrics

def T(gt, majority):
    verdicts = [] if majority is None else [majority]
    return ticket_stats(f"x::{gt}", gt, P(*verdicts))


def test_metrics_hand_computed():
    stats = [
        T("pass", "pass"), T("pass", "pass"), T("pass", "pass"),  # tp 3
        T("pass", "fail"), T("pass", None),                         # fn 2 (one all-invalid)
        T("fail", "fail"), T("fail", "fail"),                       # tn 2
        T("fail", "pass"), T("fail", None), T("fail", None),        # fp 3 (two all-invalid)
    ]
    m = compute_metrics(stats)
    assert (m.n, m.tp, m.fn, m.tn, m.fp) == (10, 3, 2, 2, 3)
    assert m.acc == pytest.approx(0.5)
    assert m.fn_rate == pytest.approx(0.2)
    assert m.fp_rate == pytest.approx(0.3)
    assert m.fn_over_tp == pytest.approx(2 / 3)
    assert m.fp_over_tp == pytest.approx(1.0)
    assert m.false_release_rate == pytest.approx(3 / 6)
    assert m.false_block_rate == pytest.approx(2 / 5)


def test_metrics_accept_a_dict_of_stats():
    stats = {s.key + str(i): s for i, s in enumerate([T("pass", "pass"), T("fail", "pass")])}
    assert compute_metrics(stats) == compute_metrics(list(stats.values()))


# (stats, fn_over_tp, fp_over_tp, false_release_rate, false_block_rate)
RATIO_TABLE = [
    ([], 0.0, 0.0, 0.0, 0.0),                                  # n = 0: every rate 0
    ([T("fail", "fail")], 0.0, 0.0, 0.0, 0.0),                  # tp = fn = fp = 0
    ([T("pass", "fail")], None, 0.0, 0.0, 1.0),                 # tp = 0 < fn: infinite -> None
    ([T("fail", "pass")], 0.0, None, 1.0, 0.0),                 # tp = 0 < fp
    ([T("fail", None), T("pass", None)], None, None, 1.0, 1.0),
    ([T("pass", "pass"), T("pass", "fail")], 1.0, 0.0, 0.0, 0.5),
]


@pytest.mark.parametrize("stats,fn_tp,fp_tp,frr,fbr", RATIO_TABLE)
def test_metric_ratios(stats, fn_tp, fp_tp, frr, fbr):
    m = compute_metrics(stats)
    assert (m.fn_over_tp, m.fp_over_tp) == (fn_tp, fp_tp)
    assert (m.false_release_rate, m.false_block_rate) == (frr, fbr)


def test_infinite_ratio_is_json_null():
    m = compute_metrics([T("pass", "fail")])
    assert b'"fn_over_tp":null' in msgspec.json.encode(m)


def test_metrics_empty_acc_is_zero():
    m = compute_metrics([])
    assert (m.n, m.acc, m.fn_rate, m.fp_rate) == (0, 0.0, 0.0, 0.0)


# ----------------------------------------------------------------------------- reasons

def R(*pairs):
    return [Parsed(v, r) for v, r in pairs]


def test_majority_reason_is_most_common_among_majority_voters():
    s = ticket_stats("k", "pass", R(("fail", "b"), ("pass", "x"), ("fail", "a"), ("fail", "a"), (None, None)))
    assert majority_reason(s) == "a"


def test_majority_reason_ties_go_to_first_seen():
    s = ticket_stats("k", "pass", R(("fail", "b"), ("fail", "a"), ("pass", "p")))
    assert majority_reason(s) == "b"


def test_majority_reason_none_when_all_invalid():
    assert majority_reason(ticket_stats("k", "pass", R((None, None), (None, None)))) is None


def test_reason_counts_top_and_order():
    s = ticket_stats("k", "pass", R(
        ("pass", "c"), ("pass", "a"), ("fail", "b"), ("pass", "a"), ("pass", "d"), ("pass", "e"),
        ("pass", "f"), ("pass", "e"), (None, None), ("pass", "g"),
    ))
    assert reason_counts(s) == [
        {"reason": "a", "count": 2}, {"reason": "e", "count": 2},
        {"reason": "c", "count": 1}, {"reason": "d", "count": 1}, {"reason": "f", "count": 1},
    ]
    assert reason_counts(s, top=1) == [{"reason": "a", "count": 2}]


@pytest.mark.parametrize("pairs, expected", [
    # upstream counts only the reasons of the samples that voted with the majority
    ([("pass", "A"), ("fail", "B"), ("fail", "C")], [{"reason": "B", "count": 1}, {"reason": "C", "count": 1}]),
    ([("fail", "B"), ("fail", "B"), ("pass", "A"), (None, None)], [{"reason": "B", "count": 2}]),
    ([(None, None), (None, None)], []),
])
def test_reason_counts_are_the_majority_voters_reasons(pairs, expected):
    assert reason_counts(ticket_stats("k", "pass", R(*pairs))) == expected
