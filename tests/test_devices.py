"""Device specs under hostile input, and which GPU an engine is given (no GPU needed)."""

from __future__ import annotations

import os
import time

import pytest

from stageb_pool import Pool
from stageb_pool.pool import Fork, Inline, Ray, plan_devices
from stageb_pool.pool.devices import MAX_CPU_WORKERS, Device, DeviceSpecError, parse_gpus, ray_devices
from stageb_pool.pool.ray_placement import bundle_shape


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
    with Pool(DeviceReport, [device], backend=Inline()) as inline:  # this process sees them all
        assert inline.worker_info == [{"torch_device": f"cuda:{gpu}", "mask": parent_mask}]


@pytest.mark.parametrize("spec, expected", [("32", ("cuda", 32)), (4, ("cuda", 4)), ("cpu", ("cpu", 1)),
                                            ("cpu:3", ("cpu", 3)), (" 0008 ", ("cuda", 8))])
def test_ray_specs_are_counts_because_ray_chooses_the_gpus(spec, expected):
    devices = ray_devices(spec)
    assert ({d.kind for d in devices}, len(devices)) == ({expected[0]}, expected[1])
    assert [(d.index, d.rank) for d in devices] == [(r, r) for r in range(expected[1])]


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
        ray_devices(spec)
    assert len(str(info.value)) < 200


def test_a_ray_pool_takes_the_bundle_shape_of_a_device_list():
    assert bundle_shape([Device("cuda", r, r) for r in range(3)]) == ("cuda", 1)
    assert bundle_shape(parse_gpus("0-3", gpu_count=4, gpus_per_worker=2)) == ("cuda", 2)
    assert bundle_shape([Device("cpu", 0, 0)]) == ("cpu", 1)
    with pytest.raises(DeviceSpecError, match="all GPU workers or all CPU workers"):
        bundle_shape([Device("cpu", 0, 0), Device("cuda", 1, 1)])
    with pytest.raises(DeviceSpecError, match="all hold the same number of GPUs"):
        bundle_shape([Device("cuda", 0, 0), Device("cuda", 1, 1, group=(1, 2))])


def test_the_backend_reads_the_spec_once_and_a_planned_list_passes_through():
    """``plan_devices`` is the one reading of a spec: a list, GPUs to fork on; under Ray a count
    numbered by rank; inline, the first device; a list of Device already planned, as it is."""
    planned = plan_devices(Ray(), "4", gpus_per_worker=2, threads_per_worker=3)
    assert [(d.gpus, d.threads) for d in planned] == [((0, 1), 3), ((2, 3), 3)]
    assert plan_devices(Ray(), planned) == planned  # the pool starts what the plan planned
    assert [d.name for d in plan_devices(Fork(), "cpu:3")] == ["cpu:0", "cpu:1", "cpu:2"]
    assert [d.name for d in plan_devices(Inline(), "cpu:3")] == ["cpu:0"]
    with pytest.raises(DeviceSpecError, match="a list of Device carries its groups itself"):
        plan_devices(Fork(), planned, gpus_per_worker=2)


# -- GPU groups (issue 25): one worker per group of GPUs ------------------------------------------
@pytest.mark.parametrize("spec, size, groups", [
    ("0-7", 2, [(0, 1), (2, 3), (4, 5), (6, 7)]),
    ("0,2,5-6", 2, [(0, 2), (5, 6)]),  # contiguous in the spec's order, not by number
    ("0,1", 2, [(0, 1)]),  # the single-worker debugging case
    ("7,6,5,4", 4, [(7, 6, 5, 4)]),
])
def test_groups_are_contiguous_in_the_specs_order(spec, size, groups):
    devices = parse_gpus(spec, gpu_count=8, gpus_per_worker=size)
    assert [d.gpus for d in devices] == groups and [d.rank for d in devices] == list(range(len(groups)))
    assert [d.index for d in devices] == [g[0] for g in groups]
    assert all(d.group_size == size and d.torch_devices == [f"cuda:{i}" for i in range(size)] for d in devices)
    assert devices[0].name == "cuda:" + ",".join(map(str, groups[0]))


def test_one_gpu_per_worker_is_exactly_the_devices_of_before():
    assert parse_gpus("0-3", gpu_count=8, gpus_per_worker=1) == parse_gpus("0-3", gpu_count=8)
    device = parse_gpus("3", gpu_count=8)[0]
    assert device.group == () and device.gpus == (3,) and device.name == "cuda:3" and device.torch_devices == ["cuda:0"]


@pytest.mark.parametrize("parent_mask, expected", [(None, ["0,1", "2,3"]), ("4,5,6,7", ["4,5", "6,7"]),
                                                   ("7,3,1,0", ["7,3", "1,0"])])
def test_a_group_sees_its_gpus_relative_to_the_parents_mask(monkeypatch, parent_mask, expected):
    if parent_mask is None:
        monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
    else:
        monkeypatch.setenv("CUDA_VISIBLE_DEVICES", parent_mask)
    devices = parse_gpus("0-3", gpu_count=8, gpus_per_worker=2)
    assert [d.visible_devices() for d in devices] == expected


def test_forked_group_workers_get_their_mask_and_inline_sees_the_physical_gpus(monkeypatch):
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "4,5,6,7")  # a fake 4-GPU listing: no GPU is touched
    devices = parse_gpus("0-3", gpus_per_worker=2)
    with Pool(DeviceReport, devices) as forked:
        assert [w["mask"] for w in forked.worker_info] == ["4,5", "6,7"]
    assert devices[1].in_this_process().torch_devices == ["cuda:2", "cuda:3"]


@pytest.mark.parametrize("spec, size, message", [
    ("0-2", 2, r"--gpus '0-2' names 3 GPUs, not a multiple of 2 GPUs per worker \(use 2 GPUs or"),
    ("0", 2, "names 1 GPU, not a multiple of 2"),
    ("cpu:2", 2, "applies to GPU workers only"),
    ("0-7", 0, "GPUs per worker must be a whole number from 1 to 16"),
    ("0-7", 17, "from 1 to 16"),
])
def test_group_sizes_that_do_not_fit_are_group_size_errors(spec, size, message):
    with pytest.raises(DeviceSpecError, match=message) as info:
        parse_gpus(spec, gpu_count=8, gpus_per_worker=size)
    assert info.type.__name__ == "GroupSizeError"


def test_ray_group_specs_count_gpus_and_number_groups_by_rank():
    assert [d.gpus for d in ray_devices("8", gpus_per_worker=4)] == [(0, 1, 2, 3), (4, 5, 6, 7)]
    with pytest.raises(DeviceSpecError, match="6 GPUs, not a multiple of 4"):
        ray_devices("6", gpus_per_worker=4)
    with pytest.raises(DeviceSpecError, match="GPU workers only"):
        ray_devices("cpu:2", gpus_per_worker=2)


# --- the parent's CUDA_VISIBLE_DEVICES, read as CUDA reads it (issue 32 item 8) -------------------


@pytest.mark.parametrize("mask, visible", [
    ("4,5,6,7", ["4", "5", "6", "7"]),
    ("4,-1,5", ["4"]),  # CUDA stops enumerating at an invalid entry: one GPU, not two
    ("4,,5", ["4"]),
    ("-1", []),
    ("", []),
    (" 2 , 0 ", ["2", "0"]),
    ("GPU-8a3f2c1e-0d4b-4e5f-9a8b-7c6d5e4f3a2b,GPU-11111111-2222-3333-4444-555555555555",
     ["GPU-8a3f2c1e-0d4b-4e5f-9a8b-7c6d5e4f3a2b", "GPU-11111111-2222-3333-4444-555555555555"]),
    ("MIG-0a1b2c3d-aaaa-bbbb-cccc-123456789abc,MIG-GPU-8a3f2c1e/1/0,x",
     ["MIG-0a1b2c3d-aaaa-bbbb-cccc-123456789abc", "MIG-GPU-8a3f2c1e/1/0"]),
])
def test_the_mask_is_read_as_cuda_reads_it(monkeypatch, mask, visible):
    from stageb_pool.pool.devices import count_gpus, visible_mask

    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", mask)
    assert visible_mask() == visible and count_gpus() == len(visible)
    if visible:  # each worker's mask names its GPU as the parent's mask does
        assert [d.visible_devices() for d in parse_gpus(f"0-{len(visible) - 1}")] == visible


def test_a_worker_after_an_invalid_mask_entry_is_refused_not_given_no_gpu(monkeypatch):
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "4,-1,5")
    with pytest.raises(DeviceSpecError) as info:
        parse_gpus("0-1")
    assert str(info.value) == ("GPU 1 does not exist: CUDA_VISIBLE_DEVICES='4,-1,5' (CUDA stops at its invalid "
                               "entry '-1') makes 1 GPU visible, which --gpus numbers 0 (GPU 4)")
    with Pool(DeviceReport, parse_gpus("0")) as forked:  # the one worker really gets GPU 4
        assert [w["mask"] for w in forked.worker_info] == ["4"]


def test_a_request_outside_the_mask_names_the_mask(monkeypatch):
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "4,5,6,7")
    with pytest.raises(DeviceSpecError) as info:
        parse_gpus("4-7", gpus_per_worker=2)
    assert str(info.value) == ("GPU 4-7 does not exist: CUDA_VISIBLE_DEVICES='4,5,6,7' makes 4 GPUs visible, "
                               "which --gpus numbers 0-3 (GPUs 4, 5, 6, 7)")
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "-1")
    with pytest.raises(DeviceSpecError, match=r"^GPU 0 does not exist: no GPU is visible under CUDA_VISIBLE_DEVICES="
                                              r"'-1' \(CUDA stops at its invalid entry '-1'\) \(use --gpus cpu:N\)$"):
        parse_gpus("0")


def test_mig_devices_are_one_per_worker(monkeypatch):
    from stageb_pool.pool.devices import GroupSizeError

    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "MIG-aaaa,MIG-bbbb")
    assert [d.visible_devices() for d in parse_gpus("0-1")] == ["MIG-aaaa", "MIG-bbbb"]
    with pytest.raises(GroupSizeError, match=r"^CUDA_VISIBLE_DEVICES='MIG-aaaa,MIG-bbbb' lists MIG devices, and "
                                             r"a CUDA process uses only one: 2 GPUs per worker"):
        parse_gpus("0-1", gpus_per_worker=2)
