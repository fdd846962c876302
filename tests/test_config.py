"""Config loading: every malformed config gives an InputError naming the file and the key
(or line); valid configs resolve paths, defaults and seeds as documented."""

from __future__ import annotations

import os
import re
import textwrap
from pathlib import Path

import msgspec
import pytest

from stageb_pool.app import config as cfgmod
from stageb_pool.app.config import Config, config_document, config_keys, load_config
from stageb_pool.stageb.errors import InputError

REPO = Path(__file__).resolve().parents[1]

BASE = """\
seed: 7
stage_a_paths: data/tickets.jsonl
guidance:
  path: data/guidance.json
output:
  root: out
  run_name: r1
rule_search:
  proposer_prompt_path: data/proposer.txt
  train_sampler:
    grid:
      - {temperature: 0.3, top_p: 0.9, max_new_tokens: 64}
  eval_sampler:
    grid:
      - {temperature: 0.1, top_p: 0.9, max_new_tokens: 64}
"""


@pytest.fixture
def cfgdir(tmp_path):
    data = tmp_path / "data"
    data.mkdir()
    (data / "tickets.jsonl").write_text("{}\n")
    (data / "guidance.json").write_text("{}\n")
    (data / "proposer.txt").write_text("propose\n")
    return tmp_path


def write(cfgdir: Path, text: str, name: str = "c.yaml") -> Path:
    path = cfgdir / name
    path.write_text(textwrap.dedent(text))
    return path


def load(cfgdir, text=BASE, overrides=()):
    return load_config(write(cfgdir, text), overrides)


def error_of(cfgdir, text=BASE, overrides=()) -> InputError:
    with pytest.raises(InputError) as info:
        load(cfgdir, text, overrides)
    return info.value


# --- valid configs ------------------------------------------------------------------------


def test_minimal_config_gets_documented_defaults(cfgdir):
    cfg = load(cfgdir)
    assert cfg.mode == "search"
    assert cfg.model.path == "embedded" and cfg.prompt.profile == "generic"
    assert cfg.runner.chunk_size == 16 and cfg.runner.epochs == 10
    assert cfg.rule_search.gate.max_changed_fraction == 0.05
    assert cfg.pool.task_timeout == 600.0 and cfg.pool.max_restarts == 0
    assert cfg.rule_search.train_sampler.grid[0].temperature == 0.3
    assert cfg.stage_b_distillation.enabled is False  # resolved: no distill_size, no export


def test_relative_paths_resolve_against_the_config_directory(cfgdir, monkeypatch):
    monkeypatch.chdir("/")
    cfg = load(cfgdir)
    assert cfg.stage_a_paths == [str(cfgdir / "data" / "tickets.jsonl")]  # single string became a list
    assert cfg.guidance.path == str(cfgdir / "data" / "guidance.json")
    assert cfg.output.root == str(cfgdir / "out")
    assert cfg.rule_search.proposer_prompt_path == str(cfgdir / "data" / "proposer.txt")
    assert all(os.path.isabs(p) for p in cfg.stage_a_paths)


def test_path_like_profile_resolves_but_a_name_stays_a_name(cfgdir):
    (cfgdir / "myprofile").mkdir()
    assert load(cfgdir).prompt.profile == "generic"
    cfg = load(cfgdir, overrides=["prompt.profile=./myprofile"])
    assert cfg.prompt.profile == str(cfgdir / "myprofile")


def test_bootstrap_seed_defaults_to_the_top_level_seed(cfgdir):
    assert load(cfgdir).rule_search.gate.bootstrap.seed == 7
    assert load(cfgdir, overrides=["rule_search.gate.bootstrap.seed=99"]).rule_search.gate.bootstrap.seed == 99
    assert load(cfgdir).stage_b_distillation.distill_seed == 7
    size = "stage_b_distillation.distill_size=5"
    assert load(cfgdir, overrides=[size, "stage_b_distillation.distill_seed=0"]).stage_b_distillation.distill_seed == 0


@pytest.mark.parametrize("overrides, enabled", [
    ((), False),
    (("stage_b_distillation.distill_size=5",), True),  # upstream: enabled unless switched off
    (("stage_b_distillation.enabled=true", "stage_b_distillation.distill_size=5"), True),
    (("stage_b_distillation.enabled=false",), False),
])
def test_the_distillation_export_is_on_when_it_has_a_size(cfgdir, overrides, enabled):
    assert load(cfgdir, overrides=overrides).stage_b_distillation.enabled is enabled


@pytest.mark.parametrize("overrides, key", [
    (("stage_b_distillation.enabled=true",), "stage_b_distillation.distill_size"),
    (("stage_b_distillation.enabled=false", "stage_b_distillation.distill_size=5"), "stage_b_distillation.distill_size"),
    (("stage_b_distillation.distill_temperature=0.1",), "stage_b_distillation.distill_temperature"),
    (("stage_b_distillation.distill_seed=3",), "stage_b_distillation.distill_seed"),
    (("stage_b_distillation.log_chatml_path=x.jsonl",), "stage_b_distillation.log_chatml_path"),
])
def test_no_distillation_setting_is_ignored(cfgdir, overrides, key):
    err = error_of(cfgdir, overrides=overrides)
    assert err.location.endswith(f"c.yaml: {key}")


def test_a_loaded_config_is_a_frozen_value(cfgdir):
    cfg = load(cfgdir)
    for section, key in ((cfg, "seed"), (cfg.output, "save_rollouts"), (cfg.rule_search.gate.bootstrap, "seed")):
        with pytest.raises(AttributeError):
            setattr(section, key, 1)
    audit = cfgmod.with_mode(cfg, True)
    assert (audit.mode, cfg.mode) == ("audit", "search")
    assert cfgmod.with_mode(cfg, False) is cfg
    assert cfgmod.replace_at(cfg, "rule_search.gate.bootstrap.seed", 5).rule_search.gate.bootstrap.seed == 5
    assert cfg.rule_search.gate.bootstrap.seed == 7


def test_max_changed_fraction_zero_means_zero(cfgdir):
    cfg = load(cfgdir, overrides=["rule_search.gate.max_changed_fraction=0"])
    assert cfg.rule_search.gate.max_changed_fraction == 0.0


def test_set_overrides_nested_keys_and_list_items(cfgdir):
    cfg = load(cfgdir, overrides=["runner.chunk_size=4", "rule_search.train_sampler.grid.0.temperature=0.9",
                                  "model.stop=[a, b]", "ingest.on_bad_line=skip"])
    assert cfg.runner.chunk_size == 4
    assert cfg.rule_search.train_sampler.grid[0].temperature == 0.9
    assert cfg.model.stop == ["a", "b"]
    assert cfg.ingest.on_bad_line == "skip"


def test_yaml_exponent_without_dot_is_a_float(cfgdir):
    cfg = load(cfgdir, BASE + "pool:\n  task_timeout: 1e3\n")
    assert cfg.pool.task_timeout == 1000.0


def test_empty_section_means_defaults(cfgdir):
    assert load(cfgdir, BASE + "ticket_filter:\n").ticket_filter.exclude_ticket_keys == []


def test_config_document_leaves_out_output_only(cfgdir):
    a = load(cfgdir)
    b = load(cfgdir, overrides=["output.run_name=other", "output.root=elsewhere"])
    c = load(cfgdir, overrides=["runner.chunk_size=4"])
    assert config_document(a) == config_document(b) and "output" not in config_document(a)
    assert config_document(a) != config_document(c)


def test_check_files_false_skips_existence_checks(cfgdir):
    path = write(cfgdir, BASE.replace("data/tickets.jsonl", "/no/such/file.jsonl"))
    assert load_config(path, check_files=False).stage_a_paths == ["/no/such/file.jsonl"]


# --- malformed configs: each names the file and the key (or line) ------------------------

KEY_ERRORS = [
    # (description, yaml appended or overrides, expected key path, expected words in message)
    ("unknown top-level key", BASE + "sed: 3\n", (), "sed", "did you mean 'seed'"),
    ("unknown nested key", BASE + "runner:\n  chunk_sise: 3\n", (), "runner.chunk_sise", "did you mean 'runner.chunk_size'"),
    ("unknown key in a grid entry", BASE.replace("max_new_tokens: 64}", "max_new_token: 64}", 1), (),
     "rule_search.train_sampler.grid[0].max_new_token", "did you mean"),
    ("wrong type", BASE + "runner:\n  chunk_size: eight\n", (), "runner.chunk_size", "expected int"),
    ("string 'false' is not a bool", BASE, ("output.save_rollouts='false'",), "output.save_rollouts", "expected bool"),
    ("negative size", BASE, ("rule_search.train_pool_size=-5",), "rule_search.train_pool_size", ">= 1"),
    ("zero chunk size", BASE, ("runner.chunk_size=0",), "runner.chunk_size", ">= 1"),
    ("probability above 1", BASE, ("rule_search.gate.bootstrap.min_prob=1.5",), "rule_search.gate.bootstrap.min_prob", "<= 1"),
    ("negative fraction", BASE, ("rule_search.gate.max_changed_fraction=-0.1",), "rule_search.gate.max_changed_fraction", ">= 0"),
    ("top_p zero", BASE, ("rule_search.proposer_top_p=0",), "rule_search.proposer_top_p", "> 0"),
    ("negative decode temperature", BASE, ("rule_search.eval_sampler.grid.0.temperature=-0.5",),
     "rule_search.eval_sampler.grid[0].temperature", "[0, 100]"),
    ("decode top_p above 1", BASE, ("rule_search.train_sampler.grid.0.top_p=1.5",), "rule_search.train_sampler.grid[0].top_p", "(0, 1]"),
    ("empty grid", BASE, ("rule_search.train_sampler.grid=[]",), "rule_search.train_sampler.grid", "length >= 1"),
    ("bad enum", BASE + "mode: jump\n", (), "mode", "'search', 'audit'"),
    ("nan", BASE + "pool:\n  task_timeout: .nan\n", (), "pool.task_timeout", "finite"),
    ("section of wrong type", BASE + "pool: 5\n", (), "pool", "expected object"),
    ("run name with a slash", BASE, ("output.run_name=a/b",), "output.run_name", "plain directory name"),
    ("bool for an int", BASE.replace("seed: 7", "seed: true"), (), "seed", "expected int"),
    ("quoted number", BASE + "pool:\n  task_timeout: '30'\n", (), "pool.task_timeout", "without quotes"),
]


@pytest.mark.parametrize("desc,text,overrides,key,words", KEY_ERRORS, ids=[c[0] for c in KEY_ERRORS])
def test_malformed_config_names_file_and_key(cfgdir, desc, text, overrides, key, words):
    err = error_of(cfgdir, text, overrides)
    assert err.location == f"{cfgdir / 'c.yaml'}: {key}", str(err)
    assert words in err.message, str(err)
    assert "\n" not in str(err)


@pytest.mark.parametrize("missing", ["seed", "guidance", "output", "rule_search"])
def test_missing_required_key(cfgdir, missing):
    lines = BASE.splitlines(keepends=True)
    start = next(i for i, line in enumerate(lines) if line.startswith(missing + ":"))
    end = next((i for i in range(start + 1, len(lines)) if not lines[i].startswith(" ")), len(lines))
    err = error_of(cfgdir, "".join(lines[:start] + lines[end:]))
    assert err.location == f"{cfgdir / 'c.yaml'}: {missing}"
    assert f"missing required key '{missing}'" in err.message


def test_missing_nested_required_key(cfgdir):
    err = error_of(cfgdir, BASE.replace("  run_name: r1\n", ""))
    assert err.location.endswith("c.yaml: output.run_name")


LEGACY = [
    ("model:\n  torch_dtype: bfloat16\n", "model.torch_dtype", "model.dtype"),
    ("model:\n  device_map: auto\n", "model.device_map", "--gpus"),
    ("jump_reflection: true\n", "jump_reflection", "mode: audit"),
    ("runner:\n  per_rank_rollout_batch_size: 16\n", "runner.per_rank_rollout_batch_size", "runner.chunk_size"),
    ("reflection:\n  batch_size: 4\n", "reflection", "no longer used"),
    ("default_domain: bbu\n", "default_domain", "prompt.domain, with prompt.profile: bbu_rru"),
    ("domain_map: {}\n", "domain_map", "prompt.domain_map, with prompt.profile: bbu_rru"),
    ("max_token_length: 12000\n", "max_token_length", "proposer_max_prompt_tokens"),
]


@pytest.mark.parametrize("extra,key,words", LEGACY, ids=[c[1] for c in LEGACY])
def test_legacy_keys_say_what_replaced_them(cfgdir, extra, key, words):
    err = error_of(cfgdir, BASE + extra)
    assert err.location.endswith(f"c.yaml: {key}")
    assert "legacy key" in err.message and words in err.message


def test_model_name_or_path_marks_an_upstream_config(cfgdir, monkeypatch):
    # upstream's required model key: the config is read in upstream's schema (translated), so
    # it must hold upstream's other required keys too
    monkeypatch.chdir(cfgdir)
    err = error_of(cfgdir, BASE + "model:\n  model_name_or_path: /m\n")
    assert err.location.endswith("c.yaml: runner") and "upstream's loader requires it too" in err.message


@pytest.mark.parametrize("override,key", [("prompt.domain=bbu", "prompt.domain"),
                                          ("prompt.domain_map={M: rru}", "prompt.domain_map")])
def test_a_domain_with_the_generic_profile_is_an_error(cfgdir, override, key):
    # the generic profile has one English prompt: a BBU mission would silently get it
    err = error_of(cfgdir, BASE, [override])
    assert err.location.endswith(f"c.yaml: {key}") and "prompt.profile: bbu_rru" in err.message
    cfg = load(cfgdir, overrides=[override, "prompt.profile=bbu_rru"])
    assert cfg.prompt.domain_for("M") in ("bbu", "rru")


def test_domain_map_comes_before_domain(cfgdir):
    cfg = load(cfgdir, overrides=["prompt.profile=bbu_rru", "prompt.domain=bbu", "prompt.domain_map={RRU线缆: rru}"])
    assert (cfg.prompt.domain_for("RRU线缆"), cfg.prompt.domain_for("BBU接地线检查")) == ("rru", "bbu")
    assert load(cfgdir).prompt.domain_for("RRU线缆") is None  # the profile decides


def test_legacy_gate_min_changed_fraction(cfgdir):
    text = BASE.replace("rule_search:\n", "rule_search:\n  gate:\n    min_changed_fraction: 0.1\n")
    err = error_of(cfgdir, text)
    assert err.location.endswith("c.yaml: rule_search.gate.min_changed_fraction")
    assert "max_changed_fraction" in err.message


@pytest.mark.parametrize("key", ["validate_size", "validate_fraction", "validate_with_replacement", "holdout"])
def test_removed_validate_keys(cfgdir, key):
    err = error_of(cfgdir, BASE.replace("rule_search:\n", f"rule_search:\n  {key}: 3\n"))
    assert err.location.endswith(f"rule_search.{key}") and "removed" in err.message


def test_bad_yaml_names_the_line(cfgdir):
    text = BASE + "runner:\n  epochs: [1, 2\n  chunk_size: 3\n"
    err = error_of(cfgdir, text)
    assert err.location.startswith(f"{cfgdir / 'c.yaml'}:")
    line = int(err.location.rsplit(":", 1)[1])
    assert len(BASE.splitlines()) + 2 <= line <= len(BASE.splitlines()) + 4
    assert "invalid YAML" in err.message


def test_bad_yaml_indentation_line(cfgdir):
    err = error_of(cfgdir, "seed: 1\n  stage_a_paths: x\n")
    assert err.location == f"{cfgdir / 'c.yaml'}:2"


def test_duplicate_yaml_key_is_an_error_with_its_line(cfgdir):
    err = error_of(cfgdir, BASE + "seed: 8\n")
    assert err.location == f"{cfgdir / 'c.yaml'}:{len(BASE.splitlines()) + 1}"
    assert "duplicate key 'seed'" in err.message and "line 1" in err.message


def test_config_that_is_not_a_mapping(cfgdir):
    err = error_of(cfgdir, "- a\n- b\n")
    assert err.location == str(cfgdir / "c.yaml") and "mapping" in err.message


def test_empty_config_lists_a_missing_key(cfgdir):
    err = error_of(cfgdir, "")
    assert "missing required key" in err.message


def test_missing_config_file(tmp_path):
    with pytest.raises(InputError) as info:
        load_config(tmp_path / "nope.yaml")
    assert info.value.location == str(tmp_path / "nope.yaml") and "not found" in info.value.message


def test_non_utf8_config(cfgdir):
    path = cfgdir / "c.yaml"
    path.write_bytes(b"seed: \xff\n")
    with pytest.raises(InputError) as info:
        load_config(path)
    assert info.value.location == f"{path}:1:7" and "UTF-8" in info.value.message


@pytest.mark.parametrize("key,override", [
    ("stage_a_paths[0]", "stage_a_paths=data/nope.jsonl"),
    ("guidance.path", "guidance.path=data/nope.json"),
    ("rule_search.proposer_prompt_path", "rule_search.proposer_prompt_path=nope.txt"),
    ("ticket_filter.exclude_ticket_keys_path", "ticket_filter.exclude_ticket_keys_path=nope.txt"),
])
def test_missing_input_file_names_key_and_path(cfgdir, key, override):
    err = error_of(cfgdir, BASE, [override])
    assert err.location == f"{cfgdir / 'c.yaml'}: {key}"
    assert "not found" in err.message and str(cfgdir) in err.message


def test_missing_profile_directory(cfgdir):
    err = error_of(cfgdir, BASE, ["prompt.profile=./nope"])
    assert err.location.endswith("c.yaml: prompt.profile") and "nope" in err.message


def test_directory_given_for_a_file(cfgdir):
    err = error_of(cfgdir, BASE, ["guidance.path=data"])
    assert err.location.endswith("c.yaml: guidance.path") and "directory" in err.message


def test_second_ticket_file_missing_names_its_index(cfgdir):
    err = error_of(cfgdir, BASE, ["stage_a_paths=[data/tickets.jsonl, data/other.jsonl]"])
    assert err.location.endswith("c.yaml: stage_a_paths[1]")


# --- --set errors --------------------------------------------------------------------------


@pytest.mark.parametrize("override,words", [
    ("runner.chunk_sz=3", "did you mean 'runner.chunk_size'"),
    ("nosuch.key=1", "unknown key 'nosuch'"),
    ("runner=", None),  # allowed: empty section -> defaults (checked below)
    ("chunk_size", "expected key.path=value"),
    ("model.torch_dtype=bf16", "replaced by model.dtype"),
    ("rule_search.train_sampler.grid.5.top_p=0.5", "no list item '5'"),
    ("seed.x=1", "not a section"),
    ("runner.chunk_size=[1", "cannot read value"),
])
def test_bad_set_path_is_an_error_naming_it(cfgdir, override, words):
    if words is None:
        assert load(cfgdir, overrides=[override]).runner.chunk_size == 16
        return
    err = error_of(cfgdir, BASE, [override])
    assert err.location == "--set" and words in err.message, str(err)


def test_set_value_error_says_it_came_from_set(cfgdir):
    err = error_of(cfgdir, BASE, ["runner.chunk_size=0"])
    assert err.location.endswith("c.yaml: runner.chunk_size") and "from --set" in err.message


# --- the shipped configs -------------------------------------------------------------------


def test_demo_config_loads_with_its_files():
    cfg = load_config(REPO / "configs" / "demo.yaml", check_files=False)
    assert cfg.model.path == "embedded" and cfg.prompt.profile == "generic"
    assert cfg.output.root == str(REPO / "runs")
    assert cfg.stage_a_paths == [str(REPO / "configs" / "demo" / "tickets.jsonl")]
    assert cfg.rule_search.proposer_prompt_path is None  # the profile's proposer.txt


def test_bbu_line_config_is_valid():
    cfg = load_config(REPO / "configs" / "bbu_line.yaml", check_files=False)
    assert cfg.prompt.profile == "bbu_rru"
    assert [d.temperature for d in cfg.rule_search.train_sampler.grid] == [0.3, 0.5, 0.7]
    assert cfg.seed == 43


# --- schema <-> docs -------------------------------------------------------------------------


def _doc_rows(column: int = 2) -> dict[str, str]:
    """``| `key` | type | default | meaning |`` rows of docs/usage.md: key -> the default cell
    (``column`` 1: the type cell)."""
    rows = {}
    for line in (REPO / "docs" / "usage.md").read_text().splitlines():
        cells = [c.strip() for c in re.split(r"(?<!\\)\|", line.strip().strip("|"))]
        if len(cells) >= 4 and cells[0].startswith("`") and cells[0].endswith("`"):
            rows[cells[0].strip("`")] = cells[column]
    return rows


def _doc_key(key: str) -> str:
    # The two samplers share one table: documented as sampler.<field>.
    for name in ("rule_search.train_sampler.", "rule_search.eval_sampler."):
        if key.startswith(name):
            return "<sampler>." + key[len(name):]
    return key


def test_every_config_key_is_documented_with_its_default():
    import yaml

    rows = _doc_rows()
    for key, default in config_keys():
        doc = _doc_key(key)
        assert doc in rows, f"{doc} is missing from docs/usage.md"
        cell = rows[doc].strip("`")
        if default is msgspec.NODEFAULT:
            assert cell == "required", f"{doc}: docs say {cell!r}, schema: required"
        else:
            assert yaml.safe_load(cell) == default, f"{doc}: docs say {cell!r}, schema default {default!r}"


def test_every_numeric_key_has_its_range_documented():
    from stageb_pool.app.config.checks import range_text
    from stageb_pool.app.config.schema import range_of

    types = _doc_rows(column=1)
    numeric = [(key, range_of(key)) for key, _ in config_keys() if range_of(key) is not None]
    assert len(numeric) > 30
    for key, meta in numeric:
        assert f"in {range_text(meta)}" in types[_doc_key(key)], f"{key}: docs say {types[_doc_key(key)]!r}"


def test_docs_list_no_keys_the_schema_lacks():
    keys = {_doc_key(k) for k, _ in config_keys()}
    sections = {k.rsplit(".", 1)[0] for k, _ in config_keys() if "." in k}
    extra = [k for k in _doc_rows() if k not in keys and k not in sections]
    assert extra == []


def test_config_struct_tree_forbids_unknown_fields_everywhere():
    def walk(struct):
        assert struct.__struct_config__.forbid_unknown_fields, struct
        for f in msgspec.structs.fields(struct):
            sub = cfgmod.struct_of(f.type)
            if sub is not None:
                walk(sub)
    walk(Config)
