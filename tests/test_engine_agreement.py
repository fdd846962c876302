"""The one engine-agreement policy (``pool/engine_agreement.py``): each parameter's outcome,
without a pool. The dispatcher applying it at start and to replacements is in
tests/test_dispatch.py; the CLI's choice in tests/test_rundir.py and tests/test_engine.py."""

from __future__ import annotations

import functools
import logging

import pytest

from stageb_pool.pool.engine_agreement import ACCEPT_ANY, REFUSE_ANY_DIFFERENCE, EngineAgreement
from stageb_pool.pool.errors import PoolError

NAMES = ["cuda:0", "cuda:1", "cuda:2", "cuda:3"]
SAME = {"engine": "vllm", "torch": "2.13.0", "gpu": "H100"}
OTHER_TORCH = dict(SAME, torch="2.12.0")
OTHER_GPU = dict(SAME, gpu="A100")
LOG = logging.getLogger("stageb_pool.test_agreement")


class Located(Exception):
    def __init__(self, message, location):
        super().__init__(f"{location}: {message}")


def infos(*each) -> dict[int, dict]:
    return dict(enumerate(each))


def test_accept_any_compares_nothing(caplog):
    with caplog.at_level(logging.DEBUG):
        ACCEPT_ANY.check(infos(SAME, OTHER_TORCH, OTHER_GPU), NAMES)
        ACCEPT_ANY.check(infos(SAME, OTHER_TORCH), NAMES, newcomer=1)
    assert not caplog.records


def test_refusing_any_difference_names_the_worker_outside_the_majority_and_every_fact():
    REFUSE_ANY_DIFFERENCE.check(infos(SAME, SAME, SAME), NAMES)
    odd = dict(OTHER_TORCH, gpu="A100")
    with pytest.raises(PoolError) as info:
        REFUSE_ANY_DIFFERENCE.check(infos(odd, SAME, SAME), NAMES)
    assert str(info.value) == ("worker 0 (cuda:0) reports a different engine (gpu: 'A100' where worker 1 has 'H100'; "
                               "torch: '2.12.0' where worker 1 has '2.13.0'): results would depend on which worker "
                               "ran which chunk; run on GPUs of one model with the same software on every node")


def test_refusing_any_difference_compares_a_replacement_with_the_workers_running():
    # the replacement of rank 0 is the odd one even where it would tie a majority vote
    with pytest.raises(PoolError, match=r"^worker 0 \(cuda:0\) reports a different engine \(gpu: 'A100' where worker 1"):
        REFUSE_ANY_DIFFERENCE.check(infos(OTHER_GPU, SAME), NAMES, newcomer=0)
    REFUSE_ANY_DIFFERENCE.check(infos(SAME, SAME), NAMES, newcomer=0)


def test_named_facts_refuse_every_worker_that_differs_from_the_first_with_the_callers_error():
    policy = EngineAgreement(refuse=("engine", "torch"), error=functools.partial(Located, location="--gpus"))
    with pytest.raises(Located) as info:
        policy.check(infos(SAME, OTHER_TORCH, SAME, OTHER_TORCH), NAMES)
    assert str(info.value) == ("--gpus: workers [1, 3] run another engine or version than worker 0 ({'engine': "
                               "'vllm', 'torch': '2.12.0'} vs {'engine': 'vllm', 'torch': '2.13.0'}): results would "
                               "depend on which worker ran which chunk")
    with pytest.raises(Located, match=r"workers \[0\] run another engine or version than worker 1"):
        policy.check(infos(OTHER_TORCH, SAME), NAMES, newcomer=0)  # a replacement: against the others
    with pytest.raises(PoolError, match="workers \\[1\\] run another"):  # the default error
        EngineAgreement(refuse=("torch",)).check(infos(SAME, OTHER_TORCH), NAMES)


def test_named_facts_leave_other_differences_to_the_warning_or_to_silence(caplog):
    policy = EngineAgreement(refuse=("engine", "torch"), warn=LOG)
    with caplog.at_level(logging.WARNING, logger=LOG.name):
        policy.check(infos(SAME, SAME), NAMES)
        assert not caplog.records
        policy.check(infos(SAME, SAME, OTHER_GPU), NAMES)
        EngineAgreement(refuse=("engine", "torch")).check(infos(SAME, OTHER_GPU), NAMES)  # no logger: quiet
    [record] = caplog.records
    assert record.name == LOG.name and record.levelno == logging.WARNING
    assert record.getMessage() == (f"workers [2] report a different engine than worker 0 ({OTHER_GPU} vs {SAME}): "
                                   "results may depend on which worker ran which chunk")


def test_facts_are_compared_as_json_values_whatever_type_the_engine_reported():
    class Version(str):  # e.g. torch's TorchVersion, an inline engine's info is not sent as JSON
        pass

    policy = EngineAgreement(refuse=("torch",), error=functools.partial(Located, location="--gpus"))
    policy.check(infos({"torch": "2.13.0"}, {"torch": Version("2.13.0")}), NAMES)
    with pytest.raises(Located, match=r"\{'torch': '2.12.0'\} vs \{'torch': '2.13.0'\}"):
        policy.check(infos({"torch": Version("2.13.0")}, {"torch": Version("2.12.0")}), NAMES)
