"""The committed demo data is exactly what the generator writes, and it is usable."""

from __future__ import annotations

import collections
import importlib.util
import json
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
DEMO = REPO / "configs" / "demo"


def _generator():
    spec = importlib.util.spec_from_file_location("make_tickets", DEMO / "make_tickets.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_committed_files_equal_a_fresh_generation(tmp_path):
    rendered = _generator().render(str(tmp_path))
    assert set(rendered) == {str(tmp_path / "tickets.jsonl"), str(tmp_path / "guidance.json")}
    for path, data in rendered.items():
        assert (DEMO / Path(path).name).read_bytes() == data, f"{Path(path).name} is stale: run configs/demo/make_tickets.py"


def test_tickets_have_the_stage_a_shape_and_both_labels():
    rows = [json.loads(line) for line in (DEMO / "tickets.jsonl").read_text().splitlines()]
    assert 150 <= len(rows) <= 250
    labels = collections.Counter(r["label"] for r in rows)
    assert set(labels) == {"pass", "fail"} and min(labels.values()) >= 0.3 * len(rows)
    assert len({r["group_id"] for r in rows}) == len(rows)
    assert {r["mission"] for r in rows} == {"Rooftop antenna mount inspection"}
    for r in rows:
        assert {"group_id", "mission", "label", "per_image", "label_source", "label_timestamp"} <= set(r)
        assert list(r["per_image"]) == [f"image_{i + 1}" for i in range(len(r["per_image"]))]
        for text in r["per_image"].values():
            body = text.splitlines()[-1]
            if body != "irrelevant photo":
                summary = json.loads(body)
                assert set(summary) in ({"stats"}, {"stats", "notes"}) and all("category" in s for s in summary["stats"])


def test_labels_mostly_follow_the_hidden_rules():
    """The hidden rules explain ~95% of the labels (the rest is the documented noise)."""
    gen = _generator()
    rows = [json.loads(line) for line in (DEMO / "tickets.jsonl").read_text().splitlines()]

    def rule_label(row) -> str:
        stats = [s for t in row["per_image"].values() if t != "irrelevant photo" for s in json.loads(t.splitlines()[-1])["stats"]]
        cats = [s["category"] for s in stats]
        bad_bolt = any(s["category"] == "mounting bolt" and ({"loose", "missing"} & set(s["condition"])) for s in stats)
        bad_seal = any(s["category"] == "weatherproof seal" and ({"cracked", "peeling"} & set(s["condition"])) for s in stats)
        fails = bad_bolt or bad_seal or "grounding cable" not in cats or "antenna mount" not in cats
        return "fail" if fails else "pass"

    agree = sum(rule_label(r) == r["label"] for r in rows) / len(rows)
    assert 0.9 <= agree < 1.0
    assert gen.NOISE == 0.05


def test_seed_guidance_has_g0_a_scaffold_rule_and_an_unhelpful_rule_only():
    data = json.loads((DEMO / "guidance.json").read_text())
    [(mission, section)] = data.items()
    assert mission == "Rooftop antenna mount inspection"
    assert set(section["experiences"]) == {"G0", "S1", "G1"}
    assert "blurry" in section["experiences"]["G1"]  # a distractor: something to ablate
    text = " ".join(section["experiences"].values()).lower()
    for hidden in ("bolt", "grounding", "seal"):
        assert hidden not in text
