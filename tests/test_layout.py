"""The package layout is the architecture: which folder may import what, checked here.

    pool/    the generic process pool          -> stdlib + msgspec, nothing else of ours
    stageb/  the pure Stage-B domain           -> stageb only (no torch, no processes)
    engine/  the only torch/transformers code  -> engine, stageb, pool
    search/  domain meets pool and artifacts   -> search, stageb, pool, engine.records, artifacts
    report/  report.html from a run's files    -> report, artifacts (+ msgspec; matplotlib lazily)
    app/     CLI, job, config, diff, progress  -> everything
    artifacts.py, artifact_rows.py (root): every file a run holds and its rows -> msgspec only,
             below every layer that writes or reads a run (search, report, app)

A wheel built from the checkout holds the prompt profiles and runs outside the checkout.
"""

from __future__ import annotations

import ast
import re
import os
import shutil
import subprocess
import sys
import typing
import zipfile
from pathlib import Path

import pytest

import stageb_pool
from stageb_pool.pool import protocol

PACKAGE = Path(stageb_pool.__file__).resolve().parent
REPO = PACKAGE.parent

# Internal imports each folder may make (a folder name, or folder.module for one module).
ALLOWED_INTERNAL = {
    "pool": {"pool"},
    "stageb": {"stageb"},
    "engine": {"engine", "stageb", "pool"},
    "search": {"search", "stageb", "pool", "engine.records", "<root>", "artifacts", "artifact_rows"},
    "app": {"app", "search", "stageb", "pool", "engine", "report", "<root>", "artifacts"},
    # reads a run directory's files only; which files, and their rows, from the registry
    "report": {"report", "artifacts"},
    "<root>": {"pool", "app", "artifact_rows"},  # artifacts.py names the rows of artifact_rows.py
}
# Third-party packages each folder may import (the standard library is always allowed).
ALLOWED_EXTERNAL = {
    "pool": {"msgspec", "ray"},  # ray only lazily, in the Ray backend's modules (tests/test_pool.py)
    "stageb": {"msgspec", "yaml"},
    # accelerate: a GPU group's device map and its hooks (engine/sharding.py); already a dependency
    "engine": {"msgspec", "torch", "transformers", "tokenizers", "llguidance", "vllm", "tqdm", "accelerate"},
    "search": {"msgspec"},
    "app": {"msgspec", "yaml", "tqdm"},
    "report": {"matplotlib", "msgspec"},  # matplotlib only lazily, while building a report (tests/test_report.py)
    "<root>": {"msgspec"},  # artifacts.py, artifact_rows.py: the records of a run's files
}
# Never, anywhere: IPC is msgspec JSON over socketpairs, workers share no collective.
BANNED = {"pickle", "cPickle", "dill", "cloudpickle", "multiprocessing", "torch.distributed", "torch.multiprocessing"}


def _modules() -> list[Path]:
    return sorted(PACKAGE.rglob("*.py"))


def _folder(path: Path) -> str:
    rel = path.relative_to(PACKAGE).parts
    return rel[0] if len(rel) > 1 else "<root>"


def _imports(path: Path) -> list[tuple[int, str]]:
    """(line, absolute module name) of every import in the file, nested ones included."""
    tree = ast.parse(path.read_text(encoding="utf-8"), str(path))
    package = ["stageb_pool", *path.relative_to(PACKAGE).parts[:-1]]
    out = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            out += [(node.lineno, a.name) for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = package[: len(package) - node.level + 1] if node.level else []
            module = ".".join(base + ([node.module] if node.module else []))
            for alias in node.names:  # from pkg import module: the module is what is imported
                sub = f"{module}.{alias.name}"
                out.append((node.lineno, sub if _is_module(sub) else module))
    return out


def _is_module(name: str) -> bool:
    if not name.startswith("stageb_pool."):
        return False
    path = PACKAGE.joinpath(*name.split(".")[1:])
    return path.with_suffix(".py").is_file() or path.is_dir()


def _internal_target(module: str) -> str:
    """``stageb_pool.engine.records`` -> ``engine.records``; the root package -> ``<root>``."""
    parts = module.split(".")[1:]
    if not parts or parts[0] in ("__version__",):
        return "<root>"
    return ".".join(parts[:2])


def _allowed(target: str, allowed: set[str]) -> bool:
    return target.split(".")[0] in allowed or target in allowed


def test_every_folder_imports_only_what_the_layer_map_allows():
    offenders = []
    for path in _modules():
        folder = _folder(path)
        for line, module in _imports(path):
            where = f"{path.relative_to(PACKAGE)}:{line}"
            top = module.split(".")[0]
            if module.startswith("stageb_pool"):
                target = _internal_target(module)
                if not _allowed(target, ALLOWED_INTERNAL[folder]):
                    offenders.append(f"{where} {folder}/ imports {module}")
            elif top not in sys.stdlib_module_names and top not in ALLOWED_EXTERNAL[folder] and top != "__future__":
                offenders.append(f"{where} {folder}/ imports third-party {module}")
    assert offenders == []


def test_no_module_imports_pickle_multiprocessing_or_torch_distributed():
    offenders = [f"{p.relative_to(PACKAGE)}:{line} {m}" for p in _modules() for line, m in _imports(p)
                 if any(m == b or m.startswith(b + ".") for b in BANNED)]
    assert offenders == []


def test_the_layer_map_sees_every_folder_and_catches_a_violation(tmp_path):
    folders = {_folder(p) for p in _modules()}
    assert folders == set(ALLOWED_INTERNAL)
    # The checker itself: a stageb module importing the engine is reported.
    bad = PACKAGE / "stageb" / "_layout_probe.py"
    try:
        bad.write_text("from ..engine import records\nimport torch\n")
        imports = _imports(bad)
        assert [_internal_target(m) for _, m in imports if m.startswith("stageb_pool")] == ["engine.records"]
        assert not _allowed("engine.records", ALLOWED_INTERNAL["stageb"])
        assert "torch" not in ALLOWED_EXTERNAL["stageb"]
    finally:
        bad.unlink()


def test_the_parent_side_never_imports_torch():
    code = ("import sys; import stageb_pool.app.cli, stageb_pool.app.job, stageb_pool.search.rule_search, "
            "stageb_pool.search.audit, stageb_pool.app.diff, stageb_pool.engine.records, stageb_pool.engine.models; "
            "print(sorted(m for m in ('torch', 'transformers') if m in sys.modules))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[]"


def test_no_module_over_400_lines_without_a_reason_in_its_docstring():
    long = []
    for path in _modules():
        lines = path.read_text(encoding="utf-8").count("\n")
        doc = ast.get_docstring(ast.parse(path.read_text(encoding="utf-8"))) or ""
        if lines > 400 and "Over 400 lines:" not in doc:
            long.append(f"{path.relative_to(PACKAGE)} ({lines} lines)")
    assert long == []


# --------------------------------------------------------------------------- an installed copy


@pytest.fixture(scope="module")
def wheel(tmp_path_factory) -> Path:
    """A wheel built (``pip wheel --no-deps``) from a copy of the checkout's package files."""
    src = tmp_path_factory.mktemp("src")
    for name in ("setup.cfg", "pyproject.toml", "README.md"):
        shutil.copy(REPO / name, src / name)
    shutil.copytree(PACKAGE, src / "stageb_pool", ignore=shutil.ignore_patterns("__pycache__"))
    out = tmp_path_factory.mktemp("wheel")
    subprocess.run([sys.executable, "-m", "pip", "wheel", "--quiet", "--no-deps", str(src), "-w", str(out)],
                   check=True, capture_output=True, text=True)
    (path,) = out.glob("stageb_pool-*.whl")
    return path


def test_the_wheel_holds_every_module_and_the_prompt_profiles(wheel):
    names = set(zipfile.ZipFile(wheel).namelist())
    for path in _modules():
        assert f"stageb_pool/{path.relative_to(PACKAGE).as_posix()}" in names
    for profile in ("generic", "bbu_rru"):
        for f in (PACKAGE / "profiles" / profile).iterdir():
            assert f"stageb_pool/profiles/{profile}/{f.name}" in names
    entry_points = next(n for n in names if n.endswith("entry_points.txt"))
    assert "stageb-pool = stageb_pool.app.cli:main" in zipfile.ZipFile(wheel).read(entry_points).decode()


def test_an_installed_copy_checks_the_demo_config_outside_the_checkout(wheel, tmp_path):
    site = tmp_path / "site"
    subprocess.run([sys.executable, "-m", "pip", "install", "--quiet", "--no-deps", "--target", str(site), str(wheel)],
                   check=True, capture_output=True, text=True)
    work = tmp_path / "work"  # the demo config and its data, away from the checkout
    shutil.copytree(REPO / "configs", work / "configs")
    env = {**os.environ, "PYTHONPATH": str(site), "HF_HUB_OFFLINE": "1"}
    where = subprocess.run([sys.executable, "-c", "import stageb_pool; print(stageb_pool.__file__)"],
                           cwd=work, env=env, capture_output=True, text=True, check=True)
    assert where.stdout.strip().startswith(str(site))
    out = subprocess.run([sys.executable, "-m", "stageb_pool", "check", "configs/demo.yaml"],
                         cwd=work, env=env, capture_output=True, text=True)
    assert out.returncode == 0, out.stderr
    assert "profile" in out.stdout and "generic" in out.stdout and "per iteration" in out.stdout


# --------------------------------------------------------------------------- one engine text layer
# Both generation engines share one text layer (``engine/chat_text.py``: chat templating,
# token counting, stop strings, clean-up, result assembly); an engine keeps only how it
# generates. Read from the source, nothing imported or run.


ENGINE = PACKAGE / "engine"
ENGINE_MODULES = ["transformers_engine.py", "vllm_engine.py"]

# Code that belongs to the text layer: a match in an engine module is a second copy of it.
TEXT_LAYER_CODE = {
    "chat template rendering": r"apply_chat_template|chat_text\.render\(",
    "tokenizing text": r"\btokenizer\(|add_special_tokens",
    "the stop set-up": r"get_vocab\(|chat_text\.stop_strings\(|END_OF_TURN",
    "decoding completions": r"\.decode\(|batch_decode\(|chat_text\.clean\(",
    "result assembly": r"\bTicketRollout\(|\bTicketVerdictProbability\(|\bChunkResult\(|\bVerdictChunkResult\(",
}


def code_lines(path: Path) -> list[tuple[int, str]]:
    """The module's lines without docstrings and comments (prose may name what code may not)."""
    source = path.read_text(encoding="utf-8")
    docstrings = set()
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)) and node.body:
            first = node.body[0]
            if isinstance(first, ast.Expr) and isinstance(first.value, ast.Constant) and isinstance(first.value.value, str):
                docstrings.update(range(first.lineno, first.end_lineno + 1))
    return [(n, line.split("#", 1)[0]) for n, line in enumerate(source.splitlines(), 1) if n not in docstrings]


@pytest.mark.parametrize("module", ENGINE_MODULES)
def test_an_engine_has_no_text_handling_of_its_own(module):
    found = [f"{module}:{n}: {what}: {line.strip()}"
             for n, line in code_lines(ENGINE / module)
             for what, pattern in TEXT_LAYER_CODE.items() if re.search(pattern, line)]
    assert not found, "\n".join(found)


def test_both_engines_use_the_shared_text_layer():
    for module in ENGINE_MODULES:
        assert "chat_text.ChatText(" in (ENGINE / module).read_text(encoding="utf-8"), module


def test_each_engine_module_has_its_builder():
    from stageb_pool.engine.registry import ENGINES

    for name, known in ENGINES.items():
        module, function = known.build.split(":")
        tree = ast.parse((ENGINE / f"{module.lstrip('.')}.py").read_text(encoding="utf-8"))
        assert function in {n.name for n in tree.body if isinstance(n, ast.FunctionDef)}, name


# --------------------------------------------------------------------------- one worker core
# A worker's request handling (building the engine, the hello, Share -> cache, Task ->
# Result or Failure) lives in one place, ``pool/worker_core.py``; its three hosts are I/O
# loops around ``WorkerCore`` with no dispatch of their own. Read from the source.

POOL = PACKAGE / "pool"
# module -> the class that hosts the core there (None: the whole module)
WORKER_HOSTS = {"worker.py": None, "ray_transport.py": "RayWorker", "inline.py": None}
# The messages a worker receives or answers, and the typed calls behind them: a host naming
# one of them handles requests itself.
REQUEST_NAMES = {"Share", "Task", "Shutdown", "Request", "Ready", "InitFailed", "Result", "Failure", "Calls",
                 "decode_request"}
FACTORY_NAMES = {"engine_factory", "factory"}


def _name(node: ast.AST) -> str | None:
    return node.id if isinstance(node, ast.Name) else node.attr if isinstance(node, ast.Attribute) else None


def request_handling(tree: ast.AST) -> list[str]:
    """What in ``tree`` handles a worker's requests: a match statement, a request message or
    ``Calls`` named, the engine factory called."""
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Match):
            found.append(f"line {node.lineno}: a match statement")
        elif _name(node) in REQUEST_NAMES:
            found.append(f"line {node.lineno}: {_name(node)}")
        elif isinstance(node, ast.Call) and _name(node.func) in FACTORY_NAMES:
            found.append(f"line {node.lineno}: calls {_name(node.func)}()")
    return found


def _host(module: str, cls: str | None) -> ast.AST:
    tree = ast.parse((POOL / module).read_text(encoding="utf-8"))
    if cls is None:
        return tree
    return next(n for n in tree.body if isinstance(n, ast.ClassDef) and n.name == cls)


@pytest.mark.parametrize("module, cls", WORKER_HOSTS.items())
def test_a_worker_host_is_an_io_loop_around_the_worker_core(module, cls):
    host = _host(module, cls)
    assert request_handling(host) == [], f"{module} {cls or ''} handles requests itself"
    assert "WorkerCore" in {_name(node) for node in ast.walk(host)}, f"{module} {cls or ''} does not use WorkerCore"


def test_the_worker_core_is_the_one_module_that_handles_requests():
    core = ast.parse((POOL / "worker_core.py").read_text(encoding="utf-8"))
    [match] = [node for node in ast.walk(core) if isinstance(node, ast.Match)]
    cases = {_name(case.pattern.cls) for case in match.cases if isinstance(case.pattern, ast.MatchClass)}
    assert cases == {request.__name__ for request in typing.get_args(protocol.Request)}  # each one, once
    # elsewhere in the pool: nobody builds an engine, makes typed calls or matches on requests
    builders = {}
    for path in sorted(POOL.glob("*.py")):
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            if isinstance(node, ast.Call) and _name(node.func) in FACTORY_NAMES | {"Calls"}:
                builders.setdefault(_name(node.func), set()).add(path.name)
            if isinstance(node, ast.Match):
                builders.setdefault("match", set()).add(path.name)
    assert builders == {"engine_factory": {"worker_core.py"}, "Calls": {"worker_core.py"},
                        "match": {"worker_core.py", "dispatch.py"}}


def test_the_parent_matches_the_replies_once():
    """The parent's side mirrors the worker's: a worker's reply is decoded as
    ``protocol.Reply`` and matched in one place, the dispatcher's ``_on_reply``."""
    dispatch = ast.parse((POOL / "dispatch.py").read_text(encoding="utf-8"))
    [on_reply] = [n for n in ast.walk(dispatch) if isinstance(n, ast.FunctionDef) and n.name == "_on_reply"]
    [match] = [node for node in ast.walk(on_reply) if isinstance(node, ast.Match)]
    cases = set()
    for case in match.cases:
        for pattern in case.pattern.patterns if isinstance(case.pattern, ast.MatchOr) else [case.pattern]:
            cases.add(_name(pattern.cls))
    assert cases == {"Ready", "InitFailed", "Result", "Failure"}


def test_the_worker_host_check_catches_a_host_with_a_dispatch_of_its_own():
    source = ("def serve(sock, engine_factory, device):\n"
              "    engine = engine_factory(device)\n"
              "    msg = protocol.recv(sock)\n"
              "    if isinstance(msg, protocol.Share):\n"
              "        pass\n")
    assert request_handling(ast.parse(source)) == ["line 2: calls engine_factory()", "line 4: Share"]


def test_the_worker_side_engine_modules_never_check_a_model_path():
    """The parent checks model.path once (``models.check_model_path``, in the run plan) and
    sends the ModelRef it gives to the workers, which load it as it is: no engine module names
    the check (a call, an import or a reference) beside its definition."""
    found = []
    for path in sorted(ENGINE.glob("*.py")):
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"), str(path))):
            if isinstance(node, ast.Name):
                name = node.id
            elif isinstance(node, ast.Attribute):
                name = node.attr
            elif isinstance(node, ast.alias):
                name = node.name
            else:
                continue
            if name == "check_model_path":
                found.append(f"engine/{path.name}:{node.lineno}")
    assert not found, found
