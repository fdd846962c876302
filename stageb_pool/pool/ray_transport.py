"""The Ray backend's transport: one actor per worker, each in its bundle of one placement
group, answering the pool's msgspec frames (``RayWorker.run``: bytes in, bytes out, not
pickled). Ray's restarts and retries are off: the dispatcher replaces a dead or stalled actor
in the same bundle, once the bundle sits on a live node (docs/architecture.md, "The Ray
backend": Faults, Node loss). Imported only for ``Pool(backend=Ray(...))``.
"""

from __future__ import annotations

import os
import re
import time

import msgspec

from . import protocol
from .cluster_probe import gcs_answers
from .devices import Device
from .dispatch import WorkerExited, WorkerMessage, WorkerStarted
from .errors import PoolError, ProtocolError
from .protocol import Ready
from .ray_cluster import RayConnection
from .backend import Ray
from .ray_placement import bundle_shape, describe_nodes, live_nodes, pack, place, plan_bundles, raylet_answers, show
from .tasks import PoolStats
from .worker import limit_threads
from .worker_core import WorkerCore


REPLACE_POLL = 0.2  # seconds between looks at a waiting replacement's bundle
REPLACE_GRACE = 2.0  # seconds a replacement may find no node with room before the run fails


class RayWorker:
    """The actor: a ``WorkerCore`` whose engine is built in ``__init__``, answering frames."""

    def __init__(self, device_json: bytes, factory_pickle: bytes, max_frame: int):
        import ray

        self.device = msgspec.json.decode(device_json, type=Device)
        self.max_frame = max_frame
        limit_threads(self.device, pin_gpu=False)  # Ray chose the GPU: CUDA_VISIBLE_DEVICES is set
        where = {"node_id": ray.get_runtime_context().get_node_id(), "node_ip": ray.util.get_node_ip_address(),
                 "gpu_ids": [str(i) for i in ray.get_gpu_ids()], "pid": os.getpid()}
        # Unpickled here, after the thread limits (Ray unpickles its arguments before __init__); a
        # module missing on this node fails the actor's creation as it did there.
        self.core = WorkerCore(ray.cloudpickle.loads(factory_pickle), self.device, max_frame)
        # The placement rides along under "ray"; the transport takes it out of worker_info again.
        self.hello = self.core.hello(ray=where)

    def __repr__(self) -> str:  # Ray's prefix of every line the actor prints: "(w3 cuda:3 pid=...)"
        device = getattr(self, "device", None)  # Ray may ask before __init__ ran
        return f"w{device.rank} {device.name}" if device else "RayWorker"

    def ready(self) -> bytes:
        return self.hello

    def run(self, frames: bytes) -> bytes:
        """The reply to the Share frames the actor lacks and the one Task frame after them."""
        return b"".join(self.core.answer(body) for body in protocol.FrameReader(self.max_frame).bodies(frames))


class RayTransport:
    """Connects to Ray, places one bundle per worker of ``devices`` (numbered by rank), then
    runs actors on request. ``placement``: per rank, where its actor runs."""

    def __init__(self, devices: list[Device], engine_factory, max_frame: int, stats: PoolStats, backend: Ray):
        self.devices = devices
        self.max_frame = max_frame
        self.stats = stats
        kind, gpus_per_worker = bundle_shape(devices)  # before connecting: a mixed list is the caller's error
        self.connection = RayConnection(backend.address, backend.connect_timeout)
        ray = self.ray = self.connection.ray
        self.group = None
        try:
            self.bundles = plan_bundles(ray, kind, gpus_per_worker, len(devices))
            self.group = place(ray, self.bundles, backend.placement_timeout,
                               name=f"stageb_pool-{os.getpid()}-{id(self):x}")
            self.actor_class = ray.remote(RayWorker)
            # Pickled once, not by Ray for each actor (the simulated engine's factory carries its
            # 1.5 MB tokenizer: 30-70 ms a pickle, 64 of them were 2-4 s of the driver's start at 64
            # actors). Passed to each actor as an argument, never ray.put: an object this process owns
            # in the object store makes Ray end the process when the cluster dies. (Ray puts an
            # argument over 100 KiB there anyway: keep factories small.)
            self.factory = ray.cloudpickle.dumps(engine_factory)
            self.gcs_address = ray.get_runtime_context().gcs_address
        except BaseException:
            self.close([])
            raise
        self.actors: list = [None] * len(self.devices)
        self.placement: list[dict] = [{} for _ in self.devices]
        self.inflight: dict = {}  # ObjectRef -> (rank, actor): the ready() and run() calls not yet answered
        self.events: list = []
        self.waiting: dict[int, float | None] = {}  # rank -> since when no live node has room for it (None: room)
        self.suspects: set[str] = set()  # nodes where an actor died: live only if their raylet answers

    def spawn(self, rank: int) -> None:
        if self.actors[rank] is None:  # the first actor: the group was just placed
            self._create(rank)
        else:  # a replacement: created by poll once its bundle is on a live node
            self.waiting[rank] = None
            self._create_waiting()

    def _create_waiting(self) -> None:
        """Create the replacements whose bundles are on live nodes; fail for one no live node has had
        room for during ``REPLACE_GRACE`` (while Ray moves a bundle, its new node shows them taken)."""
        if not self.waiting:
            return
        self._check_cluster()
        table = self.ray.util.placement_group_table(self.group)
        nodes = self._live_nodes()
        alive = {node.id for node in nodes}
        now = time.monotonic()
        for rank, since in list(self.waiting.items()):
            if table["state"] == "CREATED" and table["bundles_to_node_id"].get(rank) in alive:
                del self.waiting[rank]
                self._create(rank)
                continue
            bundle = self.bundles[rank]
            fits = None not in pack([bundle], [n.free for n in nodes])
            self.waiting[rank] = None if fits else (now if since is None else since)
            if not fits and since is not None and now - since > REPLACE_GRACE:
                free = describe_nodes(nodes, sorted(bundle), free=True)
                raise PoolError(f"worker {rank} ({self.devices[rank].name}) cannot be re-placed: no live node has "
                                f"{show(bundle)} free (free now: {free}); the placement group is {table['state']}")

    def _live_nodes(self) -> list:
        """The GCS's live nodes, less suspects whose raylet does not answer (lost, not yet dead)."""
        nodes = live_nodes(self.ray)
        for node in nodes:
            if node.id in self.suspects and raylet_answers(node):
                self.suspects.discard(node.id)  # only the actor died
        return [node for node in nodes if node.id not in self.suspects]

    def _create(self, rank: int) -> None:
        from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

        bundle = self.bundles[rank]
        actor = self.actor_class.options(
            num_gpus=bundle.get("GPU", 0), num_cpus=bundle.get("CPU", 0),
            max_restarts=0, max_task_retries=0, max_concurrency=1,  # restarts and retries are the pool's
            scheduling_strategy=PlacementGroupSchedulingStrategy(
                placement_group=self.group, placement_group_bundle_index=rank,
                placement_group_capture_child_tasks=False),
        ).remote(msgspec.json.encode(self.devices[rank]), self.factory, self.max_frame)
        self.actors[rank] = actor
        self.placement[rank] = {}  # known once it is ready
        self.inflight[actor.ready.remote()] = (rank, actor)
        self.events.append(WorkerStarted(rank, None))

    def send(self, rank: int, data: bytes) -> None:
        # Never blocks: Ray queues the call in the actor, which runs its calls in order.
        actor = self.actors[rank]
        self.inflight[actor.run.remote(data)] = (rank, actor)
        self.stats.bytes_sent += len(data)

    def cancel(self, rank: int, task_id: int) -> None:
        # The call runs to its end (its result is discarded). Not ray.cancel: on Ray 2.60 a call
        # cancelled before it reached its actor left a gap in the actor's call order, and the actor
        # waited 30 s for it, then failed every queued call (docs/performance.md).
        pass

    def kill(self, rank: int) -> None:
        # The only way to stop a running actor task; its pending calls then fail with
        # ActorDiedError, which poll reports as the exit (once).
        actor = self.actors[rank]
        self.ray.kill(actor, no_restart=True)
        if all(a is not actor for _, a in self.inflight.values()):
            self.events.append(WorkerExited(rank, None, None, "killed by the pool"))

    def poll(self, timeout: float | None) -> list:
        if self.waiting:  # look again for a live bundle every REPLACE_POLL seconds
            self._create_waiting()
            timeout = REPLACE_POLL if timeout is None else min(timeout, REPLACE_POLL)
        events, self.events = self.events, []
        if not self.inflight:
            if events:
                return events
            if timeout is not None:  # nothing can answer: only the clock (a deadline, a waiting replacement)
                time.sleep(timeout)
                return events
            raise PoolError("the Ray backend was asked to wait with nothing in flight")
        refs = list(self.inflight)
        ready, rest = self.ray.wait(refs, num_returns=1, timeout=0 if events else timeout)
        if ready and rest:  # collect whatever else is done, without waiting
            ready += self.ray.wait(rest, num_returns=len(rest), timeout=0)[0]
        for ref in self._in_order(ready):
            if ref in self.inflight:  # not dropped with an actor that died meanwhile
                events.append(self._answer(*self.inflight.pop(ref), ref))
        return events

    def _in_order(self, ready: list) -> list:
        """The calls to answer, in the order each actor got them: Ray may report a later call of
        an actor done first (``ray.get`` of the earlier ones then returns at once)."""
        done = set(ready)
        calls = list(self.inflight.items())
        last = {id(actor): i for i, (ref, (_, actor)) in enumerate(calls) if ref in done}
        return [ref for i, (ref, (_, actor)) in enumerate(calls) if i <= last.get(id(actor), -1)]

    def close(self, busy: list[int]) -> None:
        """Kill every actor, remove the placement group, and shut Ray down if this pool started
        it; skip Ray's calls (which would block) when the head is gone."""
        ray = self.ray
        gcs = getattr(self, "gcs_address", None)
        if ray.is_initialized() and (gcs is None or gcs_answers(gcs)):
            for actor in getattr(self, "actors", []):
                if actor is not None:
                    try:
                        ray.kill(actor, no_restart=True)
                    except Exception:  # noqa: BLE001 - already dead
                        pass
            if self.group is not None:
                try:
                    ray.util.remove_placement_group(self.group)
                except Exception:  # noqa: BLE001 - the cluster is going away
                    pass
        self.group = None
        self.connection.close()

    def _answer(self, rank: int, actor, ref):
        ray = self.ray
        try:
            data = ray.get(ref)
        except ray.exceptions.RayTaskError as exc:  # our actor code raised: a bug, not a death
            raise ProtocolError(f"worker {rank} ({self.devices[rank].name}) failed outside the engine: {exc}") from None
        except ray.exceptions.RayError as exc:  # the actor died (or its node, or its object)
            ray.kill(actor, no_restart=True)  # in case it only looks dead: free its bundle
            # Its other calls fail the same way: one exit per actor, then its tasks are retried.
            self.inflight = {r: v for r, v in self.inflight.items() if v[1] is not actor}
            self._check_cluster()
            return WorkerExited(rank, None, None, f"{_cause(exc)}{self._where(rank)}")
        self.stats.bytes_received += len(data)
        messages = protocol.FrameReader(self.max_frame).feed(data)
        if len(messages) != 1:
            raise ProtocolError(f"worker {rank} answered {len(messages)} messages in one reply")
        msg = messages[0]
        if isinstance(msg, Ready):
            self.placement[rank] = msg.info.pop("ray", {})
        return WorkerMessage(rank, msg)

    def _check_cluster(self) -> None:
        """Raise if the cluster's GCS no longer answers (Ray's state queries would block)."""
        if not gcs_answers(self.gcs_address):
            raise PoolError(f"lost the Ray cluster at {self.gcs_address}: its head (GCS) no longer answers; "
                            "every worker is gone")

    def _where(self, rank: int) -> str:
        """"; it ran on node 10.0.0.1 (1a2b3c4d), whose raylet does not answer": the node of the dead
        actor of ``rank`` and what is known of it; the node becomes a suspect."""
        try:
            node_id = self.placement[rank].get("node_id")  # from its Ready, else its bundle's
            if node_id is None:
                node_id = self.ray.util.placement_group_table(self.group)["bundles_to_node_id"].get(rank)
            node = next((n for n in live_nodes(self.ray) if n.id == node_id), None)
        except Exception:  # noqa: BLE001 - the cluster itself may be gone: say what is known
            return ""
        if node_id is None:
            return ""
        self.suspects.add(node_id)
        ip = self.placement[rank].get("node_ip") or (node.ip if node else "?")
        if node is None:
            state = "which Ray has declared dead"
        elif raylet_answers(node):
            state = "which is still up"
        else:
            state = "whose raylet does not answer (the node is lost)"
        return f"; it ran on node {ip} ({node_id[:8]}), {state}"


def _cause(exc: BaseException) -> str:
    """Ray's own explanation of a death, in one line (it reports no exit code or signal), less
    its list of common causes. An actor that died in its creation never reached the engine:
    Ray could not rebuild it on that node, and the last line of its traceback says why."""
    if getattr(exc, "actor_init_failed", False):
        lines = [line.strip() for line in _plain(getattr(exc, "error_msg", "") or str(exc)).splitlines()]
        last = next((line for line in reversed(lines) if line and not line.startswith("^")), type(exc).__name__)
        return (f"the actor could not be created ({last}): Ray could not rebuild the worker or its engine factory "
                "on that node; every node needs the same installation, the factory's module included")
    text = " ".join(_plain(str(exc)).split())  # one line
    why = re.search(r"The actor (?:is dead|died) because .*?\.(?=\s|$)", text)
    detail = re.search(r"Worker exit detail: (.*?)(?: Some common causes|$)", text)
    if why is None:
        return f"{type(exc).__name__}: {text}"
    cause = why.group(0).rstrip(".")
    return f"{cause} ({detail.group(1).strip()})" if detail else cause


def _plain(text: str) -> str:
    return re.sub(r"\x1b\[[0-9;]*m", "", text)
