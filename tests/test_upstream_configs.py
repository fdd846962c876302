"""Upstream Stage-B configs run as written: every file of upstream's configs/stage_b/ and
configs/smoke/stage_b_tiny.yaml (verbatim copies under tests/data/upstream/configs/, with small
data files in upstream's record shapes at the relative paths they name), translated key by key,
and their imported native configs (`stageb-pool import-config`) giving the same run."""

from __future__ import annotations

import logging
import shutil
from pathlib import Path

import pytest
import yaml

from stageb_pool.app import cli
from stageb_pool.app.config import load_config
from stageb_pool.app.diff import diff_runs
from stageb_pool.stageb.errors import InputError
from stageb_pool.search.run_owner import lock_path

REPO = Path(__file__).resolve().parents[1]
UPSTREAM = REPO / "tests" / "data" / "upstream"
RUNNABLE = ["configs/smoke/stage_b_tiny.yaml"] + [f"configs/stage_b/{name}.yaml" for name in (
    "bbu_cable", "bbu_install", "bbu_line", "bbu_wind", "debug", "rru_cable", "rru_install", "rru_position")]
# Refused as upstream's newest loader refuses them (older schemas), each at the key that decides it.
REFUSED = {
    "configs/stage_b/bbu_cable_rule_search.yaml": "rule_search.validate_size",
    "configs/stage_b/bbu_line_rule_search.yaml": "rule_search.validate_size",
    "configs/stage_b/bbu_wind_rule_search.yaml": "rule_search.validate_size",
    "configs/stage_b/run.yaml": "rule_search",
}
MISSIONS = {"bbu_cable": "BBU线缆布放要求", "bbu_install": "BBU安装方式检查（正装）", "bbu_line": "BBU接地线检查",
            "bbu_wind": "挡风板安装检查", "debug": "BBU安装方式检查（正装）", "rru_cable": "RRU线缆",
            "rru_install": "RRU安装检查", "rru_position": "RRU位置检查", "stage_b_tiny": "挡风板安装检查"}


@pytest.fixture
def root(tmp_path) -> Path:
    """A copy of the upstream repository layout (configs and data); runs write into it."""
    shutil.copytree(UPSTREAM, tmp_path / "upstream")
    return tmp_path / "upstream"


def test_the_fixture_covers_every_upstream_config():
    found = {p.relative_to(UPSTREAM).as_posix() for p in UPSTREAM.glob("configs/*/*.yaml")}
    assert found == set(RUNNABLE) | set(REFUSED)
    for name in found:
        head = (UPSTREAM / name).read_text(encoding="utf-8").splitlines()[:2]
        assert "Pein2017/Qwen3-VL" in head[1] and "commit" in head[1], name


# --- translation -----------------------------------------------------------------------------


@pytest.mark.parametrize("name", RUNNABLE)
def test_each_runnable_config_loads_as_upstream_reads_it(name, root, monkeypatch):
    monkeypatch.chdir(root)
    cfg = load_config(name, ["model.path=tiny"])
    raw = (root / name).read_text(encoding="utf-8")
    assert cfg.prompt.profile == "bbu_rru"
    stem = Path(name).stem
    assert cfg.prompt.domain_for(MISSIONS[stem]) == ("rru" if stem.startswith("rru") else "bbu")
    assert all(p.startswith(str(root) + "/output_post/") for p in cfg.stage_a_paths)
    assert cfg.output.root == str(root / "output_post" / "stage_b")
    assert cfg.rule_search.proposer_prompt_path == str(root / "configs/prompts/stage_b_rule_search_proposer_prompt.txt")
    assert cfg.mode == ("audit" if "jump_reflection: true" in raw else "search")
    assert cfg.model.trust_remote_code is True and cfg.model.dtype == "bfloat16"
    if "max_token_length: 120000000" in raw:  # production: explicit sampler budgets, proposer budget L
        assert cfg.rule_search.proposer_max_prompt_tokens == 120_000_000
        assert cfg.rule_search.train_sampler.max_prompt_tokens == 240_000
        assert cfg.runner.chunk_size == 16 and cfg.stage_b_distillation.enabled is True
        assert cfg.stage_b_distillation.distill_size == 2000
        assert (cfg.ticket_filter.exclude_ticket_keys_path is None) == (stem == "bbu_wind")


def test_debug_config_keeps_its_domain_map_and_budgets(root, monkeypatch):
    monkeypatch.chdir(root)
    cfg = load_config("configs/stage_b/debug.yaml", check_files=False)
    assert cfg.prompt.domain == "bbu"
    assert cfg.prompt.domain_map == {"RRU安装检查": "rru", "RRU位置检查": "rru", "RRU线缆": "rru"}
    assert cfg.prompt.domain_for("RRU线缆") == "rru" and cfg.prompt.domain_for("BBU接地线检查") == "bbu"
    assert cfg.rule_search.proposer_max_prompt_tokens == 12000  # max_token_length wins
    assert cfg.rule_search.eval_sampler.max_prompt_tokens == 4096  # the sampler's own budget
    assert cfg.runner.chunk_size == 4 and cfg.rule_search.gate.bootstrap.min_prob == 0.4


def test_smoke_config_gets_upstreams_rollout_guard_and_default_stops(root, monkeypatch):
    monkeypatch.chdir(root)
    cfg = load_config("configs/smoke/stage_b_tiny.yaml", check_files=False)
    assert cfg.rule_search.train_sampler.max_prompt_tokens == 4096  # no budget anywhere: upstream's 4096 guard
    assert cfg.rule_search.proposer_max_prompt_tokens == 4096
    assert cfg.model.stop is None  # upstream's two stop strings are the default end-of-turn stops
    assert cfg.runner.chunk_size == 1 and cfg.stage_b_distillation.enabled is False  # enabled: false
    assert cfg.model.path == "model_cache/models/Qwen/Qwen3-32B"  # not a local folder: a hub id, as upstream


@pytest.mark.parametrize("name,key", REFUSED.items())
def test_configs_upstream_itself_refuses_are_located_errors(name, key, root, monkeypatch):
    monkeypatch.chdir(root)
    with pytest.raises(InputError) as info:
        load_config(name, check_files=False)
    assert info.value.location == f"{root / name}: {key}"


def test_relative_paths_resolve_against_the_launch_directory(root, tmp_path, monkeypatch):
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    monkeypatch.chdir(elsewhere)  # upstream resolves against the working directory, not the config's folder
    with pytest.raises(InputError) as info:
        load_config(root / "configs/stage_b/bbu_line.yaml")
    assert info.value.location.endswith("bbu_line.yaml: stage_a_paths[0]") and str(elsewhere) in info.value.message
    cfg = load_config(root / "configs/stage_b/bbu_line.yaml", ["model.path=tiny"], upstream_root=str(root))
    assert cfg.guidance.path == str(root / "output_post/stage_b/initial_guidance.json")
    monkeypatch.chdir(root)
    assert load_config("configs/stage_b/bbu_line.yaml", ["model.path=tiny"]) == cfg


def test_upstream_root_is_refused_for_a_native_config(tmp_path):
    with pytest.raises(InputError) as info:
        load_config(REPO / "configs" / "demo.yaml", upstream_root=str(tmp_path))
    assert info.value.location == "--upstream-root" and "upstream Stage-B configs only" in info.value.message


def test_one_log_line_names_the_translation(root, monkeypatch, caplog):
    monkeypatch.chdir(root)
    with caplog.at_level(logging.INFO, logger="stageb_pool"):
        load_config("configs/stage_b/rru_cable.yaml", check_files=False)
    [line] = [r.getMessage() for r in caplog.records]
    assert "upstream Stage-B config" in line and "profile bbu_rru, domain rru, mode audit" in line
    assert str(root) in line and "import-config" in line


# --- translation rules, on small variations of one upstream config -------------------------

SMOKE = (UPSTREAM / "configs/smoke/stage_b_tiny.yaml").read_text(encoding="utf-8")


def variant(root: Path, old: str, new: str) -> Path:
    assert old in SMOKE, old
    path = root / "configs/variant.yaml"
    path.write_text(SMOKE.replace(old, new, 1), encoding="utf-8")
    return path


def load_variant(root, old, new, **kw):
    return load_config(variant(root, old, new), ["model.path=tiny"], upstream_root=str(root), **kw)


def error_of(root, old, new) -> InputError:
    with pytest.raises(InputError) as info:
        load_variant(root, old, new, check_files=False)
    return info.value


@pytest.mark.parametrize("limit,train_budget,proposer", [
    ("", 4096, 4096),  # nothing set: the 4096 rollout guard, the default proposer budget
    ("max_token_length: 12000\n", 4096, 12000),  # min(L, 4096) for samplers, L for the proposer
    ("max_token_length: 2000\n", 2000, 2000),
])
def test_max_token_length(root, limit, train_budget, proposer):
    cfg = load_variant(root, "seed: 17\n", "seed: 17\n" + limit)
    assert cfg.rule_search.train_sampler.max_prompt_tokens == train_budget
    assert cfg.rule_search.eval_sampler.max_prompt_tokens == train_budget
    assert cfg.rule_search.proposer_max_prompt_tokens == proposer


def test_max_token_length_overrides_an_explicit_proposer_budget(root):
    explicit = "  reflect_size: 4\n  proposer_max_prompt_tokens: 999\n"
    assert load_variant(root, "  reflect_size: 4\n", explicit).rule_search.proposer_max_prompt_tokens == 999
    path = variant(root, "  reflect_size: 4\n", explicit)
    path.write_text("max_token_length: 5000\n" + path.read_text(encoding="utf-8"), encoding="utf-8")
    assert load_config(path, check_files=False, upstream_root=str(root)).rule_search.proposer_max_prompt_tokens == 5000


@pytest.mark.parametrize("old,new,domain,mapped", [
    ("default_domain: bbu", "default_domain: ' RRU '", "rru", {}),
    ("default_domain: bbu", "default_domain: bbu\ndomain_map: {挡风板安装检查: rru}", "bbu", {"挡风板安装检查": "rru"}),
    ("default_domain: bbu", "domain_map: {挡风板安装检查: Rru}", None, {"挡风板安装检查": "rru"}),
])
def test_domain_rule(root, old, new, domain, mapped):
    cfg = load_variant(root, old, new)
    assert (cfg.prompt.profile, cfg.prompt.domain, cfg.prompt.domain_map) == ("bbu_rru", domain, mapped)


@pytest.mark.parametrize("new,key,words", [
    ("default_domain: generic", "default_domain", "bbu or rru"),
    ("default_domain: ''", "default_domain", "needs default_domain"),
    ("domain_map: {x: qq}", "domain_map.x", "bbu or rru"),
])
def test_domain_errors(root, new, key, words):
    err = error_of(root, "default_domain: bbu", new)
    assert err.location.endswith(f"variant.yaml: {key}") and words in err.message


@pytest.mark.parametrize("value,mode", [("true", "audit"), ("'yes'", "audit"), ("0", "search"), ("'off'", "search")])
def test_jump_reflection_is_the_audit_mode(root, value, mode):
    assert load_variant(root, "seed: 17\n", f"seed: 17\njump_reflection: {value}\n").mode == mode


@pytest.mark.parametrize("fraction,expected", [("0.0", 0.05), ("null", 0.05), ("0.2", 0.2)])
def test_max_changed_fraction_zero_or_null_reads_as_upstream(root, fraction, expected):
    cfg = load_variant(root, "max_changed_fraction: 1.0", f"max_changed_fraction: {fraction}")
    assert cfg.rule_search.gate.max_changed_fraction == expected


def test_min_changed_fraction_is_upstreams_upper_bound(root):
    cfg = load_variant(root, "max_changed_fraction: 1.0", "min_changed_fraction: 0.3")
    assert cfg.rule_search.gate.max_changed_fraction == 0.3


def test_upstream_defaults_that_differ_from_ours_are_written_out(root):
    cfg = load_variant(root, "  per_rank_rollout_batch_size: 1\n", "")
    assert cfg.runner.chunk_size == 1  # upstream's default per-rank batch
    text = SMOKE[: SMOKE.index("stage_b_distillation:")] + "stage_b_distillation:\n  distill_size: 3\n"
    (root / "configs/d.yaml").write_text(text, encoding="utf-8")
    assert load_config(root / "configs/d.yaml", check_files=False, upstream_root=str(root)).stage_b_distillation.enabled
    # without a size upstream exports nothing, and its other distillation keys have no effect
    text = SMOKE[: SMOKE.index("stage_b_distillation:")] + "stage_b_distillation:\n  distill_temperature: 0.1\n"
    (root / "configs/d.yaml").write_text(text, encoding="utf-8")
    dist = load_config(root / "configs/d.yaml", check_files=False, upstream_root=str(root)).stage_b_distillation
    assert (dist.enabled, dist.distill_temperature) == (False, None)
    cfg = load_variant(root, "  device_map: auto\n", "  device_map: auto\n  attn_impl: flash_attn\n")
    assert cfg.model.attn_implementation == "flash_attention_2"


@pytest.mark.parametrize("old,new,key,words", [
    ("  reflect_size: 4\n", "  reflect_size: 4\n  train_with_replacement: true\n",
     "rule_search.train_with_replacement", "no counterpart"),
    ("  reflect_size: 4\n", "  reflect_size: 4\n  mining_sampler: {grid: [{temperature: 1}]}\n",
     "rule_search.mining_sampler", "no counterpart"),
    ("        repetition_penalty: 1.05\n", "        repetition_penalty: 1.05\n        no_repeat_ngram_size: 3\n",
     "rule_search.train_sampler.grid[0].no_repeat_ngram_size", "no counterpart"),
    ('stop: ["<|endoftext|>", "<|im_end|>"]', 'stop: ["</s>"]', "rule_search.train_sampler.grid[0].stop", "accepts only"),
    ("  reflect_size: 4\n", "  reflect_size: 4\n  holdout: {default_fraction: 0.1}\n", "rule_search.holdout", "refuses"),
    ("  reflect_size: 4\n", "  reflect_size: 4\n  reflect_order: random\n", "rule_search.reflect_order", "hard_first"),
    ("  enabled: false", "  enabled: 'false'", "stage_b_distillation.enabled", "'false' too, as true"),
    ("  run_name: smoke_tiny\n", "  run_name: smoke_tiny\n  save_rollouts: true\n", "output.save_rollouts",
     "stageb-pool key"),
    ("seed: 17\n", "seed: 17\nprompt: {profile: generic}\n", "prompt", "--set"),
    ("seed: 17\n", "seed: 17\nheadroom: {tickets: 96}\n", "headroom", "stageb-pool key"),
    ("  torch_dtype: bfloat16\n", "", "model.torch_dtype", "requires it too"),
    ("        max_new_tokens: 512\n", "", "rule_search.train_sampler.grid[0].max_new_tokens", "requires it too"),
    ("  per_rank_rollout_batch_size: 1\n", "  per_rank_rollout_batch_size: one\n",
     "runner.per_rank_rollout_batch_size", "read as runner.chunk_size"),
    ("  per_rank_rollout_batch_size: 1\n", "  per_rank_rollout_batch_size: 0\n",
     "runner.per_rank_rollout_batch_size", ">= 1"),
])
def test_settings_without_a_counterpart_are_located_errors(root, old, new, key, words):
    err = error_of(root, old, new)
    assert err.location.endswith(f"variant.yaml: {key}"), str(err)
    assert words in err.message, str(err)


def test_keys_upstream_never_reads_are_ignored_and_listed(root, caplog):
    path = variant(root, "        repetition_penalty: 1.05\n", "        repetition_penalty: 1.05\n        top_k: 5\n")
    path.write_text(path.read_text() + "selection: {policy: top_label}\nmode: rule_search\n")
    with caplog.at_level(logging.INFO, logger="stageb_pool"):
        cfg = load_config(path, check_files=False, upstream_root=str(root))
    assert cfg.mode == "search"
    line = caplog.records[-1].getMessage()
    assert "ignored as upstream does: mode, rule_search.train_sampler.grid[0].top_k, selection.policy" in line


def test_set_overrides_apply_in_our_schema_after_translation(root):
    cfg = load_config(root / "configs/smoke/stage_b_tiny.yaml", ["model.path=tiny", "runner.chunk_size=3", "mode=audit"],
                      upstream_root=str(root))
    assert (cfg.model.path, cfg.runner.chunk_size, cfg.mode) == ("tiny", 3, "audit")


# --- import-config ---------------------------------------------------------------------------


@pytest.mark.parametrize("name", RUNNABLE)
def test_imported_config_loads_to_the_same_config(name, root, tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(root)
    assert cli.main(["import-config", name]) == 0
    text = capsys.readouterr().out
    native = tmp_path / "native" / "ours.yaml"
    native.parent.mkdir()
    native.write_text(text, encoding="utf-8")
    assert "path" in yaml.safe_load(text)["model"] and "model_name_or_path" not in yaml.safe_load(text)["model"]
    sets = ["model.path=tiny"]
    assert load_config(native, sets) == load_config(name, sets)
    assert cli.main(["import-config", name, "-o", str(tmp_path / "rel.yaml")]) == 0
    assert load_config(tmp_path / "rel.yaml", sets) == load_config(name, sets)


def test_import_writes_relative_paths_next_to_the_output_file(root, monkeypatch, capsys):
    monkeypatch.chdir(root)
    out = root / "configs" / "native" / "debug.yaml"
    out.parent.mkdir()
    assert cli.main(["import-config", "--config", "configs/stage_b/debug.yaml", "-o", str(out)]) == 0
    text = out.read_text(encoding="utf-8")
    assert 'root: "../../output_post/stage_b"' in text
    assert "# was runner.per_rank_rollout_batch_size" in text and "#   reflection: not used" in text
    assert "domain_map:  # was domain_map" in text
    assert cli.main(["import-config", "configs/stage_b/debug.yaml", "-o", str(out)]) == 2  # never overwrites
    assert "exists" in capsys.readouterr().err
    assert cli.main(["check", str(out), "--set", "model.path=tiny"]) == 0


def test_import_of_a_native_config_is_an_error(capsys):
    assert cli.main(["import-config", str(REPO / "configs" / "demo.yaml")]) == 2
    assert "already a stageb-pool config" in capsys.readouterr().err


# --- end to end: each upstream config runs as written, its import gives the same artifacts ---


def small_run_overrides(cfg) -> list[str]:
    """The tiny model on CPU (flash attention and bfloat16 are GPU settings), one iteration,
    and 4 new tokens per sample (the tiny model never stops by itself)."""
    sets = ["model.path=tiny", "model.attn_implementation=sdpa", "model.dtype=float32", "runner.epochs=1"]
    for name in ("train_sampler", "eval_sampler"):
        grid = getattr(cfg.rule_search, name).grid
        sets += [f"rule_search.{name}.grid.{i}.max_new_tokens=4" for i in range(len(grid))]
    return [arg for s in sets for arg in ("--set", s)]


def snapshot(root: Path) -> dict[str, bytes | None]:
    return {p.relative_to(root).as_posix(): p.read_bytes() if p.is_file() else None for p in root.rglob("*")}


def assert_only_the_run_directory_was_added(root: Path, before: dict, run_dir: Path) -> None:
    """Inputs unchanged, and nothing written outside the run directory (its parents and its
    lock file beside it aside: search/run_owner.py)."""
    after = snapshot(root)
    assert {k: v for k, v in after.items() if k in before} == before
    run = run_dir.relative_to(root).as_posix()
    parents = {p.as_posix() for p in run_dir.relative_to(root).parents}
    lock = lock_path(run_dir).relative_to(root).as_posix()
    assert [k for k in after if k not in before and not (k == run or k.startswith(run + "/") or k in parents
                                                            or k == lock)] == []


# The smoke config (rule search), debug.yaml (rule search, domain_map, chunks of 4) and an RRU
# audit with a ticket filter cover every translation path; the other production audits differ
# from rru_cable only in their data and domain (13-17 s each, 85 s together: CI's budget), so
# they are `exhaustive`, run by hand with `pytest -m exhaustive tests/test_upstream_configs.py`.
REPRESENTATIVE = ("configs/smoke/stage_b_tiny.yaml", "configs/stage_b/debug.yaml", "configs/stage_b/rru_cable.yaml")
END_TO_END = [name if name in REPRESENTATIVE else pytest.param(name, marks=pytest.mark.exhaustive) for name in RUNNABLE]


@pytest.mark.parametrize("name", END_TO_END)
def test_upstream_config_runs_as_written_and_its_import_gives_the_same_artifacts(name, root, monkeypatch, capsys):
    monkeypatch.chdir(root)
    cfg = load_config(name, check_files=False)
    sets = small_run_overrides(cfg)
    before = snapshot(root)
    assert cli.main(["--gpus", "cpu:2", name, *sets]) == 0, capsys.readouterr().err[-3000:]
    run_dir = root / "output_post" / "stage_b" / MISSIONS[Path(name).stem] / cfg.output.run_name
    assert (run_dir / "run.json").is_file() and (run_dir / "summary.json").is_file()
    assert_only_the_run_directory_was_added(root, before, run_dir)

    native = root.parent / "native.yaml"
    assert cli.main(["import-config", name, "-o", str(native)]) == 0
    monkeypatch.chdir(root.parent)
    assert cli.main(["--gpus", "cpu:2", str(native), *sets, "--set", "output.run_name=imported"]) == 0
    assert diff_runs(run_dir, run_dir.parent / "imported") == []
