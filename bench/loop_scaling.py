"""The whole rule search at 1 to 64 workers, on the simulated engine (a latency model).

    .venv/bin/python bench/loop_scaling.py                       # small: 1,2,4,8,16,32,64 fork; Ray at 8 and 64
    .venv/bin/python bench/loop_scaling.py --workers 1,8,64 --no-ray --workload small,production --json rows.json
    .venv/bin/python bench/loop_scaling.py --workers 64 --no-ray --compare HEAD~1   # this tree against a revision

Two workloads (``--workload``), both on demo-style tickets (``configs/demo/make_tickets.py``,
the demo's seed guidance), 3 candidates per iteration, early stop off, the judge-headroom
check on:

- ``small``: 400 tickets, 5 iterations, a train pool of 256 of the 320 train tickets (so that
  the pools, and with them the proposer's examples, change from one iteration to the next),
  an eval pool of 80, chunks of 4 tickets (a train rollout is 64 chunks: with 16-ticket
  chunks it would be 16, and 64 workers could never all be busy), one decode of 32 tokens, a
  512-token proposer budget, reflect size 8. Its serial share is large: the issue's targets
  are set on it.
- ``production``: shaped like upstream's production configs (``configs/bbu_line.yaml``):
  600 tickets, 3 iterations, a train pool of 512, an eval pool of 20, chunks of 16, three
  decodes per ticket (T 0.3/0.5/0.7, seed 43) each ending at ``PRODUCTION_ANSWER_TOKENS``
  (an estimate of the longest verdict answer of a batch: the simulated engine runs a batch to
  its decode's ``max_new_tokens``), reflect size 16, a 2048-token proposer budget (the
  simulated proposer answers about 110 tokens, three operations, and takes the time of those).

``model.engine: simulated`` with the embedded model's tokenizer counting the tokens and its
default latency model (a 7-8B model on one H100, docs/performance.md) slept at
``--time-scale`` (default 0.25: four times faster than the modelled GPU, so that the bench
fits minutes on two cores; the parent's own work is not scaled, so the speedups here are a
lower bound of those at time scale 1).

Each row runs in a fresh Python process (``--row``: no row pays another's imports, e.g.
matplotlib's or Ray's, or inherits its caches), the same search (``app.job.run_job``, as the
CLI does) into its own run directory; the Ray rows start their own local Ray cluster (2 CPUs,
the row's declared GPUs: the actors sleep, no GPU is used) before the row's clock starts
(``ray_cluster_s``, apart from every other column).
Per row:

- ``wall_s``: ``run_job``, start to end (the guidance check, the workers' start, the search,
  the close); ``speedup`` = the workload's first row's wall / this wall. report.html is
  drawn by its own process while the pool closes and is waited for apart: ``report_s``
  (from the request for the page to its end) and ``report_wait_s`` (the part of it after the
  close, which a run of the CLI waits for).
- ``start-up s``: from the call to the pool's ready workers (plan, the guidance check, the
  fork of every worker; under Ray the creation of every actor, each in a new process that
  imports Ray and unpickles the engine factory); ``close s``: the pool's close.
- ``search_s``: the rule search alone (``summary.json`` timing ``search_s``), ``search_speedup``.
- ``rollout_s``: the time the run spent gathering rollouts and the judge-headroom check's
  scoring (``summary.json`` timing ``rollout_s``); ``rollout_speedup`` against the first row, ``rollout_efficiency`` = that / workers.
- ``critical path s``: the run's length with infinitely many workers and the same parent:
  ``serial s`` (all the time outside the pool's gathers: start-up, the parent's work between
  gathers, the gate, the writes, the close) plus ``rounds s`` (per gather, its longest task: a
  rollout round, or the proposer call). ``bound``: the first row's wall / this critical path,
  the speedup no worker count can pass with this parent (Amdahl).
- the wall time of each phase: the union of the intervals in which at least one task of that
  phase ran on some worker (``pool_timeline.jsonl``): headroom, train baselines, proposer
  calls, candidate rollouts, eval rollouts, final train rollout; ``parent_only_s``: the time
  between the first task and the last in which no worker had a task.
- ``idle_share``: the share of worker-seconds idle between the first task's start and the
  last task's end, split by why: ``idle_proposer`` (a proposer call was running: the others
  had nothing to do), ``idle_parent`` (no task anywhere: the parent was busy), ``idle_tail``
  (some tasks running, this worker out of work: the end of a gather).
- ``parent_us_per_item``: the parent's CPU time inside the rollout runner's submit and wait
  (building chunks, dispatching, decoding and assembling results) per pool task: its dispatch
  cost; ``parent_total_us_per_item``: all of the parent's CPU over the run per pool task.
  Both are the process's CPU (``time.process_time``): under Ray they include the threads of
  Ray's client library in the parent (gRPC, the replies' handling), which a forked pool has not.
- speculation: its hit rate and the worker-seconds of discarded speculative tasks (columns shown when any row speculated).
- ``identical``: ``stageb-pool diff`` (``app.diff.diff_runs``) of this run against the
  workload's first row finds no difference.

``--compare REV`` measures a change on a host whose speed drifts (here by up to 60 % within
minutes, docs/performance.md): each row runs ``--pairs`` times with this tree's code and as
often with REV's (a detached ``git worktree`` in the temporary directory; both byte-compiled,
as ``bin/setup`` leaves this tree), back to back, the two taking turns to go first; it prints
per column both medians and the median of the pairs' ratios, and whether all runs wrote the
same artifacts.
"""

from __future__ import annotations

import argparse
import contextlib
import importlib.util
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
# The code a row runs: this tree, or with --compare another revision's checkout (the row's
# processes, Ray's actors included, import stageb_pool from it through PYTHONPATH).
SOURCE_ENV = "LOOP_SCALING_SOURCE"
sys.path.insert(0, os.environ.get(SOURCE_ENV) or str(REPO))
os.environ.setdefault("HF_HUB_OFFLINE", "1")

from stageb_pool.app import job  # noqa: E402
from stageb_pool.app.config import load_config  # noqa: E402
from stageb_pool.app.diff import diff_runs  # noqa: E402
from stageb_pool.app.job import run_job  # noqa: E402
from stageb_pool.pool import Pool  # noqa: E402
from stageb_pool.search.rollout import RolloutRunner  # noqa: E402

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
runner: {{epochs: {epochs}, chunk_size: {chunk_size}}}
pool: {{task_timeout: 600}}
rule_search:
  proposer_max_new_tokens: {proposer_max_new_tokens}
  reflect_size: {reflect_size}
  num_candidate_rules: 3
  train_pool_size: {train_pool_size}
  eval_pool_size: {eval_pool_size}
  gate:
    min_relative_error_reduction: 0.05
    max_changed_fraction: 0.3
    max_fp_rate_increase: 0.05
    bootstrap: {{iterations: 200, min_prob: 0.5}}
  early_stop: {{patience: 5}}
  train_sampler:
    grid: {train_grid}
  eval_sampler:
    grid: {eval_grid}
"""


def _grid(temperatures, max_new_tokens: int, seed: int | None = None) -> str:
    extra = f", seed: {seed}" if seed is not None else ""
    return "[" + ", ".join(f"{{temperature: {t}, top_p: 0.9, max_new_tokens: {max_new_tokens}{extra}}}"
                           for t in temperatures) + "]"


# The two workloads (module docstring). A decode's max_new_tokens is where the simulated
# engine ends a batch (its longest row): for "production" an estimate of the longest answer
# of a 16-ticket batch held to the verdict line at T 0.3-0.7 (docs/performance.md says why
# it is not measured yet: the tiny model, random weights, runs every answer to its budget).
PRODUCTION_ANSWER_TOKENS = 48
WORKLOADS = {
    "small": dict(tickets=400, epochs=5, chunk_size=4, proposer_max_new_tokens=512, reflect_size=8,
                  train_pool_size=256, eval_pool_size=80, train_grid=_grid([0.7], 32), eval_grid=_grid([0.7], 32),
                  what="400 tickets, 5 iterations, 3 candidates, train pool 256, eval 80, chunks of 4, "
                       "1 decode of 32 tokens"),
    "production": dict(tickets=600, epochs=3, chunk_size=16, proposer_max_new_tokens=2048, reflect_size=16,
                       train_pool_size=512, eval_pool_size=20,
                       train_grid=_grid([0.3, 0.5, 0.7], PRODUCTION_ANSWER_TOKENS, 43),
                       eval_grid=_grid([0.1], PRODUCTION_ANSWER_TOKENS, 43),
                       what=f"600 tickets, 3 iterations, 3 candidates, train pool 512, eval 20, chunks of 16, "
                            f"3 decodes (T 0.3/0.5/0.7) of {PRODUCTION_ANSWER_TOKENS} tokens, reflect 16"),
}
PHASES = ("headroom", "train_base", "proposer", "candidates", "eval", "final")


def write_inputs(root: Path, tickets: int) -> None:
    """The tickets and the seed guidance of the demo's generator."""
    spec = importlib.util.spec_from_file_location("make_tickets", REPO / "configs" / "demo" / "make_tickets.py")
    make = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(make)
    root.mkdir(parents=True, exist_ok=True)
    (root / "tickets.jsonl").write_text("".join(json.dumps(t) + "\n" for t in make.make_tickets(n=tickets)))
    (root / "guidance.json").write_text(json.dumps(make.GUIDANCE))


class Probes:
    """What the bench measures inside the run, by wrapping a few methods: the parent's CPU
    inside the rollout runner's submit and wait (nested calls counted once): its dispatch
    cost per task; each rollout gather's window (monotonic start, end); the pool's start and
    close; and the report: its render (from the fork of its process to its end) and how long
    the run waited for it."""

    def __init__(self):
        self.seconds, self._depth = 0.0, 0
        self.gathers: list[tuple[float, float]] = []
        self.pool_start_s = self.pool_close_s = self.report_s = self.report_wait_s = 0.0
        self.pool_ready_at = self.origin = None

    @contextlib.contextmanager
    def installed(self):
        patches = []

        def patch(owner, name, wrapper):
            original = getattr(owner, name)
            patches.append((owner, name, original))
            setattr(owner, name, wrapper(original))

        def cpu_timed(method):
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

        def gather_window(method):
            def call(pool, *args, **kwargs):
                wall = time.monotonic()
                try:
                    return method(pool, *args, **kwargs)
                finally:
                    self.gathers.append((wall, time.monotonic()))
            return call

        def pool_init(method):
            def call(pool, *args, **kwargs):
                started = time.perf_counter()
                method(pool, *args, **kwargs)
                self.origin = pool.stats.origin  # the timeline's zero (time.monotonic)
                self.pool_start_s = time.perf_counter() - started
                self.pool_ready_at = time.perf_counter()
            return call

        def pool_close(method):
            def call(pool):
                started = time.perf_counter()
                method(pool)
                self.pool_close_s += time.perf_counter() - started
            return call

        def report_start(method):  # the page is asked for
            def call(report, *args, **kwargs):
                report.bench_started = time.perf_counter()
                method(report, *args, **kwargs)
            return call

        def report_wait(method):
            def call(report):
                waited = time.perf_counter()
                try:
                    return method(report)
                finally:
                    end = time.perf_counter()
                    self.report_s, self.report_wait_s = end - report.bench_started, end - waited
            return call

        for name in ("submit", "submit_chat", "wait"):
            patch(RolloutRunner, name, cpu_timed)
        patch(Pool, "__init__", pool_init)
        patch(Pool, "close", pool_close)
        patch(Pool, "gather", gather_window)
        patch(job.ReportJob, "render", report_start)  # the report's process: forked at the start, asked at the end
        patch(job.ReportJob, "wait", report_wait)
        try:
            yield self
        finally:
            for owner, name, original in reversed(patches):
                setattr(owner, name, original)


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


def critical_path(rows: list[dict], gathers: list[tuple[float, float]], origin: float, wall_s: float) -> dict:
    """The run's length with infinitely many workers and the same parent: everything outside
    the pool's gathers (start-up, the parent's work between them, the close, the report's
    wait: serial) plus, per gather (a rollout phase, the headroom check), its longest task (a round: every task of the gather
    could start at once; a proposer call in the gather is usually that task)."""
    rounds = 0.0
    inside = 0.0
    for start, end in gathers:
        a, b = start - origin, end - origin
        durations = [r["end_s"] - r["start_s"] for r in rows if a - 1e-3 <= r["start_s"] <= b]
        rounds += max(durations, default=0.0)
        inside += end - start
    serial = wall_s - inside
    return {"serial_s": round(serial, 3), "rounds_s": round(rounds, 3), "critical_path_s": round(serial + rounds, 3),
            "gathers": len(gathers)}


def speculation(summary: dict) -> dict:
    """Speculation's hit rate (speculative tasks used ahead, of those submitted) and the
    worker-seconds of discarded ones, from summary.json's volatile part (empty without
    speculation: one worker, or ``runner.speculate: false``)."""
    found = summary.get("speculation") or (summary.get("timing") or {}).get("speculation") or {}
    return {"speculation_hits": found.get("hit_rate"), "speculation_wasted_s": found.get("wasted_worker_s")} if found else {}


def run_row(root: Path, workload: str, backend: str, workers: int, time_scale: float,
            ray_address: str | None) -> dict:
    """One run of ``workload`` (in this process: ``main`` gives each row a fresh one)."""
    name = f"{workload}-{backend}-{workers}"
    config_path = root / f"{name}.yaml"
    fields = {k: v for k, v in WORKLOADS[workload].items() if k not in ("tickets", "what")}
    config_path.write_text(CONFIG.format(root=root / "runs", run_name=name, time_scale=time_scale, **fields))
    config = load_config(config_path, announce=False)
    gpus = str(workers) if backend == "ray" else f"cpu:{workers}"
    with Probes().installed() as probes:
        cpu0, wall0 = time.process_time(), time.perf_counter()
        reports = []  # the report's process, waited for apart
        run_job(config, gpus, argv=["loop_scaling"], config_path=str(config_path), ray_address=ray_address,
                report_jobs=reports)
        wall, cpu = time.perf_counter() - wall0, time.process_time() - cpu0
        for report in reports:
            report.wait()
    run_dir = next((root / "runs").glob(f"*/{name}"))
    timeline = [json.loads(line) for line in (run_dir / "pool_timeline.jsonl").read_text().splitlines()]
    summary = json.loads((run_dir / "summary.json").read_text())
    return {"workload": workload, "backend": backend, "workers": workers, "wall_s": round(wall, 3),
            "startup_s": round(probes.pool_ready_at - wall0, 3) if probes.pool_ready_at else None,
            "pool_start_s": round(probes.pool_start_s, 3), "pool_close_s": round(probes.pool_close_s, 3),
            "report_s": round(probes.report_s, 3), "report_wait_s": round(probes.report_wait_s, 3),
            "search_s": summary["timing"].get("search_s"), "rollout_s": summary["timing"]["rollout_s"],
            "proposer_gather_s": summary["timing"].get("proposer_s"),
            "gate_s": summary["timing"].get("gate_s"), "io_s": summary["timing"].get("io_s"),
            "items": len(timeline), "edits_accepted": summary["edits_accepted"],
            "parent_us_per_item": round(probes.seconds / len(timeline) * 1e6, 1),
            "parent_total_us_per_item": round(cpu / len(timeline) * 1e6, 1),
            **critical_path(timeline, probes.gathers, probes.origin, wall), **speculation(summary),
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


def row_in_fresh_process(root: Path, workload: str, backend: str, workers: int, time_scale: float,
                         source: Path | None = None) -> dict:
    """``run_row`` in a new Python process: no row pays another's imports (matplotlib, Ray)
    or inherits its caches. ``source``: the checkout whose stageb_pool it runs (None: this tree)."""
    out = root / f"row-{workload}-{backend}-{workers}.json"
    env = None
    if source is not None:
        env = {**os.environ, SOURCE_ENV: str(source),
               "PYTHONPATH": os.pathsep.join(filter(None, [str(source), os.environ.get("PYTHONPATH")]))}
    subprocess.run([sys.executable, __file__, "--row", f"{backend}:{workers}", "--workload", workload,
                    "--time-scale", str(time_scale), "--keep", str(root), "--json", str(out)], check=True, env=env)
    return json.loads(out.read_text())


def one_row(args) -> None:
    """``--row``: one row, written as JSON to ``--json`` (the child side of ``row_in_fresh_process``)."""
    backend, workers = args.row.split(":")
    started = time.perf_counter()
    address = start_ray(int(workers)) if backend == "ray" else None  # before the timing: Ray's own start
    cluster_s = time.perf_counter() - started
    row = run_row(Path(args.keep), args.workload, backend, int(workers), args.time_scale, address)
    if address is not None:
        row["ray_cluster_s"] = round(cluster_s, 3)
    Path(args.json).write_text(json.dumps(row) + "\n")


def finish(rows: list[dict]) -> None:
    """Speedups against the first row of each workload (1 fork worker) and the artifact check
    against it; the Amdahl bound of the first row's critical path."""
    base = rows[0]
    for row in rows:
        row["speedup"] = round(base["wall_s"] / row["wall_s"], 2)
        row["search_speedup"] = round(base["search_s"] / row["search_s"], 2)
        row["rollout_speedup"] = round(base["rollout_s"] / row["rollout_s"], 2) if row["rollout_s"] else None
        row["rollout_efficiency"] = round(row["rollout_speedup"] / row["workers"], 3) if row["rollout_speedup"] else None
        row["bound"] = round(base["wall_s"] / row["critical_path_s"], 2)  # this row's critical path: infinite workers
        if "identical" not in row:
            differences = diff_runs(base["run_dir"], row["run_dir"], limit=3)
            row["identical"] = not differences
            if differences:
                row["differences"] = [f"{d.file} {d.where} {d.key}" for d in differences]


COLUMNS = [("backend", "backend"), ("workers", "workers"), ("wall_s", "wall s"), ("speedup", "speedup"),
           ("search_s", "search s"), ("search_speedup", "search speedup"),
           ("rollout_s", "rollout s"), ("rollout_speedup", "rollout speedup"),
           ("rollout_efficiency", "rollout eff."), ("critical_path_s", "critical path s"),
           ("serial_s", "serial s"), ("rounds_s", "rounds s"), ("bound", "bound"),
           ("ray_cluster_s", "Ray cluster s"), ("startup_s", "start-up s"), ("pool_close_s", "close s"),
           ("report_s", "report s"), ("report_wait_s", "report wait s"),
           ("headroom_s", "headroom s"), ("train_base_s", "train base s"),
           ("proposer_s", "proposer s"), ("candidates_s", "candidates s"), ("eval_s", "eval s"),
           ("final_s", "final s"), ("gate_s", "gate+bootstrap s"), ("io_s", "writes s"),
           ("parent_only_s", "parent-only s"), ("idle_share", "idle share"), ("idle_proposer", "idle: proposer"),
           ("idle_tail", "idle: tail"), ("idle_parent", "idle: parent"),
           ("parent_us_per_item", "parent µs/item (dispatch)"), ("parent_total_us_per_item", "parent µs/item (all)"),
           ("edits_accepted", "edits"), ("identical", "identical")]


def table(rows: list[dict]) -> str:
    spec = [("speculation_hits", "spec. hit rate"), ("speculation_wasted_s", "spec. wasted worker-s")]
    columns = COLUMNS + (spec if any("speculation_hits" in r for r in rows) else [])
    lines = ["| " + " | ".join(title for _, title in columns) + " |",
             "|" + "|".join("---" if key == "backend" else "---:" for key, _ in columns) + "|"]
    lines += ["| " + " | ".join(str(row.get(key, "")) for key, _ in columns) + " |" for row in rows]
    return "\n".join(lines)


COMPARED = [("wall_s", "wall s"), ("search_s", "search s"), ("rollout_s", "rollout s"),
            ("critical_path_s", "critical path s"), ("startup_s", "start-up s"), ("report_wait_s", "report wait s"),
            ("parent_us_per_item", "parent µs/task (dispatch)"), ("parent_total_us_per_item", "parent µs/task (all)"),
            ("speculation_wasted_s", "spec. wasted worker-s")]


def compare_table(pairs: list[tuple[dict, dict]], rev: str) -> str:
    """Per column, the median of this tree's rows, of ``rev``'s, and of the pairs' ratios
    (this / rev): the ratio of two rows run back to back, on a host whose speed drifts."""
    lines = [f"| column | this tree (median) | {rev} (median) | this / {rev} (median of {len(pairs)} pairs) |",
             "|---|---:|---:|---:|"]
    for key, title in COMPARED:
        got = [(a[key], b[key]) for a, b in pairs if a.get(key) is not None and b.get(key) is not None]
        if got:
            ratios = [a / b for a, b in got if b]
            ratio = f"{statistics.median(ratios):.3f}" if ratios else ""
            lines.append(f"| {title} | {statistics.median(a for a, _ in got):g} | "
                         f"{statistics.median(b for _, b in got):g} | {ratio} |")
    return "\n".join(lines)


def compare(root: Path, rev: str, pairs: int, workloads: list[str], rows: list[tuple[str, int]],
            time_scale: float) -> list[dict]:
    """``--compare REV``: each row (backend, workers) of each workload with this tree's code and
    with REV's (a detached git worktree); every run, this tree's first."""
    checkout = root / "compared-source"
    subprocess.run(["git", "-C", str(REPO), "worktree", "add", "--detach", "--quiet", str(checkout), rev], check=True)
    # Both sides byte-compiled, as bin/setup leaves this tree: where PYTHONDONTWRITEBYTECODE is
    # set, a side left as sources would compile them in every process (a Ray actor: seconds).
    for source in (REPO, checkout):
        subprocess.run([sys.executable, "-m", "compileall", "-q", str(source / "stageb_pool")], check=True)
    try:
        return [run for workload in workloads for backend, workers in rows
                for run in compare_row(root, checkout, rev, pairs, workload, backend, workers, time_scale)]
    finally:
        subprocess.run(["git", "-C", str(REPO), "worktree", "remove", "--force", str(checkout)], check=False)


def compare_row(root: Path, checkout: Path, rev: str, pairs: int, workload: str, backend: str, workers: int,
                time_scale: float) -> list[dict]:
    """One row ``pairs`` times with each side's code, back to back, the two taking turns to go
    first; prints the medians and whether every run wrote the same artifacts as this tree's first."""
    runs: dict[str, list[dict]] = {"this tree": [], rev: []}
    for i in range(pairs):
        for code in (("this tree", rev) if i % 2 == 0 else (rev, "this tree")):
            this_tree = code == "this tree"
            folder = root / workload / f"{backend}-{workers}-{'this' if this_tree else 'rev'}-{i}"
            write_inputs(folder, WORKLOADS[workload]["tickets"])
            row = row_in_fresh_process(folder, workload, backend, workers, time_scale, None if this_tree else checkout)
            runs[code].append({**row, "code": code})
            print(f"{workload} {backend} {workers} {code} {i + 1}/{pairs}: {row['wall_s']} s", flush=True)
    first = runs["this tree"][0]["run_dir"]
    differing = [r["code"] for r in runs["this tree"][1:] + runs[rev] if diff_runs(first, r["run_dir"], limit=1)]
    print(f"\n{workload} {backend} {workers} workers, this tree against {rev}, time scale {time_scale}; "
          + (f"artifacts differ from this tree's first run: {', '.join(differing)}" if differing
             else f"all {2 * pairs} runs wrote the same artifacts"))
    print(compare_table(list(zip(runs["this tree"], runs[rev])), rev))
    return runs["this tree"] + runs[rev]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--workers", default="1,2,4,8,16,32,64", help="fork worker counts (the first is the base)")
    parser.add_argument("--ray-workers", default="8,64", help="Ray actor counts ('' for none)")
    parser.add_argument("--no-ray", action="store_true", help="skip the Ray rows")
    parser.add_argument("--workload", default="small", help=f"comma-separated: {', '.join(WORKLOADS)}")
    parser.add_argument("--time-scale", type=float, default=0.25, help="model.simulated.time_scale")
    parser.add_argument("--json", help="write the rows (a JSON list of objects) to this file")
    parser.add_argument("--keep", help="write the run directories here (default: a temporary directory)")
    parser.add_argument("--compare", metavar="REV", help="run each row with this tree's code and with REV's "
                                                            "(a git revision), in turn, and compare the medians")
    parser.add_argument("--pairs", type=int, default=5, help="with --compare: runs of each row per side")
    parser.add_argument("--row", help=argparse.SUPPRESS)  # BACKEND:WORKERS, one row in this process
    args = parser.parse_args()
    if args.row:
        return one_row(args)
    started = time.perf_counter()
    workloads = [w for w in args.workload.split(",") if w]
    for workload in workloads:
        if workload not in WORKLOADS:
            parser.error(f"--workload {workload!r}: one of {', '.join(WORKLOADS)}")
    if args.compare and subprocess.run(["git", "-C", str(REPO), "rev-parse", "--verify", "--quiet",
                                        f"{args.compare}^{{commit}}"], capture_output=True).returncode:
        parser.error(f"--compare {args.compare!r}: not a commit of this repository")
    if args.pairs < 1:
        parser.error("--pairs must be at least 1")
    fork_counts = [int(w) for w in args.workers.split(",") if w]
    ray_counts = [] if args.no_ray else [int(w) for w in args.ray_workers.split(",") if w]
    if ray_counts and importlib.util.find_spec("ray") is None:
        print("Ray rows skipped: ray is not installed (.venv/bin/python -m pip install -e '.[ray]')")
        ray_counts = []
    everything = []
    with contextlib.ExitStack() as stack:
        root = Path(args.keep) if args.keep else Path(stack.enter_context(tempfile.TemporaryDirectory()))
        if args.compare:
            specs = [("fork", n) for n in fork_counts] + [("ray", n) for n in ray_counts]
            everything = compare(root, args.compare, args.pairs, workloads, specs, args.time_scale)
        else:
            for workload in workloads:
                folder = root / workload
                write_inputs(folder, WORKLOADS[workload]["tickets"])
                rows = []
                for backend, counts in (("fork", fork_counts), ("ray", ray_counts)):
                    for workers in counts:
                        rows.append(row_in_fresh_process(folder, workload, backend, workers, args.time_scale))
                        print(f"{workload} {backend} {workers}: {rows[-1]['wall_s']} s", flush=True)
                finish(rows)
                print(f"\n{workload}: {WORKLOADS[workload]['what']}; time scale {args.time_scale}")
                print(table(rows))
                everything += rows
    print(f"bench wall {time.perf_counter() - started:.0f} s")
    if args.json:
        Path(args.json).write_text(json.dumps([{k: v for k, v in r.items() if k != "run_dir"} for r in everything],
                                              indent=1) + "\n")


if __name__ == "__main__":
    main()
