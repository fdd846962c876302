"""The small shared modules: device specs, content hashes and seeds, atomic writes."""

import os
from pathlib import Path

import pytest

from stageb_pool.search import fileio
from stageb_pool.app.plan import resolve_devices
from stageb_pool.pool.devices import Device, DeviceSpecError, parse_gpus
from stageb_pool.stageb.errors import InputError
from stageb_pool.stageb.hashing import content_hash, stable_seed


@pytest.mark.parametrize(
    "spec, expected",
    [
        ("0-7", list(range(8))),
        ("0,2,5-6", [0, 2, 5, 6]),
        ("0", [0]),
        ([1, 3], [1, 3]),
        (2, [2]),
        (" 3 , 1 ", [3, 1]),
    ],
)
def test_gpu_specs_name_gpus_in_order_with_ranks(spec, expected):
    devices = parse_gpus(spec, gpu_count=8)
    assert [d.index for d in devices] == expected
    assert [d.rank for d in devices] == list(range(len(expected)))
    assert all(d.kind == "cuda" and d.torch_device == "cuda:0" for d in devices)


@pytest.mark.parametrize("spec, n", [("cpu", 1), ("cpu:1", 1), ("cpu:3", 3)])
def test_cpu_specs(spec, n):
    devices = parse_gpus(spec)
    assert [d.name for d in devices] == [f"cpu:{i}" for i in range(n)]
    assert all(d.threads == 1 and d.torch_device == "cpu" for d in devices)



@pytest.mark.parametrize(
    "spec, message",
    [
        ("0-", "cannot read GPU list"),
        ("a", "cannot read GPU list"),
        ("3-1", "runs backwards"),
        ("0,0", "names a GPU twice"),
        ("cpu:0", "cpu:N needs a worker count"),
        ("cpu:x", "cpu:N needs a worker count"),
        ("4", "GPU 4 does not exist: GPUs 0-3 exist"),
        ("2-5", "GPU 4, 5 does not exist: GPUs 0-3 exist"),
    ],
)
def test_bad_gpu_specs_raise_a_value_error_in_the_pool(spec, message):
    with pytest.raises(DeviceSpecError, match=message):
        parse_gpus(spec, gpu_count=4)
    assert issubclass(DeviceSpecError, ValueError) and not issubclass(DeviceSpecError, InputError)


def test_the_cli_reports_a_bad_gpu_spec_as_an_input_error_located_at_the_option(monkeypatch):
    with pytest.raises(InputError) as err:
        resolve_devices("3-1")
    assert str(err.value) == "--gpus: GPU range '3-1' runs backwards"


def test_no_gpu_machine_says_so():
    with pytest.raises(DeviceSpecError, match="no GPU is visible"):
        parse_gpus("0", gpu_count=0)


def test_visible_devices_follow_the_parents_mask(monkeypatch):
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "4,6")
    assert Device("cuda", 1, 0).visible_devices() == "6"
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES")
    assert Device("cuda", 1, 0).visible_devices() == "1"


def test_content_hash_ignores_dict_order_but_not_content():
    assert content_hash({"G0": "a", "G1": "b"}) == content_hash({"G1": "b", "G0": "a"})
    assert content_hash({"G0": "a"}) != content_hash({"G0": "b"})
    assert len(content_hash([1, 2])) == 16


def test_stable_seed_is_a_pure_function_of_its_parts():
    assert stable_seed(1234, "train", 0, 1) == stable_seed(1234, "train", 0, 1)
    assert stable_seed(1234, "train", 0, 1) != stable_seed(1234, "train", 1, 0)
    assert 0 <= stable_seed("x") < 2**63


def test_atomic_write_keeps_the_old_file_when_the_rename_fails(tmp_path, monkeypatch):
    target = tmp_path / "guidance.json"
    fileio.write_json(target, {"step": 1})
    before = target.read_bytes()

    def broken_replace(src, dst):
        raise OSError("disk gone")

    monkeypatch.setattr(os, "replace", broken_replace)
    with pytest.raises(OSError):
        fileio.write_json(target, {"step": 2})
    assert target.read_bytes() == before
    assert [p.name for p in tmp_path.iterdir()] == ["guidance.json"]  # no temp file left


def test_json_is_utf8_and_deterministic(tmp_path):
    path = tmp_path / "rows.jsonl"
    fileio.write_jsonl(path, [{"verdict": "通过", "x": 1.5}])
    fileio.append_jsonl(path, [{"verdict": "不通过", "x": float("inf")}])
    assert path.read_text(encoding="utf-8") == '{"verdict":"通过","x":1.5}\n{"verdict":"不通过","x":null}\n'
    assert fileio.read_jsonl(path)[1] == {"verdict": "不通过", "x": None}
    assert fileio.read_jsonl(Path(tmp_path / "missing.jsonl")) == []
