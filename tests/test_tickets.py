"""Stage-A ingest: normalisation, every malformed-line kind with its located message,
skip mode, file-level errors and exclusions."""

from __future__ import annotations

import json
import os

import pytest

from stageb_pool.stageb.errors import InputError
from stageb_pool.engine.records import TicketText
from stageb_pool.stageb.tickets import (
    bbu_clean_summary,
    bbu_clean_tickets,
    load_exclusions,
    load_tickets,
    normalize_per_image,
)

BBU = "BBU安装方式检查（正装）"
RRU = "RRU安装检查"


def rec(group="G-1", label="pass", mission=BBU, per_image=None, **extra):
    return {"mission": mission, "group_id": group, "label": label,
            "per_image": per_image if per_image is not None else {"image_1": "s1"}, **extra}


def line(record) -> str:
    return record if isinstance(record, str) else json.dumps(record, ensure_ascii=False)


def write(tmp_path, rows, name="t.jsonl", *, newline="\n", bom=False):
    path = tmp_path / name
    data = newline.join(line(r) for r in rows) + newline
    path.write_bytes((b"\xef\xbb\xbf" if bom else b"") + data.encode("utf-8"))
    return path


# ----------------------------------------------------------------------------- good input

def test_fields_key_and_order(tmp_path):
    path = write(tmp_path, [
        rec("G-2", "FAIL", images=["a.jpg"], label_source="audit", label_timestamp="2025-03-15T10:22:00"),
        rec("G-1", " Pass "),
        rec("G-2", "pass"),  # same group, other label: a distinct ticket
    ])
    report = load_tickets(str(path))
    assert [t.key for t in report.tickets] == ["G-2::fail", "G-1::pass", "G-2::pass"]
    first = report.tickets[0]
    assert (first.group_id, first.mission, first.label) == ("G-2", BBU, "fail")
    assert (first.label_source, first.label_timestamp) == ("audit", "2025-03-15T10:22:00")
    assert (report.tickets[1].label_source, report.tickets[1].label_timestamp) == ("human", None)
    assert report.skipped == [] and report.excluded == 0
    assert first.text() == TicketText("G-2::fail", BBU, {"image_1": "s1"})


def test_invalid_timestamp_becomes_none_like_upstream(tmp_path):
    report = load_tickets(write(tmp_path, [rec(label_timestamp="yesterday")]))
    assert report.tickets[0].label_timestamp is None


@pytest.mark.parametrize("per_image,expected", [
    ({"image_2": "b", "image_10": "c", "image_1": "a"}, {"image_1": "a", "image_2": "b", "image_10": "c"}),
    ({"图片_3": "x", "图片_1": "y"}, {"image_1": "y", "image_3": "x"}),
    ({"front": "x", "back": "y"}, {"image_1": "x", "image_2": "y"}),  # no digits: 1-based position
    ({"img7": "x", "side": "y"}, {"image_2": "y", "image_7": "x"}),
    ({"image_1": '"quoted \\"text\\""'}, {"image_1": 'quoted "text"'}),  # JSON string unwrapped
    ({"image_1": '{"统计": []}'}, {"image_1": '{"统计": []}'}),  # JSON objects kept as text
    ({"image_1": '"unterminated'}, {"image_1": '"unterminated'}),
    # kept as given, header lines included (the BBU clean-up and the prompt remove them, as upstream)
    ({"image_1": "<DOMAIN=RRU>, <TASK=SUMMARY>\r\nfree text "}, {"image_1": "<DOMAIN=RRU>, <TASK=SUMMARY>\r\nfree text "}),
])
def test_per_image_normalisation(per_image, expected):
    out = normalize_per_image(per_image)
    assert out == expected and list(out) == list(expected)


@pytest.mark.parametrize("bom", [False, True])
@pytest.mark.parametrize("newline", ["\n", "\r\n"])
def test_bom_and_crlf(tmp_path, bom, newline):
    path = write(tmp_path, [rec("A"), "", rec("B", per_image={"image_1": "第一行"})], newline=newline, bom=bom)
    report = load_tickets(path)
    assert [t.key for t in report.tickets] == ["A::pass", "B::pass"]
    assert report.tickets[1].per_image == {"image_1": "第一行"}


def test_several_files_keep_file_order(tmp_path):
    a = write(tmp_path, [rec("A"), rec("B")], "a.jsonl")
    b = write(tmp_path, [rec("C")], "b.jsonl")
    assert [t.group_id for t in load_tickets([a, b]).tickets] == ["A", "B", "C"]


# ----------------------------------------------------------------------------- bad lines

BAD_LINES = [
    ("{not json", "invalid JSON: "),
    ('["a", "b"]', "expected a JSON object, got array"),
    ('"text"', "expected a JSON object, got string"),
    ("42", "expected a JSON object, got integer"),
    ({k: v for k, v in rec().items() if k != "mission"}, "missing field 'mission'"),
    ({k: v for k, v in rec().items() if k != "group_id"}, "missing field 'group_id'"),
    ({k: v for k, v in rec().items() if k != "label"}, "missing field 'label'"),
    ({k: v for k, v in rec().items() if k != "per_image"}, "missing field 'per_image'"),
    (rec(mission=""), "field 'mission' is empty"),
    (rec(label=""), "field 'label' is empty"),
    (rec(mission=7), "field 'mission' must be a string, got integer"),
    (rec(label=True), "field 'label' must be a string, got boolean"),
    (rec(mission="BBU\u0000x"), "field 'mission' contains a NUL character"),
    # what upstream would have turned into "None", "True" or "1.5" stays refused
    (rec(group=None), "field 'group_id' must be a string or an integer, got null"),
    (rec(group=True), "field 'group_id' must be a string or an integer, got boolean"),
    (rec(group=1.5), "field 'group_id' must be a string or an integer, got number"),
    # hostile input: located, never a crash or a silently kept value
    ('{"mission": "M", "mission": "N", "group_id": "A", "label": "pass", "per_image": {"image_1": "s"}}',
     "key 'mission' is given twice in one object"),
    ('{"mission": "M", "group_id": "A", "label": "pass", "per_image": {"image_1": "s", "image_1": "t"}}',
     "key 'image_1' is given twice in one object at per_image"),
    (rec(per_image={"image_" + "7" * 4301: "s"}), "per_image key 'image_7777"),
    ('{"mission": "M", "group_id": "A", "label": "pass", "per_image": {"image_1": "\\ud800"}}',
     "lone surrogate escape (\\ud800-\\udfff) in a string at per_image.image_1"),
    ('{"mission": "M", "group_id": "A", "label": "pass", "n": ' + "1" * 4301 + ', "per_image": {"image_1": "s"}}',
     "invalid JSON: Exceeds the limit (4300 digits)"),
    (rec(label="maybe"), "label must be 'pass' or 'fail', got 'maybe'"),
    (rec(label="通过"), "label must be 'pass' or 'fail', got '通过'"),
    (rec(per_image=["a"]), "field 'per_image' must be an object, got array"),
    (rec(per_image="a"), "field 'per_image' must be an object, got string"),
    (rec(per_image={}), "field 'per_image' is empty"),
    (rec(per_image={"image_1": "a", "图片_1": "b"}), "per_image keys 'image_1' and '图片_1' both map to image_1"),
]


@pytest.mark.parametrize("bad,message", BAD_LINES)
def test_bad_line_is_located(tmp_path, bad, message):
    path = write(tmp_path, [rec("A"), "", bad, rec("C")])  # bad record on line 3
    with pytest.raises(InputError) as err:
        load_tickets(path)
    assert err.value.location == f"{path}:3"
    assert err.value.message.startswith(message)
    assert str(err.value).startswith(f"{path}:3: {message}")


@pytest.mark.parametrize("bad,message", BAD_LINES)
def test_skip_mode_records_and_continues(tmp_path, bad, message):
    path = write(tmp_path, [rec("A"), bad, rec("C")])
    report = load_tickets(path, on_bad_line="skip")
    assert [t.group_id for t in report.tickets] == ["A", "C"]
    assert len(report.skipped) == 1
    assert report.skipped[0]["location"] == f"{path}:2"
    assert report.skipped[0]["error"].startswith(message)


def test_records_upstream_reads_are_read_with_counted_conversions(tmp_path):
    path = write(tmp_path, [
        rec(15502, "pass"),                                   # integer id -> its decimal text
        rec("", "fail", label_timestamp=12345),               # empty id; non-string timestamp ignored
        rec(" B ", per_image={"image_1": {"统计": [{"类别": "BBU设备"}]}, "image_2": None, "image_3": 7},
            label_source=5),
    ])
    report = load_tickets(path)
    assert [t.key for t in report.tickets] == ["15502::pass", "::fail", " B ::pass"]  # ids verbatim, as upstream
    assert report.tickets[0].group_id == "15502"
    assert report.tickets[1].label_timestamp is None
    # an object summary is compact JSON text (not a Python repr); null and numbers their JSON text
    assert report.tickets[2].per_image == {"image_1": '{"统计":[{"类别":"BBU设备"}]}', "image_2": "null",
                                           "image_3": "7"}
    assert report.tickets[2].label_source == "human"
    assert report.converted == {"group_id": 1, "per_image": 3}  # values converted
    assert report.ignored == {"label_source": 1, "label_timestamp": 1}


@pytest.mark.parametrize("on_bad_line", ["error", "skip"])
def test_json_nested_too_deep_is_an_error_in_both_modes(tmp_path, on_bad_line):
    deep = '{"mission": "M", "group_id": "A", "label": "pass", "per_image": {"image_1": "s"}, "x": ' \
        + "[" * 1000 + "]" * 1000 + "}"
    path = write(tmp_path, [rec("A"), deep])
    with pytest.raises(InputError) as err:
        load_tickets(path, on_bad_line=on_bad_line)
    assert err.value.location == f"{path}:2"
    assert err.value.message.startswith("JSON nested deeper than 100 levels")


def test_only_regular_files_are_read(tmp_path):
    fifo = tmp_path / "tickets.fifo"
    os.mkfifo(fifo)
    with pytest.raises(InputError, match="ticket file is not a regular file"):
        load_tickets(fifo)
    with pytest.raises(InputError, match="exclusion list is not a regular file"):
        load_exclusions([], fifo)
    with pytest.raises(InputError, match="ticket file is not a regular file"):
        load_tickets(tmp_path)


def test_exclusion_list_must_be_utf8(tmp_path):
    path = tmp_path / "exclude.txt"
    path.write_bytes(b"\xef\xbb\xbfA::pass\nB\xff::fail\n")
    with pytest.raises(InputError) as err:
        load_exclusions([], path)
    assert err.value.location == f"{path}:2:2" and "not valid UTF-8" in err.value.message


def test_invalid_utf8_is_located(tmp_path):
    path = tmp_path / "t.jsonl"
    path.write_bytes(line(rec("A")).encode() + b"\n\xff\xfe bad\n")
    with pytest.raises(InputError, match=r":2: not valid UTF-8"):
        load_tickets(path)


def test_skip_mode_counts_every_bad_line(tmp_path):
    path = write(tmp_path, [rec("A"), "{", rec(label="x"), rec("B"), "[]"])
    report = load_tickets(path, on_bad_line="skip")
    assert [s["location"] for s in report.skipped] == [f"{path}:2", f"{path}:3", f"{path}:5"]
    assert len(report.tickets) == 2


def test_unknown_on_bad_line_value(tmp_path):
    with pytest.raises(InputError, match="'error' or 'skip'"):
        load_tickets(write(tmp_path, [rec()]), on_bad_line="ignore")


# ----------------------------------------------------------------------------- file-level errors

def test_missing_file(tmp_path):
    with pytest.raises(InputError, match="ticket file not found") as err:
        load_tickets(tmp_path / "nope.jsonl")
    assert err.value.location == str(tmp_path / "nope.jsonl")


def test_empty_file(tmp_path):
    path = tmp_path / "t.jsonl"
    path.write_text("\n\n")
    with pytest.raises(InputError, match="no tickets"):
        load_tickets(path)


def test_all_lines_skipped_is_empty(tmp_path):
    with pytest.raises(InputError, match=r"no tickets \(0 excluded, 2 bad lines skipped\)"):
        load_tickets(write(tmp_path, ["{", "["]), on_bad_line="skip")


def test_duplicate_keys_name_both_locations(tmp_path):
    a = write(tmp_path, [rec("A"), rec("B")], "a.jsonl")
    b = write(tmp_path, [rec("C"), rec("B", per_image={"image_1": "other"})], "b.jsonl")
    with pytest.raises(InputError) as err:
        load_tickets([a, b])
    assert err.value.location == f"{b}:2"
    assert f"duplicate ticket key 'B::pass' (first at {a}:2)" in err.value.message


def test_duplicates_are_errors_in_skip_mode_too(tmp_path):
    with pytest.raises(InputError, match="duplicate"):
        load_tickets(write(tmp_path, [rec("A"), rec("A")]), on_bad_line="skip")


def test_more_than_one_mission_names_them_with_counts(tmp_path):
    path = write(tmp_path, [rec("A"), rec("B", mission=RRU), rec("C"), rec("D", mission=RRU), rec("E")])
    with pytest.raises(InputError) as err:
        load_tickets(path)
    msg = str(err.value)
    assert f"'{BBU}' (3 tickets, first at {path}:1)" in msg
    assert f"'{RRU}' (2 tickets, first at {path}:2)" in msg


# ----------------------------------------------------------------------------- exclusions

def test_exclusions_union_of_list_and_file(tmp_path):
    f = tmp_path / "exclude.txt"
    f.write_text("# noisy labels\nB::pass\n\n  C::fail  \n# D::pass\n", encoding="utf-8")
    keys = load_exclusions(["A::pass", " "], f)
    assert keys == frozenset({"A::pass", "B::pass", "C::fail"})
    assert load_exclusions(["A::pass"], None) == frozenset({"A::pass"})
    assert load_exclusions([], None) == frozenset()


def test_exclusion_file_missing(tmp_path):
    with pytest.raises(InputError, match="exclusion list not found"):
        load_exclusions([], tmp_path / "nope.txt")


def test_exclusions_applied_and_counted(tmp_path):
    path = write(tmp_path, [rec("A"), rec("B"), rec("B", "fail"), rec("C")])
    report = load_tickets(path, exclude_keys=frozenset({"B::pass", "C::pass", "Z::pass"}))
    assert [t.key for t in report.tickets] == ["A::pass", "B::fail"]
    assert report.excluded == 2


def test_exclusion_happens_before_the_mission_check(tmp_path):
    path = write(tmp_path, [rec("A"), rec("B", mission=RRU)])
    assert [t.key for t in load_tickets(path, exclude_keys={"B::pass"}).tickets] == ["A::pass"]


def test_everything_excluded_is_empty(tmp_path):
    with pytest.raises(InputError, match=r"no tickets \(1 excluded"):
        load_tickets(write(tmp_path, [rec("A")]), exclude_keys={"A::pass"})


# ----------------------------------------------------------------------------- BBU clean-up

STATION_JSON = json.dumps({"备注": ["近景"], "统计": [
    {"类别": "BBU设备", "可见性": {"完整": 1}},
    {"类别": "站点距离", "站点距离": {"35": 1}},
], "分组统计": {"站点距离": {"35": 1}, "BBU": 1}}, ensure_ascii=False)


@pytest.mark.parametrize("raw,expected", [
    ("无关图片", "无关图片"),
    ("无关图片（室外远景）", "无关图片"),
    (STATION_JSON, '{"统计": [{"类别": "BBU设备", "可见性": {"完整": 1}}], "备注": ["近景"], "分组统计": {"BBU": 1}}'),
    ('{"统计":[{"类别":"标签","文本":{"站点距离35米":1}}]}', '{"统计": [{"类别": "标签", "文本": {"35米": 1}}]}'),
    ('{"other": 1}', '{"other": 1}'),  # nothing to remove
    ("<DOMAIN=BBU>, <TASK=SUMMARY>\n\n  螺丝齐全  \n", "螺丝齐全"),  # header and blank lines go, stripped
    ("BBU设备, 螺丝齐全", "BBU设备, 螺丝齐全"),
    ('统计=[{"类别": "BBU设备"}, {"类别": "站点距离", "站点距离": {"35": 1}}]', '统计=[{"类别": "BBU设备"}]'),
])
def test_bbu_clean_summary(raw, expected):
    assert bbu_clean_summary(raw) == expected


def test_bbu_cleanup_only_for_non_rru_missions(tmp_path):
    rows = [rec("A", per_image={"image_1": STATION_JSON, "image_2": "无关图片!"}),
            ]
    bbu = load_tickets(write(tmp_path, rows, "bbu.jsonl"), bbu_cleanup=True).tickets[0]
    assert "站点距离" not in bbu.per_image["image_1"] and bbu.per_image["image_2"] == "无关图片"
    raw = load_tickets(write(tmp_path, rows, "bbu.jsonl")).tickets[0]  # default: no clean-up
    assert raw.per_image["image_1"] == STATION_JSON
    rru_rows = [rec("A", mission=RRU, per_image={"image_1": STATION_JSON})]
    rru = load_tickets(write(tmp_path, rru_rows, "rru.jsonl"), bbu_cleanup=True).tickets[0]
    assert rru.per_image["image_1"] == STATION_JSON
    assert bbu_clean_tickets([raw, rru]) == [bbu, rru]


@pytest.mark.parametrize("raw,expected", [
    ('统计=[{"类别": "A"}, {"类别": "站点距离", "站点距离": {"35": 1}}, {"类别": "B"}]', '统计=[{"类别": "A"},{"类别": "B"}]'),
    ('统计=[{"类别": "站点距离", "站点距离": {"35": 1}}, {"类别": "B"}] 备注', '统计=[{"类别": "B"}] 备注'),
    ("站点距离=35, 设备完整", "=35, 设备完整"),  # no braces: the word itself is removed
])
def test_bbu_clean_unparsable_text(raw, expected):
    assert bbu_clean_summary(raw) == expected


@pytest.mark.parametrize("raw,expected", [
    # issue 14 §3 item 5: a truncated summary keeps its BBU entry, minus the distance
    ('{"统计": [{"类别": "BBU设备", "备注": "站点距离=5"}, {"类别": "站点距离", "站点距离": {"35": 1}}',
     '{"统计": [{"类别": "BBU设备", "备注": "=5"}'),
    # parseable JSON without a 统计 list: the distance still goes, the text keeps its form
    ('{"备注": ["站点距离=12"], "分组统计": {"站点距离": {"12": 1}, "BBU": 1}}', '{"备注": ["=12"], "分组统计": {"BBU": 1}}'),
    ('{"描述": "站点距离=12"}', '{"描述": "=12"}'),
    # text around one JSON object: the object is parsed and re-serialised, the rest dropped
    ('note: {"统计": [{"类别": "站点距离", "站点距离": {"3": 1}}, {"类别": "BBU设备"}]}', '{"统计": [{"类别": "BBU设备"}]}'),
    # upstream's other executed examples (docs/notes ingest.md section 3)
    ('{"统计": "x", "站点距离": 3}', '{"统计": "x"'),
    ('{"统计": [{"类别": "BBU设备", "备注": "站点距离=3"}], "备注": ["站点距离/5"]',
     '{"统计": [{"类别": "BBU设备", "备注": "=3"}], "备注": ["/5"]'),
    ('{"统计": [{"类别":"站点距离","站点距离":{"3":1}}, {"类别": "BBU设备"}]', '{"统计": [{"类别":}, {"类别": "BBU设备"}]'),
    ('  {"统计": [{"类别": "BBU设备"}], "分组统计": {"站点距离": {"3": 1}}}  ', '{"统计": [{"类别": "BBU设备"}], "分组统计": {}}'),
    ('[1, "站点距离"]', '[1, ""]'),
    ("", ""),
    ("   \n ", ""),
    ("{" * 500 + "站点距离", "{" * 500),  # hostile nesting: treated as text, no RecursionError
])
def test_bbu_clean_matches_upstream(raw, expected):
    assert bbu_clean_summary(raw) == expected


# --------------------------------------------------------------- the line size limit (issue 21)

@pytest.mark.parametrize("newline", ["\n", "\r\n"])
def test_a_line_at_the_limit_is_read_and_one_byte_more_is_a_located_bad_line(tmp_path, newline):
    good = line(rec("A"))
    limit = len(good.encode())
    path = write(tmp_path, [rec("A"), rec("B", per_image={"image_1": "x" * 300}), rec("C")], newline=newline)
    over = len(line(rec("B", per_image={"image_1": "x" * 300})).encode())
    assert over > limit
    with pytest.raises(InputError) as err:
        load_tickets(path, max_line_bytes=over - 1)
    assert err.value.location == f"{path}:2"
    assert err.value.message == f"a line of {over} bytes, over ingest.max_line_bytes ({over - 1})"
    assert [t.group_id for t in load_tickets(path, max_line_bytes=over).tickets] == ["A", "B", "C"]


@pytest.mark.parametrize("size", [200, 4096, 3 * (1 << 20) + 7])  # shorter, longer than one read block
def test_an_over_long_line_is_skipped_whole_in_skip_mode(tmp_path, size):
    path = tmp_path / "t.jsonl"
    path.write_text(line(rec("A")) + "\n" + "x" * size + "\n" + line(rec("C")))  # no final newline
    report = load_tickets(path, on_bad_line="skip", max_line_bytes=len(line(rec("A")).encode()) + 2)
    assert [t.group_id for t in report.tickets] == ["A", "C"]
    assert report.skipped == [{"location": f"{path}:2",
                               "error": f"a line of {size} bytes, over ingest.max_line_bytes "
                                        f"({len(line(rec('A')).encode()) + 2})"}]


def test_a_bom_before_the_first_line_is_not_counted_against_the_limit(tmp_path):
    path = write(tmp_path, [rec("A")], bom=True)
    limit = len(line(rec("A")).encode())
    assert [t.group_id for t in load_tickets(path, max_line_bytes=limit).tickets] == ["A"]
