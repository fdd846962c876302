"""Test-session settings shared by every test file."""

import os
import signal
import socket
from datetime import timedelta

import pytest
from hypothesis import HealthCheck, settings

# Never touch a hub, and keep fast tokenizers from starting a thread pool in this process
# (it forks pool workers later; tokenizers would warn and disable itself in each child).
os.environ["HF_HUB_OFFLINE"] = "1"
os.environ["TOKENIZERS_PARALLELISM"] = "false"
# torch computing with >1 OpenMP thread in this process makes every worker forked later
# that uses >1 thread hang (GNU OpenMP; docs/architecture.md, "Fork first"). Torch work done in the
# test process itself (inline pools, in-process engines) therefore runs single-threaded.
os.environ["OMP_NUM_THREADS"] = "1"
os.environ["MKL_NUM_THREADS"] = "1"
# Tests send SIGINT to subprocesses and expect Ctrl-C behaviour. A shell starts background
# jobs (e.g. `.ci/run &`) with SIGINT ignored, and an ignored signal stays ignored across
# exec, so those subprocesses would never see the interrupt. Python's own handler is reset
# to the default at exec, so installing it here gives every subprocess a normal Ctrl-C.
signal.signal(signal.SIGINT, signal.default_int_handler)


# The fuzz suite (tests/test_fuzz.py): the same examples on every run and machine
# (derandomized, no example database written into the checkout), a fixed budget, and a
# deadline far above an example's few milliseconds so that a loaded 2-core machine never turns
# slowness into a failure; hangs are caught by the tests' own time bound. Another profile:
# HYPOTHESIS_PROFILE=explore (random examples, more of them) to look for new failures.
settings.register_profile("ci", derandomize=True, database=None, max_examples=200, deadline=timedelta(seconds=20),
                          suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large], print_blob=True)
settings.register_profile("explore", database=None, max_examples=2000, deadline=None,
                          suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])
settings.load_profile(os.environ.get("HYPOTHESIS_PROFILE", "ci"))


@pytest.fixture
def channel():
    """A channel from a parent to this process, watched for cancellations as a forked worker's
    is (``pool.cancellation``): (the worker's end, the parent's end)."""
    from stageb_pool.pool import cancellation

    worker, parent = socket.socketpair()
    cancellation.listen(worker)
    yield worker, parent
    cancellation.listen(None)
    worker.close()
    parent.close()


@pytest.fixture(scope="session", autouse=True)
def model_cache(tmp_path_factory):
    """A fresh model cache per test session (the embedded model converts into it once),
    so tests never read or fill the user's ~/.cache."""
    path = tmp_path_factory.mktemp("model-cache")
    os.environ["STAGEB_POOL_CACHE"] = str(path)
    return path


def pytest_collection_modifyitems(config, items):
    """Tests marked ``ray`` run last. ray.init leaves threads in this process (even after
    ray.shutdown), and a fork pool created after them refuses to start (a forked child
    could deadlock, and segfaults on any Ray call), so every fork-pool test runs first."""
    items.sort(key=lambda item: item.get_closest_marker("ray") is not None)  # stable: order kept otherwise
