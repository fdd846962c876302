"""The Ray backend's placement: one bundle per worker, packed onto the live nodes by the pool
itself (Ray shows an impossible request and a blocked one alike, pending forever), then
reserved through one PACK placement group, waited for within a bound. docs/architecture.md,
"The Ray backend" (Placement).
"""

from __future__ import annotations

import logging
import math
from typing import NamedTuple

from .cluster_probe import port_answers
from .devices import Device, DeviceSpecError, GroupSizeError
from .errors import PoolError

log = logging.getLogger("stageb_pool.pool")
MAX_THREADS = 8  # CPUs a GPU worker's bundle reserves at most (its torch threads are the pool's threads_per_worker)
RESOURCE_UNIT = 10_000  # Ray keeps resources in units of 1/10000: shares are rounded down to one
EPS = 1e-9
RAYLET_PROBE_TIMEOUT = 1.0  # seconds; a raylet on a live node answers in milliseconds
PLACEMENT_SETTLE = 3.0  # seconds a request that fits may take to be placed before the wait is reported


class Node(NamedTuple):  # a live node as the GCS sees it
    id: str
    ip: str
    port: int
    total: dict
    free: dict

    def label(self) -> str:
        return f"node {self.ip} ({self.id[:8]})"


def live_nodes(ray) -> list[Node]:
    """Every live node, with what it has and what is free on it now."""
    from ray._private.state import available_resources_per_node

    free = available_resources_per_node()
    return [Node(n["NodeID"], n.get("NodeManagerAddress", "?"), int(n.get("NodeManagerPort") or 0),
                 dict(n["Resources"]), dict(free.get(n["NodeID"], {})))
            for n in ray.nodes() if n.get("Alive")]


def raylet_answers(node: Node, timeout: float = RAYLET_PROBE_TIMEOUT) -> bool:
    """Whether the node's raylet accepts a connection now: the GCS keeps a lost node "alive" for
    about 15 s, and a replacement placed there would die too."""
    return port_answers(node.ip, node.port, timeout)


def bundle_shape(devices: list[Device]) -> tuple[str, int]:
    """``(kind, GPUs per worker)`` of a Ray pool's workers, which share one bundle shape."""
    shapes = {(d.kind, d.group_size) for d in devices}
    if len({kind for kind, _ in shapes}) > 1:
        raise DeviceSpecError("a Ray pool's workers are all GPU workers or all CPU workers")
    if len(shapes) > 1:
        raise GroupSizeError("a Ray pool's GPU workers all hold the same number of GPUs")
    return shapes.pop()


def plan_bundles(ray, kind: str, gpus_per_worker: int, workers: int) -> list[dict]:
    """The placement bundles of ``workers`` workers of ``gpus_per_worker`` GPUs (or CPU workers):
    a GPU worker's holds its group (on one node) and the CPUs per GPU of the poorest node that can
    hold a group, at most 8 (its torch threads stay the device's); CPU workers share the CPUs
    (``cpu_share``)."""
    nodes = live_nodes(ray)
    if kind == "cuda":
        fitting = [n for n in nodes if n.total.get("GPU", 0) >= gpus_per_worker]
        if not fitting and gpus_per_worker > 1:  # one GPU per worker: the packing says what is missing
            largest = max((n.total.get("GPU", 0) for n in nodes), default=0)
            raise PoolError(f"cannot place a worker of {gpus_per_worker} GPUs: a worker's GPUs must be on one node, "
                            f"and no node of the cluster has {gpus_per_worker} (the largest has {largest:g}); "
                            "use fewer GPUs per worker, or add a node with that many")
        per_gpu = [int(n.total.get("CPU", 0) // n.total["GPU"]) for n in fitting]
        cpus = min(min(per_gpu, default=0) * gpus_per_worker, MAX_THREADS)
        bundle = {"GPU": float(gpus_per_worker), **({"CPU": float(cpus)} if cpus else {})}
    else:
        cpus = cpu_share([n.total.get("CPU", 0.0) for n in nodes], workers)
        if cpus is None:
            raise PoolError(f"cannot place {workers} CPU workers: the cluster's live nodes have no CPU to share "
                            f"({describe_nodes(nodes, ['CPU'], free=False)})")
        bundle = {"CPU": float(cpus)}
    return [dict(bundle) for _ in range(workers)]


def cpu_share(cpus: list[float], count: int) -> float | None:
    """The largest CPU share per worker such that ``count`` of them pack onto nodes with ``cpus``
    CPUs: whole CPUs where possible, else a fraction rounded down to Ray's unit (never 3 x 0.6667
    on 2 CPUs); None without CPUs."""
    fits = lambda share: sum(math.floor(c / share + EPS) for c in cpus) >= count  # noqa: E731
    whole = [s for s in range(int(max(cpus, default=0)), 0, -1) if fits(s)]
    if whole:
        return float(whole[0])
    shares = {math.floor(c / k * RESOURCE_UNIT) / RESOURCE_UNIT for c in cpus for k in range(1, count + 1)}
    usable = sorted((s for s in shares if s > 0 and fits(s)), reverse=True)
    return usable[0] if usable else None


def pack(bundles: list[dict], capacity: list[dict]) -> list[int | None]:
    """The node (index into ``capacity``) of each bundle, first fit, largest first; None where none fits."""
    left = [dict(c) for c in capacity]
    where: list[int | None] = [None] * len(bundles)
    for i in sorted(range(len(bundles)), key=lambda i: sorted(bundles[i].values(), reverse=True), reverse=True):
        for n, free in enumerate(left):
            if all(free.get(key, 0.0) + EPS >= value for key, value in bundles[i].items()):
                for key, value in bundles[i].items():
                    free[key] = free.get(key, 0.0) - value
                where[i] = n
                break
    return where


def refuse_impossible(ray, bundles: list[dict]) -> None:
    """A PoolError at once when the live nodes could never hold ``bundles``, naming what each has."""
    nodes = live_nodes(ray)
    on_totals = pack(bundles, [n.total for n in nodes])
    if None in on_totals:
        fit = sum(w is not None for w in on_totals)
        raise PoolError(f"cannot place {_request(bundles)}: the cluster's live nodes could hold {fit} "
                        f"({describe_nodes(nodes, _keys(bundles), free=False)}) (ask for fewer workers, or add nodes "
                        "with `ray start`)")


def place(ray, bundles: list[dict], timeout: float, name: str):
    """Reserve every bundle in one PACK placement group (32 GPU bundles fill four 8-GPU nodes).

    An impossible request fails at once. One not placed within ``PLACEMENT_SETTLE`` seconds (the
    time Ray takes to return a just-removed group's resources) is logged as blocked by other jobs
    and waited for at most ``timeout`` seconds in all, then fails naming what is free per node."""
    refuse_impossible(ray, bundles)
    group = ray.util.placement_group(bundles, strategy="PACK", name=name)
    settle = min(timeout, PLACEMENT_SETTLE)
    ready, _ = ray.wait([group.ready()], timeout=settle)
    if not ready and timeout > settle:
        log.warning("the cluster can hold %s, but other jobs hold the resources now (free now: %s); waiting up to "
                    "%g s more for them", _request(bundles), describe_nodes(live_nodes(ray), _keys(bundles), free=True),
                    timeout - settle)
        ready, _ = ray.wait([group.ready()], timeout=timeout - settle)
    if ready:
        return group
    state = ray.util.placement_group_table(group)
    ray.util.remove_placement_group(group)
    nodes = live_nodes(ray)
    raise PoolError(f"could not reserve {_request(bundles)} within {timeout:g} s (placement group "
                    f"{state['state']}, {state['stats']['scheduling_state']}): the cluster can hold them, but other "
                    f"jobs hold the resources (free now: {describe_nodes(nodes, _keys(bundles), free=True)})")


def show(bundle: dict) -> str:
    """A bundle as a person reads it: "1 GPU + 2 CPU"."""
    return " + ".join(f"{value:g} {key}" for key, value in bundle.items()) or "nothing"


def _request(bundles: list[dict]) -> str:
    if all(b == bundles[0] for b in bundles):
        return f"{len(bundles)} workers of {show(bundles[0])} each"
    return f"{len(bundles)} workers of {', '.join(show(b) for b in bundles)}"


def _keys(bundles: list[dict]) -> list[str]:
    return sorted({key for bundle in bundles for key in bundle})


def describe_nodes(nodes: list[Node], keys: list[str], *, free: bool) -> str:
    """Per node, the resources asked for: "node 10.0.0.1 (1a2b3c4d): 2 CPU, 0 GPU"."""
    if not nodes:
        return "no live node"

    def amounts(node: Node) -> str:
        if free:
            return ", ".join(f"{node.free.get(k, 0.0):g} of {node.total.get(k, 0.0):g} {k}" for k in keys)
        return ", ".join(f"{node.total.get(k, 0.0):g} {k}" for k in keys)

    return "; ".join(f"{node.label()}: {amounts(node)}" for node in nodes)
