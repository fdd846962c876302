"""Rollout throughput of the engine, in-process and through the pool.

    .venv/bin/python bench/engine_throughput.py [--tickets 32] [--chunk 8] [--max-new-tokens 32]
                                                [--repeats 3] [--model embedded]

Three layouts run the same workload (the demo tickets under the generic profile, one
sampled decode, chunks of ``--chunk`` tickets):
  (a) ``Engine`` called in-process, no pool, with the threads a cpu:1 worker gets;
  (b) the pool with one CPU worker (``cpu:1``);
  (c) the pool with two CPU workers (``cpu:2``).
(a) and (b) run in one process, alternating rollout by rollout: the pool is created first
(its worker is forked from a clean process), then the in-process engine is loaded next to
it. Alternating makes the pair see the same machine load, which matters on a shared
machine; (c) runs in a second fresh process. Every layout gets a warm-up chunk first and
only the rollouts are timed; the median of ``--repeats`` is reported. The pool's overhead
is ``time(a) / time(b)`` (= tickets/s of b over a): 1.0 means free, the target is >= 0.98.
The script also checks that all layouts produced the same bytes.

    .venv/bin/python bench/engine_throughput.py --engines [--tickets 64] [--chunks 16,64]

compares the engines instead: the transformers engine (in .venv) and the vLLM engine (in
.venv-vllm, made by bin/setup-vllm), each in-process in its own fresh process, on the same
tickets, decode and model, for each chunk size; it reports tickets/s, generated tokens/s and
the vLLM / transformers ratio of both. Each engine's bytes are checked across repeats.
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

    from stageb_pool.stageb import prompts
    from stageb_pool.stageb.guidance import load_guidance
    from stageb_pool.engine.records import Decode, RolloutChunk
    from stageb_pool.stageb.tickets import load_tickets

    tickets = [t.text() for t in load_tickets(ROOT / "configs/demo/tickets.jsonl").tickets[: args.tickets]]
    mission = tickets[0].mission
    guidance = load_guidance(ROOT / "configs/demo/guidance.json", mission).experiences
    profile = prompts.load_profile("generic", mission=mission)
    decode = Decode(temperature=0.7, top_p=0.9, max_new_tokens=args.max_new_tokens, repetition_penalty=1.05, seed=43)
    chunks = [
        RolloutChunk("bench", i // args.chunk, tickets[i:i + args.chunk], [decode], 1, None, True)
        for i in range(0, len(tickets), args.chunk)
    ]
    warmup = [RolloutChunk("warmup", 0, tickets[:2], [msgspec.structs.replace(decode, max_new_tokens=4)])]
    return chunks, warmup, dict(guidance=guidance, profile=profile)


def engine_factory(model: str, engine: str = "transformers"):
    from stageb_pool.engine.models import check_model_path

    checked = check_model_path(model)  # in the parent, as a run checks it

    def build(device):
        from stageb_pool.app.config import ModelConfig
        from stageb_pool.engine.registry import build_engine
        from stageb_pool.engine.vllm_engine import VllmSettings

        # the same threads for both engines (the vLLM default pins CPU workers to one)
        return build_engine(device, checked, ModelConfig(engine=engine, vllm=VllmSettings(cpu_threads=device.threads)))

    return build


def measure_engine(args) -> list[dict]:
    """One engine in this fresh process, all cores, each chunk size in turn."""
    from stageb_pool.pool.devices import parse_gpus

    engine = engine_factory(args.model, args.child_engine)(parse_gpus("cpu:1")[0])
    rows = []
    for size in [int(c) for c in args.chunks.split(",")]:
        args.chunk = size
        chunks, warmup, shared = workload(args)
        for ch in warmup:
            engine.rollout(ch, **shared)
        for _ in range(args.repeats):
            seconds, results = timed(lambda: [engine.rollout(ch, **shared) for ch in chunks])
            rows.append(dict(summary(args.child_engine, seconds, results), chunk=size))
    return rows


def compare_engines(args) -> None:
    venvs = {"transformers": ROOT / ".venv", "vllm": ROOT / ".venv-vllm"}
    rows = []
    for engine, venv in venvs.items():
        python = venv / "bin" / "python"
        if not python.exists():
            raise SystemExit(f"{python} is missing (the vLLM environment comes from bin/setup-vllm)")
        cmd = [str(python), __file__, "--child", "engine", "--child-engine", engine, "--tickets", str(args.tickets),
               "--chunks", args.chunks, "--max-new-tokens", str(args.max_new_tokens), "--model", args.model,
               "--repeats", str(args.repeats)]
        env = dict(os.environ, HF_HUB_OFFLINE="1", TOKENIZERS_PARALLELISM="false")
        out = subprocess.run(cmd, capture_output=True, text=True, env=env, cwd=ROOT)
        if out.returncode != 0:
            raise SystemExit(f"{engine} failed:\n{out.stderr[-4000:]}")
        rows += json.loads(out.stdout.strip().splitlines()[-1])
    print(f"workload: {args.tickets} tickets, max_new_tokens {args.max_new_tokens}, model {args.model}, "
          f"{os.cpu_count()} CPUs, one in-process engine per engine; median of {args.repeats} runs")
    print("| chunk | engine | wall s (median) | tickets/s | generated tokens | generated tokens/s |")
    print("| ---: | --- | ---: | ---: | ---: | ---: |")
    for size in [int(c) for c in args.chunks.split(",")]:
        rate = {}
        for engine in venvs:
            runs = [r for r in rows if r["chunk"] == size and r["layout"] == engine]
            med = statistics.median(r["seconds"] for r in runs)
            tokens = runs[0]["tokens"]
            rate[engine] = (runs[0]["tickets"] / med, tokens / med)
            same = "" if len({r["digest"] for r in runs}) == 1 else " (repeats DIFFER)"
            print(f"| {size} | {engine}{same} | {med:.2f} | {rate[engine][0]:.2f} | {tokens} | {rate[engine][1]:.1f} |")
        print(f"| {size} | vllm / transformers | | {rate['vllm'][0] / rate['transformers'][0]:.2f}x | | "
              f"{rate['vllm'][1] / rate['transformers'][1]:.2f}x |")


def summary(layout: str, seconds: float, results) -> dict:
    import msgspec

    stable = [msgspec.structs.replace(r, elapsed_s=0.0) for r in results]
    return {
        "layout": layout,
        "seconds": seconds,
        "tickets": sum(len(r.tickets) for r in results),
        "tokens": sum(r.generated_tokens for r in results),
        "prompt_tokens": sum(t.prompt_tokens for r in results for t in r.tickets),
        "digest": hashlib.sha256(msgspec.json.encode(stable)).hexdigest()[:16],
    }


def timed(fn):
    start = time.perf_counter()
    value = fn()
    return time.perf_counter() - start, value


def measure_pair(args) -> list[dict]:
    """(a) and (b), alternating, in this fresh process."""
    from stageb_pool import Pool
    from stageb_pool.pool.devices import parse_gpus
    from stageb_pool.engine.records import ChunkResult

    chunks, warmup, shared = workload(args)
    rows = []
    with Pool(engine_factory(args.model), gpus="cpu:1", start_timeout=900) as pool:
        engine = engine_factory(args.model)(parse_gpus("cpu:1")[0])  # after the fork: same threads as the worker
        pool.map("rollout", warmup, **shared)
        for ch in warmup:
            engine.rollout(ch, **shared)
        for _ in range(args.repeats):
            seconds, results = timed(lambda: [engine.rollout(ch, **shared) for ch in chunks])
            rows.append(summary("a", seconds, results))
            seconds, results = timed(lambda: pool.map("rollout", chunks, result_type=ChunkResult, **shared))
            rows.append(summary("b", seconds, results))
    return rows


def measure_two_workers(args) -> list[dict]:
    from stageb_pool import Pool
    from stageb_pool.engine.records import ChunkResult

    chunks, warmup, shared = workload(args)
    rows = []
    with Pool(engine_factory(args.model), gpus="cpu:2", start_timeout=900) as pool:
        pool.map("rollout", warmup * pool.size, **shared)
        for _ in range(args.repeats):
            seconds, results = timed(lambda: pool.map("rollout", chunks, result_type=ChunkResult, **shared))
            rows.append(summary("c", seconds, results))
    return rows


def run_child(part: str, args) -> list[dict]:
    cmd = [sys.executable, __file__, "--child", part, "--tickets", str(args.tickets), "--chunk", str(args.chunk),
           "--max-new-tokens", str(args.max_new_tokens), "--model", args.model, "--repeats", str(args.repeats)]
    env = dict(os.environ, HF_HUB_OFFLINE="1", TOKENIZERS_PARALLELISM="false")
    out = subprocess.run(cmd, capture_output=True, text=True, env=env, cwd=ROOT)
    if out.returncode != 0:
        raise SystemExit(f"part {part} failed:\n{out.stderr[-4000:]}")
    return json.loads(out.stdout.strip().splitlines()[-1])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--tickets", type=int, default=32)
    ap.add_argument("--chunk", type=int, default=8)
    ap.add_argument("--max-new-tokens", type=int, default=32)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--model", default="embedded")
    ap.add_argument("--engines", action="store_true", help="compare the transformers and vLLM engines")
    ap.add_argument("--chunks", default="16,64", help="chunk sizes of --engines")
    ap.add_argument("--child", choices=["ab", "c", "engine"], help=argparse.SUPPRESS)
    ap.add_argument("--child-engine", default="transformers", help=argparse.SUPPRESS)
    args = ap.parse_args()
    sys.path.insert(0, str(ROOT))
    if args.child:
        part = {"ab": measure_pair, "c": measure_two_workers, "engine": measure_engine}[args.child]
        print(json.dumps(part(args)))
        return
    from stageb_pool.engine import models

    if args.model == "embedded":
        models.ensure_embedded()  # convert once, outside the timings
    if args.engines:
        compare_engines(args)
        return
    rows = run_child("ab", args) + run_child("c", args)
    runs = {k: [r for r in rows if r["layout"] == k] for k in LAYOUTS}
    first = runs["a"][0]
    print(f"workload: {args.tickets} tickets, chunk {args.chunk}, max_new_tokens {args.max_new_tokens}, "
          f"model {args.model}, {os.cpu_count()} CPUs; median of {args.repeats} runs")
    print(f"prompt tokens per ticket (mean): {first['prompt_tokens'] / first['tickets']:.0f}; "
          f"generated tokens in all: {first['tokens']}")
    print("| layout | wall s (median) | all runs s | tickets/s | generated tokens/s |")
    print("| --- | ---: | --- | ---: | ---: |")
    median = {}
    for layout, name in LAYOUTS.items():
        times = [x["seconds"] for x in runs[layout]]
        median[layout] = statistics.median(times)
        print(f"| ({layout}) {name} | {median[layout]:.2f} | {', '.join(f'{t:.1f}' for t in times)} | "
              f"{first['tickets'] / median[layout]:.2f} | {first['tokens'] / median[layout]:.1f} |")
    pairs = [a["seconds"] / b["seconds"] for a, b in zip(runs["a"], runs["b"])]
    print(f"pool overhead ratio (a)/(b) = time(a) / time(b): median {median['a'] / median['b']:.3f}, "
          f"per alternating pair {', '.join(f'{p:.3f}' for p in pairs)} (target >= 0.98)")
    print(f"cpu:2 speed-up over cpu:1 = {median['b'] / median['c']:.2f}x")
    digests = {x["digest"] for x in rows}
    print(f"identical outputs across layouts and repeats: {'yes' if len(digests) == 1 else 'NO ' + str(sorted(digests))}")


if __name__ == "__main__":
    main()
