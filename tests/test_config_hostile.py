"""Hostile and surprising configs (issue 15): never a traceback, never a hang, no silent
misreading. Each gives exit code 2 and one located line, or loads the way it reads."""

from __future__ import annotations

import io
import os
import subprocess
import sys
from pathlib import Path

import pytest
from test_config import BASE, cfgdir, error_of, load, write  # noqa: F401 - cfgdir is a fixture

from stageb_pool.app import cli
from stageb_pool.app.config import load_config
from stageb_pool.stageb.errors import InputError

REPO = Path(__file__).resolve().parents[1]


def run_cli(*args: str, timeout: float = 60) -> subprocess.CompletedProcess:
    env = dict(os.environ, PYTHONPATH=str(REPO), HF_HUB_OFFLINE="1")
    return subprocess.run([sys.executable, "-m", "stageb_pool.app.cli", *args], capture_output=True, text=True,
                          env=env, timeout=timeout)


def assert_located(proc: subprocess.CompletedProcess, location: str) -> str:
    assert proc.returncode == 2, (proc.returncode, proc.stderr[-2000:])
    assert "Traceback" not in proc.stderr
    [line] = proc.stderr.splitlines()
    assert line.startswith(f"stageb-pool: error: {location}"), line[:500]
    return line


# --- YAML structure: aliases, nesting ---------------------------------------------------------


def test_recursive_alias(cfgdir):
    path = write(cfgdir, BASE + "model:\n  stop: &a [*a]\n")
    line = assert_located(run_cli("check", str(path)), f"{path}:")
    assert "refers to the node that contains it" in line


@pytest.mark.parametrize("text", [
    "stop: " + "[" * 1000 + "]" * 1000 + "\n",
    "".join(f"{'  ' * i}k{i}:\n" for i in range(5000)) + "  " * 5000 + "v: 1\n",
], ids=["1000 nested flow lists", "5000 nested mappings"])
def test_deep_nesting(cfgdir, text):
    path = write(cfgdir, BASE + "model:\n" + "".join("  " + line + "\n" for line in text.splitlines()))
    assert "nested deeper than 100 levels" in assert_located(run_cli("check", str(path)), f"{path}:")


def alias_bomb(levels: int, item: str = "lol") -> str:
    """``[&a0 [item x10], &a1 [*a0 x10], ...]``: 10**levels values once the aliases are expanded."""
    parts = [f"&a0 [{', '.join([item] * 10)}]"]
    parts += [f"&a{i} [{', '.join([f'*a{i - 1}'] * 10)}]" for i in range(1, levels)]
    return f"[{', '.join(parts)}]"


def test_billion_laughs_is_refused_at_once(cfgdir):
    path = write(cfgdir, BASE + f"ticket_filter:\n  exclude_ticket_keys: {alias_bomb(9)}\n")
    assert "aliases expand this to more than 100000 values" in assert_located(run_cli("check", str(path)), f"{path}:")


def test_a_million_values_through_aliases_give_a_short_error(cfgdir):
    # without the bound this expanded into seed's error message: 722 KB on one line
    path = write(cfgdir, BASE.replace("seed: 7", f"seed: {alias_bomb(6, '1')}"))
    assert len(assert_located(run_cli("check", str(path)), f"{path}:")) < 500


def test_a_huge_value_in_an_error_is_cut_short(cfgdir):
    path = write(cfgdir, BASE.replace("seed: 7", "seed: [" + ", ".join(["1"] * 50_000) + "]"))
    line = assert_located(run_cli("check", str(path)), f"{path}: seed")
    assert len(line) < 500 and "characters)" in line


def test_every_printed_error_is_capped():
    line = cli.capped("a" * 4000 + "b" * 1000 + ": output.root: Not a directory")
    assert len(line) < 2100 and "(3030 characters left out)" in line
    assert line.startswith("a" * 1000) and line.endswith("b" * 400 + ": output.root: Not a directory")  # the reason stays
    assert cli.capped("short") == "short"


# --- numbers --------------------------------------------------------------------------------


def test_an_integer_beyond_pythons_digit_limit(cfgdir):
    path = write(cfgdir, BASE.replace("seed: 7", "seed: " + "9" * 5000))
    line = assert_located(run_cli("check", str(path)), f"{path}:1:")
    assert "5000 digits" in line and len(line) < 500


@pytest.mark.parametrize("override,key,words", [
    ("pool.task_timeout=1e300", "pool.task_timeout", "<= 604800"),
    ("pool.start_timeout=1e300", "pool.start_timeout", "<= 604800"),
    ("rule_search.gate.bootstrap.iterations=1000000000", "rule_search.gate.bootstrap.iterations", "<= 10000"),
    ("seed=99999999999999999999", "seed", "<= 9223372036854775807"),
    ("runner.chunk_size=100000", "runner.chunk_size", "<= 4096"),
    ("rule_search.train_sampler.grid.0.max_new_tokens=10000000", "rule_search.train_sampler.grid[0].max_new_tokens",
     "[1, 1000000]"),
    ("rule_search.eval_sampler.samples_per_decode=5000", "rule_search.eval_sampler.samples_per_decode", "[1, 1000]"),
    ("rule_search.train_sampler.grid.0.temperature=-0.5", "rule_search.train_sampler.grid[0].temperature", "[0, 100]"),
])
def test_every_number_has_a_range(cfgdir, override, key, words):
    err = error_of(cfgdir, BASE, [override])
    assert err.location.endswith(f"c.yaml: {key}") and words in err.message, str(err)


# --- YAML 1.1 surprises ---------------------------------------------------------------------


@pytest.mark.parametrize("text,key,words", [
    (BASE.replace("seed: 7", "seed: 010"), "seed", "octal"),  # YAML 1.1: 8
    (BASE.replace("seed: 7", "seed: 1:30"), "seed", "base-60"),  # YAML 1.1: 90
    (BASE.replace("seed: 7", "seed: 0x1f"), "seed", "hexadecimal"),
    (BASE.replace("  run_name: r1\n", "  run_name: r1\n  save_rollouts: yes\n"), "output.save_rollouts", "true or false"),
    (BASE.replace("  run_name: r1\n", "  run_name: r1\n  save_rollouts: on\n"), "output.save_rollouts", "true or false"),
])
def test_yaml_11_coercions_are_refused_where_a_number_or_boolean_is_expected(cfgdir, text, key, words):
    err = error_of(cfgdir, text)
    assert err.location.endswith(f"c.yaml: {key}") and words in err.message, str(err)


def test_yaml_12_scalars_still_read_as_written(cfgdir):
    text = BASE.replace("seed: 7", "seed: -0") + "pool:\n  task_timeout: 1e3\n  start_timeout: .5\nrunner:\n  epochs: +3\n"
    cfg = load(cfgdir, text, ["output.save_rollouts=True", "output.run_name=yes"])
    assert (cfg.seed, cfg.pool.task_timeout, cfg.pool.start_timeout, cfg.runner.epochs) == (0, 1000.0, 0.5, 3)
    assert cfg.output.save_rollouts is True and cfg.output.run_name == "yes"  # text where text is wanted


def test_a_date_stays_text(cfgdir):
    assert load(cfgdir, overrides=["output.run_name=2025-01-21"]).output.run_name == "2025-01-21"


# --- text that no file or path can hold -----------------------------------------------------


@pytest.mark.parametrize("text,key", [
    (BASE.replace("run_name: r1", 'run_name: "r\\0x"'), "output.run_name"),
    (BASE.replace("root: out", 'root: "o\\0ut"'), "output.root"),
    (BASE.replace("run_name: r1", 'run_name: "r\\ud800"'), "output.run_name"),
    (BASE + 'prompt:\n  profile: bbu_rru\n  domain_map: {"M\\udc80": rru}\n', "prompt.domain_map"),
])
def test_nul_and_lone_surrogates_are_located(cfgdir, text, key):
    err = error_of(cfgdir, text)
    assert err.location.endswith(f"c.yaml: {key}") and "not allowed" in err.message, str(err)


def test_a_nul_byte_in_the_file_gives_its_line(cfgdir):
    path = cfgdir / "c.yaml"
    path.write_bytes(BASE.encode() + b"runner:\n  epochs: 3\x00\n")
    with pytest.raises(InputError) as info:
        load_config(path)
    assert info.value.location == f"{path}:{len(BASE.splitlines()) + 2}"


def test_a_byte_order_mark_is_removed_as_in_every_input(cfgdir):
    path = cfgdir / "c.yaml"
    path.write_bytes(b"\xef\xbb\xbf" + BASE.encode())
    assert load_config(path) == load(cfgdir)


def test_invalid_utf8_gives_line_and_column(cfgdir):
    path = cfgdir / "c.yaml"
    path.write_bytes(BASE.encode() + b"runner:\n  epochs: \xff\n")
    with pytest.raises(InputError) as info:
        load_config(path)
    assert info.value.location == f"{path}:{len(BASE.splitlines()) + 2}:11" and "UTF-8" in info.value.message


# --- files ----------------------------------------------------------------------------------


def test_a_fifo_config_is_refused_without_opening_it(cfgdir):
    fifo = cfgdir / "c.yaml"
    os.mkfifo(fifo)
    line = assert_located(run_cli("check", str(fifo), timeout=60), str(fifo))
    assert "not a regular file" in line


@pytest.mark.parametrize("key,override", [
    ("stage_a_paths[0]", "stage_a_paths=data/fifo"),
    ("guidance.path", "guidance.path=data/fifo"),
    ("ticket_filter.exclude_ticket_keys_path", "ticket_filter.exclude_ticket_keys_path=data/fifo"),
])
def test_a_fifo_named_by_the_config_is_refused(cfgdir, key, override):
    os.mkfifo(cfgdir / "data" / "fifo")
    err = error_of(cfgdir, BASE, [override])
    assert err.location.endswith(f"c.yaml: {key}") and "not a regular file" in err.message


def test_an_unreadable_config(cfgdir, monkeypatch):
    path = write(cfgdir, BASE)
    real_open = io.open

    def refuse(file, *args, **kwargs):
        if os.fspath(file) == str(path):
            raise PermissionError(13, "Permission denied", str(path))
        return real_open(file, *args, **kwargs)

    monkeypatch.setattr(io, "open", refuse)
    monkeypatch.setattr("builtins.open", refuse)
    with pytest.raises(InputError) as info:
        load_config(path)
    assert info.value.location == str(path) and "Permission denied" in info.value.message


def test_paths_over_the_os_limit(cfgdir, capsys):
    long = str(cfgdir / ("x" * 300) / "c.yaml")
    with pytest.raises(InputError) as info:
        load_config(long)
    assert "File name too long" in info.value.message
    err = error_of(cfgdir, BASE, ["guidance.path=" + "y" * 5000])
    assert err.location.endswith("c.yaml: guidance.path") and "too long" in err.message
    assert cli.main(["import-config", str(REPO / "tests/data/upstream/configs/smoke/stage_b_tiny.yaml"),
                     "--upstream-root", str(REPO / "tests/data/upstream"), "-o", str(cfgdir / ("z" * 300))]) == 2
    assert "File name too long" in capsys.readouterr().err


# --- --set and model.path -------------------------------------------------------------------


def test_set_into_a_list_item_that_is_not_a_section(cfgdir):
    text = BASE.replace("      - {temperature: 0.3, top_p: 0.9, max_new_tokens: 64}", '      - "abc"')
    err = error_of(cfgdir, text, ["rule_search.train_sampler.grid.0.temperature=1"])
    assert err.location == "--set" and "grid[0] is a string, not a section" in err.message


@pytest.mark.parametrize("override", ["model.path=./no_model", "model.path=/no/such/model.gguf", "model.path=org/name"])
def test_model_path_errors_name_the_key(cfgdir, override):
    err = error_of(cfgdir, BASE, [override])
    assert err.location.endswith("c.yaml: model.path") and "does not exist" in err.message


def test_a_fifo_model_path_is_refused_without_opening_it(cfgdir):
    os.mkfifo(cfgdir / "m.gguf")
    path = write(cfgdir, BASE)
    line = assert_located(run_cli("check", "--set", "model.path=m.gguf", str(path), timeout=60), f"{path}: model.path")
    assert "not a regular file" in line and "m.gguf" in line


def test_a_deep_config_json_in_the_model_path_is_located(cfgdir):
    (cfgdir / "m").mkdir()
    (cfgdir / "m" / "config.json").write_text('{"a":' + "[" * 1000 + "]" * 1000 + "}")
    path = write(cfgdir, BASE)
    line = assert_located(run_cli("check", "--set", "model.path=m", str(path)), f"{path}: model.path")
    assert "config.json:1:" in line and "nested deeper than 100 levels" in line


def test_an_error_about_a_key_with_a_line_break_stays_one_line(cfgdir):
    # found by the fuzz suite: the key path of the location held a raw U+2028 (a line separator)
    path = write(cfgdir, BASE + "? \"x\\u2028y\\nz\"\n: 1\n")
    line = assert_located(run_cli("check", str(path)), f"{path}: x\\u2028y\\x0az")
    assert "unknown key" in line
