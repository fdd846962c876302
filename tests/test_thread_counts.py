"""A worker's numbers do not depend on the layout: the worker count or the machine's cores.

A reduction split over another number of torch threads adds in another order, so the thread
count decides the low bits of every float a worker computes (measured on a 2-core AMD EPYC:
1 vs 2 threads moved the tiny model's P(pass) in its sixth decimal). Every worker therefore
computes with ``pool.threads_per_worker`` threads (1 unless configured), never with a share
of the cores. The tests below run one side of each comparison with the parent (and so its
forked workers) pinned to one core and the other with every core of the machine, with one
worker against three: under a rule that shared the cores out, the two sides would compute with
different thread counts on any machine of two or more cores (CI's has two). The whole-run
comparisons (audit, headroom, rollouts, a search) pin one side the same way in their own files.
"""

from __future__ import annotations

import json

import pytest
from doubles.run_inputs import MISSION
from processes import CORES, pinned

from stageb_pool import Pool
from stageb_pool.pool.devices import MAX_THREADS_PER_WORKER, parse_gpus

needs_two_cores = pytest.mark.skipif(len(CORES) < 2, reason="needs two cores to vary the cores a worker sees")


# ---------------------------------------------------------------- the rule (pure)


@pytest.mark.parametrize("spec", ["cpu", "cpu:1", "cpu:2", "cpu:3", "cpu:8", "cpu:64", "0", "0-3", "0,2,5"])
@pytest.mark.parametrize("threads", [1, 2, 7])
def test_every_worker_gets_the_configured_threads_whatever_the_worker_count(spec, threads):
    devices = parse_gpus(spec, gpu_count=8, threads_per_worker=threads)
    assert {d.threads for d in devices} == {threads}


def test_gpu_groups_get_the_configured_threads_too():
    devices = parse_gpus("0-7", gpu_count=8, gpus_per_worker=2, threads_per_worker=3)
    assert [d.group for d in devices] == [(0, 1), (2, 3), (4, 5), (6, 7)]
    assert {d.threads for d in devices} == {3}


def test_the_default_is_one_thread_on_any_number_of_cores():
    for cores in ([CORES[0]], CORES):
        with pinned(cores):
            assert {d.threads for d in parse_gpus("cpu:1")} == {1}
            assert {d.threads for d in parse_gpus("0-1", gpu_count=2)} == {1}


@pytest.mark.parametrize("bad", [0, -1, MAX_THREADS_PER_WORKER + 1, 1.5, True, "2"])
def test_a_thread_count_out_of_range_is_a_value_error(bad):
    with pytest.raises(ValueError, match="threads_per_worker"):
        parse_gpus("cpu:1", threads_per_worker=bad)
    with pytest.raises(ValueError, match="threads_per_worker"):
        Pool(ThreadCount, gpus="cpu:1", threads_per_worker=bad)


# ---------------------------------------------------------------- real workers


class ThreadCount:
    """Reports the torch thread count its worker computes with."""

    def __init__(self, device):
        import torch

        self.torch = torch

    def threads(self, _item=None) -> int:
        return self.torch.get_num_threads()


@needs_two_cores
@pytest.mark.parametrize("gpus, cores", [("cpu:1", CORES), ("cpu:3", CORES[:1]), ("cpu:1", CORES[:1])])
def test_workers_compute_with_the_configured_threads_on_any_cores(gpus, cores):
    with pinned(cores), Pool(ThreadCount, gpus=gpus, start_timeout=120) as pool:
        assert set(pool.map("threads", range(6))) == {1}
    with pinned(cores), Pool(ThreadCount, gpus=gpus, start_timeout=120, threads_per_worker=2) as pool:
        assert set(pool.map("threads", range(6))) == {2}


GUIDANCE = {"G0": "Confirm that the antenna mount is installed securely, with all of its fittings in order.",
            "S1": "If no photo shows the antenna mount, the verdict is fail."}


class RawScores:
    """The tiny model's summed log-probabilities of the two verdict answers of each ticket of
    a chunk, unrounded: the numbers the headroom check's P(pass) is computed from (through the
    transformers engine's own scoring, before ``verdict_probabilities`` rounds them). The
    prompt-sized padded batch and the cached answer step are where a thread count shows (a
    forward pass over random ids did not show it here)."""

    def __init__(self, device):
        from stageb_pool.app.config import ModelConfig
        from stageb_pool.engine.models import check_model_path
        from stageb_pool.engine.registry import build_engine
        from stageb_pool.stageb import prompts

        self.engine = build_engine(device, check_model_path("tiny"), ModelConfig())
        self.profile = prompts.load_profile("generic", mission=MISSION)

    def scores(self, index: int) -> list[list[str]]:
        from stageb_pool.engine import verdict_scoring
        from stageb_pool.engine.records import VerdictChunk
        from stageb_pool.stageb.tickets import TicketText

        parts = ["antenna mount", "mounting bolt", "weatherproof seal", "grounding cable", "cable tie"]
        tickets = [TicketText(f"T{i:03d}", MISSION, {
            f"image_{n + 1}": json.dumps({"stats": [{"category": parts[(i + n) % 5], "condition": {"tight": i + n}}],
                                          "notes": ["close-up"] * ((i + n) % 3)})
            for n in range(1 + i % 3)}) for i in range(4 * index, 4 * index + 4)]
        chunk = VerdictChunk(index, tickets)
        ids, kept = self.engine.text.chunk_prompts(chunk, GUIDANCE, self.profile)
        answers = verdict_scoring.answer_ids(self.engine.tokenizer, self.profile.verdict)
        return [[x.hex() for x in pair] for pair in self.engine._score_answers(chunk, ids, kept, answers)]


@needs_two_cores
def test_raw_model_floats_are_identical_on_one_worker_with_every_core_and_three_on_one_core():
    """Exact floats (``float.hex``), not rounded strings: one worker seeing every core against
    three workers pinned to one core. Fails under a rule that shares the cores out (1 worker
    then sums with 2 threads, each of 3 with 1)."""
    with pinned(CORES), Pool(RawScores, gpus="cpu:1", start_timeout=120) as pool:
        wide = pool.map("scores", range(3))
    with pinned(CORES[:1]), Pool(RawScores, gpus="cpu:3", start_timeout=120) as pool:
        narrow = pool.map("scores", range(3))
    assert len(wide) == 3 and all(len(chunk) == 4 for chunk in wide)
    assert wide == narrow


@needs_two_cores
def test_two_threads_is_a_different_setting_not_a_different_layout():
    """The setting is what decides the bits: 2 threads per worker on one worker and on three
    agree with each other (and, on this stack, may differ from 1 thread)."""
    with pinned(CORES), Pool(RawScores, gpus="cpu:1", start_timeout=120, threads_per_worker=2) as pool:
        one = pool.map("scores", range(2))
    with pinned(CORES[:1]), Pool(RawScores, gpus="cpu:3", start_timeout=120, threads_per_worker=2) as pool:
        three = pool.map("scores", range(2))
    assert one == three
