"""The Ray backend's cluster side: connecting (or starting a local cluster), planning one
bundle per worker, and reserving them all through one placement group.

``ray`` is imported here lazily, never at module level: the fork backend and everything
else in the package run without it (tests/test_layout.py and tests/test_ray.py check it).
Measured facts behind the choices (ray 2.60, docs/performance.md) are in the comments.
"""

from __future__ import annotations

import math
import os
import secrets
import signal
import sys

from .devices import Device, ray_devices, ray_workers
from .errors import PoolError

# Plain-text actor output, one line per line, never merged across workers; no usage stats.
QUIET_ENV = {"RAY_USAGE_STATS_ENABLED": "0", "RAY_DEDUP_LOGS": "0", "RAY_COLOR_PREFIX": "0"}
MAX_THREADS = 8  # torch threads per GPU worker, as the fork backend's devices.parse_gpus


def import_ray():
    try:
        import ray
    except ImportError:
        raise PoolError("the Ray backend needs Ray: pip install 'stageb_pool[ray]' "
                        "(.venv/bin/python -m pip install -e '.[ray]' in a checkout)") from None
    return ray


class RayConnection:
    """This process's connection to a Ray cluster.

    ``address``: ``"auto"`` (the cluster started with ``ray start`` on this machine, or at
    ``RAY_ADDRESS``), ``"local"`` (a new single-machine cluster, shut down by ``close``),
    or ``"host:port"``. If Ray is already initialised in this process (a notebook, the test
    session), that connection is used and left open."""

    def __init__(self, address: str):
        self.started = False
        self._saved_env: dict[str, str | None] = {}
        self._saved_sigterm = None
        loaded = sys.modules.get("ray")
        already = loaded is not None and loaded.is_initialized()
        if not already:
            # Set before `import ray` where possible: some of it is read at import.
            for name, value in {**QUIET_ENV, **(_local_auth_env() if address == "local" else {})}.items():
                self._setenv(name, value)
        try:
            self.ray = import_ray()
        except PoolError:
            self.close()
            raise
        if already:
            return
        if address == "local":
            _apply_auth_env()  # ray may have been imported before the env was set
        # ray.init replaces the SIGTERM handler with one that calls sys.exit, and keeps it
        # after shutdown: restore ours in close().
        self._saved_sigterm = signal.getsignal(signal.SIGTERM)
        kwargs = dict(logging_level="WARNING", log_to_driver=True)
        if address == "local":
            kwargs["include_dashboard"] = False  # the API server still runs; nothing is served
        try:
            self.started = True  # from here on, close() shuts Ray down
            self.ray.init(address=address, **kwargs)
        except BaseException as exc:  # Ctrl-C included: leave no half-started cluster behind
            self.close()
            if not isinstance(exc, (ConnectionError, RuntimeError, ValueError)):
                raise
            hint = " (start one with `ray start --head`, or use address 'local')" if address == "auto" else ""
            raise PoolError(f"cannot connect to the Ray cluster at {address!r}{hint}: {exc}") from None

    def _setenv(self, name: str, value: str) -> None:
        if name not in os.environ:
            self._saved_env[name] = None
            os.environ[name] = value

    def close(self) -> None:
        """Shut Ray down if this connection started it; restore SIGTERM and the env."""
        if self.started:
            self.started = False
            if self.ray.is_initialized():
                self.ray.shutdown()
        if self._saved_sigterm is not None:
            signal.signal(signal.SIGTERM, self._saved_sigterm)
            self._saved_sigterm = None
        for name in self._saved_env:
            os.environ.pop(name, None)
        self._saved_env = {}


def _local_auth_env() -> dict[str, str]:
    """Token auth for a new local cluster, without writing ~/.ray/auth_token.

    Ray 2.60 turns token auth on for a new local cluster, writes ~/.ray/auth_token and logs
    a warning; its ports listen on every interface, so auth stays on, with a per-run token
    in the environment that the raylet and the actors inherit. A RAY_AUTH_* the user set wins."""
    if "RAY_AUTH_MODE" in os.environ:
        return {}
    env = {"RAY_AUTH_MODE": "token"}
    if "RAY_AUTH_TOKEN" not in os.environ and "RAY_AUTH_TOKEN_PATH" not in os.environ:
        env["RAY_AUTH_TOKEN"] = secrets.token_hex(32)
    return env


def _apply_auth_env() -> None:
    """Make an already imported ray see RAY_AUTH_* set after its import: its C++ config
    reads them once. Private API (what ray.init itself calls when it turns auth on), hence
    the pinned ray version."""
    from ray._raylet import AuthenticationTokenLoader, Config

    Config.initialize("")
    AuthenticationTokenLoader.instance().reset_cache()


# -- planning and placement ---------------------------------------------------------------------
def plan_workers(ray, kind: str, count: int, gpus_per_worker: int = 1) -> tuple[list[Device], list[dict]]:
    """The devices and the placement bundles of the workers of ``count`` GPUs (or ``count``
    CPU workers) on this cluster.

    A GPU worker reserves its group of ``gpus_per_worker`` GPUs in one bundle (a bundle
    always lands on one node, so a group never spans nodes) and the CPUs that go with them on
    the poorest node that can hold a group (CPUs // GPUs per GPU, at most 8 per worker; 0 on a
    cluster that declares more GPUs than CPUs); its torch thread count is that, at least 1,
    as on one machine. CPU workers share the cluster's CPUs (fractions when there are more
    workers than CPUs). ``Device.index`` is the rank (times the group size): which node and
    GPUs it lands on is Ray's choice (``Pool.placement`` tells)."""
    nodes = [n["Resources"] for n in ray.nodes() if n.get("Alive")]
    workers = ray_workers(kind, count, gpus_per_worker)
    if kind == "cuda":
        fitting = [n for n in nodes if n.get("GPU", 0) >= gpus_per_worker]
        if not fitting:
            largest = max((n.get("GPU", 0) for n in nodes), default=0)
            raise PoolError(f"cannot place a worker of {gpus_per_worker} GPUs: a worker's GPUs must be on one node, "
                            f"and no node of the cluster has {gpus_per_worker} (the largest has {largest:g}); "
                            "use fewer GPUs per worker, or add a node with that many")
        per_gpu = [int(n.get("CPU", 0) // n["GPU"]) for n in fitting]
        cpus = min(min(per_gpu, default=0) * gpus_per_worker, MAX_THREADS)
        bundle = {"GPU": float(gpus_per_worker), **({"CPU": float(cpus)} if cpus else {})}
        threads = max(1, cpus)
    else:
        share = sum(n.get("CPU", 0) for n in nodes) / workers
        largest = max((n.get("CPU", 0) for n in nodes), default=0)
        cpus = min(math.floor(share), largest) if share >= 1 else round(share, 4)
        bundle = {"CPU": float(cpus) if cpus > 0 else 0.0001}
        threads = max(1, int(cpus))
    devices = ray_devices(kind, count, gpus_per_worker, threads)
    return devices, [dict(bundle) for _ in range(workers)]


def place(ray, bundles: list[dict], timeout: float, name: str):
    """Reserve every bundle in one PACK placement group (PACK fills a node before the next,
    so 32 GPU bundles fill four 8-GPU nodes; STRICT_SPREAD would wait for 32 nodes).

    Ray reports an impossible group and one blocked by other jobs the same way (PENDING,
    NO_RESOURCES, forever), so an impossible request is found by hand first, and the wait
    is bounded; both errors name the resources."""
    from ray.util.placement_group import placement_group, placement_group_table, remove_placement_group

    need: dict[str, float] = {}
    for bundle in bundles:
        for key, value in bundle.items():
            need[key] = need.get(key, 0.0) + value
    total = ray.cluster_resources()
    short = [f"{value:g} {key} in total, the cluster has {total.get(key, 0.0):g}"
             for key, value in need.items() if value > total.get(key, 0.0) + 1e-9]
    nodes = [n["Resources"] for n in ray.nodes() if n.get("Alive")]
    if not any(all(n.get(k, 0.0) >= v for k, v in bundles[0].items()) for n in nodes):
        short.append(f"one node with {_show(bundles[0])}, and no node has that much")
    elif not short and (fit := sum(_bundles_per_node(n, bundles[0]) for n in nodes)) < len(bundles):
        # Enough in total but not per node: three nodes of 3 GPUs hold only three 2-GPU
        # groups (a bundle, so a group, never spans nodes).
        short.append(f"whole bundles on single nodes, and the nodes hold only {fit}")
    if short:
        raise PoolError(f"cannot place {len(bundles)} workers of {_show(bundles[0])} each: they need "
                        f"{'; '.join(short)} (ask for fewer workers, or add nodes with `ray start`)")
    group = placement_group(bundles, strategy="PACK", name=name)
    ready, _ = ray.wait([group.ready()], timeout=timeout)
    if ready:
        return group
    state = placement_group_table(group)
    free = ray.available_resources()
    remove_placement_group(group)
    held = ", ".join(f"{key} {free.get(key, 0.0):g} of {total.get(key, 0.0):g} free" for key in need)
    raise PoolError(f"could not reserve {len(bundles)} workers of {_show(bundles[0])} each within {timeout:g} s "
                    f"(placement group {state['state']}, {state['stats']['scheduling_state']}): {held}; "
                    "other jobs hold the rest")


def remove_group(group) -> None:
    from ray.util.placement_group import remove_placement_group

    remove_placement_group(group)


def _bundles_per_node(node: dict, bundle: dict) -> int:
    """How many copies of ``bundle`` fit on a node with the resources ``node``."""
    return int(min((node.get(k, 0.0) + 1e-9) // v for k, v in bundle.items() if v > 0))


def _show(bundle: dict) -> str:
    return " + ".join(f"{value:g} {key}" for key, value in bundle.items())
