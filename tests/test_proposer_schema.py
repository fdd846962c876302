"""The proposer's JSON schema (rule_search.constrain_proposer): what it allows, what it rules
out, and that llguidance compiles it and holds a real generation to it."""

import json
import re

import pytest

from stageb_pool.stageb import proposer
from stageb_pool.stageb.prompts import VerdictVocab
from stageb_pool.stageb.proposer_schema import RATIONALE_MAX_CHARS, TEXT_MAX_CHARS, proposer_schema
from stageb_pool.stageb.rule_text import normalize_signature

EN = VerdictVocab(pass_words=["pass"], fail_words=["fail"], pass_text="pass", fail_text="fail")
ZH = VerdictVocab(pass_words=["通过"], fail_words=["不通过"], pass_text="通过", fail_text="不通过")
GUIDANCE = {
    "G0": "Confirm that the antenna mount is installed securely.",
    "G1": "If any photo is blurry, the verdict is fail.",
    "G2": "If the grounding cable is attached, judge pass.",
    "S1": "If no photo shows the mount, the verdict is fail.",
}


def choices(schema) -> dict:
    return {c["properties"]["op"]["const"]: c for c in schema["properties"]["operations"]["items"]["anyOf"]}


def text_pattern(schema) -> str:
    return choices(schema)["upsert"]["properties"]["text"]["pattern"]


def test_targets_are_the_existing_signatures_and_g0_is_never_removed_or_merged():
    ops = choices(proposer_schema(GUIDANCE, EN, max_operations=3))
    sig = {k: normalize_signature(v) for k, v in GUIDANCE.items()}
    assert ops["update"]["properties"]["target_signature"]["enum"] == [sig["G0"], sig["G1"], sig["G2"]]
    assert ops["remove"]["properties"]["target_signature"]["enum"] == [sig["G1"], sig["G2"]]
    merge = ops["merge"]["properties"]["target_signatures"]
    assert merge["items"]["enum"] == [sig["G1"], sig["G2"]] and merge["minItems"] == 2 and merge["maxItems"] == 2
    assert sig["S1"] not in json.dumps(ops)  # scaffold rules are read-only


def test_each_operation_has_exactly_its_fields_in_writing_order():
    ops = choices(proposer_schema(GUIDANCE, EN, max_operations=3))
    assert {op: c["required"] for op, c in ops.items()} == {
        "upsert": ["op", "text", "rationale"],
        "update": ["op", "target_signature", "text", "rationale"],
        "merge": ["op", "target_signatures", "text", "rationale"],
        "remove": ["op", "target_signature", "rationale"],
    }
    assert all(c["additionalProperties"] is False and list(c["properties"]) == c["required"] for c in ops.values())


@pytest.mark.parametrize("rules, ops", [
    ({"G0": "Check the mount."}, ["upsert", "update"]),
    ({"G0": "Check the mount.", "G1": "If blurry, judge fail."}, ["upsert", "update", "remove"]),
    ({"S1": "Scaffold only."}, ["upsert"]),
])
def test_operations_without_a_possible_target_are_left_out(rules, ops):
    assert list(choices(proposer_schema(rules, EN, max_operations=2))) == ops


@pytest.mark.parametrize("limit", [1, 2, 5])
def test_the_operation_count_is_bounded_by_num_candidate_rules(limit):
    ops = proposer_schema(GUIDANCE, EN, max_operations=limit)["properties"]["operations"]
    assert (ops["minItems"], ops["maxItems"]) == (1, limit)


@pytest.mark.parametrize("text, ok", [
    ("If the bolt is loose, judge fail.", True),
    ("If the grounding cable is attached, judge pass", True),
    ("The verdict is fail.", True),
    ("x refail.", False),  # the verdict word must be a word of its own
    ("If the bolt is loose, judge fail. Then more", False),  # the verdict ends the rule
    ("If image_1 shows rust, judge fail.", False),  # field names and image references
    ("If category=bolt, judge fail.", False),
    ('If {"bolt": 1}, judge fail.', False),
    ("If <b>rust</b>, judge fail.", False),
    ("If rust,\njudge fail.", False),
    (" If rust, judge fail.", False),
    ("If " + "a" * (TEXT_MAX_CHARS - 3) + " fail.", True),
    ("If " + "a" * (TEXT_MAX_CHARS - 2) + " fail.", False),
])
def test_a_rule_text_is_one_bounded_line_that_ends_with_its_verdict(text, ok):
    assert bool(re.fullmatch(text_pattern(proposer_schema(GUIDANCE, EN, max_operations=2)), text)) is ok


def test_chinese_verdict_words_need_no_space():
    pattern = text_pattern(proposer_schema(GUIDANCE, ZH, max_operations=2))
    assert re.fullmatch(pattern, "若螺栓松动，则判定不通过。") and re.fullmatch(pattern, "若接地线完好则通过")
    assert not re.fullmatch(pattern, "若螺栓松动，则判定 fail")


def test_the_rationale_is_one_bounded_line():
    rationale = choices(proposer_schema(GUIDANCE, EN, max_operations=2))["remove"]["properties"]["rationale"]["pattern"]
    assert re.fullmatch(rationale, "Blurry photos are not a defect.")
    assert not re.fullmatch(rationale, "a" * (RATIONALE_MAX_CHARS + 1)) and not re.fullmatch(rationale, "two\nlines")


def test_an_answer_the_schema_allows_is_parsed_into_candidates():
    sig = {k: normalize_signature(v) for k, v in GUIDANCE.items()}
    answer = {"operations": [
        {"op": "upsert", "text": "If the seal is cracked, judge fail.", "rationale": "Cracked seals leak."},
        {"op": "merge", "target_signatures": [sig["G1"], sig["G2"]], "text": "If the photos are sharp, judge pass.",
         "rationale": "One rule."},
        {"op": "remove", "target_signature": sig["G1"], "rationale": "Blur is not a defect."},
    ]}
    accepted, rejected = proposer.parse_candidates(answer, GUIDANCE, vocab=EN, limit=3)
    assert [c.op for c in accepted] == ["upsert", "merge", "remove"] and rejected == []


def test_llguidance_compiles_the_schema():
    llguidance = pytest.importorskip("llguidance")
    schema = json.dumps(proposer_schema(GUIDANCE, ZH, max_operations=3), ensure_ascii=False)
    grammar = llguidance.LLMatcher.grammar_from_json_schema(schema)
    assert llguidance.LLMatcher.validate_grammar(grammar) == ""  # the error text; empty: none
