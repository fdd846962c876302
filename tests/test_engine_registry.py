"""The list of engines (``engine/registry.py``): an engine is its module plus one entry, and
the rest of the program (the config schema, ``check``, the resume identity, the workers'
agreement) takes what it needs of an engine from that entry."""

from __future__ import annotations

import ast
import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path
from typing import get_args

from doubles.run_inputs import MISSION, search_inputs

import stageb_pool
from stageb_pool.app.config import ModelConfig
from stageb_pool.app.config.schema import type_at
from stageb_pool.engine.registry import ENGINES, agreement_facts, identity_model_section

PACKAGE = Path(stageb_pool.__file__).resolve().parent
REPO = PACKAGE.parent

# A new engine in a module of its own: verdicts from the guidance's "If any photo shows X"
# rules (the package's rule judge), a proposer that always suggests the rust rule. Its
# methods declare the records they take (the pool decodes each request into them).
ECHO_ENGINE = '''
import json
import time

from stageb_pool.engine import chat_text, rule_judge
from stageb_pool.engine.records import ChatRequest, ChatResult, RolloutChunk, Sample, VerdictChunk
from stageb_pool.stageb.prompts import PromptProfile


class EchoEngine:
    def __init__(self, device, model_path):
        self.device, self.model_path = device, model_path

    def info(self):
        return {"engine": "echo", "model_path": self.model_path}

    def rollout(self, chunk: RolloutChunk, *, guidance: dict[str, str], profile: PromptProfile):
        conditions = rule_judge.fail_conditions(guidance)
        lengths = [10 + len(rule_judge.ticket_text(t)) // 4 for t in chunk.tickets]
        kept = chat_text.kept_positions(lengths, chunk.max_prompt_tokens)
        samples = [[] for _ in chunk.tickets]
        for i in kept:
            ticket = chunk.tickets[i]
            verdict, why = rule_judge.judge(conditions, rule_judge.ticket_text(ticket))
            samples[i] = [Sample(d, s, rule_judge.answer_text(verdict, why, profile.verdict), 5, "stop")
                          for d in range(len(chunk.grid)) for s in range(chunk.samples_per_decode)]
        return chat_text.rollout_result(chunk, lengths, kept, samples, time.perf_counter())

    def verdict_probabilities(self, chunk: VerdictChunk, *, guidance: dict[str, str], profile: PromptProfile):
        conditions = rule_judge.fail_conditions(guidance)
        lengths = [10] * len(chunk.tickets)
        p_pass = {i: 0.8 if rule_judge.judge(conditions, rule_judge.ticket_text(t))[0] == "pass" else 0.2
                  for i, t in enumerate(chunk.tickets)}
        return chat_text.verdict_result(chunk, lengths, p_pass, time.perf_counter())

    def chat(self, request: ChatRequest):
        text = json.dumps({"operations": [{"op": "upsert", "text": "If any photo shows rust, the verdict is fail.",
                                           "rationale": "the falsely passed tickets show rust"}]})
        return ChatResult(text, len(request.examples), 10, 5, "stop")


def build_echo_engine(device, model, config, preloaded):
    return EchoEngine(device, model.path)
'''

# The CLI with one more entry in the list, added before the program is imported.
LAUNCHER = '''
import sys

from stageb_pool.engine.registry import ENGINES, EngineEntry

ENGINES["echo"] = EngineEntry(build="echo_engine:build_echo_engine", describe="the guidance's rules, read literally")

from stageb_pool.app.cli import main

sys.exit(main(sys.argv[1:]))
'''


def launch(folder: Path, *args: str) -> subprocess.CompletedProcess:
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(folder), str(REPO)]), HF_HUB_OFFLINE="1",
               CUDA_VISIBLE_DEVICES="")
    return subprocess.run([sys.executable, str(folder / "launch.py"), *args], capture_output=True, text=True,
                          env=env, timeout=300)


def test_a_new_engine_is_its_module_and_one_entry_and_runs_a_search(tmp_path):
    engine_dir = tmp_path / "engine"
    engine_dir.mkdir()
    (engine_dir / "echo_engine.py").write_text(textwrap.dedent(ECHO_ENGINE))
    (engine_dir / "launch.py").write_text(textwrap.dedent(LAUNCHER))
    config = search_inputs(tmp_path / "in", out=str(tmp_path / "out"), epochs=2, train_pool_size=40)

    check = launch(engine_dir, "check", config, "--set", "model.engine=echo")
    assert check.returncode == 0, check.stderr[-3000:]
    assert "(engine echo: the guidance's rules, read literally)" in check.stdout

    run = launch(engine_dir, "run", config, "--gpus", "cpu:2", "--set", "model.engine=echo")
    assert run.returncode == 0, run.stderr[-3000:]
    run_dir = tmp_path / "out" / MISSION / "run"
    run_json = json.loads((run_dir / "run.json").read_text())
    assert run_json["provenance"]["engine"] == {"engine": "echo", "model_path": "tiny"}
    assert run_json["config"]["model"]["engine"] == "echo"
    assert json.loads((run_dir / "summary.json").read_text())["edits_accepted"] >= 1
    guidance = json.loads((run_dir / "guidance.json").read_text())
    assert "If any photo shows rust, the verdict is fail." in json.dumps(guidance)


def test_without_its_entry_the_engine_is_an_unknown_config_value(tmp_path):
    config = search_inputs(tmp_path / "in", out=str(tmp_path / "out"))
    env = dict(os.environ, PYTHONPATH=str(REPO), HF_HUB_OFFLINE="1", CUDA_VISIBLE_DEVICES="")
    proc = subprocess.run([sys.executable, "-m", "stageb_pool", "check", config, "--set", "model.engine=echo"],
                          capture_output=True, text=True, env=env, timeout=120)
    assert proc.returncode == 2
    assert "model.engine: invalid value 'echo': expected one of 'transformers', 'vllm', 'simulated'" in proc.stderr


def test_the_schema_offers_the_engines_of_the_list_and_a_section_for_each_engine_with_settings():
    assert get_args(type_at("model.engine")) == tuple(ENGINES)
    assert ModelConfig().engine == next(iter(ENGINES))
    for name, known in ENGINES.items():
        if known.settings is not None:
            assert getattr(ModelConfig(), name) == known.settings(), name


def test_an_engine_section_is_in_the_identity_of_its_own_runs_and_vllm_in_every_one():
    model = {"path": "tiny", "engine": "transformers", "vllm": {"kv_cache_gib": 1.0}, "simulated": {"noise": 0.5}}
    assert identity_model_section(model) == {"path": "tiny", "engine": "transformers", "vllm": {"kv_cache_gib": 1.0}}
    simulated = dict(model, engine="simulated")
    assert identity_model_section(simulated) == simulated


def test_the_workers_agree_on_the_engine_its_version_and_the_libraries():
    assert agreement_facts() == ("engine", "vllm", "torch", "transformers")


def _code_strings(path: Path) -> set[str]:
    """The string constants of a module's code (docstrings aside)."""
    tree = ast.parse(path.read_text(encoding="utf-8"))
    docstrings = {id(node.body[0].value) for node in ast.walk(tree)
                  if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef))
                  and node.body and isinstance(node.body[0], ast.Expr) and isinstance(node.body[0].value, ast.Constant)}
    return {node.value for node in ast.walk(tree)
            if isinstance(node, ast.Constant) and isinstance(node.value, str) and id(node) not in docstrings}


# Where "transformers" is the library's name in a version lookup, not the engine's.
VERSION_LOOKUPS = {"engine/provenance.py", "search/rundir.py"}


def test_each_engine_name_is_a_constant_in_its_own_module_and_the_registry_only():
    strings = {path.relative_to(PACKAGE).as_posix(): _code_strings(path) for path in sorted(PACKAGE.rglob("*.py"))}
    for name in ENGINES:
        holders = {module for module, found in strings.items() if name in found} - VERSION_LOOKUPS
        assert holders <= {f"engine/{name}_engine.py", "engine/registry.py"}, (name, holders)


def test_every_engine_of_the_list_declares_the_contract_as_the_protocol_does():
    """The pool decodes a request into the types a method declares: an engine whose
    parameters or annotations drift from ``contract.Engine`` would get other values."""
    import importlib
    import inspect
    import typing

    from stageb_pool.engine.contract import Engine

    methods = ("info", "rollout", "verdict_probabilities", "chat")
    for name, known in ENGINES.items():
        module_name, function = known.build.split(":")
        module = importlib.import_module(module_name, "stageb_pool.engine")
        engine_class = typing.get_type_hints(getattr(module, function))["return"]
        for method in methods:
            ours, theirs = getattr(Engine, method), getattr(engine_class, method)
            assert list(inspect.signature(theirs).parameters) == list(inspect.signature(ours).parameters), (name, method)
            assert typing.get_type_hints(theirs) == typing.get_type_hints(ours), (name, method)
