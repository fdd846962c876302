"""Scaling of the pool on a simulated GPU workload, against the two designs it replaces.

Each item sleeps for a duration drawn from a seeded log-normal distribution (mean 50 ms,
heavy tail), standing in for one rollout chunk on one GPU; sleeping needs no cores, so
8 "GPUs" fit on a 2-core machine. For 1, 2, 4 and 8 workers it prints, from one run:

- (a) this pool: ``Pool.map`` with dynamic dispatch (a free worker takes the next item);
- (a') this pool, most expensive first: every item submitted with its cost (its duration;
  the rollout runner passes prompt characters x samples), so the longest start first;
- (b) the torchrun design: W processes in a torch.distributed gloo group; each global step
  takes ``per_rank * W`` items, cuts them into contiguous per-rank slices, and every rank
  waits for the slowest (a collective) before the next step;
- (c) ``multiprocessing.Pool.map`` (pickle, default chunksize);
- (d) this pool with ``backend=Ray()``: W Ray actors, each reserving one (declared) GPU of
  a local Ray cluster started here, in submission order and most expensive first. Ray runs
  last: no fork pool may start in a process after ray.init. ``--no-ray`` skips it,
  ``--no-baselines`` skips (b) and (c).

efficiency = ideal / measured, ideal = sum(durations) / W. Also the parent's CPU time per
item (µs), on the sleep workload (where every result wakes the parent from an idle wait)
and on zero-duration items (pure dispatch cost), the CPU of Ray's own processes per item
(raylet, GCS, the actors' core workers: every descendant of this process), and the round
trip of a small message (µs). The bounds of zero-overhead dispatch on the same items, in
submission order and most expensive first, are printed too.

    .venv/bin/python bench/pool_scaling.py            # about 4 minutes on 2 cores

This file is the only place in the project that imports torch.distributed (the gloo ranks
are separate processes started from here) and multiprocessing.
"""

from __future__ import annotations

import argparse
import heapq
import math
import multiprocessing
import os
import random
import subprocess
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from stageb_pool import Pool  # noqa: E402
from stageb_pool.pool import Ray  # noqa: E402

MEAN_S = 0.050
SIGMA = 1.0  # log-normal shape: a few items take 10-20x the median


def list_scheduling_makespan(items: list[float], workers: int) -> float:
    """Makespan of zero-overhead dynamic dispatch in the given order (a free worker takes
    the next item). In submission order: the best any online dispatcher can do without
    knowing durations; sorted longest first: the longest-processing-time-first schedule."""
    free = [0.0] * workers
    for duration in items:
        heapq.heappush(free, heapq.heappop(free) + duration)
    return max(free)


def durations(n: int, seed: int) -> list[float]:
    rng = random.Random(seed)
    mu = math.log(MEAN_S) - SIGMA**2 / 2  # so that the mean is MEAN_S
    return [rng.lognormvariate(mu, SIGMA) for _ in range(n)]


class SleepEngine:
    """The simulated GPU: an item is its own duration."""

    def __init__(self, device):
        self.device = device

    def run(self, seconds, *, guidance=None):
        time.sleep(seconds)
        return {"slept": seconds}

    def echo(self, item):
        return item


def sleep_item(seconds: float) -> dict:
    time.sleep(seconds)
    return {"slept": seconds}


def echo(item):
    return item


# -- (a), (a') and (d): this pool -----------------------------------------------------------
def bench_pool(items: list[float], workers: int, round_trips: int, *, costed: bool = False, **pool_kw) -> dict:
    """``pool_kw`` picks the backend: ``gpus=f"cpu:{workers}"`` (fork) or ``gpus=str(workers),
    backend=Ray()``."""
    guidance = {f"G{i}": "a rule of about sixty characters, like the real guidance ones" for i in range(20)}
    with Pool(SleepEngine, **pool_kw) as pool:
        cpu0, others0, t0 = time.process_time(), _descendants_cpu(), time.perf_counter()
        if costed:
            pool.gather([pool.submit("run", d, cost=d, guidance=guidance) for d in items])
        else:
            pool.map("run", items, guidance=guidance)
        wall, cpu = time.perf_counter() - t0, time.process_time() - cpu0
        others = _descendants_cpu() - others0
        cpu_zero = _cpu_per_item(lambda: pool.map("run", [0.0] * round_trips, guidance=guidance), round_trips)
        t1 = time.perf_counter()
        for i in range(round_trips):
            pool.call(0, "echo", i)
        rtt = (time.perf_counter() - t1) / round_trips
    return {"wall": wall, "cpu_per_item": cpu / len(items), "cpu_zero": cpu_zero, "rtt": rtt,
            "others_per_item": others / len(items)}


def _cpu_per_item(run, n: int) -> float:
    cpu0 = time.process_time()
    run()
    return (time.process_time() - cpu0) / n


def _descendants_cpu() -> float:
    """CPU seconds (user + system) of every living descendant of this process, from /proc:
    the forked workers, or the Ray processes (raylet, GCS, actors) a local cluster started."""
    children: dict[int, list[int]] = {}
    ticks = os.sysconf("SC_CLK_TCK")
    stats = {}
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                with open(f"/proc/{entry}/stat") as f:
                    fields = f.read().rsplit(")", 1)[1].split()
            except OSError:
                continue
            stats[int(entry)] = fields
            children.setdefault(int(fields[1]), []).append(int(entry))
    total, frontier = 0.0, [os.getpid()]
    while frontier:
        for child in children.get(frontier.pop(), []):
            total += (int(stats[child][11]) + int(stats[child][12])) / ticks  # utime, stime
            frontier.append(child)
    return total


def start_ray(workers: int) -> None:
    """A local Ray cluster for the Ray rows: 2 CPUs, ``workers`` declared GPUs (the actors
    sleep: no GPU is used), a per-run auth token, no dashboard."""
    import secrets

    os.environ.update(RAY_USAGE_STATS_ENABLED="0", RAY_DEDUP_LOGS="0", RAY_AUTH_MODE="token",
                      RAY_AUTH_TOKEN=secrets.token_hex(32))
    import ray

    ray.init(address="local", num_cpus=os.cpu_count(), num_gpus=workers, include_dashboard=False,
             logging_level="ERROR")


# -- (b) static torchrun-style schedule over gloo -------------------------------------------
def gloo_rank(rank: int, world: int, store: str, n: int, seed: int, per_rank: int) -> None:
    import torch.distributed as dist  # only here, in the benchmark's own rank processes

    dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=world)
    items = durations(n, seed)
    dist.barrier()
    t0 = time.perf_counter()
    step = per_rank * world
    for start in range(0, n, step):
        chunk = items[start:start + step]
        base, extra = divmod(len(chunk), world)  # upstream's balanced contiguous slices
        lo = rank * base + min(rank, extra)
        hi = lo + base + (rank < extra)
        results = [sleep_item(d) for d in chunk[lo:hi]]
        gathered = [None] * world
        dist.all_gather_object(gathered, results)  # every rank waits for the slowest
    if rank == 0:
        print(f"WALL {time.perf_counter() - t0:.6f}", flush=True)
    dist.destroy_process_group()


def bench_gloo(n: int, seed: int, workers: int, per_rank: int) -> dict:
    with tempfile.TemporaryDirectory() as tmp:
        store = os.path.join(tmp, "store")
        env = dict(os.environ, OMP_NUM_THREADS="1")
        procs = [
            subprocess.Popen(
                [sys.executable, __file__, "--gloo-rank", str(r), str(workers), store, str(n), str(seed), str(per_rank)],
                stdout=subprocess.PIPE, text=True, env=env)
            for r in range(workers)
        ]
        outs = [p.communicate(timeout=600)[0] for p in procs]
    if any(p.returncode for p in procs):
        raise RuntimeError(f"gloo ranks failed: {[p.returncode for p in procs]}")
    wall = float(next(line for line in outs[0].splitlines() if line.startswith("WALL")).split()[1])
    return {"wall": wall, "cpu_per_item": None, "cpu_zero": None, "rtt": None}


# -- (c) multiprocessing.Pool ----------------------------------------------------------------
def bench_mp(items: list[float], workers: int, round_trips: int) -> dict:
    ctx = multiprocessing.get_context("fork")
    with ctx.Pool(workers) as mp_pool:
        cpu0, t0 = time.process_time(), time.perf_counter()
        mp_pool.map(sleep_item, items)
        wall, cpu = time.perf_counter() - t0, time.process_time() - cpu0
        cpu_zero = _cpu_per_item(lambda: mp_pool.map(sleep_item, [0.0] * round_trips), round_trips)
        t1 = time.perf_counter()
        for i in range(round_trips):
            mp_pool.apply(echo, (i,))
        rtt = (time.perf_counter() - t1) / round_trips
    return {"wall": wall, "cpu_per_item": cpu / len(items), "cpu_zero": cpu_zero, "rtt": rtt}


POOL, POOL_LPT = "pool (dynamic)", "pool, most expensive first"
RAY, RAY_LPT = "pool on Ray (dynamic)", "pool on Ray, most expensive first"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--items", type=int, default=320)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--workers", default="1,2,4,8")
    parser.add_argument("--per-rank", type=int, default=4, help="static schedule: items per rank per step")
    parser.add_argument("--round-trips", type=int, default=2000)
    parser.add_argument("--no-ray", action="store_true", help="skip the Ray rows")
    parser.add_argument("--no-baselines", action="store_true", help="skip the torchrun and multiprocessing rows")
    args = parser.parse_args()
    items = durations(args.items, args.seed)
    total = sum(items)
    workers = [int(x) for x in args.workers.split(",")]
    print(f"{args.items} items, seed {args.seed}: mean {1000 * total / len(items):.1f} ms, "
          f"max {1000 * max(items):.0f} ms, total {total:.2f} s; static schedule: {args.per_rank} items per rank per step")
    designs = [(POOL, lambda w: bench_pool(items, w, args.round_trips, gpus=f"cpu:{w}")),
               (POOL_LPT, lambda w: bench_pool(items, w, args.round_trips, costed=True, gpus=f"cpu:{w}")),
               ("torchrun-style static (gloo)", lambda w: bench_gloo(args.items, args.seed, w, args.per_rank)),
               ("multiprocessing.Pool.map", lambda w: bench_mp(items, w, args.round_trips))][:2 if args.no_baselines else 4]
    rows = []
    for w in workers:
        for name, run in designs:
            rows.append((name, w, total / w, run(w)))
            _report(rows[-1])
    if not args.no_ray:  # last: after ray.init, no fork pool may start in this process
        try:
            start_ray(max(workers))
        except ImportError:
            print("Ray rows skipped: ray is not installed (.venv/bin/python -m pip install -e '.[ray]')")
        else:
            for w in workers:
                for name, costed in ((RAY, False), (RAY_LPT, True)):
                    r = bench_pool(items, w, args.round_trips, costed=costed, gpus=str(w), backend=Ray())
                    rows.append((name, w, total / w, r))
                    _report(rows[-1])
    print()
    print("Zero-overhead dynamic dispatch on these items (the bounds of the pool's efficiency):")
    for w in workers:
        bound = total / w / list_scheduling_makespan(items, w)
        lpt = total / w / list_scheduling_makespan(sorted(items, reverse=True), w)
        got = {name: total / w / r["wall"] for name, ww, _, r in rows if ww == w}
        line = f"  W={w}: submission order {bound:.3f}, most expensive first {lpt:.3f}"
        for name, ref in ((POOL, bound), (POOL_LPT, lpt), (RAY, bound), (RAY_LPT, lpt)):
            if name in got:
                line += f"; {name} {got[name]:.3f} = {got[name] / ref:.3f} of its bound"
        print(line)
    print()
    print("| design | workers | ideal s | measured s | efficiency | parent CPU µs/item (sleep items) "
          "| parent CPU µs/item (0 ms items) | other processes' CPU µs/item (sleep items) | small round trip µs |")
    print("|---|---:|---:|---:|---:|---:|---:|---:|---:|")
    for name, w, ideal, r in rows:
        cells = (f"{1e6 * r[k]:.0f}" if r.get(k) is not None else "n/a"
                 for k in ("cpu_per_item", "cpu_zero", "others_per_item", "rtt"))
        cpu, zero, others, rtt = cells
        print(f"| {name} | {w} | {ideal:.2f} | {r['wall']:.2f} | {ideal / r['wall']:.3f} | {cpu} | {zero} | {others} | {rtt} |")


def _report(row) -> None:
    name, w, ideal, r = row
    print(f"  {name:34s} W={w}: {r['wall']:.2f} s, efficiency {ideal / r['wall']:.3f}", flush=True)


if __name__ == "__main__":
    if len(sys.argv) > 1 and sys.argv[1] == "--gloo-rank":
        rank, world, store, n, seed, per_rank = sys.argv[2:8]
        gloo_rank(int(rank), int(world), store, int(n), int(seed), int(per_rank))
    else:
        main()
