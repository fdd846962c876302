"""Device specs under hostile input, and which GPU an engine is given (no GPU needed)."""

from __future__ import annotations

import os
import sys
import time

import pytest

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "pool_scripts"))

from stageb_pool import Pool  # noqa: E402
from stageb_pool.pool.devices import (  # noqa: E402
    MAX_CPU_WORKERS,
    Device,
    DeviceSpecError,
    parse_gpus,
    parse_ray_spec,
)


@pytest.mark.parametrize(
    "spec, message",
    [
        ("cpu:65", "at most 64 CPU workers"),
        ("cpu:99999", "at most 64 CPU workers"),
        ("cpu:" + "9" * 5000, "at most 64 CPU workers"),  # past Python's 4300-digit int() limit
        ("cpu:\u00b2", "cpu:N needs a worker count"),  # a superscript two passes str.isdigit
        ("cpu:\u0663", "cpu:N needs a worker count"),  # an Arabic-Indic three: int() reads it as 3
        ("0-99999999", "GPU 4-99999999 does not exist: GPUs 0-3 exist"),  # was a MemoryError
        ("1,3-" + "9" * 5000, r"GPU 4-999999\.\.\. \(5000 digits\) does not exist: GPUs 0-3 exist"),
        ("\u00b2", "cannot read GPU list"),
        ("0-\u0663", "cannot read GPU list"),
        ("0," * 100000 + "0", r"cannot read GPU list|names a GPU twice"),
    ],
)
def test_hostile_gpu_specs_are_clear_value_errors(spec, message):
    started = time.monotonic()
    with pytest.raises(DeviceSpecError, match=message) as info:
        parse_gpus(spec, gpu_count=4)
    assert len(str(info.value)) < 200  # a huge spec is not echoed back whole
    assert time.monotonic() - started < 1.0  # nothing is expanded before it is checked


def test_cpu_workers_are_limited_to_a_documented_maximum_not_to_the_cores():
    assert MAX_CPU_WORKERS == 64
    devices = parse_gpus("cpu:64")
    assert [d.rank for d in devices] == list(range(64)) and all(d.threads >= 1 for d in devices)
    assert len(parse_gpus("cpu:8")) == 8  # more workers than the 2 cores of CI is fine


class DeviceReport:
    """Reports the device it was given and the CUDA mask of its process."""

    def __init__(self, device):
        self.device = device

    def info(self):
        return {"torch_device": self.device.torch_device, "mask": os.environ.get("CUDA_VISIBLE_DEVICES")}


@pytest.mark.parametrize("parent_mask, gpu, forked_mask", [(None, 3, "3"), ("4,6", 1, "6")])
def test_inline_mode_runs_on_the_listed_gpu(monkeypatch, parent_mask, gpu, forked_mask):
    # Issue 12.5: `--gpus 3 --debug` loaded the model on GPU 0.
    if parent_mask is None:
        monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
    else:
        monkeypatch.setenv("CUDA_VISIBLE_DEVICES", parent_mask)
    device = Device("cuda", gpu, 0)
    with Pool(DeviceReport, [device]) as forked:  # a worker sees only its GPU, as cuda:0
        assert forked.worker_info == [{"torch_device": "cuda:0", "mask": forked_mask}]
    with Pool(DeviceReport, [device], inline=True) as inline:  # this process sees them all
        assert inline.worker_info == [{"torch_device": f"cuda:{gpu}", "mask": parent_mask}]


@pytest.mark.parametrize("spec, expected", [("32", ("cuda", 32)), (4, ("cuda", 4)), ("cpu", ("cpu", 1)),
                                            ("cpu:3", ("cpu", 3)), (" 0008 ", ("cuda", 8))])
def test_ray_specs_are_counts_because_ray_chooses_the_gpus(spec, expected):
    assert parse_ray_spec(spec) == expected


@pytest.mark.parametrize("spec, message", [
    ("0-7", "with Ray, the GPU spec is a count of GPUs N >= 1"),
    ("0", "a count of GPUs N >= 1"),
    ("\u00b2", "a count of GPUs"),
    ("4097", "at most 4096 Ray workers"),
    ("9" * 5000, "at most 4096 Ray workers"),
    ("cpu:" + "9" * 5000, "at most 4096 Ray workers"),
])
def test_bad_ray_specs_are_clear_value_errors(spec, message):
    with pytest.raises(DeviceSpecError, match=message) as info:
        parse_ray_spec(spec)
    assert len(str(info.value)) < 200


def test_a_ray_pool_takes_the_kind_and_number_of_a_device_list():
    assert parse_ray_spec([Device("cuda", r, r) for r in range(3)]) == ("cuda", 3)
    assert parse_ray_spec([Device("cpu", 0, 0)]) == ("cpu", 1)
    with pytest.raises(DeviceSpecError, match="all GPU workers or all CPU workers"):
        parse_ray_spec([Device("cpu", 0, 0), Device("cuda", 1, 1)])
