"""Does the GPU-group path (issue 25) give the same bytes as one GPU per worker? Needs a GPU.

    .venv/bin/python bench/gpu_groups_check.py [--model tiny] [--tickets 24] [--chunk 8]
                                               [--max-new-tokens 24] [--dtype bfloat16]

Runs the same rollouts (the demo tickets under the generic profile, a sampled and a greedy
decode) through the pool, each layout in its own pool, and compares the results byte for
byte (everything but the wall-clock field):
  (a) today's path: ``--gpus 0``, one GPU per worker, the model loaded whole on cuda:0;
  (b) the device-map path over every visible GPU: one worker holding them all, its model
      split by ``sharding.layer_split_map`` with accelerate's hooks. With one visible GPU the
      group is that GPU (hooks forced, every layer on cuda:0): the code path of a group,
      without a second device;
  (c) with two or more visible GPUs, also the production path ``--gpus 0-(n-1)
      --gpus-per-worker n`` (``build_engine``), which must equal (b).
It prints each layout's digest, its engine's sharding facts, and IDENTICAL or DIFFERENT per
comparison; the exit code is 0 when (a) == (b) on one GPU, or (b) == (c) on several, else 1.
A difference between (a) and (b) on several GPUs is allowed by the determinism contract
(another group size may change the numbers, docs/usage.md) and is reported, not hidden.

The parent never initialises CUDA: each layout's engine lives in a forked worker.
"""

from __future__ import annotations

import argparse
import hashlib
import os
import shutil
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))


def visible_gpus() -> int:
    from stageb_pool.pool.devices import count_gpus

    return count_gpus()


def whole_engine(device, model, dtype: str | None):
    """(a) and (c): the engine as a run builds it (``model``: a checked ModelRef)."""
    from stageb_pool.app.config import ModelConfig
    from stageb_pool.engine.registry import build_engine

    return build_engine(device, model, ModelConfig(dtype=dtype))


def split_engine(device, model, dtype: str | None):
    """(b): the engine of a group worker, the layer map forced even for a one-GPU group."""
    from stageb_pool.engine import models
    from stageb_pool.engine.registry import pin_cuda_environment
    from stageb_pool.engine.transformers_engine import TransformersEngine, prepare_device

    pin_cuda_environment()
    prepare_device(device)
    dtype = dtype or models.default_dtype(device.kind)
    attn = models.default_attn_implementation(device.kind, dtype)
    loaded, tokenizer = models.load(model, dtype=dtype, attn_implementation=attn, shard_over=device.torch_devices)
    engine = TransformersEngine(loaded, tokenizer, device, model_path=model.path, model_name=model.name)
    engine.layer_map = {k: str(v) for k, v in (getattr(loaded, "hf_device_map", None) or {}).items()}
    return engine


def workload(args):
    from stageb_pool.engine.records import Decode, RolloutChunk
    from stageb_pool.stageb import prompts
    from stageb_pool.stageb.guidance import load_guidance
    from stageb_pool.stageb.tickets import load_tickets

    tickets = [t.text() for t in load_tickets(ROOT / "configs/demo/tickets.jsonl").tickets[: args.tickets]]
    mission = tickets[0].mission
    guidance = load_guidance(ROOT / "configs/demo/guidance.json", mission).experiences
    profile = prompts.load_profile("generic", mission=mission)
    decodes = [Decode(temperature=0.7, top_p=0.9, max_new_tokens=args.max_new_tokens, repetition_penalty=1.05, seed=43),
               Decode(temperature=0.0, max_new_tokens=args.max_new_tokens)]
    chunks = [RolloutChunk("gpu-groups", i // args.chunk, tickets[i:i + args.chunk], decodes, 2, None, True)
              for i in range(0, len(tickets), args.chunk)]
    return chunks, dict(guidance), profile


def run_layout(name: str, factory, gpus: str, gpus_per_worker: int, args) -> tuple[str, dict]:
    """The digest of the layout's results and its engine's info."""
    import functools

    import msgspec

    from stageb_pool import Pool
    from stageb_pool.engine.models import check_model_path
    from stageb_pool.engine.records import ChunkResult

    chunks, guidance, profile = workload(args)
    build = functools.partial(factory, model=check_model_path(args.model), dtype=args.dtype)
    with Pool(build, gpus=gpus, gpus_per_worker=gpus_per_worker, start_timeout=600) as pool:
        results = pool.map("rollout", chunks, guidance=guidance, profile=profile, result_type=ChunkResult)
        info = pool.worker_info[0]
    stable = b"".join(msgspec.json.encode(msgspec.structs.replace(r, elapsed_s=0.0)) for r in results)
    digest = hashlib.sha256(stable).hexdigest()[:16]
    texts = sum(len(s.text) for r in results for t in r.tickets for s in t.samples)
    facts = {k: info.get(k) for k in ("device", "dtype", "gpus_per_worker", "sharding")}
    print(f"({name}) --gpus {gpus} --gpus-per-worker {gpus_per_worker}: digest {digest}, "
          f"{len(results)} chunks, {texts} characters generated, {facts}", flush=True)
    return digest, info


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--model", default="tiny", help="model.path: tiny (default), embedded or a checkpoint")
    parser.add_argument("--tickets", type=int, default=24)
    parser.add_argument("--chunk", type=int, default=8)
    parser.add_argument("--max-new-tokens", type=int, default=24)
    parser.add_argument("--dtype", default=None, help="default: bfloat16 (the engine's default on CUDA)")
    args = parser.parse_args()
    n = visible_gpus()
    if n == 0:
        print("no GPU is visible: this check needs at least one (CPU: tests/test_engine.py covers the layer map)")
        return 2
    if shutil.which("nvidia-smi"):
        print(subprocess.run(["nvidia-smi", "-L"], capture_output=True, text=True).stdout.strip())
    print(f"{n} visible GPU(s); model {args.model}; CUDA_VISIBLE_DEVICES={os.environ.get('CUDA_VISIBLE_DEVICES')}")
    everything = f"0-{n - 1}" if n > 1 else "0"
    a, _ = run_layout("a", whole_engine, "0", 1, args)
    b, _ = run_layout("b", split_engine, everything, n, args)
    print(f"(a) vs (b): {'IDENTICAL' if a == b else 'DIFFERENT'}"
          + ("" if n == 1 else "  (a group of several GPUs may differ: the determinism contract is per group size)"))
    if n == 1:
        return 0 if a == b else 1
    c, _ = run_layout("c", whole_engine, everything, n, args)
    print(f"(b) vs (c): {'IDENTICAL' if b == c else 'DIFFERENT'}  (the same layer map: must be identical)")
    return 0 if b == c else 1


if __name__ == "__main__":
    sys.exit(main())
