"""The Ray backend on real Ray clusters: one local cluster for the session (2 CPUs, 4 declared
GPUs, an 80 MiB object store, no dashboard), a two-node ``ray.cluster_utils.Cluster`` and a
cluster the pool starts itself (both in a child process: this one is already connected).

Every test here is marked ``ray``: skipped, saying why, where Ray is not installed, and run
after every fork-pool test (tests/conftest.py), since no fork pool may start after ray.init.
Waits are on conditions with deadlines; sleeping engine methods are the simulated work.
"""

from __future__ import annotations

import functools
import json
import logging
import os
import secrets
import signal
import subprocess
import sys
import time

import pytest

TESTS = os.path.dirname(os.path.abspath(__file__))
SCRIPTS = os.path.join(TESTS, "pool_scripts")

from doubles.pool_engines import OddOne, Uniform, wait_for_path  # noqa: E402
from processes import descendants, gone  # noqa: E402

from stageb_pool import Pool, PoolError, WorkerDied, WorkerError, WorkerTimeout  # noqa: E402
from stageb_pool.pool import Ray  # noqa: E402

pytestmark = pytest.mark.ray
GPUS = 4  # declared on the session cluster; there is no GPU


def wait_until(condition, timeout: float) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if condition():
            return True
        time.sleep(0.02)
    return condition()


@pytest.fixture(scope="session")
def ray_cluster():
    ray = pytest.importorskip("ray", reason="Ray is not installed: .venv/bin/python -m pip install -e '.[ray]'")
    from stageb_pool.pool.ray_cluster import QUIET_ENV, _apply_auth_env

    env = {**QUIET_ENV, "RAY_AUTH_MODE": "token", "RAY_AUTH_TOKEN": secrets.token_hex(32),
           # the actors import the test engines (their processes inherit the raylet's env)
           "PYTHONPATH": os.pathsep.join([TESTS, os.environ.get("PYTHONPATH", "")])}
    saved = {name: os.environ.get(name) for name in env}
    os.environ.update(env)
    _apply_auth_env()  # ray was imported before RAY_AUTH_* were set
    ray.init(address="local", num_cpus=2, num_gpus=GPUS, object_store_memory=80 * 2**20,
             include_dashboard=False, logging_level="ERROR")
    yield ray
    ray.shutdown()
    for name, value in saved.items():
        if value is None:
            os.environ.pop(name, None)
        else:
            os.environ[name] = value


@pytest.fixture
def ray_free(ray_cluster):
    """Each test leaves the cluster as it found it: every GPU and CPU free again."""
    yield ray_cluster
    free = lambda: ray_cluster.available_resources()  # noqa: E731
    assert wait_until(lambda: free().get("GPU") == GPUS and free().get("CPU") == 2, 10), free()


def ray_pool(engine=Uniform, gpus="2", placement_timeout: float = 60.0, **kwargs):
    return Pool(engine, gpus, backend=Ray(placement_timeout=placement_timeout), **kwargs)


# -- order, shared values, placement ------------------------------------------------------------------
def test_map_keeps_input_order_and_sends_each_snapshot_once_per_actor(ray_free):
    guidance = {f"G{i}": "a rule of about sixty characters, like the real guidance ones" for i in range(5)}
    with ray_pool(gpus=str(GPUS), task_timeout=60) as pool:
        out = pool.map("echo", list(range(40)), guidance=guidance)
        assert [o["item"] for o in out] == list(range(40))
        assert all(o["shared"] == {"guidance": guidance} for o in out)
        ran = sum(1 for n in pool.stats.items if n)
        assert pool.stats.shared_sends == ran and sum(pool.stats.items) == 40
        assert [pool.call(r, "echo", r)["rank"] for r in range(GPUS)] == list(range(GPUS))  # pinned
        pool.map("echo", [1, 2, 3], guidance=dict(guidance))  # an equal value: not sent again
        assert pool.stats.shared_sends == GPUS
        assert sorted(p["gpu_ids"][0] for p in pool.placement) == [str(i) for i in range(GPUS)]
        assert pool.worker_info == [{"engine": "test", "kind": "cuda"}] * GPUS  # "ray" placement kept apart
        assert [d.torch_device for d in pool.devices] == ["cuda:0"] * GPUS  # Ray masks one GPU per actor
        task = pool.submit("echo", 7, label="labelled")  # the timeline is recorded under Ray too
        task.result()
        assert [(r, label) for r, _, label, _, _ in pool.stats.intervals if label] == [(task.ran_on, "labelled")]
        assert len(pool.stats.intervals) == sum(pool.stats.items)


class CountsItsPickles:
    """An engine factory that counts how often the driver pickles it; each actor unpickles a
    ``Uniform`` factory."""

    def __init__(self):
        self.pickles = 0

    def __call__(self, device):
        return Uniform(device)

    def __reduce__(self):
        self.pickles += 1
        return functools.partial, (Uniform,)


def test_the_engine_factory_is_pickled_once_per_pool_not_once_per_actor(ray_free):
    """A factory may carry megabytes (the simulated engine's tokenizer): 64 actors pickled it
    64 times in the driver, seconds of its start-up."""
    factory = CountsItsPickles()
    with ray_pool(factory, gpus=str(GPUS)) as pool:
        assert pool.map("square", [1, 2, 3]) == [1, 4, 9]
        assert factory.pickles == 1


def test_engine_exception_is_a_worker_error_with_the_remote_traceback(ray_free):
    with ray_pool() as pool:
        with pytest.raises(WorkerError) as info:
            pool.map("fail_on", list(range(4)), bad=2)
        err = info.value
        assert str(err).endswith("in fail_on() on item 2: ValueError: item 2 is bad")
        assert "in fail_on" in err.remote_traceback and err.__cause__ is not None
        assert pool.map("square", [3]) == [9]  # still usable


def test_engine_init_failure_raises_from_the_constructor(ray_free):
    from doubles.pool_engines import FailingEngine

    with pytest.raises(WorkerError, match=r"in engine_factory\(\): RuntimeError: no model for cuda:") as info:
        ray_pool(FailingEngine)
    assert "in __init__" in info.value.remote_traceback


def test_an_actor_that_dies_while_starting_is_worker_died(ray_free):
    from doubles.pool_engines import ExitsWhileStarting

    with pytest.raises(WorkerDied, match=r"in engine_factory\(\): worker process died: The actor is dead because"):
        ray_pool(ExitsWhileStarting)


def test_an_engine_factory_the_nodes_cannot_import_says_so_in_one_line(ray_free, tmp_path, monkeypatch):
    """The factory's module is importable here but not in the actors' processes (a node
    without the user's code): Ray fails the actor's creation before any engine code runs."""
    (tmp_path / "only_on_the_driver.py").write_text("class Engine:\n    def __init__(self, device):\n        pass\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    from only_on_the_driver import Engine

    with pytest.raises(WorkerDied) as info:
        ray_pool(Engine, "1")
    message = str(info.value)
    assert message.startswith("worker 0 (cuda:0) in engine_factory(): worker process died: the actor could not be "
                              "created (ModuleNotFoundError: No module named 'only_on_the_driver'): "), message
    assert "the factory's module included; it ran on node " in message and "^" not in message, message


def test_workers_with_different_engines_are_refused_naming_the_odd_one(ray_free):
    with pytest.raises(PoolError, match=r"worker 1 \(cuda:1\) reports a different engine "
                                        r"\(torch: '2.12.0' where worker 0 has '2.13.0'\)"):
        ray_pool(OddOne, "3")


def test_an_impossible_placement_fails_at_once_naming_the_resources(ray_free):
    started = time.monotonic()
    with pytest.raises(PoolError, match=r"cannot place 5 workers of 1 GPU each: the cluster's live nodes could "
                                        r"hold 4 \(node [0-9.]+ \([0-9a-f]{8}\): 4 GPU\)"):
        ray_pool(gpus="5", placement_timeout=30)
    assert time.monotonic() - started < 5


def test_a_placement_blocked_by_other_jobs_fails_within_its_timeout(ray_free):
    from ray.util.placement_group import placement_group, remove_placement_group

    hog = placement_group([{"GPU": 1}] * GPUS, strategy="PACK")
    ray_free.get(hog.ready(), timeout=30)
    try:
        started = time.monotonic()
        with pytest.raises(PoolError, match=r"within 1 s .*the cluster can hold them, but other jobs hold the "
                                            r"resources \(free now: node [0-9.]+ \([0-9a-f]{8}\): 0 of 4 GPU\)"):
            ray_pool(placement_timeout=1.0)
        assert time.monotonic() - started < 5
    finally:
        remove_placement_group(hog)


def test_a_wait_longer_than_a_release_says_who_holds_the_resources(ray_free, caplog):
    from ray.util.placement_group import placement_group, remove_placement_group

    from stageb_pool.pool.ray_placement import PLACEMENT_SETTLE

    hog = placement_group([{"GPU": 1}] * GPUS, strategy="PACK")
    ray_free.get(hog.ready(), timeout=30)
    try:
        with caplog.at_level(logging.WARNING, logger="stageb_pool"), pytest.raises(PoolError, match="within 5 s"):
            ray_pool(placement_timeout=5.0)
    finally:
        remove_placement_group(hog)
    [warning] = [r.getMessage() for r in caplog.records if "other jobs" in r.getMessage()]
    assert warning.startswith("the cluster can hold 2 workers of 1 GPU each, but other jobs hold the resources now "
                              "(free now: node ") and ": 0 of 4 GPU)" in warning, warning
    assert f"waiting up to {5 - PLACEMENT_SETTLE:g} s more for them" in warning


# -- cancelling a task ------------------------------------------------------------------------------
def test_a_cancelled_task_holds_its_actor_until_its_call_ends(ray_free):
    # An actor's call runs to its end: the pool must not count the actor free (nor start the
    # next task's clock) before then.
    with ray_pool(task_timeout=120) as pool:
        slow = pool.submit("sleep", 2.0)
        assert pool.gather([pool.submit("square", 3)]) == [9]
        pool.cancel([slow])
        assert pool.gather([pool.submit("pid", rank=slow.ran_on)]) == [pool.pids[slow.ran_on]]
        [(_, _, _, start, end)] = [i for i in pool.stats.intervals if i[1] == "sleep"]
        [(_, _, _, next_start, _)] = [i for i in pool.stats.intervals if i[1] == "pid"]
        assert end - start >= 2.0 and next_start >= end


def test_a_task_cancelled_while_its_call_waits_in_the_actor_leaves_the_actor_and_its_shared_value(ray_free,
                                                                                                     tmp_path):
    # ray.cancel of a call not yet at its actor stalled the actor for 30 s, then failed it
    # (docs/performance.md); the pool must not cancel it, and the next task, whose frames omit
    # the shared value the cancelled call brought, must find it there.
    import msgspec

    from stageb_pool.pool.protocol import Task, frame

    release = tmp_path / "release"
    with ray_pool(gpus="1", task_timeout=120) as pool:
        transport = pool._dispatcher.transport
        # The actor busy with a call of its own, so that the pool's next call waits behind it.
        busy = transport.actors[0].run.remote(frame(Task(10**9, "wait_for", msgspec.Raw(json.dumps(str(release))), {})))
        two = pool.share(2)
        task = pool.submit("sum_shared", 1, a=two)
        pool._dispatcher._dispatch()  # sent: Share(2) and the task, queued behind the busy call
        pool.cancel([task])
        release.touch()
        assert ray_free.get(busy)  # the actor is free again
        assert pool.gather([pool.submit("sum_shared", 10, a=two)]) == [12]
        assert task.cancelled() and pool.stats.shared_sends == 1 and pool.stats.restarts == 0


# -- faults ------------------------------------------------------------------------------------------
def test_an_actor_that_exits_mid_task_is_worker_died_and_nothing_is_left(ray_free):
    pool = ray_pool()
    actors = [p["pid"] for p in pool.placement]
    with pytest.raises(WorkerDied, match=r"worker 1 \(cuda:1\) in exit_with\(\) on item 0: worker process died: "
                                         r"The actor is dead because its worker process has died") as info:
        pool.call(1, "exit_with", 3)
    assert info.value.exitcode is None and info.value.signal is None  # Ray reports neither
    with pytest.raises(PoolError, match="closed"):
        pool.map("square", [1])
    assert wait_until(lambda: all(gone(pid) for pid in actors), 10)


def test_an_actor_past_its_deadline_is_killed_as_worker_timeout(ray_free, tmp_path):
    pool = ray_pool(task_timeout=1.0)
    started = time.monotonic()
    with pytest.raises(WorkerTimeout, match=r"worker 0 \(cuda:0\) in block\(\) on item 0: no answer within 1 s"):
        pool.call(0, "block", str(tmp_path / "m"))
    assert time.monotonic() - started < 5


@pytest.mark.parametrize("how", ["exit", "hang"])
def test_a_replacement_in_the_same_bundle_retries_the_task_with_identical_results(ray_free, tmp_path, how):
    items, marker = list(range(8)), str(tmp_path / how)
    with ray_pool(max_restarts=1, task_timeout=2.0 if how == "hang" else 60) as pool:
        first = [p["pid"] for p in pool.placement]
        out = pool.map("die_once", items, marker=marker, how=how)
        assert out == [x * x for x in items]
        assert pool.stats.restarts == 1
        assert [pool.call(rank, "die_once", 2, marker=marker, how=how) for rank in (0, 1)] == [4, 4]  # both work
        assert len(set(p["pid"] for p in pool.placement) - set(first)) == 1  # one fresh actor
        # the two shared values (marker, how) went to each of the 3 actors once: resent to the replacement
        assert pool.stats.shared_sends == 2 * 3


def test_close_leaves_no_actor_and_frees_every_gpu(ray_cluster):
    pool = ray_pool(gpus=str(GPUS))
    actors = [p["pid"] for p in pool.placement]
    assert ray_cluster.available_resources().get("GPU", 0) == 0
    pool.close()
    pool.close()
    free = lambda: ray_cluster.available_resources().get("GPU")  # noqa: E731
    assert wait_until(lambda: free() == GPUS and all(gone(pid) for pid in actors), 10)


def test_no_fork_pool_after_ray_init(ray_cluster):
    with pytest.raises(PoolError, match="Refusing to fork.*Ray is initialised in this process"):
        Pool(Uniform, "cpu:1")


# -- the whole job -------------------------------------------------------------------------------------
def test_audit_artifacts_are_identical_on_the_fork_pool_and_on_ray_with_one_and_two_actors(ray_free, tmp_path):
    from doubles.run_inputs import MISSION, audit_inputs

    from stageb_pool.app.config import load_config
    from stageb_pool.app.diff import diff_runs
    from stageb_pool.app.job import run_job
    from stageb_pool.search.fileio import read_jsonl

    config = audit_inputs(tmp_path, n_tickets=12, model="tiny")
    out = tmp_path / "out" / MISSION
    sets = ["--set", "output.save_rollouts=true"]
    # The fork pool runs in a child process: this one is connected to Ray and may not fork.
    fork = subprocess.run([sys.executable, "-m", "stageb_pool.app.cli", "--gpus", "cpu:1", "--audit", config,
                           "--set", "output.run_name=fork", *sets], capture_output=True, text=True, timeout=600,
                          env=_child_env())
    assert fork.returncode == 0, fork.stderr[-3000:]
    for gpus in ("cpu:1", "cpu:2"):
        cfg = load_config(config, [f"output.run_name=ray-{gpus[-1]}", "output.save_rollouts=true"])
        assert run_job(cfg, gpus, audit=True, ray_address="auto", argv=["test"]) == 0
    texts = [r["text"] for r in read_jsonl(out / "fork" / "rollouts" / "audit.jsonl")]
    assert len(texts) == 12 * 4 and len(set(texts)) > 1  # real, varied generations are compared
    for run in ("ray-1", "ray-2"):
        assert [f"{d.file} {d.where} {d.key}" for d in diff_runs(out / "fork", out / run)] == [], run
        for name in ("baseline_ticket_stats.jsonl", "rollouts/audit.jsonl"):
            assert (out / run / name).read_bytes() == (out / "fork" / name).read_bytes(), name
        assert json.loads((out / run / "summary.json").read_text())["workers"].keys() == (
            {"cpu:0"} if run == "ray-1" else {"cpu:0", "cpu:1"})


# -- clusters of their own (child processes) --------------------------------------------------------
def run_script(name: str, *args, timeout: float = 120):
    return subprocess.run([sys.executable, os.path.join(SCRIPTS, name), *args], capture_output=True, text=True,
                          timeout=timeout, env=_child_env())


def _child_env() -> dict:
    env = {k: v for k, v in os.environ.items() if not k.startswith("RAY_")}
    env["PYTHONPATH"] = TESTS
    return env


def test_pack_spans_a_two_node_cluster(ray_cluster):
    out = run_script("ray_two_nodes.py")
    assert out.returncode == 0, out.stderr[-3000:]
    report = json.loads(out.stdout.strip().splitlines()[-1])
    assert report["results"] == [i * i for i in range(12)]
    assert len(set(report["nodes"])) == 2 and len(report["nodes"]) == 4  # 2 GPU bundles per node
    assert report["left"] == []


def test_ctrl_c_leaves_no_actor_and_no_cluster_behind(ray_cluster, tmp_path):
    home = tmp_path / "home"
    home.mkdir()
    env = dict(_child_env(), HOME=str(home))
    child = subprocess.Popen([sys.executable, os.path.join(SCRIPTS, "run_ray_pool.py"), str(tmp_path)],
                             stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env)
    assert wait_for_path(str(tmp_path / "pids.json"), 120), child.stderr.read() if child.poll() is not None else ""
    pids = json.loads((tmp_path / "pids.json").read_text())
    cluster = descendants(child.pid)
    assert wait_until(lambda: len(list(tmp_path.glob("started.*"))) == 2, 30)  # both actors inside a task
    child.send_signal(signal.SIGINT)
    out, err = child.communicate(timeout=60)
    assert child.returncode == 130, err[-3000:]
    assert wait_until(lambda: all(gone(p) for p in cluster + pids["actors"]), 15), [p for p in cluster if not gone(p)]
    assert not (home / ".ray" / "auth_token").exists()  # token auth from the environment, no file
    assert "Traceback" not in err, err[-3000:]



# -- GPU groups (issue 25) -----------------------------------------------------------------------
def test_a_gpu_group_is_one_bundle_of_its_gpus_and_one_actor(ray_free):
    with ray_pool(gpus=str(GPUS), gpus_per_worker=2, task_timeout=60) as pool:
        assert pool.size == 2 and [d.gpus for d in pool.devices] == [(0, 1), (2, 3)]
        assert [sorted(p["gpu_ids"]) for p in pool.placement] in ([["0", "1"], ["2", "3"]], [["2", "3"], ["0", "1"]])
        assert pool.map("echo", [1, 2, 3])[0]["item"] == 1
        assert ray_free.available_resources().get("GPU", 0) == 0  # two bundles of 2 GPUs hold all 4


def test_a_group_larger_than_every_node_is_refused_at_once(ray_free):
    with pytest.raises(PoolError, match=r"a worker's GPUs must be on one node, and no node of the cluster has 8 "
                                        r"\(the largest has 4\)"):
        ray_pool(gpus="8", gpus_per_worker=8, placement_timeout=30)


def test_groups_that_fit_in_total_but_not_per_node_do_not_pack():
    from stageb_pool.pool.ray_placement import pack

    # Enough GPUs in total (9) for four groups of 2, but a group (a bundle) never spans nodes.
    where = pack([{"GPU": 2.0}] * 4, [{"GPU": 3.0, "CPU": 8.0}] * 3)
    assert sorted(w for w in where if w is not None) == [0, 1, 2] and where.count(None) == 1
