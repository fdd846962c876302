"""The whole rule search at 1 to 64 workers, on the simulated engine (a latency model).

    .venv/bin/python bench/loop_scaling.py                       # 1,2,4,8,16,32,64 fork; Ray at 8 and 64
    .venv/bin/python bench/loop_scaling.py --workers 1,8,64 --json rows.json --no-ray

Workload: 400 demo-style tickets (``configs/demo/make_tickets.py`` with n=400; the demo's seed
guidance), 5 iterations (early stop off), 3 candidates per iteration, a train pool of 256 of
the 320 train tickets (so that the pools, and with them the proposer's examples, change from
one iteration to the next) and an eval pool of 80, chunks of 4 tickets (so that a train
rollout is 64 chunks: with 16-ticket chunks it would be 16, and 64 workers could never all be
busy), the judge-headroom check on;
``model.engine: simulated`` with the embedded model's tokenizer counting the tokens and its
default latency model (a 7-8B model on one H100, docs/performance.md) slept at
``--time-scale`` (default 0.25: four times faster than the modelled GPU, so that the whole
bench fits 15 minutes on two cores; the parent's own work is not scaled, so the speedups
here are a lower bound of those at time scale 1).

Each worker count runs the same search in this process (``app.job.run_job``, as the CLI
does), into its own run directory; the fork rows first, then the Ray rows on a local Ray
cluster this bench starts (2 CPUs, 64 declared GPUs: the actors sleep, no GPU is used), as no
fork pool may start after ``ray.init``. Per row:

- ``wall_s``: the run, start to end (the tokenizer check of the guidance, the workers' start
  and report.html included); ``speedup`` = wall of 1 fork worker / this wall. ``search_s``:
  the rule search alone (``summary.json`` timing ``search_s``), ``search_speedup`` likewise.
- ``rollout_s``: the time the search spent gathering rollouts (``summary.json`` timing
  ``rollout_s``); ``rollout_speedup`` against 1 worker, ``rollout_efficiency`` = that / workers.
- the wall time of each phase: the union of the intervals in which at least one task of that
  phase ran on some worker (``pool_timeline.jsonl``): headroom, train baselines, proposer
  calls, candidate rollouts, eval rollouts, final train rollout; ``parent_only_s``: the time
  no worker had a task (the parent's gate, bootstrap, proposer parsing, writes, start, report).
- ``idle_share``: the share of worker-seconds idle between the first task's start and the
  last task's end, split by why: ``idle_proposer`` (a proposer call was running: the others
  had nothing to do), ``idle_parent`` (no task anywhere: the parent was busy), ``idle_tail``
  (some tasks running, this worker out of work: the end of a gather).
- ``parent_us_per_item``: the parent's CPU time inside the rollout runner's submit and wait
  (building chunks, dispatching, decoding and assembling results) per pool task;
  ``parent_total_us_per_item``: all of the parent's CPU over the run per pool task.
- ``identical``: ``stageb-pool diff`` (``app.diff.diff_runs``) of this run against the first
  row's finds no difference.
"""

from __future__ import annotations

import argparse
import contextlib
import importlib.util
import json
import os
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
os.environ.setdefault("HF_HUB_OFFLINE", "1")

from stageb_pool.app.config import load_config  # noqa: E402
from stageb_pool.app.diff import diff_runs  # noqa: E402
from stageb_pool.app.job import run_job  # noqa: E402
from stageb_pool.search.rollout import RolloutRunner  # noqa: E402

TICKETS = 400
CONFIG = """\
seed: 7
stage_a_paths: tickets.jsonl
mode: search
model:
  path: embedded
  engine: simulated
  simulated: {{time_scale: {time_scale}}}
prompt: {{profile: generic}}
guidance: {{path: guidance.json}}
output: {{root: {root}, run_name: {run_name}}}
runner: {{epochs: 5, chunk_size: 4}}
pool: {{task_timeout: 600}}
rule_search:
  proposer_max_new_tokens: 512
  reflect_size: 8
  num_candidate_rules: 3
  train_pool_size: 256
  eval_pool_size: 80
  gate:
    min_relative_error_reduction: 0.05
    max_changed_fraction: 0.3
    max_fp_rate_increase: 0.05
    bootstrap: {{iterations: 200, min_prob: 0.5}}
  early_stop: {{patience: 5}}
  train_sampler:
    grid: [{{temperature: 0.7, top_p: 0.9, max_new_tokens: 32}}]
  eval_sampler:
    grid: [{{temperature: 0.7, top_p: 0.9, max_new_tokens: 32}}]
"""
PHASES = ("headroom", "train_base", "proposer", "candidates", "eval", "final")


def write_inputs(root: Path) -> None:
    """The tickets and the seed guidance of the demo's generator, with 400 tickets."""
    spec = importlib.util.spec_from_file_location("make_tickets", REPO / "configs" / "demo" / "make_tickets.py")
    make = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(make)
    root.mkdir(parents=True, exist_ok=True)
    (root / "tickets.jsonl").write_text("".join(json.dumps(t) + "\n" for t in make.make_tickets(n=TICKETS)))
    (root / "guidance.json").write_text(json.dumps(make.GUIDANCE))


class ParentCpu:
    """CPU time of the parent inside the rollout runner's submit and wait calls (nested calls
    counted once): what the parent spends per item on dispatch and results."""

    def __init__(self):
        self.seconds, self._depth = 0.0, 0

    @contextlib.contextmanager
    def installed(self):
        originals = {name: getattr(RolloutRunner, name) for name in ("submit", "submit_chat", "wait")}

        def timed(method):
            def call(runner, *args, **kwargs):
                self._depth += 1
                start = time.process_time() if self._depth == 1 else None
                try:
                    return method(runner, *args, **kwargs)
                finally:
                    self._depth -= 1
                    if start is not None:
                        self.seconds += time.process_time() - start
            return call

        for name, method in originals.items():
            setattr(RolloutRunner, name, timed(method))
        try:
            yield self
        finally:
            for name, method in originals.items():
                setattr(RolloutRunner, name, method)


def phase_of(method: str, label: str | None) -> str:
    label = label or ""
    if method == "chat":
        return "proposer"
    if label == "headroom":
        return "headroom"
    if label.startswith("final"):
        return "final"
    if label.startswith("eval"):
        return "eval"
    return "train_base" if label.endswith("/base") else "candidates"


def union_length(intervals: list[tuple[float, float]]) -> float:
    total, end = 0.0, float("-inf")
    for a, b in sorted(intervals):
        if b > end:
            total += b - max(a, end)
            end = b
    return total


def timeline_analysis(rows: list[dict], workers: int) -> dict:
    """Phase wall times and idle worker-seconds by cause, from ``pool_timeline.jsonl``."""
    out = {f"{p}_s": round(union_length([(r["start_s"], r["end_s"]) for r in rows
                                          if phase_of(r["method"], r["label"]) == p]), 3) for p in PHASES}
    first, last = min(r["start_s"] for r in rows), max(r["end_s"] for r in rows)
    events = sorted([(r["start_s"], 1, r["method"] == "chat") for r in rows]
                    + [(r["end_s"], -1, r["method"] == "chat") for r in rows])
    idle = {"proposer": 0.0, "parent": 0.0, "tail": 0.0}
    running = chats = 0
    previous = first
    for t, delta, is_chat in events:
        span, free = t - previous, workers - running
        if span > 0 and free > 0:
            cause = "parent" if running == 0 else "proposer" if chats else "tail"
            idle[cause] += span * free
        running += delta
        chats += delta if is_chat else 0
        previous = t
    capacity = workers * (last - first)
    out["task_window_s"] = round(last - first, 3)
    out["parent_only_s"] = round((last - first) - union_length([(r["start_s"], r["end_s"]) for r in rows]), 3)
    out["idle_share"] = round(sum(idle.values()) / capacity, 4)
    out.update({f"idle_{k}": round(v / capacity, 4) for k, v in idle.items()})
    return out


def run_row(root: Path, backend: str, workers: int, time_scale: float, ray_address: str | None) -> dict:
    name = f"{backend}-{workers}"
    config_path = root / f"{name}.yaml"
    config_path.write_text(CONFIG.format(root=root / "runs", run_name=name, time_scale=time_scale))
    config = load_config(config_path, announce=False)
    gpus = str(workers) if backend == "ray" else f"cpu:{workers}"
    with ParentCpu().installed() as dispatch:
        cpu0, wall0 = time.process_time(), time.perf_counter()
        run_job(config, gpus, argv=["loop_scaling"], config_path=str(config_path), ray_address=ray_address)
        wall, cpu = time.perf_counter() - wall0, time.process_time() - cpu0
    run_dir = next((root / "runs").glob(f"*/{name}"))
    timeline = [json.loads(line) for line in (run_dir / "pool_timeline.jsonl").read_text().splitlines()]
    summary = json.loads((run_dir / "summary.json").read_text())
    return {"backend": backend, "workers": workers, "wall_s": round(wall, 3),
            "search_s": summary["timing"].get("search_s"), "rollout_s": summary["timing"]["rollout_s"], "proposer_gather_s": summary["timing"].get("proposer_s"),
            "gate_s": summary["timing"].get("gate_s"), "io_s": summary["timing"].get("io_s"),
            "items": len(timeline), "edits_accepted": summary["edits_accepted"],
            "parent_us_per_item": round(dispatch.seconds / len(timeline) * 1e6, 1),
            "parent_total_us_per_item": round(cpu / len(timeline) * 1e6, 1),
            **timeline_analysis(timeline, workers), "run_dir": str(run_dir)}


def start_ray(gpus: int) -> str:
    """A local Ray cluster (this machine's CPUs, ``gpus`` declared GPUs, no dashboard)."""
    import secrets

    os.environ.update(RAY_USAGE_STATS_ENABLED="0", RAY_DEDUP_LOGS="0", RAY_AUTH_MODE="token",
                      RAY_AUTH_TOKEN=secrets.token_hex(32))
    import ray

    ray.init(address="local", num_cpus=os.cpu_count(), num_gpus=gpus, include_dashboard=False,
             logging_level="ERROR")
    return "auto"


def finish(rows: list[dict]) -> None:
    """Speedups against the first row (1 fork worker) and the artifact check against it."""
    base = rows[0]
    for row in rows:
        row["speedup"] = round(base["wall_s"] / row["wall_s"], 2)
        row["search_speedup"] = round(base["search_s"] / row["search_s"], 2)
        row["rollout_speedup"] = round(base["rollout_s"] / row["rollout_s"], 2) if row["rollout_s"] else None
        row["rollout_efficiency"] = round(row["rollout_speedup"] / row["workers"], 3) if row["rollout_speedup"] else None
        if "identical" not in row:
            differences = diff_runs(base["run_dir"], row["run_dir"], limit=3)
            row["identical"] = not differences
            if differences:
                row["differences"] = [f"{d.file} {d.where} {d.key}" for d in differences]


COLUMNS = [("backend", "backend"), ("workers", "workers"), ("wall_s", "wall s"), ("speedup", "speedup"),
           ("search_s", "search s"), ("search_speedup", "search speedup"),
           ("rollout_s", "rollout s"), ("rollout_speedup", "rollout speedup"),
           ("rollout_efficiency", "rollout eff."), ("headroom_s", "headroom s"), ("train_base_s", "train base s"),
           ("proposer_s", "proposer s"), ("candidates_s", "candidates s"), ("eval_s", "eval s"),
           ("final_s", "final s"), ("gate_s", "gate+bootstrap s"), ("io_s", "writes s"),
           ("parent_only_s", "parent-only s"), ("idle_share", "idle share"), ("idle_proposer", "idle: proposer"),
           ("idle_tail", "idle: tail"), ("idle_parent", "idle: parent"),
           ("parent_us_per_item", "parent µs/item (dispatch)"), ("parent_total_us_per_item", "parent µs/item (all)"),
           ("edits_accepted", "edits"), ("identical", "identical")]


def table(rows: list[dict]) -> str:
    lines = ["| " + " | ".join(title for _, title in COLUMNS) + " |",
             "|" + "|".join("---" if key == "backend" else "---:" for key, _ in COLUMNS) + "|"]
    lines += ["| " + " | ".join(str(row.get(key, "")) for key, _ in COLUMNS) + " |" for row in rows]
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--workers", default="1,2,4,8,16,32,64", help="fork worker counts (the first is the base)")
    parser.add_argument("--ray-workers", default="8,64", help="Ray actor counts ('' for none)")
    parser.add_argument("--no-ray", action="store_true", help="skip the Ray rows")
    parser.add_argument("--time-scale", type=float, default=0.25, help="model.simulated.time_scale")
    parser.add_argument("--json", help="write the rows (a JSON list of objects) to this file")
    parser.add_argument("--keep", help="write the run directories here (default: a temporary directory)")
    args = parser.parse_args()
    started = time.perf_counter()
    fork_counts = [int(w) for w in args.workers.split(",") if w]
    ray_counts = [] if args.no_ray else [int(w) for w in args.ray_workers.split(",") if w]
    if ray_counts and importlib.util.find_spec("ray") is None:
        print("Ray rows skipped: ray is not installed (.venv/bin/python -m pip install -e '.[ray]')")
        ray_counts = []
    with contextlib.ExitStack() as stack:
        root = Path(args.keep) if args.keep else Path(stack.enter_context(tempfile.TemporaryDirectory()))
        write_inputs(root)
        rows = []
        for workers in fork_counts:
            rows.append(run_row(root, "fork", workers, args.time_scale, None))
            print(f"fork {workers}: {rows[-1]['wall_s']} s", flush=True)
        if ray_counts:  # last: no fork pool may start after ray.init
            address = start_ray(max(ray_counts))
            for workers in ray_counts:
                rows.append(run_row(root, "ray", workers, args.time_scale, address))
                print(f"ray {workers}: {rows[-1]['wall_s']} s", flush=True)
        finish(rows)
    print(f"time scale {args.time_scale}; {TICKETS} tickets, 5 iterations, 3 candidates, chunks of 4; "
          f"bench wall {time.perf_counter() - started:.0f} s")
    print(table(rows))
    if args.json:
        Path(args.json).write_text(json.dumps([{k: v for k, v in r.items() if k != "run_dir"} for r in rows],
                                              indent=1) + "\n")


if __name__ == "__main__":
    main()
