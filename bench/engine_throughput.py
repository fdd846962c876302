"""Rollout throughput of the engine, in-process and through the pool.

    .venv/bin/python bench/engine_throughput.py [--tickets 32] [--chunk 8] [--max-new-tokens 32]
                                                [--repeats 3] [--model embedded]

Three layouts run the same workload (the demo tickets under the generic profile, one
sampled decode, chunks of ``--chunk`` tickets):
  (a) ``Engine`` called in-process, no pool (as many threads as a cpu:1 worker gets);
  (b) the pool with one CPU worker (``cpu:1``);
  (c) the pool with two CPU workers (``cpu:2``).
Each measurement runs in a fresh interpreter (so no layout inherits another's threads or
caches), after a small warm-up chunk, and times only the rollouts. Layouts are interleaved
``--repeats`` times and the median is reported; on a shared machine, noise is the biggest
error term. The pool's overhead is ``time(a) / time(b)`` (= tickets/s of b over a): 1.0
means free, the target is >= 0.98. The script also checks that all layouts produced the
same bytes.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
LAYOUTS = {"a": "in-process Engine", "b": "pool cpu:1", "c": "pool cpu:2"}


def workload(args):
    import msgspec

    from stageb_pool import prompts
    from stageb_pool.records import Decode, RolloutChunk, TicketText

    rows = [json.loads(line) for line in (ROOT / "configs/demo/tickets.jsonl").read_text().splitlines() if line.strip()]
    rows = rows[: args.tickets]
    mission = rows[0]["mission"]
    guidance = json.loads((ROOT / "configs/demo/guidance.json").read_text())[mission]["experiences"]
    profile = msgspec.to_builtins(prompts.load_profile("generic", mission=mission))
    tickets = [TicketText(r["group_id"], mission, r["per_image"]) for r in rows]
    decode = Decode(temperature=0.7, top_p=0.9, max_new_tokens=args.max_new_tokens, repetition_penalty=1.05, seed=43)
    chunks = [
        RolloutChunk("bench", i // args.chunk, tickets[i:i + args.chunk], [decode], 1, None, True)
        for i in range(0, len(tickets), args.chunk)
    ]
    warmup = [RolloutChunk("warmup", 0, tickets[:2], [msgspec.structs.replace(decode, max_new_tokens=4)])]
    return chunks, warmup, guidance, profile


def measure(layout: str, args) -> dict:
    """One layout in this (fresh) process: seconds for the rollouts, tokens, output digest."""
    import msgspec

    from stageb_pool.devices import parse_gpus
    from stageb_pool.records import ChunkResult

    chunks, warmup, guidance, profile = workload(args)
    shared = dict(guidance=guidance, profile=profile)
    if layout == "a":
        from stageb_pool.engine import Engine

        engine = Engine(parse_gpus("cpu:1")[0], path=args.model)
        for ch in warmup:
            engine.rollout(ch, **shared)
        start = time.perf_counter()
        results = [engine.rollout(ch, **shared) for ch in chunks]
        seconds = time.perf_counter() - start
    else:
        from stageb_pool import Pool

        def factory(device):
            from stageb_pool.engine import Engine

            return Engine(device, path=args.model)

        with Pool(factory, gpus="cpu:1" if layout == "b" else "cpu:2", start_timeout=900) as pool:
            pool.map("rollout", warmup * pool.size, **shared)
            start = time.perf_counter()
            results = pool.map("rollout", chunks, result_type=ChunkResult, **shared)
            seconds = time.perf_counter() - start
    stable = [msgspec.structs.replace(r, elapsed_s=0.0) for r in results]
    return {
        "layout": layout,
        "seconds": seconds,
        "tickets": sum(len(r.tickets) for r in results),
        "tokens": sum(r.generated_tokens for r in results),
        "digest": hashlib.sha256(msgspec.json.encode(stable)).hexdigest()[:16],
    }


def run_child(layout: str, args) -> dict:
    cmd = [sys.executable, __file__, "--child", layout, "--tickets", str(args.tickets), "--chunk", str(args.chunk),
           "--max-new-tokens", str(args.max_new_tokens), "--model", args.model]
    env = dict(os.environ, HF_HUB_OFFLINE="1", TOKENIZERS_PARALLELISM="false")
    out = subprocess.run(cmd, capture_output=True, text=True, env=env, cwd=ROOT)
    if out.returncode != 0:
        raise SystemExit(f"layout {layout} failed:\n{out.stderr[-4000:]}")
    return json.loads(out.stdout.strip().splitlines()[-1])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--tickets", type=int, default=32)
    ap.add_argument("--chunk", type=int, default=8)
    ap.add_argument("--max-new-tokens", type=int, default=32)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--model", default="embedded")
    ap.add_argument("--child", choices=sorted(LAYOUTS), help=argparse.SUPPRESS)
    args = ap.parse_args()
    sys.path.insert(0, str(ROOT))
    if args.child:
        print(json.dumps(measure(args.child, args)))
        return
    from stageb_pool import models

    if args.model == "embedded":
        models.ensure_embedded()  # convert once, outside the timings
    runs: dict[str, list[dict]] = {k: [] for k in LAYOUTS}
    for r in range(args.repeats):
        for layout in LAYOUTS:
            result = run_child(layout, args)
            runs[layout].append(result)
            print(f"  repeat {r + 1} {LAYOUTS[layout]:18s} {result['seconds']:7.2f} s", file=sys.stderr, flush=True)
    print(f"workload: {args.tickets} tickets, chunk {args.chunk}, max_new_tokens {args.max_new_tokens}, "
          f"model {args.model}, {os.cpu_count()} CPUs; median of {args.repeats} interleaved runs")
    print("| layout | wall s | tickets/s | generated tokens/s |")
    print("| --- | ---: | ---: | ---: |")
    median = {}
    for layout, name in LAYOUTS.items():
        median[layout] = statistics.median(x["seconds"] for x in runs[layout])
        first = runs[layout][0]
        print(f"| ({layout}) {name} | {median[layout]:.2f} | {first['tickets'] / median[layout]:.2f} | "
              f"{first['tokens'] / median[layout]:.1f} |")
    digests = {x["digest"] for rs in runs.values() for x in rs}
    print(f"pool overhead ratio (a)/(b) = time(a) / time(b) = {median['a'] / median['b']:.3f} (target >= 0.98)")
    print(f"cpu:2 speed-up over cpu:1 = {median['b'] / median['c']:.2f}x")
    print(f"identical outputs across layouts and repeats: {'yes' if len(digests) == 1 else 'NO ' + str(sorted(digests))}")


if __name__ == "__main__":
    main()
