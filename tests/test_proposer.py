"""Proposer: signatures, example selection, the request, JSON extraction, every filter."""

from __future__ import annotations

import json
import re

import pytest

from stageb_pool.stageb.guidance import ExperienceMeta, Guidance, Operation, apply_operation
from stageb_pool.stageb.prompts import VerdictVocab
from stageb_pool.stageb.proposer import (
    Candidate,
    ablation_candidates,
    build_proposer_prompt,
    confidently_wrong,
    extract_json,
    normalize_signature,
    parse_candidates,
    proposer_language,
    reflection_id,
    select_examples,
)
from stageb_pool.stageb.text import normalize_spaces
from stageb_pool.stageb.tickets import Ticket
from stageb_pool.stageb.verdicts import TicketStats

ZH = VerdictVocab(pass_words=["通过", "pass"], fail_words=["不通过", "fail"], pass_text="通过", fail_text="不通过")
EN = VerdictVocab(pass_words=["pass"], fail_words=["fail"], pass_text="pass", fail_text="fail")

G1 = "若任一图片中BBU安装螺丝出现不符合，则判定不通过。"
G2 = "若BBU设备与螺丝均显示完整，则判定通过。"
S1 = "若所有图片都无法确认BBU安装螺丝的状态，则判定不通过。"


def guidance(**extra) -> Guidance:
    exp = {"G0": "需同时确认BBU设备与BBU安装螺丝，且螺丝符合要求", "S1": S1, "G1": G1, "G2": G2}
    exp.update(extra)
    return Guidance(step=1, updated_at="2025-01-01T00:00:00+00:00", experiences=exp)


SIG1 = normalize_signature(G1)
SIG2 = normalize_signature(G2)


# --------------------------------------------------------------------------- signatures

@pytest.mark.parametrize(
    "text, expected",
    [
        (G1, "若任一图片中bbu安装螺丝出现不符合则判定不通过"),  # upstream's verified example
        ("如果螺丝缺失，就判定不通过", "若螺丝缺失则判定不通过"),
        ("当 螺丝 缺失 时，判定不通过。", "若螺丝缺失时判定不通过"),
        ("If screws are MISSING, judge fail.", "if screws are missing judge fail"),
        ("  a  (b) [c]—d  ", "a b c d"),
        ("", ""),
        (None, ""),
    ],
)
def test_normalize_signature(text, expected):
    assert normalize_signature(text) == expected


@pytest.mark.parametrize(
    "text, expected",
    [
        ("螺丝  缺失", "螺丝缺失"),
        ("螺丝 ， 缺失", "螺丝，缺失"),
        ("挡 wind 板", "挡wind板"),
        ("设备BB U设备", "设备BBU设备"),
        ("BB U设备", "BBU设备"),
        ("a   b ", "a b"),
    ],
)
def test_normalize_spaces(text, expected):
    assert normalize_spaces(text) == expected


# --------------------------------------------------------------------------- examples

def stats(key, gt, majority, agreement):
    wrong = majority is not None and majority != gt
    return TicketStats(key=key, gt_label=gt, majority=majority, pass_count=0, fail_count=0, invalid_count=0,
                       total_samples=3, agreement=agreement,
                       difficulty=1 - agreement if majority else 0.5,
                       hard_wrong=agreement if wrong else 0.0, verdicts=[], reasons=[])


def ticket(key, label, per_image=None):
    return Ticket(key=key, group_id=key.split("::")[0], mission="M", label=label,
                  per_image=per_image or {"image_1": "a"})


def test_select_examples_order_and_filter():
    rows = [
        stats("a::pass", "pass", "fail", 2 / 3),
        stats("b::pass", "pass", "pass", 1.0),  # correct: never an example
        stats("c::fail", "fail", None, 0.0),  # no majority: not a mismatch
        stats("d::fail", "fail", "pass", 1.0),
        stats("e::pass", "pass", "fail", 2 / 3),  # ties with a: pool order kept
        stats("f::fail", "fail", "pass", 0.5),
    ]
    tickets = {s.key: ticket(s.key, s.gt_label) for s in rows}
    picked = select_examples({s.key: s for s in rows}, tickets, 3)
    assert [s.key for s, _ in picked] == ["d::fail", "a::pass", "e::pass"]
    assert all(t.key == s.key for s, t in picked)
    assert [s.key for s, _ in select_examples(rows, tickets, 10)] == ["d::fail", "a::pass", "e::pass", "f::fail"]
    assert select_examples(rows, tickets, 0) == []
    del tickets["d::fail"]
    assert [s.key for s, _ in select_examples(rows, tickets, 1)] == ["a::pass"]
    # the same order drives the hard-case rows of the audit and the rule search
    assert [s.key for s in confidently_wrong(rows)] == ["d::fail", "a::pass", "e::pass", "f::fail"]


# --------------------------------------------------------------------------- request

def request(examples, g=None, **kw):
    return build_proposer_prompt("SYSTEM", "BBU安装方式检查（正装）", g or guidance(), examples, **kw)


def test_request_layout_matches_upstream_user_message():
    per_image = {f"image_{n}": f"summary {n}" for n in (10, 2, 1)}
    ex = [(stats("k1::fail", "fail", "pass", 1.0), ticket("k1::fail", "fail", per_image)),
          (stats("k2::pass", "pass", "fail", 2 / 3), ticket("k2::pass", "pass"))]
    req = request(ex)
    assert req.system == "SYSTEM"
    head = req.user_head.split("\n")
    assert head[:2] == ["任务: BBU安装方式检查（正装）", "G0: 需同时确认BBU设备与BBU安装螺丝，且螺丝符合要求"]
    assert head[2:5] == ["", "SCAFFOLD (S*):", f"[S1]. {S1}"]
    assert head[5:9] == ["", "EXISTING_RULES (modifiable G*, G0 is non-removable):",
                         f"[G1] signature={SIG1} | {G1}", f"[G2] signature={SIG2} | {G2}"]
    assert head[9] == "" and "错例样本" in head[10] and len(head) == 11
    assert req.examples[0].split("\n") == [
        "样本1: ticket_key=k1::fail; gt_label=fail; baseline_majority=pass; agreement=1.000; difficulty=0.000",
        "stage_a_summaries:",
        "  - image_1: summary 1", "  - image_10: summary 10", "  - image_2: summary 2",  # upstream's string order
    ]
    assert req.examples[1].startswith("样本2: ticket_key=k2::pass; gt_label=pass; baseline_majority=fail; "
                                      "agreement=0.667; difficulty=0.333")
    assert req.user_tail == "请基于上述错例样本提出候选规则。只输出 JSON。"


def test_request_trimming_drops_examples_from_the_end():
    ex = [(stats(f"k{i}::pass", "pass", "fail", 1.0), ticket(f"k{i}::pass", "pass")) for i in range(1, 5)]
    req = request(ex)
    # the worker joins head + examples[:k] + tail with blank lines: numbering stays 1..k
    for k in range(4, 0, -1):
        user = "\n\n".join([req.user_head, *req.examples[:k], req.user_tail])
        assert re.findall(r"样本(\d+):", user) == [str(i) for i in range(1, k + 1)]
        assert f"ticket_key=k{k}::pass" in user and f"ticket_key=k{k + 1}::pass" not in user


def test_request_without_optional_blocks_and_english_labels():
    g = Guidance(step=0, updated_at="2025-01-01T00:00:00+00:00", experiences={"G0": "check screws"})
    req = request([], g=g, lang="en")
    assert req.user_head.split("\n")[:3] == ["Mission: BBU安装方式检查（正装）", "G0: check screws", ""]
    assert "SCAFFOLD" not in req.user_head and "EXISTING_RULES" not in req.user_head
    assert req.examples == [] and req.user_tail.endswith("Output JSON only.")
    assert proposer_language(ZH) == "zh" and proposer_language(EN) == "en"


# --------------------------------------------------------------------------- JSON extraction

OPS = {"operations": [{"op": "upsert", "text": "x"}]}


@pytest.mark.parametrize(
    "text, expected",
    [
        (json.dumps(OPS), OPS),
        ("```json\n" + json.dumps(OPS) + "\n```", OPS),
        ("Sure! Here you go:\n```\n" + json.dumps(OPS) + "\n```\nHope it helps.", OPS),
        ("Here is my answer: " + json.dumps(OPS) + " -- done.", OPS),
        (json.dumps(OPS) + " } ] trailing garbage {", OPS),
        ('{"a": {"b": [1, {"c": "}"}]}, "d": "x\\"y"}', {"a": {"b": [1, {"c": "}"}]}, "d": 'x"y'}),
        ('noise {"broken": } then {"ok": 1}', {"ok": 1}),
        ("[1, 2]", [1, 2]),
        ("```json\n{bad}\n```\n" + json.dumps(OPS), OPS),
    ],
)
def test_extract_json_variants(text, expected):
    assert extract_json(text) == expected


@pytest.mark.parametrize(
    "text, reason",
    [("", "empty"), ("   ", "empty"), ("no json here", "no JSON object"), ('{"a": 1,', "no JSON object"),
     ("{'a': 1}", "no valid JSON"), ('{"a": 1,}', "no valid JSON")],
)
def test_extract_json_failures_say_why(text, reason):
    with pytest.raises(ValueError, match=reason):
        extract_json(text)


# --------------------------------------------------------------------------- validation

def parse(entries, g=None, **kw):
    kw.setdefault("vocab", ZH)
    kw.setdefault("limit", 10)
    obj = entries if isinstance(entries, dict) else {"operations": entries}
    return parse_candidates(obj, g or guidance(), **kw)


GOOD = "若机柜门未关闭，则判定不通过。"


def one(entry, **kw):
    accepted, rejected = parse([entry], **kw)
    return accepted, [r["reason"] for r in rejected]


def test_accepts_a_good_upsert_with_id_and_operation():
    accepted, reasons = one({"op": "upsert", "text": GOOD, "rationale": " 门未关被放行 "}, evidence=["k1", "k2"])
    assert reasons == []
    (c,) = accepted
    assert isinstance(c, Candidate)
    assert c.candidate_id == "upsert:若机柜门未关闭则判定不通过" and c.signature == "若机柜门未关闭则判定不通过"
    assert c.source == "proposer" and c.rationale == "门未关被放行" and c.text == GOOD
    assert c.operation == Operation(op="upsert", key=None, text=GOOD, rationale="门未关被放行",
                                    evidence=["k1", "k2"], merged_from=[])


def test_op_defaults_to_upsert_and_is_case_insensitive():
    assert one({"text": GOOD})[0][0].op == "upsert"
    assert one({"op": " UPSERT ", "text": GOOD})[0][0].op == "upsert"


def test_an_empty_op_is_rejected_as_upstream_does():
    # upstream: op = str(op).strip().lower() unless the key is absent or null, so "" is no
    # operation at all (only a missing or null op means upsert)
    accepted, rejected = parse([{"op": "", "text": GOOD}, {"op": None, "text": "若标签缺失则判定不通过"}])
    assert [c.op for c in accepted] == ["upsert"]
    assert rejected == [{"index": 0, "op": "", "text": GOOD, "reason": "unknown op ''"}]


def test_a_second_identical_upsert_is_a_rejected_duplicate_candidate():
    g = guidance()
    first = apply_operation(g, one({"text": "若螺丝松动则判定不通过。"})[0][0].operation, now="2025-01-01T00:00:00",
                            reflection_id="r")
    accepted, rejected = parse([{"text": "若螺丝松动则判定不通过。"}], g=first)
    assert accepted == [] and [r["reason"] for r in rejected] == [f"duplicate of existing rule G{len(g.experiences) - 1}"]


def test_legacy_rules_form_is_upserts():
    accepted, _ = parse({"rules": [{"text": GOOD, "rationale": "r"}]})
    assert [c.op for c in accepted] == ["upsert"]


@pytest.mark.parametrize(
    "obj, message",
    [
        ({"operations": [], "rules": []}, "both"),
        ({"operations": "x"}, "must be a list"),
        ({"rules": {"a": 1}}, "must be a list"),
        ({"other": 1}, "neither"),
        ([{"op": "upsert", "text": GOOD}], "JSON object"),
    ],
)
def test_malformed_top_level_raises(obj, message):
    with pytest.raises(ValueError, match=message):
        parse_candidates(obj, guidance(), vocab=ZH, limit=3)


@pytest.mark.parametrize(
    "entry, reason",
    [
        ("just a string", "entry is not an object"),
        ({"op": "rewrite", "text": GOOD}, "unknown op 'rewrite'"),
        ({"op": "update", "text": GOOD}, "missing target_signature"),
        ({"op": "remove", "target_signature": "  "}, "missing target_signature"),
        ({"op": "merge", "target_signatures": [SIG1], "text": GOOD}, "merge needs at least 2 target_signatures"),
        ({"op": "merge", "target_signatures": SIG1, "text": GOOD}, "merge needs a target_signatures list"),
        ({"op": "upsert", "text": "  "}, "missing text"),
    ],
)
def test_structural_rejections(entry, reason):
    accepted, reasons = one(entry)
    assert accepted == [] and reasons == [reason]


@pytest.mark.parametrize(
    "text",
    [
        '{"image_1": "BBU设备/显示完整"}',
        "若标签/不符合，则判定不通过",
        "若image_2中螺丝缺失，则判定不通过",
        "若image2中螺丝缺失，则判定不通过",  # upstream's image\\d pattern missed this
        "若 Image 3 螺丝缺失，则判定不通过",
        "若BBU设备/显示完整/螺丝，则判定通过",
        "若类别=螺丝/不符合，则判定不通过",
        "If cabinet/door/complete, judge pass",
        # issue 14 §3 item 3: a Stage-A summary anywhere in the rule, as upstream rejects it
        '<DOMAIN=BBU>, <TASK=SUMMARY>\n{"统计":[]}',
        '若出现 {"统计": []} 则判定不通过',
        '统计=[{"类别": "BBU设备"}] 则判定不通过',
        '若BBU设备缺失则判定不通过。\n{"dataset": "BBU", "统计": [{"类别": "BBU设备"}]}',
        '若BBU设备缺失则判定不通过。\n{"统计": [{"类别": "BBU设备"}]}',
    ],
)
def test_stage_a_leak(text):
    assert one({"text": text})[1] == ["Stage-A summary leak"]


@pytest.mark.parametrize(
    "text, hit",
    [
        ("若螺丝状态不明，则需复核并判定不通过", "复核"),
        ("若螺丝状态不明，则判定待定或不通过", "待定"),
        ("若证据不足，则判定不通过", "证据不足"),
        ("若需要进一步确认，则判定不通过", "需要进一步"),
        ("若螺丝完好则判定通过但记录", "通过但"),
        ("If the door is open, judge fail; manual review otherwise", "manual review"),
        ("If screws are uncertain, judge fail", "uncertain"),
        ("If the label is unreadable, judge fail (Review-Needed)", "review needed"),
    ],
)
def test_third_state_wording(text, hit):
    vocab = EN if text.startswith("If") else ZH
    assert one({"text": text}, vocab=vocab)[1] == [f"third-state wording {hit!r}"]


@pytest.mark.parametrize(
    "text, hit, vocab",
    [
        ("若螺丝齐全，不应判定为不通过", "不应判定为", ZH),
        ("若门已关闭，不要判断为不通过", "不要判断为", ZH),
        ("If screws are present, the ticket should not be judged as fail", "should not be judged", EN),
        ("If the door is closed, do not directly fail the ticket", "do not directly", EN),
    ],
)
def test_hedged_negation(text, hit, vocab):
    assert one({"text": text}, vocab=vocab)[1] == [f"hedged negation {hit!r}"]


def test_binary_outcome_uses_the_profile_vocabulary():
    assert one({"text": "若机柜门未关闭，则记录问题"})[1] == ["no binary outcome (needs 通过/不通过)"]
    assert one({"text": "If the cabinet door is open, judge fail"}, vocab=ZH)[1] == [
        "no binary outcome (needs 通过/不通过)"]
    assert one({"text": "If the cabinet door is open, judge fail."}, vocab=EN)[1] == []
    assert one({"text": "If the cabinet door is open, it fails."}, vocab=EN)[1] == []
    assert one({"text": "If the door is open, note it as bypassed."}, vocab=EN)[1] == [
        "no binary outcome (needs pass/fail)"]
    # no vocabulary given: either language counts
    assert one({"text": "If the cabinet door is open, judge fail"}, vocab=None)[1] == []


def test_scaffold_conflict():
    # S1: 无法确认 ... 不通过; a pass-only rule on the same anchor contradicts it
    assert one({"text": "若无法确认螺丝状态但设备完好，则判定通过"})[1] == ["conflicts with scaffold S1"]
    # same polarity, or mentioning both outcomes, or no shared anchor: fine
    assert one({"text": "若无法确认BBU设备，则判定不通过"})[1] == []
    assert one({"text": "若螺丝齐全则判定通过，若缺失则判定不通过"})[1] == []
    assert one({"text": "若机柜门已关闭，则判定通过"})[1] == []


def test_scaffold_conflict_english():
    g = Guidance(step=0, updated_at="2025-01-01T00:00:00+00:00",
                 experiences={"G0": "check", "S1": "If you cannot confirm the screws, judge fail."})
    accepted, rejected = parse([{"text": "If you cannot confirm the screws but the device is fine, judge pass."}],
                               g=g, vocab=EN)
    assert [r["reason"] for r in rejected] == ["conflicts with scaffold S1"]


def test_brand_dimension():
    assert one({"text": GOOD, "dimension": "Brand"})[1] == ["brand dimension"]
    assert one({"text": GOOD, "dimension": "设备品牌"})[1] == ["brand dimension"]
    assert one({"text": GOOD, "dimension": "安装方式"})[1] == []


def test_duplicate_signatures():
    assert one({"text": "若任一图片中 BBU 安装螺丝出现不符合则判定不通过"})[1] == ["duplicate of existing rule G1"]
    assert one({"text": S1})[1] == ["duplicate of existing rule S1"]
    accepted, rejected = parse([{"text": GOOD}, {"text": "如果机柜门未关闭，就判定不通过"}])
    assert len(accepted) == 1 and [r["reason"] for r in rejected] == ["duplicate signature within the response"]
    assert rejected[0]["index"] == 1 and rejected[0]["op"] is None


def test_update_resolves_target_and_forms_id():
    (c,), _ = one({"op": "update", "target_signature": G1, "text": GOOD})
    assert c.candidate_id == f"update:{SIG1}:若机柜门未关闭则判定不通过"
    assert c.target_signature == SIG1 and c.operation.key == "G1"
    g0 = normalize_signature(guidance().experiences["G0"])
    (c,), _ = one({"op": "update", "target_signature": g0, "text": GOOD})
    assert c.operation.key == "G0"  # G0 may be updated


def test_update_and_remove_target_failures():
    assert one({"op": "update", "target_signature": "不存在的规则", "text": GOOD})[1] == [
        "target signature not found: '不存在的规则'"]
    assert one({"op": "update", "target_signature": S1, "text": GOOD})[1] == ["target S1 is a read-only scaffold rule"]
    assert one({"op": "remove", "target_signature": S1})[1] == ["target S1 is a read-only scaffold rule"]
    g0 = guidance().experiences["G0"]
    assert one({"op": "remove", "target_signature": g0})[1] == ["G0 cannot be removed"]


def test_remove_candidate():
    (c,), _ = one({"op": "remove", "target_signature": G2, "rationale": "误放行"})
    assert c.candidate_id == f"remove:{SIG2}" and c.signature == SIG2 and c.text is None
    assert c.operation == Operation(op="remove", key="G2", text=None, rationale="误放行", evidence=[], merged_from=[])


def test_merge_candidate_and_failures():
    (c,), _ = one({"op": "merge", "target_signatures": [G2, SIG1], "text": GOOD})
    assert c.candidate_id == f"merge:{SIG2},{SIG1}:若机柜门未关闭则判定不通过"
    assert c.target_signatures == [SIG2, SIG1] and c.target_signature is None
    assert c.operation.key == "G2" and c.operation.merged_from == ["G1"]
    assert one({"op": "merge", "target_signatures": [G1, G1], "text": GOOD})[1] == ["merge names rule G1 twice"]
    assert one({"op": "merge", "target_signatures": [G1, S1], "text": GOOD})[1] == ["merge target S1 cannot be merged"]
    g0 = guidance().experiences["G0"]
    assert one({"op": "merge", "target_signatures": [G1, g0], "text": GOOD})[1] == ["merge target G0 cannot be merged"]
    assert one({"op": "merge", "target_signatures": [G1, "无"], "text": GOOD})[1] == [
        "merge target signature not found: '无'"]


def test_a_merge_naming_one_rule_twice_is_rejected_with_its_reason():
    """Issue 32: [G2, G1, G2] was accepted as the merge of G2 and G1 (the schema allows a
    repeated target: llguidance has no uniqueItems), with both G2 signatures in its id."""
    from stageb_pool.search.decisions import reason_kind

    other = "若机柜门未上锁，则判定不通过。"
    accepted, rejected = parse([{"op": "merge", "target_signatures": [G2, SIG1, G2], "text": GOOD},
                                {"op": "merge", "target_signatures": [G2, SIG1], "text": other}])
    assert rejected == [{"index": 0, "op": "merge", "text": GOOD, "reason": "merge names rule G2 twice"}]
    assert [c.candidate_id for c in accepted] == [f"merge:{SIG2},{SIG1}:{normalize_signature(other)}"]
    assert reason_kind(rejected[0]["reason"]) == "merge names rule"  # counted by kind in the iteration line


def test_rejected_ids_and_duplicate_ids_are_skipped():
    rejected = {"upsert:若机柜门未关闭则判定不通过"}
    assert one({"text": GOOD}, rejected_ids=rejected)[1] == ["previously rejected candidate"]
    accepted, rej = parse([{"op": "remove", "target_signature": G2}, {"op": "remove", "target_signature": SIG2}])
    assert len(accepted) == 1 and [r["reason"] for r in rej] == ["duplicate candidate"]
    assert rej[0] == {"index": 1, "op": "remove", "text": None, "reason": "duplicate candidate"}


def test_a_rule_text_rejected_earlier_is_rejected_whatever_its_op():
    # The gate rejected this text as an update of G1: proposed again as an upsert (another id),
    # only its text is the same after normalisation (case, spaces, punctuation).
    rejected = {f"update:{SIG1}:若机柜门未关闭则判定不通过"}
    assert one({"text": " 若机柜门未关闭 ，则判定不通过 "}, rejected_ids=rejected)[1] == [
        "repeats a rule text rejected earlier in the run"]
    assert one({"text": GOOD}, rejected_ids={"remove:若机柜门未关闭则判定不通过"})[1] == []  # a remove has no text


def test_a_rule_copying_a_ticket_key_or_a_long_digit_run_of_the_examples_is_rejected():
    key = "ROOF-DEMO-20250317-0000073::fail"
    examples = f"Sample 1: ticket_key={key}; gt_label=fail\n  - image_1: serial 4471923"
    kw = dict(evidence=[key], examples_text=examples)
    assert one({"text": "若工单roof-demo-20250317-0000073的机柜门未关闭，则判定不通过"}, **kw)[1] == [
        "copies a ticket key from the examples: 'ROOF-DEMO-20250317-0000073'"]
    assert one({"text": "若序列号为4471923的机柜门未关闭，则判定不通过"}, **kw)[1] == [
        "copies a digit run from the examples: '4471923'"]
    assert one({"text": "若日期20250317之后机柜门未关闭，则判定不通过"}, **kw)[1] == [
        "copies a digit run from the examples: '20250317'"]
    # digits the examples do not hold, or short ones, are a rule's own business
    assert one({"text": "若序列号为9999999的机柜门未关闭，则判定不通过"}, **kw)[1] == []
    assert one({"text": "若超过44719个螺丝未关闭，则判定不通过"}, **kw)[1] == []


def test_limit_stops_examining_entries():
    entries = [{"text": f"若第{n}号机柜门未关闭，则判定不通过"} for n in range(5)] + ["garbage"]
    accepted, rejected = parse(entries, limit=2)
    assert len(accepted) == 2 and rejected == []
    accepted, rejected = parse(["garbage"] + entries, limit=3)
    assert len(accepted) == 3 and [r["index"] for r in rejected] == [0]


# --------------------------------------------------------------------------- ablation and ids

def meta(conf):
    return ExperienceMeta(updated_at="2025-01-01T00:00:00+00:00", reflection_id="r", confidence=conf)


def test_ablation_order_and_skips():
    g = guidance(G3="若天线松动，则判定不通过", G10="若线缆破损，则判定不通过", X1="若其他，则判定通过")
    g.metadata = {"G3": meta(0.99999), "G10": meta(0.5)}
    cands = ablation_candidates(g, limit=10)
    assert [c.operation.key for c in cands] == ["G10", "G3", "G1", "G2"]  # confidence, then key
    assert all(c.op == "remove" and c.source == "ablation" and c.rationale == "ablation_candidate" for c in cands)
    assert cands[0].candidate_id == "remove:若线缆破损则判定不通过" == "remove:" + cands[0].target_signature
    assert cands[0].operation == Operation(op="remove", key="G10", rationale="ablation_candidate")
    skipped = ablation_candidates(g, rejected_ids={cands[0].candidate_id}, limit=2)
    assert [c.operation.key for c in skipped] == ["G3", "G1"]
    assert ablation_candidates(g, limit=0) == []


def test_reflection_id_is_deterministic_hex():
    rid = reflection_id(3, "upsert:x")
    assert rid == reflection_id(3, "upsert:x") and re.fullmatch(r"[0-9a-f]{12}", rid)
    assert rid != reflection_id(4, "upsert:x") != reflection_id("abcd", 3, "upsert:x")
