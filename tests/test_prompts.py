"""Prompt profiles: loading, located errors, the user layout (upstream 2.1) as snapshots,
the obj estimate and the RRU station-distance blocks."""

from __future__ import annotations

import json
import os
import shutil
import threading
from pathlib import Path

import msgspec
import pytest

from stageb_pool.stageb.errors import InputError
from stageb_pool.stageb.prompts import (
    PROFILES_DIR,
    PromptProfile,
    build_messages,
    estimate_objects,
    load_profile,
    load_proposer_prompt,
    render_template,
    station_summary_lines,
)
from stageb_pool.engine.records import TicketText

DATA = Path(__file__).parent / "data" / "data_prompts"
UPDATE = os.environ.get("STAGEB_UPDATE_SNAPSHOTS") == "1"


def j(obj) -> str:
    return json.dumps(obj, ensure_ascii=False)


BBU = "BBU安装方式检查（正装）"
BBU_GUIDANCE = {
    "G0": "需同时确认BBU设备与BBU安装螺丝，且螺丝符合要求",
    "G2": "若任一图片中BBU安装螺丝出现不符合，则判定不通过",
    "S1": "若所有图片都无法确认BBU安装螺丝的状态，则判定不通过",
    "G10": "螺丝数量以完整可见的图片为准",
    "S2": "无关图片不参与判断",
    "X1": "other prefixes are never rendered",
}
BBU_TICKET = TicketText("QC-DEMO-0042::fail", BBU, {
    "image_1": "<DOMAIN=BBU>, <TASK=SUMMARY>\n" + j({"统计": [
        {"类别": "BBU设备", "品牌": {"华为": 1}, "可见性": {"完整": 1}},
        {"类别": "BBU安装螺丝", "符合性": {"符合": 2, "不符合/未拧紧": 1}}], "备注": []}),
    "image_2": j({"统计": [{"类别": "标签", "文本": {"BBU-01": 1}}], "备注": ["局部特写"]}),
    "image_10": "机柜正面，螺丝齐全，标签清晰",
    "image_3": "无关图片",
})
RRU_TICKET = TicketText("QC-DEMO-0077::pass", "RRU安装检查", {
    "image_1": j({"统计": [{"类别": "RRU设备", "可见性": {"完整": 1}}, {"类别": "站点距离", "站点距离": {"35": 1}}]}),
    "image_2": j({"统计": [{"类别": "紧固件", "符合性": {"符合": 2}}, {"类别": "站点距离", "站点距离": {"35": 1}}]}),
    "image_3": j({"统计": [{"类别": "RRU设备", "可见性": {"部分": 1}}, {"类别": "站点距离", "距离": {"8": 1}}]}),
    "image_4": "无关图片",
})
GENERIC_GUIDANCE = {"G10": "Cable labels must be readable.", "G2": "Every bolt must be tight.",
                    "G0": "Check the cabinet mounting.", "G1": "A missing ground wire fails."}
GENERIC_TICKET = TicketText("demo-1::pass", "cabinet-mounting", {
    "image_2": "Ground wire attached, label readable.",
    "image_1": "<DOMAIN=BBU>, <TASK=SUMMARY>\nCabinet front, 4 bolts visible, all tight.",
})


def render(profile_name, mission, guidance, ticket) -> str:
    messages = build_messages(load_profile(profile_name, mission=mission), guidance, ticket)
    assert [m["role"] for m in messages] == ["system", "user"]
    return f"=== system ===\n{messages[0]['content']}\n=== user ===\n{messages[1]['content']}\n"


SNAPSHOTS = [
    ("bbu_rru_bbu.txt", "bbu_rru", BBU, BBU_GUIDANCE, BBU_TICKET),
    ("bbu_rru_rru.txt", "bbu_rru", "RRU安装检查", {"G0": "RRU与紧固件需在同一安装点出现"}, RRU_TICKET),
    ("generic.txt", "generic", "cabinet-mounting", GENERIC_GUIDANCE, GENERIC_TICKET),
]


@pytest.mark.parametrize("name,profile,mission,guidance,ticket", SNAPSHOTS)
def test_rendering_snapshot(name, profile, mission, guidance, ticket):
    text = render(profile, mission, guidance, ticket)
    path = DATA / name
    if UPDATE:
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text, encoding="utf-8")
    assert text == path.read_text(encoding="utf-8")


def test_bbu_user_layout_details():
    user = build_messages(load_profile("bbu_rru", mission=BBU), BBU_GUIDANCE, BBU_TICKET)[1]["content"]
    lines = user.split("\n")
    assert lines[:4] == [f"任务: {BBU}", f"重点: {BBU_GUIDANCE['G0']}", "结构不变量：", f"1. {BBU_GUIDANCE['S1']}"]
    # sorted by key string (G10 before G2), numbered by position, no keys shown
    assert lines[6:11] == ["可学习规则：", f"1. {BBU_GUIDANCE['G0']}", f"2. {BBU_GUIDANCE['G10']}", f"3. {BBU_GUIDANCE['G2']}", ""]
    assert lines[11] == "统计: Image1(obj=4), Image2(obj=1), Image3(obj=0), Image4(obj=3)；图片数量: 4"
    assert "X1" not in user and "other prefixes" not in user and "G10" not in user
    assert "<DOMAIN" not in user and "安装点汇总" not in user  # BBU: no station block
    assert lines[-4:] == ["1. " + BBU_TICKET.per_image["image_1"].split("\n")[1],
                          "2. " + BBU_TICKET.per_image["image_2"], "3. 无关图片", "4. 机柜正面，螺丝齐全，标签清晰"]


def test_no_scaffold_block_leaves_no_gap():
    user = build_messages(load_profile("bbu_rru", mission=BBU), {"G0": "清单"}, BBU_TICKET)[1]["content"]
    assert user.startswith(f"任务: {BBU}\n重点: 清单\n可学习规则：\n1. 清单\n\n统计: ")


def test_focus_falls_back_to_mission_when_g0_empty():
    user = build_messages(load_profile("bbu_rru", mission=BBU), {"G0": "", "G1": "r"}, BBU_TICKET)[1]["content"]
    assert f"重点: {BBU}" in user


def test_empty_guidance_is_an_error():
    with pytest.raises(ValueError):
        build_messages(load_profile("generic", mission="m"), {}, GENERIC_TICKET)


def test_domain_from_mission_prefix_and_override():
    assert load_profile("bbu_rru", mission="RRU线缆").domain == "rru"
    assert load_profile("bbu_rru", mission="挡风板安装检查").domain == "bbu"
    bbu = load_profile("bbu_rru", mission=BBU)
    forced = load_profile("bbu_rru", mission=BBU, domain="rru")
    assert forced.domain == "rru" and forced.system != bbu.system
    assert forced.system == (PROFILES_DIR / "bbu_rru" / "system_rru.txt").read_text(encoding="utf-8")
    assert load_profile("generic", mission="x").domain is None


def test_profile_is_a_self_contained_snapshot(tmp_path):
    copy = tmp_path / "mine"
    shutil.copytree(PROFILES_DIR / "bbu_rru", copy)
    profile = load_profile(str(copy), mission=BBU)
    shutil.rmtree(copy)  # nothing is read from disk after loading
    wire = msgspec.json.decode(msgspec.json.encode(profile))  # what a worker receives
    again = msgspec.convert(wire, PromptProfile)
    assert again == profile and again.hash == profile.hash
    assert build_messages(again, BBU_GUIDANCE, BBU_TICKET) == build_messages(load_profile("bbu_rru", mission=BBU), BBU_GUIDANCE, BBU_TICKET)
    ticket_dict = {"key": "k", "mission": BBU, "per_image": BBU_TICKET.per_image}
    assert build_messages(again, BBU_GUIDANCE, ticket_dict) == build_messages(again, BBU_GUIDANCE, BBU_TICKET)


def test_profile_hash_changes_with_content(tmp_path):
    copy = tmp_path / "generic"
    shutil.copytree(PROFILES_DIR / "generic", copy)
    before = load_profile(str(copy), mission="m").hash
    (copy / "user.txt").write_text("Mission: {mission}\n\n{rules}\n", encoding="utf-8")
    assert load_profile(str(copy), mission="m").hash != before


def test_name_lookup_uses_base_dir(tmp_path):
    shutil.copytree(PROFILES_DIR / "generic", tmp_path / "other")
    assert load_profile("other", mission="m", base_dir=tmp_path).name == "other"


# ----------------------------------------------------------------------------- malformed profiles

@pytest.fixture
def profile_dir(tmp_path):
    d = tmp_path / "p"
    shutil.copytree(PROFILES_DIR / "generic", d)
    return d


def test_the_proposer_prompt_defaults_to_the_profiles_proposer_txt(tmp_path):
    for name in ("generic", "bbu_rru"):
        assert load_proposer_prompt(name, None) == (PROFILES_DIR / name / "proposer.txt").read_text(encoding="utf-8")
    own = tmp_path / "mine.txt"
    own.write_text("You propose rules.\n", encoding="utf-8")
    assert load_proposer_prompt("generic", str(own)) == "You propose rules.\n"
    shutil.copytree(PROFILES_DIR / "generic", tmp_path / "custom")
    (tmp_path / "custom" / "proposer.txt").write_text("Custom proposer.", encoding="utf-8")
    assert load_proposer_prompt(str(tmp_path / "custom"), None) == "Custom proposer."


@pytest.mark.parametrize("content, message", [(None, "proposer prompt not found"), (" \n", "empty"),
                                              (b"ok\n\xff\xfe", "not valid UTF-8")])
def test_a_bad_proposer_prompt_is_a_located_error(tmp_path, content, message):
    path = tmp_path / "proposer.txt"
    if isinstance(content, bytes):
        path.write_bytes(content)
    elif content is not None:
        path.write_text(content, encoding="utf-8")
    with pytest.raises(InputError, match=message) as err:
        load_proposer_prompt("generic", str(path))
    assert err.value.location == (f"{path}:2:1" if message == "not valid UTF-8" else str(path))


def test_a_fifo_proposer_prompt_is_refused_not_waited_for(tmp_path):
    fifo = tmp_path / "proposer.txt"
    os.mkfifo(fifo)
    # A writer that closes at once: a reader that opens the FIFO gets an empty text instead
    # of blocking the test forever (a reader that refuses the FIFO never opens it).
    writer = threading.Thread(target=lambda: open(fifo, "wb").close(), daemon=True)
    writer.start()
    try:
        with pytest.raises(InputError, match="proposer prompt is not a regular file"):
            load_proposer_prompt("generic", str(fifo))
    finally:
        reader = os.open(fifo, os.O_RDONLY | os.O_NONBLOCK)  # lets the writer's open return
        writer.join()
        os.close(reader)


def test_unknown_profile_name_lists_known():
    with pytest.raises(InputError, match=r"prompt profile not found \(profiles there: .*bbu_rru, generic"):
        load_profile("nope", mission="m")


@pytest.mark.parametrize("missing", ["profile.yaml", "user.txt", "system.txt"])
def test_missing_profile_file(profile_dir, missing):
    (profile_dir / missing).unlink()
    with pytest.raises(InputError, match="profile file not found") as err:
        load_profile(str(profile_dir), mission="m")
    assert err.value.location == str(profile_dir / missing)


def test_missing_domain_system_file(tmp_path):
    d = tmp_path / "p"
    shutil.copytree(PROFILES_DIR / "bbu_rru", d)
    (d / "system_rru.txt").unlink()
    with pytest.raises(InputError) as err:
        load_profile(str(d), mission="RRU线缆")
    assert err.value.location == str(d / "system_rru.txt")


@pytest.mark.parametrize("yaml_text,location,message", [
    ("verdict: {pass_words: [a], fail_words: [b], pass_text: a, fail_text: b}\ncolour: red\n", "", "Object contains unknown field `colour`"),
    ("verdict: {pass_words: [a], fail_words: [b], pass_text: a, fail_text: b}\noptions: {stats: true}\n", "options", "Object contains unknown field `stats`"),
    ("verdict: {pass_words: [a], fail_words: [b], pass_text: a, fail_text: b}\nlabels: {rule: x}\n", "labels", "Object contains unknown field `rule`"),
    ("verdict: {pass_words: [a], fail_words: [b], pass_text: a}\n", "verdict", "Object missing required field `fail_text`"),
    ("verdict: {pass_words: a, fail_words: [b], pass_text: a, fail_text: b}\n", "verdict.pass_words", "Expected `array`"),
    ("verdict: {pass_words: [], fail_words: [b], pass_text: a, fail_text: b}\n", "verdict", "pass_words and fail_words must be non-empty"),
    ("verdict: {pass_words: [a], fail_words: [b], pass_text: a, fail_text: b}\noptions: {rules_order: random}\n", "options.rules_order", "must be one of key, g0_first"),
    ("language: en\n", "", "Object missing required field `verdict`"),
    ("verdict: {pass_words: [pass, OK], fail_words: [fail, ' o k'], pass_text: a, fail_text: b}\n",
     "verdict.fail_words", "' o k' is both a pass word and a fail word"),
])
def test_bad_profile_yaml_is_located(profile_dir, yaml_text, location, message):
    path = profile_dir / "profile.yaml"
    path.write_text(yaml_text, encoding="utf-8")
    with pytest.raises(InputError) as err:
        load_profile(str(profile_dir), mission="m")
    assert err.value.location == (f"{path}: {location}" if location else str(path))
    assert err.value.message.startswith(message)


def test_invalid_yaml_names_the_line(profile_dir):
    path = profile_dir / "profile.yaml"
    path.write_text("language: en\nverdict: [unclosed\n", encoding="utf-8")
    with pytest.raises(InputError, match="invalid YAML") as err:
        load_profile(str(profile_dir), mission="m")
    assert err.value.location.startswith(f"{path}:")


VOCAB_YAML = "verdict: {pass_words: [a], fail_words: [b], pass_text: a, fail_text: b}\n"


@pytest.mark.parametrize("yaml_text, line, message", [
    # a key given twice keeps the last value silently in PyYAML: refused with both lines
    ("language: en\n" + VOCAB_YAML + "language: zh\n", 3, "key 'language' is given twice (first on line 1)"),
    (VOCAB_YAML + "options:\n  object_stats: true\n  object_stats: false\n", 4, "key 'object_stats' is given twice"),
    # nesting 1,000 deep: a located error, never RecursionError
    (VOCAB_YAML + "labels: " + "[" * 1000 + "]" * 1000 + "\n", 2, "nested deeper than 100 levels"),
    (VOCAB_YAML + "x:\n" + "".join("  " * i + "- \n" for i in range(1, 400)), None, "nested deeper than 100 levels"),
])
def test_hostile_profile_yaml_is_located(profile_dir, yaml_text, line, message):
    path = profile_dir / "profile.yaml"
    path.write_text(yaml_text, encoding="utf-8")
    with pytest.raises(InputError) as err:
        load_profile(str(profile_dir), mission="m")
    assert err.value.location.startswith(f"{path}:" if line is None else f"{path}:{line}")
    assert message in err.value.message


def test_profile_files_accept_a_bom_and_refuse_a_fifo(profile_dir):
    path = profile_dir / "profile.yaml"
    path.write_bytes(b"\xef\xbb\xbf" + path.read_bytes())
    system = profile_dir / "system.txt"
    system.write_bytes(b"\xef\xbb\xbfSystem text.\r\n")
    assert load_profile(str(profile_dir), mission="m").system == "System text.\n"
    (profile_dir / "user.txt").unlink()
    os.mkfifo(profile_dir / "user.txt")
    with pytest.raises(InputError, match="profile file is not a regular file"):
        load_profile(str(profile_dir), mission="m")


def test_unknown_placeholder_is_located(profile_dir):
    path = profile_dir / "user.txt"
    path.write_text("Mission: {mission}\n\n{rulez}\n", encoding="utf-8")
    with pytest.raises(InputError, match=r"unknown placeholder \{rulez\}") as err:
        load_profile(str(profile_dir), mission="m")
    assert err.value.location == f"{path}:3"


def test_empty_profile_file(profile_dir):
    (profile_dir / "system.txt").write_text("\n  \n", encoding="utf-8")
    with pytest.raises(InputError, match="empty profile file"):
        load_profile(str(profile_dir), mission="m")


# ----------------------------------------------------------------------------- template rule

@pytest.mark.parametrize("template,values,expected", [
    ("A {mission}\n{rules}\n\nB", {"mission": "m", "rules": "R:\n1. x"}, "A m\nR:\n1. x\n\nB"),
    ("A\n{rules}\n\nB", {"rules": ""}, "A\nB"),  # empty block: its line and one blank go
    ("A\n\n{rules}\n\n{scaffold}\n\nB", {"rules": "", "scaffold": ""}, "A\n\nB"),
    ("A\n{rules}\nB", {"rules": ""}, "A\nB"),
    ("x {rules} y", {"rules": "R"}, "x R y"),  # inline use: plain substitution
    ("{rules}\n\nB\n", {"rules": "R"}, "R\n\nB"),
])
def test_render_template(template, values, expected):
    assert render_template(template, values) == expected


# ----------------------------------------------------------------------------- obj estimate

OBJ_TABLE = [
    ("无关图片", 0),
    ("  无关图片 \n", 0),
    ("  无关图片（远景） ", 1),  # upstream: only exactly 无关图片 is 0; this is one free-text segment
    ("", 0),
    (j({"统计": []}), 0),
    (j({"统计": [{"类别": "BBU设备"}]}), 1),  # no attributes: max(1, 0)
    (j({"统计": [{"类别": "BBU设备", "品牌": {"华为": 1}, "可见性": {"完整": 1}}]}), 1),
    (j({"统计": [{"类别": "螺丝", "符合性": {"符合": 2, "不符合": 1}}]}), 3),
    (j({"统计": [{"类别": "螺丝", "符合性": {"符合": 2, "坏": -1, "x": 0, "y": True, "z": "3"}}]}), 5),  # digit strings count
    (j({"统计": [{"类别": "螺丝", "符合性": {"符合": 2.0, "x": 1.5, "z": " 2 "}}]}), 4),  # integral floats too
    (j({"统计": [{"类别": " 标签 ", "文本": {"A": 1}, "可读性": {"可读": 2}}]}), 3),  # 类别 compared stripped
    (j({"统计": [{"类别": "线缆", "颜色": ["红", "黑", None]}]}), 2),  # list: non-null items
    (j({"统计": [{"类别": "线缆", "颜色": "红"}]}), 1),  # scalar: 1
    (j({"统计": [{"类别": "线缆", "颜色": None}]}), 1),  # null: 0 -> max(1, 0)
    (j({"统计": [{"类别": "标签", "文本": {"A": 1, "B": 1}, "可读性": {"可读": 2}}]}), 4),  # 文本 + 可读性
    (j({"统计": [{"类别": "标签", "文本": {"A": 1}, "位置": {"上": 5}}]}), 5),  # max attr wins
    (j({"统计": [{"类别": "标签"}]}), 1),
    (j({"统计": [{"类别": "a", "n": {"x": 2}}, {"类别": "b", "n": {"x": 3}}, "free"]}), 5),  # non-object entry: 0
    (j({"统计": {"类别": "a"}}), 0),  # a summary object whose 统计 is no list: nothing to count
    (j({"统计": [{"类别": "标签", "文本": {"A": 2.0, "B": "3"}}, "junk"]}), 5),  # prompts.md's executed example
    ("<DOMAIN=BBU>, <TASK=SUMMARY>\n" + j({"统计": [{"类别": "a", "n": {"x": 2}}]}), 2),  # last JSON line
    ("前缀说明 " + j({"统计": [{"类别": "a", "n": {"x": 3}}]}) + " 后缀", 3),  # widest {...} span
    ('统计=[{"类别": "a", "n": {"x": 4}}]', 4),  # repaired assignment text
    ('统计:[{"类别": "a", "n": {"x": 2}}] 备注', 2),
    ('统计：[{"类别": "a", "n": {"x": 2}}] 备注', 1),  # a full-width colon is not repaired (upstream): free text
    ('分组统计=[{"类别": "a", "n": {"x": 2}}]', 2),  # upstream finds "统计=" inside "分组统计="
    ("<DOMAIN=BBU><TASK=SUMMARY>\n" + j({"统计": [{"类别": "a", "n": {"x": 2}}]}), 2),  # header without comma
    (j({"备注": ["x"]}), 1),  # JSON without 统计: non-JSON fallback, one segment
    ("机柜正面，螺丝齐全，标签清晰", 3),  # split on the Chinese comma
    ("机柜正面，，", 1),
    ("cabinet front, bolts", 1),  # ASCII commas do not split
]


@pytest.mark.parametrize("summary,expected", OBJ_TABLE)
def test_obj_estimate(summary, expected):
    assert estimate_objects(summary) == expected


# ----------------------------------------------------------------------------- RRU blocks

def S(*entries, distance=None, key="站点距离"):
    items = list(entries)
    if distance is not None:
        items.append({"类别": "站点距离", key: {str(distance): 1}})
    return j({"统计": items})


STATION_TABLE = [
    ("RRU安装检查", [S({"类别": "RRU设备"}, distance=35), S({"类别": "紧固件"}, distance=35), S({"类别": "RRU设备"}, distance=8)],
     ["- 站点距离=8: RRU=有, 紧固件=无", "- 站点距离=35: RRU=有, 紧固件=有"]),  # numeric order
    ("RRU安装检查", [S({"类别": "固定件"}, distance=3, key="距离"), S({"类别": "其他"}, distance=4)],
     ["- 站点距离=3: RRU=无, 紧固件=有", "- 站点距离=4: RRU=无, 紧固件=无"]),  # kept even when empty
    ("RRU安装检查", [S({"类别": "RRU设备"})], []),  # no distance: not paired
    ("RRU安装检查", ["RRU设备完整，站点距离=12", "紧固件齐全，站点距离/12", "无关图片 站点距离=13"],
     ["- 站点距离=12: RRU=有, 紧固件=有", "- 站点距离=13: RRU=无, 紧固件=无"]),  # non-JSON text (upstream
    # does not skip 无关图片 text; it rarely carries a distance)
    ("RRU安装检查", ["RRU 在左侧，站点距离=5"], ["- 站点距离=5: RRU=有, 紧固件=无"]),  # the word RRU
    ("RRU安装检查", [S({"类别": "RRU设备"}, distance="035"), S({"类别": "紧固件"}, distance=35)],
     ["- 站点距离=035: RRU=有, 紧固件=无", "- 站点距离=35: RRU=无, 紧固件=有"]),  # distances kept as written
    ("RRU安装检查", [j({"统计": [{"类别": "RRU设备"}, {"类别": "站点距离", "站点距离": {"3": 1}},
                                 {"类别": "站点距离", "站点距离": {"4": 1}}]})],
     ["- 站点距离=3: RRU=有, 紧固件=无"]),  # the first 站点距离 entry only
    ("RRU安装检查", [j({"统计": [{"类别": {"RRU设备": 1}}, {"类别": "站点距离", "站点距离": {"3": 1}}]})],
     ["- 站点距离=3: RRU=无, 紧固件=无"]),  # a non-string 类别 names nothing (upstream crashed)
    ("RRU位置检查", [S({"类别": "RRU接地端"}, distance=5), S({"类别": "接地线"}, {"类别": "标签", "文本": {"GND-1": 1}}, distance=6),
                   S({"类别": "接地线"}, {"类别": "标签", "可读性": {"不可读": 1}}, distance=7), S({"类别": "其他"}, distance=9),
                   S({"类别": "接地线"}, {"类别": "标签", "文本": {"无法识别": 1}}, distance=8)],
     ["- 站点距离=5: RRU接地端=有, 接地线(可读标签)=无", "- 站点距离=6: RRU接地端=无, 接地线(可读标签)=有",
      "- 站点距离=8: RRU接地端=无, 接地线(可读标签)=有"]),  # upstream: any 文本 key is readable text
    ("RRU位置检查", ["接地线，标签/GND-1，站点距离=3", "接地线，标签/无法识别，站点距离=4", "接地线，标签，站点距离=5"],
     ["- 站点距离=3: RRU接地端=无, 接地线(可读标签)=有"]),  # text: 标签/ and not 无法识别/没有标签
    ("RRU线缆", [S({"类别": "尾纤"}, distance=2), S({"类别": "尾纤", "套管保护": {"有保护": 1}}, distance=3),
               S({"类别": "尾纤", "套管保护": {"没有保护": 2}}, distance=4), S({"类别": "标签", "文本": {"ODF-3": 1}}, distance=4)],
     ["- 站点距离=2: 尾纤=有, 套管=无, 标签文本=无", "- 站点距离=3: 尾纤=有, 套管=有, 标签文本=无",
      "- 站点距离=4: 尾纤=有, 套管=无, 标签文本=有"]),
    ("RRU线缆", [S({"类别": "尾纤", "套管保护": {"有保护": 0}}, distance=1)],
     ["- 站点距离=1: 尾纤=有, 套管=无, 标签文本=无"]),  # zero count: no sleeve
    # issue 14 §3 item 7: upstream reads 套管保护 of the first 尾纤 entry only, so a separate
    # 套管 entry is no sleeve (as upstream) ...
    ("RRU线缆", [S({"类别": "尾纤"}, {"类别": "套管", "套管保护": {"有保护": 1}}, distance=8)],
     ["- 站点距离=8: 尾纤=有, 套管=无, 标签文本=无"]),
    # ... and in free text "套管/没有保护" is no sleeve here; upstream said 套管=有 (its defect,
    # listed in docs/formats.md)
    ("RRU线缆", ["站点距离=8，尾纤，套管/没有保护，标签/OPT-1"], ["- 站点距离=8: 尾纤=有, 套管=无, 标签文本=有"]),
    ("RRU线缆", ["站点距离=9，套管/有保护"], ["- 站点距离=9: 尾纤=无, 套管=有, 标签文本=无"]),
    (BBU, [S({"类别": "RRU设备"}, distance=35)], []),  # only the three RRU missions
]


@pytest.mark.parametrize("mission,summaries,expected", STATION_TABLE)
def test_station_summary(mission, summaries, expected):
    assert station_summary_lines(mission, summaries) == expected


# ----------------------------------------------------------------------------- a team's own templates

# issue 14 §4: a profile folder of plain files outside the package reproduces a given pair of
# messages byte for byte. The system text is a file used as written (final newline kept);
# the user message follows upstream's builder, here checked against messages built by it
# (the worked example of the upstream research notes, and the rules those notes give for
# summaries, obj counts and station blocks).
UPSTREAM_STYLE_YAML = """\
language: zh
domain_prefixes: {RRU: rru}
default_domain: bbu
verdict: {pass_words: [通过, pass, 通过。], fail_words: [不通过, fail, 未通过, 不通过。], pass_text: 通过, fail_text: 不通过}
labels:
  scaffold: 结构不变量：
  rules: 可学习规则：
  image_stats: "统计: {items}；图片数量: {count}"
  station_summary: 安装点汇总（按站点距离合并）：
  image_summaries: 图片摘要：
options: {rules_order: key, object_stats: true, station_aggregation: true, bbu_cleanup: true}
"""
UPSTREAM_STYLE_USER = "任务: {mission}\n重点: {focus}\n{scaffold}\n\n{rules}\n\n{image_stats}\n\n{station_summary}\n\n{image_summaries}\n"
# Blocks joined by two empty lines, one final newline: the shape of upstream's system messages.
OWN_SYSTEM_BBU = "你是质检助手。\n\n【任务】\n只输出两行。\n\n\n【BBU】\n- 无关图片不参与判断。\n\n\n【输出格式】\n- Verdict: 通过 或 不通过\n"
OWN_SYSTEM_RRU = "你是质检助手。\n\n\n【RRU】\n- 跨图只按站点距离合并。\n"


@pytest.fixture
def own_profile(tmp_path):
    folder = tmp_path / "team_prompts"
    folder.mkdir()
    (folder / "profile.yaml").write_text(UPSTREAM_STYLE_YAML, encoding="utf-8")
    (folder / "user.txt").write_text(UPSTREAM_STYLE_USER, encoding="utf-8")
    (folder / "system_bbu.txt").write_bytes(OWN_SYSTEM_BBU.encode())
    (folder / "system_rru.txt").write_bytes(OWN_SYSTEM_RRU.encode())
    return folder


def test_a_folder_of_plain_templates_reproduces_upstream_messages_byte_for_byte(own_profile):
    guidance = {"G0": "检查BBU", "S1": "若缺失则判定不通过。", "G10": "规则十", "G2": "规则二"}
    summary = j({"统计": [{"类别": "BBU设备", "品牌": {"华为": 1}, "可见性": {"完整": 1}},
                          {"类别": "BBU安装螺丝", "符合性": {"符合": 2, "不符合/未拧紧": 1}}], "备注": []})
    ticket = TicketText("k::pass", BBU, {"image_1": summary, "image_2": "无关图片", "image_3": "螺丝，标签，  "})
    system, user = build_messages(load_profile(str(own_profile), mission=BBU), guidance, ticket)
    assert system == {"role": "system", "content": OWN_SYSTEM_BBU}
    assert user["content"] == (
        "任务: BBU安装方式检查（正装）\n"
        "重点: 检查BBU\n"
        "结构不变量：\n"
        "1. 若缺失则判定不通过。\n"
        "\n"
        "可学习规则：\n"
        "1. 检查BBU\n"
        "2. 规则十\n"
        "3. 规则二\n"
        "\n"
        "统计: Image1(obj=4), Image2(obj=0), Image3(obj=2)；图片数量: 3\n"
        "\n"
        "图片摘要：\n"
        f"1. {summary}\n"
        "2. 无关图片\n"
        "3. 螺丝，标签，"
    )


def test_upstream_summary_rules_hold_in_a_teams_own_profile(own_profile):
    # lines stripped, blank lines and comma-less headers dropped; an empty summary "3. "
    ticket = TicketText("k::pass", "RRU安装检查", {
        "image_2": "  <DOMAIN=RRU><TASK=SUMMARY>\n\n  RRU设备，站点距离=12  \n   紧固件  ",
        "image_1": j({"统计": [{"类别": "RRU设备"}, {"类别": "站点距离", "站点距离": {"12": 1}}]}),
        "image_3": "",
    })
    system, user = build_messages(load_profile(str(own_profile), mission="RRU安装检查"), {"G0": "RRU检查"}, ticket)
    assert system["content"] == OWN_SYSTEM_RRU
    assert user["content"] == (
        "任务: RRU安装检查\n"
        "重点: RRU检查\n"
        "可学习规则：\n"
        "1. RRU检查\n"
        "\n"
        "统计: Image1(obj=2), Image2(obj=2), Image3(obj=0)；图片数量: 3\n"
        "\n"
        "安装点汇总（按站点距离合并）：\n"
        "- 站点距离=12: RRU=有, 紧固件=有\n"
        "\n"
        "图片摘要：\n"
        '1. {"统计": [{"类别": "RRU设备"}, {"类别": "站点距离", "站点距离": {"12": 1}}]}\n'
        "2. RRU设备，站点距离=12\n紧固件\n"
        "3. "
    )
