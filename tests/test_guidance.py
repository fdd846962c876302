"""Guidance file validation, edit invariants (upstream 1.3), atomic writes and snapshots."""

from __future__ import annotations

import json
import os

import msgspec
import pytest

from stageb_pool.stageb.errors import InputError
from stageb_pool.stageb.guidance import (
    ExperienceMeta,
    Guidance,
    GuidanceError,
    Operation,
    apply_operation,
    load_guidance,
)
from stageb_pool.search.guidance_store import GuidanceStore
from stageb_pool.stageb.hashing import content_hash

M = "BBU安装方式检查（正装）"
T0 = "2025-03-20T08:00:00+00:00"
NOW = "2025-03-21T09:30:00+00:00"


def section(**over):
    base = {"step": 1, "updated_at": T0, "experiences": {"G0": "需确认螺丝", "S1": "无法确认则不通过"}}
    base.update(over)
    return base


def write_file(tmp_path, data, name="guidance.json"):
    path = tmp_path / name
    path.write_text(json.dumps(data, ensure_ascii=False), encoding="utf-8")
    return path


def G(experiences, metadata=None, step=3):
    return Guidance(step=step, updated_at=T0, experiences=dict(experiences), metadata=dict(metadata or {}))


def apply(g, **op):
    return apply_operation(g, Operation(**op), now=NOW, reflection_id="refl-1")


# ----------------------------------------------------------------------------- loading

def test_load_valid_file(tmp_path):
    meta = {"G1": {"updated_at": T0, "reflection_id": "r1", "sources": ["a::pass"], "hit_count": 2}}
    path = write_file(tmp_path, {M: section(experiences={"G0": " 检查 ", "G1": "规则"}, metadata=meta), "其他": section()})
    g = load_guidance(path, M)
    assert g.step == 1 and g.updated_at == T0
    assert g.experiences == {"G0": "检查", "G1": "规则"}  # stored stripped
    assert g.metadata["G1"] == ExperienceMeta(updated_at=T0, reflection_id="r1", sources=["a::pass"], hit_count=2)
    assert g.hash == content_hash({"G0": "检查", "G1": "规则"})


def test_hash_depends_on_experiences_only():
    a = G({"G0": "x", "G1": "y"}, step=1)
    b = G({"G1": "y", "G0": "x"}, step=9)
    assert a.hash == b.hash
    assert a.hash != G({"G0": "x", "G1": "z"}).hash


def test_hash_is_computed_once_per_value(monkeypatch):
    from stageb_pool.stageb import guidance as guidance_mod

    calls = []
    monkeypatch.setattr(guidance_mod, "content_hash", lambda value: calls.append(value) or content_hash(value))
    g = G({"G0": "x"})
    assert g.hash == g.hash == content_hash({"G0": "x"})
    assert len(calls) == 1
    assert msgspec.to_builtins(g) == {"step": 3, "updated_at": T0, "experiences": {"G0": "x"}, "metadata": {}}


def test_focus_is_promoted_into_g0(tmp_path):
    data = {M: section(experiences={"G1": "r"}, focus="焦点"), "B": section(experiences={"G0": "Initial guidance placeholder"}, focus="f")}
    path = write_file(tmp_path, data)
    assert load_guidance(path, M).experiences == {"G0": "焦点", "G1": "r"}
    assert load_guidance(path, "B").experiences["G0"] == "f"


def test_mission_absent_names_the_missions_there(tmp_path):
    path = write_file(tmp_path, {"A": section(), "B": section()})
    with pytest.raises(InputError) as err:
        load_guidance(path, M)
    assert err.value.location == str(path)
    assert "'A', 'B'" in err.value.message and M in err.value.message


@pytest.mark.parametrize("mutate,keypath,message", [
    (lambda s: s["experiences"].pop("G0"), "experiences.G0", "missing"),
    (lambda s: s.pop("step"), "step", "missing"),
    (lambda s: s.update(step=True), "step", "must be a non-negative integer"),
    (lambda s: s.update(step="1"), "step", "must be a non-negative integer"),
    (lambda s: s.update(step=-1), "step", "must be a non-negative integer"),
    (lambda s: s.pop("updated_at"), "updated_at", "missing"),
    (lambda s: s.update(updated_at="yesterday"), "updated_at", "must be an ISO-8601"),
    (lambda s: s.pop("experiences"), "experiences", "missing"),
    (lambda s: s.update(experiences={}), "experiences", "must be a non-empty object"),
    (lambda s: s.update(experiences=["G0"]), "experiences", "must be a non-empty object"),
    (lambda s: s["experiences"].update(G1="  "), "experiences.G1", "must be a non-empty string"),
    (lambda s: s["experiences"].update(G1=3), "experiences.G1", "must be a non-empty string"),
    (lambda s: s.update(focus=3), "focus", "must be a string"),
    (lambda s: s.update(rules=[]), "rules", "unknown field"),
    (lambda s: s.update(metadata=[]), "metadata", "must be an object"),
    (lambda s: s.update(metadata={"G1": {"reflection_id": "r"}}), "metadata.G1.updated_at", "missing"),
    (lambda s: s.update(metadata={"G1": {"updated_at": "x", "reflection_id": "r"}}), "metadata.G1.updated_at", "must be an ISO-8601"),
    (lambda s: s.update(metadata={"G1": {"updated_at": T0}}), "metadata.G1.reflection_id", "missing"),
    (lambda s: s.update(metadata={"G1": {"updated_at": T0, "reflection_id": ""}}), "metadata.G1.reflection_id", "must be a non-empty string"),
    (lambda s: s.update(metadata={"G1": {"updated_at": T0, "reflection_id": "r", "sources": "a"}}), "metadata.G1.sources", "must be a list of strings"),
    (lambda s: s.update(metadata={"G1": {"updated_at": T0, "reflection_id": "r", "hit_count": 1.5}}), "metadata.G1.hit_count", "must be a non-negative integer"),
    (lambda s: s.update(metadata={"G1": {"updated_at": T0, "reflection_id": "r", "confidence": "high"}}), "metadata.G1.confidence", "must be a number"),
    (lambda s: s.update(metadata={"G1": {"updated_at": T0, "reflection_id": "r", "colour": 1}}), "metadata.G1.colour", "unknown field"),
])
def test_malformed_section_names_the_key_path(tmp_path, mutate, keypath, message):
    s = section()
    mutate(s)
    path = write_file(tmp_path, {M: s})
    with pytest.raises(InputError) as err:
        load_guidance(path, M)
    assert err.value.location == f"{path}: {M}: {keypath}"
    assert err.value.message.startswith(message)
    assert str(err.value).startswith(f"{path}: {M}: {keypath}: {message}")


@pytest.mark.parametrize("content,message", [
    (b"{nope", "invalid JSON"),
    (b"[1, 2]", "must be a JSON object keyed by mission"),
])
def test_malformed_file(tmp_path, content, message):
    path = tmp_path / "g.json"
    path.write_bytes(content)
    with pytest.raises(InputError, match=message):
        load_guidance(path, M)


def test_section_not_an_object(tmp_path):
    with pytest.raises(InputError, match="must be an object"):
        load_guidance(write_file(tmp_path, {M: []}), M)


def test_legacy_schema_rejected(tmp_path):
    with pytest.raises(InputError, match="legacy schema"):
        load_guidance(write_file(tmp_path, {M: {"version": 1, "guidance": ["a"]}}), M)


def test_missing_file(tmp_path):
    with pytest.raises(InputError, match="guidance file not found"):
        load_guidance(tmp_path / "nope.json", M)


def test_json_errors_give_line_and_column(tmp_path):
    path = tmp_path / "g.json"
    path.write_text('{\n  "M": {\n    "step": 1,,\n  }\n}\n', encoding="utf-8")
    with pytest.raises(InputError) as err:
        load_guidance(path, M)
    assert err.value.location == f"{path}:3:15" and err.value.message.startswith("invalid JSON")


@pytest.mark.parametrize("text, location, message", [
    # a rule key or a mission section given twice: refused, not the last one kept
    ('{"M": {"step": 1, "updated_at": "%s", "experiences": {"G0": "a", "G1": "b", "G1": "c"}}}' % T0,
     "M.experiences", "key 'G1' is given twice"),
    ('{"M": {"step": 1}, "M": {"step": 2}}', "", "key 'M' is given twice"),
    ('{"M": {"step": 1, "updated_at": "%s", "experiences": {"G0": "\\ud800"}}}' % T0,
     "M.experiences.G0", "lone surrogate"),
])
def test_strict_json_content_problems_name_the_key_path(tmp_path, text, location, message):
    path = tmp_path / "g.json"
    path.write_text(text, encoding="utf-8")
    with pytest.raises(InputError) as err:
        load_guidance(path, "M")
    assert err.value.location == (f"{path}: {location}" if location else str(path))
    assert err.value.message.startswith(message)


@pytest.mark.parametrize("content, location, message", [
    (b'{"M": ' + b"[" * 1000 + b"]" * 1000 + b"}", ":1:106", "JSON nested deeper than 100 levels"),
    (b'{"M": {"step": 1, "updated_at": "x", "experiences": {"G0": "\xff"}}}', ":1:61", "not valid UTF-8"),
    (b'{"M": {"step": ' + b"1" * 4301 + b"}}", ":1:16", "invalid JSON: Exceeds the limit (4300 digits)"),
])
def test_hostile_guidance_bytes_are_located(tmp_path, content, location, message):
    path = tmp_path / "g.json"
    path.write_bytes(content)
    with pytest.raises(InputError) as err:
        load_guidance(path, "M")
    assert err.value.location == f"{path}{location}" and err.value.message.startswith(message)


def test_a_huge_rule_key_is_refused_at_load(tmp_path):
    key = "G" + "1" * 5000  # would kill the worker that orders the rules by number
    path = write_file(tmp_path, {M: section(experiences={"G0": "a", key: "b"})})
    with pytest.raises(InputError) as err:
        load_guidance(path, M)
    assert err.value.location.startswith(f"{path}: {M}: experiences.G1111")
    assert len(str(err.value)) < 300 and "rule key too long" in err.value.message


def test_bom_and_fifo(tmp_path):
    path = tmp_path / "g.json"
    path.write_bytes(b"\xef\xbb\xbf" + json.dumps({M: section()}).encode())
    assert load_guidance(path, M).experiences["G0"] == "需确认螺丝"  # a BOM is accepted, as in every input
    fifo = tmp_path / "g.fifo"
    os.mkfifo(fifo)
    with pytest.raises(InputError, match="not a regular file"):
        load_guidance(fifo, M)


# ----------------------------------------------------------------------------- operations

BASE = {"G0": "检查螺丝", "S1": "无法确认则不通过", "G1": "螺丝松动则不通过", "G2": "标签缺失则不通过"}


def test_preview_is_pure_and_bumps_step():
    g = G(BASE)
    new = apply(g, op="upsert", text="新规则")
    assert g.experiences == BASE and g.step == 3 and g.metadata == {}
    assert new.step == 4 and new.updated_at == NOW
    assert new.experiences == {**BASE, "G3": "新规则"}


def test_upsert_without_key_takes_lowest_unused():
    g = G({"G0": "a", "G1": "b", "G3": "d"})
    assert "G2" in apply(g, op="upsert", text="c").experiences
    assert "G1" in apply(G({"G0": "a", "G5": "x"}), op="upsert", text="c").experiences


def test_upsert_with_key_creates_or_rewrites():
    g = G(BASE)
    assert apply(g, op="upsert", key="G7", text="x").experiences["G7"] == "x"
    assert apply(g, op="upsert", key="G1", text="改写").experiences["G1"] == "改写"


@pytest.mark.parametrize("given, stored", [
    ("若螺丝松动则判定不通过。", "若螺丝松动则判定不通过。"),  # upstream stores and prompts the text as given
    ("  接地线\u3000缺失   则不通过。。 \n", "接地线\u3000缺失   则不通过。。"),  # outer whitespace stripped only
    ("第一行\n第二行", "第一行\n第二行"),
])
def test_text_is_stored_as_given(given, stored):
    new = apply(G(BASE), op="upsert", text=given)
    assert new.experiences["G3"] == stored


def test_a_second_identical_upsert_is_a_no_op_write_not_an_error():
    g1 = apply(G(BASE), op="upsert", text="若螺丝松动则判定不通过。", evidence=["k0"])
    g2 = apply(g1, op="upsert", text="若螺丝松动则判定不通过。", evidence=["k1"])
    assert g2.experiences == g1.experiences and g2.step == g1.step + 1
    meta = g2.metadata["G3"]
    assert (meta.hit_count, meta.miss_count, meta.sources) == (2, 0, ["k1", "k0"])


def test_identical_text_redirects_to_the_existing_key():
    g = G(BASE, metadata={"G2": ExperienceMeta(updated_at=T0, reflection_id="old", sources=["s::fail"], hit_count=1)})
    # upsert of an existing rule's text (compared without the trailing 。) rewrites that rule
    new = apply(g, op="upsert", text="标签 缺失则不通过。")
    assert new.experiences == {**BASE, "G2": "标签 缺失则不通过。"}
    assert new.metadata["G2"].hit_count == 2 and new.step == g.step + 1
    # update of G1 with G2's text rewrites G2, not G1
    assert apply(g, op="update", key="G1", text="标签缺失则不通过").experiences == BASE
    # merge into G5 with G2's text lands on G2 and folds G1 into it
    new = apply(g, op="merge", key="G5", text="标签缺失则不通过", merged_from=["G1", "G2"])
    assert new.experiences == {"G0": "检查螺丝", "S1": "无法确认则不通过", "G2": "标签缺失则不通过"}
    assert new.metadata["G2"].hit_count == 2


def test_identical_to_scaffold_is_refused():
    with pytest.raises(GuidanceError, match="scaffold rule S1"):
        apply(G(BASE), op="upsert", text="无法确认则不通过")


def test_update_needs_an_existing_key():
    with pytest.raises(GuidanceError, match="does not exist"):
        apply(G(BASE), op="update", key="G9", text="x")
    with pytest.raises(GuidanceError, match="needs a key"):
        apply(G(BASE), op="update", text="x")


def test_g0_is_updatable_but_not_removable():
    assert apply(G(BASE), op="update", key="G0", text="新清单").experiences["G0"] == "新清单"
    with pytest.raises(GuidanceError, match="G0"):
        apply(G(BASE), op="remove", key="G0")
    with pytest.raises(GuidanceError, match="G0"):
        apply(G(BASE), op="merge", key="G1", text="合并", merged_from=["G0", "G1"])


@pytest.mark.parametrize("op", [
    dict(op="update", key="S1", text="x"),
    dict(op="upsert", key="S2", text="x"),
    dict(op="remove", key="S1"),
    dict(op="merge", key="S1", text="x", merged_from=["G1"]),
    dict(op="merge", key="G1", text="x", merged_from=["S1"]),
])
def test_scaffold_rules_are_read_only(op):
    with pytest.raises(GuidanceError, match="read-only"):
        apply(G(BASE), **op)


@pytest.mark.parametrize("key", ["focus", "g1", "G1a", "X3", ""])
def test_only_g_keys_are_editable(key):
    with pytest.raises(GuidanceError, match="not a learnable rule key"):
        apply(G(BASE), op="upsert", key=key, text="x")


def test_remove():
    g = G(BASE, metadata={"G1": ExperienceMeta(updated_at=T0, reflection_id="r")})
    new = apply(g, op="remove", key="G1")
    assert "G1" not in new.experiences and "G1" not in new.metadata
    with pytest.raises(GuidanceError, match="did not modify"):
        apply(g, op="remove", key="G9")  # missing key: nothing changes (upstream's error too)
    with pytest.raises(GuidanceError, match="needs a key"):
        apply(g, op="remove")


@pytest.mark.parametrize("op", [dict(op="upsert"), dict(op="upsert", text="  。"), dict(op="rename", key="G1", text="x")])
def test_invalid_operations(op):
    with pytest.raises(GuidanceError):
        apply(G(BASE), **op)


def test_merge_folds_metadata_and_deletes_merged_from():
    meta = {
        "G1": ExperienceMeta(updated_at=T0, reflection_id="a", sources=["t1", "t2"], rationale="旧理由", hit_count=2, miss_count=1),
        "G2": ExperienceMeta(updated_at=T0, reflection_id="b", sources=["t2", "t3"], hit_count=1, miss_count=3),
    }
    g = G(BASE, metadata=meta)
    new = apply(g, op="merge", key="G1", text="螺丝或标签有问题则不通过", merged_from=["G2", "G1", "G9"], evidence=["e1", "t3"])
    assert new.experiences == {"G0": "检查螺丝", "S1": "无法确认则不通过", "G1": "螺丝或标签有问题则不通过"}
    assert set(new.metadata) == {"G1"}
    m = new.metadata["G1"]
    assert (m.hit_count, m.miss_count) == (4, 4)  # 2 + 1 + this write; 1 + 3
    assert m.confidence == pytest.approx(4 / (8 + 1e-5))
    assert m.sources == ["e1", "t3", "t1", "t2"]  # evidence first, then old sources, de-duplicated
    assert m.rationale == "旧理由"  # no new rationale: the old one stays
    assert (m.updated_at, m.reflection_id) == (NOW, "refl-1")
    assert g.metadata == meta  # the input was not touched


def test_merge_without_rationale_keeps_the_first_one_of_target_then_merged():
    meta = {"G2": ExperienceMeta(updated_at=T0, reflection_id="a", sources=["t2"], hit_count=1),
            "G3": ExperienceMeta(updated_at=T0, reflection_id="b", rationale="B", sources=["t3"], hit_count=1)}
    g = G({**BASE, "G3": "三"}, metadata=meta)
    m = apply(g, op="merge", key="G2", text="合并后", merged_from=["G3"], evidence=["e1"]).metadata["G2"]
    assert (m.rationale, m.sources, m.hit_count) == ("B", ["e1", "t2", "t3"], 3)
    meta["G2"] = msgspec.structs.replace(meta["G2"], rationale="A")
    g = G({**BASE, "G3": "三"}, metadata=meta)
    assert apply(g, op="merge", key="G2", text="合并后", merged_from=["G3"], rationale=" ").metadata["G2"].rationale == "A"


def test_new_rationale_replaces_old():
    meta = {"G1": ExperienceMeta(updated_at=T0, reflection_id="a", rationale="旧")}
    new = apply(G(BASE, metadata=meta), op="update", key="G1", text="新文本", rationale="新")
    assert new.metadata["G1"].rationale == "新"
    assert new.metadata["G1"].hit_count == 1 and new.metadata["G1"].confidence == pytest.approx(1 / (1 + 1e-5))


# ----------------------------------------------------------------------------- store

def store(tmp_path, retention=2):
    return GuidanceStore(tmp_path / "run", M, retention)


def test_write_and_load_round_trip(tmp_path):
    r = store(tmp_path)
    assert not r.exists()
    g = apply(G(BASE), op="upsert", text="新规则", evidence=["a::pass"])
    r.write(g)
    assert r.exists() and r.path == tmp_path / "run" / "guidance.json"
    assert list(json.loads(r.path.read_text(encoding="utf-8"))) == [M]
    assert r.load() == g


def test_snapshots_named_by_step_and_pruned(tmp_path):
    r = store(tmp_path, retention=2)
    g = G(BASE, step=0)
    assert r.snapshot_and_write(None, g) is None  # first write: nothing to snapshot
    contents = {}
    for i in range(4):
        contents[g.step] = r.path.read_bytes()
        new = apply(g, op="upsert", text=f"规则{i}")
        snap = r.snapshot_and_write(g, new)
        assert snap.name == f"guidance-step{g.step:04d}.json"
        assert snap.read_bytes() == contents[g.step]  # the same bytes as the replaced file
        g = new
    assert [p.name for p in r.snapshots()] == ["guidance-step0002.json", "guidance-step0003.json"]
    assert r.load() == g and g.step == 4


def test_retention_zero_keeps_no_snapshot(tmp_path):
    r = store(tmp_path, retention=0)
    r.write(G(BASE, step=0))
    r.snapshot_and_write(G(BASE, step=0), G(BASE, step=1))
    assert r.snapshots() == []


def test_retention_orders_by_step_not_name(tmp_path):
    r = store(tmp_path, retention=1)
    r.write(G(BASE, step=9999))
    r.snapshot_and_write(G(BASE, step=9999), G(BASE, step=10000))
    r.snapshot_and_write(G(BASE, step=10000), G(BASE, step=10001))
    assert [p.name for p in r.snapshots()] == ["guidance-step10000.json"]


def test_failed_rename_leaves_the_old_file_intact(tmp_path, monkeypatch):
    r = store(tmp_path)
    old = G(BASE, step=1)
    r.write(old)
    before = r.path.read_bytes()

    def crash(src, dst):
        raise OSError("simulated crash between write and rename")

    monkeypatch.setattr(os, "replace", crash)
    with pytest.raises(OSError, match="simulated crash"):
        r.write(apply(old, op="upsert", text="新"))
    monkeypatch.undo()
    assert r.path.read_bytes() == before
    assert r.load() == old
    assert [p.name for p in r.path.parent.iterdir()] == ["guidance.json"]  # no temp file left
