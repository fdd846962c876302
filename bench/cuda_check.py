"""What the CUDA path does on a real GPU: identical bytes across worker layouts, and the
throughput of a model of a realistic shape.

    python bench/cuda_check.py layouts [--model embedded] [--tickets 64] [--chunk 8]
    python bench/cuda_check.py shapes [--shape qwen2-7b] [--chunks 8,32,64]

``layouts`` runs the same rollouts (the demo tickets, one sampled decode with the verdict
line constrained) and a schema-held proposer chat in three layouts on GPU 0:
  (1) the pool with one worker (``--gpus 0``);
  (2) the pool with two workers sharing GPU 0 (what 2 GPUs do, with one GPU to hand);
  (3) the engine in this process, after the pools are closed (the parent must not create a
      CUDA context before forking).
It prints tickets/s per layout and whether the three gave the same bytes (elapsed times
aside), plus the judge-headroom probabilities' digest.

``shapes`` builds a randomly initialised bfloat16 model of a real checkpoint's shape (no
weights travel to a GPU machine) with the embedded model's tokenizer, wraps it in the
transformers ``Engine`` in this process and measures, per chunk size: one prefill of the
chunk's prompts (prompt tokens/s) and the rollout (generated tokens/s; random weights never
stop early, so every row generates ``--max-new-tokens``). These are the measured rates the
simulated engine's cost model is compared with (docs/performance.md). The rollout runs once
more "watched", as in a forked worker, whose engine peeks at its channel for a cancellation at
every decode step (``pool.cancellation``): its time per decode step is the last column, and
one check on its own is timed apart (the difference of two rollouts is mostly their noise).
"""

from __future__ import annotations

import argparse
import contextlib
import hashlib
import socket
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]

# Shapes of public checkpoints (their config.json), vocabulary replaced by the tokenizer's.
SHAPES = {
    "qwen2-7b": dict(hidden_size=3584, intermediate_size=18944, num_hidden_layers=28, num_attention_heads=28,
                     num_key_value_heads=4, rope_theta=1e6, rms_norm_eps=1e-6, tie_word_embeddings=False),
    # for trying the script on CPU (--cpu): the same code on a model of no size
    "smoke": dict(hidden_size=128, intermediate_size=256, num_hidden_layers=2, num_attention_heads=4,
                  num_key_value_heads=2, tie_word_embeddings=True),
    "qwen2-1.5b": dict(hidden_size=1536, intermediate_size=8960, num_hidden_layers=28, num_attention_heads=12,
                       num_key_value_heads=2, rope_theta=1e6, rms_norm_eps=1e-6, tie_word_embeddings=True),
}


def workload(tickets: int, chunk: int, max_new_tokens: int):
    import msgspec

    from stageb_pool.engine.records import ChatRequest, Decode, RolloutChunk, VerdictChunk
    from stageb_pool.stageb import prompts
    from stageb_pool.stageb.guidance import load_guidance
    from stageb_pool.stageb.proposer_schema import proposer_schema
    from stageb_pool.stageb.tickets import load_tickets

    items = [t.text() for t in load_tickets(ROOT / "configs/demo/tickets.jsonl").tickets[:tickets]]
    mission = items[0].mission
    guidance = load_guidance(ROOT / "configs/demo/guidance.json", mission).experiences
    profile = prompts.load_profile("generic", mission=mission)
    decode = Decode(temperature=0.7, top_p=0.9, max_new_tokens=max_new_tokens, seed=43)
    chunks = [RolloutChunk("cuda-check", i // chunk, items[i:i + chunk], [decode], constrain_verdict=True)
              for i in range(0, len(items), chunk)]
    verdicts = [VerdictChunk(i // chunk, items[i:i + chunk]) for i in range(0, len(items), chunk)]
    schema = msgspec.json.encode(proposer_schema(guidance, profile.verdict, max_operations=2)).decode()
    chat = ChatRequest("You propose rule edits as JSON.", "Current rules:\n" + "\n".join(guidance.values()),
                       [t.key for t in items[:4]], "Answer with the JSON object.",
                       Decode(temperature=0.7, top_p=0.9, max_new_tokens=320, seed=43), "cuda-check-chat",
                       json_schema=schema)
    return chunks, verdicts, chat, dict(guidance=guidance, profile=profile)


def digest(results) -> str:
    import msgspec

    def stable(r):
        return msgspec.structs.replace(r, elapsed_s=0.0) if hasattr(r, "elapsed_s") else r

    return hashlib.sha256(msgspec.json.encode([stable(r) for r in results])).hexdigest()[:16]


def run_layout(name, run, chunks, verdicts, chat, shared) -> dict:
    from stageb_pool.engine.records import ChatResult, ChunkResult, VerdictChunkResult

    run("rollout", chunks[:1], ChunkResult, shared)  # warm-up: kernels, allocator
    start = time.perf_counter()
    rollouts = run("rollout", chunks, ChunkResult, shared)
    seconds = time.perf_counter() - start
    probabilities = run("verdict_probabilities", verdicts, VerdictChunkResult, shared)
    (answer,) = run("chat", [chat], ChatResult, {})
    return dict(layout=name, seconds=seconds, tickets=sum(len(r.tickets) for r in rollouts),
                tokens=sum(r.generated_tokens for r in rollouts), rollouts=digest(rollouts),
                probabilities=digest(probabilities), chat=digest([answer]), answer=answer)


def layouts(args) -> None:
    import msgspec

    from stageb_pool import Pool
    from stageb_pool.app.config import ModelConfig
    from stageb_pool.engine.models import check_model_path
    from stageb_pool.engine.registry import build_engine
    from stageb_pool.pool.devices import Device

    model = check_model_path(args.model)

    def factory(device):
        return build_engine(device, model, ModelConfig())

    chunks, verdicts, chat, shared = workload(args.tickets, args.chunk, args.max_new_tokens)
    rows = []
    kind = "cpu" if args.cpu else "cuda"
    specs = {"pool --gpus 0 (1 worker)": [Device(kind, 0, 0, 4)],
             "pool, 2 workers on GPU 0": [Device(kind, 0, 0, 4), Device(kind, 0, 1, 4)]}
    for name, devices in specs.items():
        with Pool(factory, gpus=devices, start_timeout=900) as pool:
            def run(method, items, result_type, kw, pool=pool):
                return pool.map(method, items, result_type=result_type, **kw)
            rows.append(run_layout(name, run, chunks, verdicts, chat, shared))
    engine = build_engine(Device(kind, 0, 0, 4).in_this_process(), model, ModelConfig())

    def run(method, items, result_type, kw):
        return [getattr(engine, method)(item, **kw) for item in items]
    rows.append(run_layout("in-process Engine", run, chunks, verdicts, chat, shared))
    print("engine:", msgspec.json.encode(engine.info()).decode())
    print(f"workload: {args.tickets} demo tickets, chunks of {args.chunk}, max_new_tokens {args.max_new_tokens}, "
          f"model {args.model}")
    print("| layout | rollout s | tickets/s | generated tokens | rollouts | P(pass) | proposer chat |")
    print("| --- | ---: | ---: | ---: | --- | --- | --- |")
    for r in rows:
        print(f"| {r['layout']} | {r['seconds']:.2f} | {r['tickets'] / r['seconds']:.1f} | {r['tokens']} | "
              f"{r['rollouts']} | {r['probabilities']} | {r['chat']} |")
    same = all(len({r[k] for r in rows}) == 1 for k in ("rollouts", "probabilities", "chat"))
    print("identical across layouts:", same)
    answer = rows[-1]["answer"]
    print(f"proposer answer ({answer.finish_reason}, {answer.completion_tokens} tokens): {answer.text!r}")
    try:
        msgspec.json.decode(answer.text or "")
        print("proposer answer parses as JSON: True")
    except msgspec.DecodeError as e:
        print("proposer answer parses as JSON: False:", e)


def random_model(shape: str, vocab_size: int, device: str, seed: int = 0):
    """A bfloat16 model of ``shape`` on ``device``, weights N(0, 0.02) drawn there (norms 1)."""
    import torch
    from transformers import Qwen2Config, Qwen2ForCausalLM

    config = Qwen2Config(vocab_size=vocab_size, max_position_embeddings=32768, **SHAPES[shape])
    config._attn_implementation = "sdpa"
    torch.set_default_dtype(torch.bfloat16)
    with torch.device("meta"):
        model = Qwen2ForCausalLM(config)
    torch.set_default_dtype(torch.float32)
    model = model.to_empty(device=device)
    generator = torch.Generator(device=device).manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("norm.weight"):
                p.fill_(1.0)
            elif name.endswith(".bias"):
                p.zero_()
            else:
                p.normal_(0.0, 0.02, generator=generator)
    # The rotary tables are buffers computed at construction, on meta here: build them again.
    for name, module in list(model.named_modules()):
        if type(module).__name__.endswith("RotaryEmbedding"):
            parent, _, attr = name.rpartition(".")
            with torch.device(device):
                setattr(model.get_submodule(parent) if parent else model, attr, type(module)(config))
    return model.eval()


@contextlib.contextmanager
def watched():
    """Calls inside run as a forked worker's task does: cancellable, its channel checked."""
    from stageb_pool.pool import cancellation

    worker, parent = socket.socketpair()
    cancellation.listen(worker)
    try:
        with cancellation.running(0):
            yield
    finally:
        cancellation.listen(None)
        worker.close()
        parent.close()


def shapes(args) -> None:
    import torch

    from stageb_pool.engine import chat_text, models
    from stageb_pool.engine.models import check_model_path
    from stageb_pool.engine.transformers_engine import TransformersEngine, prepare_device
    from stageb_pool.pool import cancellation
    from stageb_pool.pool.devices import Device

    device = Device("cpu" if args.cpu else "cuda", 0, 0, 4).in_this_process()
    prepare_device(device)
    tokenizer = models.tokenizer_only(check_model_path("embedded"))
    model = random_model(args.shape, len(tokenizer), device.torch_device)
    sync = torch.cuda.synchronize if device.kind == "cuda" else (lambda: None)
    params = sum(p.numel() for p in model.parameters())
    engine = TransformersEngine(model, tokenizer, device, model_name=f"random {args.shape}")
    print(f"model: random {args.shape}, {params / 1e9:.2f}B parameters, bfloat16, sdpa; "
          f"{torch.cuda.get_device_name(0) if device.kind == 'cuda' else 'cpu'}; torch {torch.__version__}")
    with watched():
        checks = 10_000
        start = time.perf_counter()
        for _ in range(checks):
            cancellation.checkpoint()
        print(f"one cancellation check, as at every decode step of a forked worker: "
              f"{(time.perf_counter() - start) / checks * 1e6:.2f} µs")
    print("| chunk | prompt tokens (mean) | prefill s | prompt tokens/s | rollout s | generated tokens/s | "
          "s per decode step | s per decode step, watched |")
    print("| ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: |")
    for size in [int(c) for c in args.chunks.split(",")]:
        chunks, _, _, shared = workload(size, size, args.max_new_tokens)
        chunk = chunks[0]
        engine.rollout(chunk, **shared)  # warm-up
        ids, kept = chat_text.chunk_prompts(tokenizer, chunk, shared["guidance"], shared["profile"])
        batch = engine._pad([ids[i] for i in kept])
        sync()
        start = time.perf_counter()
        with torch.inference_mode():
            model(**batch, logits_to_keep=1)
        sync()
        prefill = time.perf_counter() - start
        prompt_tokens = sum(len(ids[i]) for i in kept)
        start = time.perf_counter()
        result = engine.rollout(chunk, **shared)
        sync()
        rollout = time.perf_counter() - start
        with watched():
            start = time.perf_counter()
            engine.rollout(chunk, **shared)
            sync()
            watched_s = time.perf_counter() - start
        steps = max(s.completion_tokens for t in result.tickets for s in t.samples)
        print(f"| {size} | {prompt_tokens / len(kept):.0f} | {prefill:.3f} | {prompt_tokens / prefill:,.0f} | "
              f"{rollout:.2f} | {result.generated_tokens / rollout:,.0f} | {(rollout - prefill) / steps:.4f} | "
              f"{(watched_s - prefill) / steps:.4f} |")


def repeat(args) -> None:
    """The same chunk, three times per variant, in this process: which settings give the
    same bytes on every repeat, and what each costs."""
    import warnings

    import msgspec

    from stageb_pool.app.config import ModelConfig
    from stageb_pool.engine.models import check_model_path
    from stageb_pool.engine.registry import build_engine
    from stageb_pool.pool.devices import Device

    model = check_model_path(args.model)
    chunks, _, _, shared = workload(args.chunk, args.chunk, args.max_new_tokens)
    chunk = chunks[0]
    device = Device("cpu" if args.cpu else "cuda", 0, 0, 4).in_this_process()
    # sdpa backends switched off per variant (names of torch.backends.cuda.enable_*_sdp)
    variants = {
        "as the demo (t 0.7, top-p 0.9, verdict held)": ({}, {}, ()),
        "greedy, verdict held": ({}, dict(grid=[msgspec.structs.replace(chunk.grid[0], temperature=0.0)]), ()),
        "sdpa without cudnn": ({}, {}, ("cudnn",)),
        "sdpa without cudnn, flash": ({}, {}, ("cudnn", "flash")),
        "sdpa math only": ({}, {}, ("cudnn", "flash", "mem_efficient")),
        "attn eager": (dict(attn_implementation="eager"), {}, ()),
        "float32": (dict(dtype="float32"), {}, ()),
    }
    import torch

    engines = {}
    print(f"| variant | digests of {args.repeats} repeats | seconds (median) | distinct |")
    print("| --- | --- | ---: | ---: |")
    for name, (build, change, off) in variants.items():
        for backend in ("cudnn", "flash", "mem_efficient", "math"):
            getattr(torch.backends.cuda, f"enable_{backend}_sdp")(backend not in off)
        key = tuple(sorted(build.items()))
        if key not in engines:
            engines.clear()
            engines[key] = build_engine(device, model, ModelConfig(**build))
        engine = engines[key]
        work = msgspec.structs.replace(chunk, **change)
        engine.rollout(work, **shared)  # warm-up
        digests, seconds = [], []
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            for _ in range(args.repeats):
                start = time.perf_counter()
                result = engine.rollout(work, **shared)
                seconds.append(time.perf_counter() - start)
                digests.append(digest([result])[:6])
        print(f"| {name} | {' '.join(digests)} | {sorted(seconds)[len(seconds) // 2]:.2f} | {len(set(digests))} |")
        for w in {str(w.message)[:160] for w in caught}:
            print(f"|   warning: {w} | | | |")
    import cProfile
    import pstats

    engine = build_engine(device, model, ModelConfig())
    profile = cProfile.Profile()
    profile.runcall(engine.rollout, chunk, **shared)
    pstats.Stats(profile).sort_stats("tottime").print_stats(18)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("part", choices=["layouts", "shapes", "repeat"])
    ap.add_argument("--model", default="embedded")
    ap.add_argument("--tickets", type=int, default=64)
    ap.add_argument("--chunk", type=int, default=8)
    ap.add_argument("--chunks", default="8,32,64")
    ap.add_argument("--max-new-tokens", type=int, default=32)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--cpu", action="store_true", help="layouts on CPU workers (to try the script without a GPU)")
    ap.add_argument("--shape", choices=sorted(SHAPES), default="qwen2-7b")
    args = ap.parse_args()
    {"layouts": layouts, "shapes": shapes, "repeat": repeat}[args.part](args)


if __name__ == "__main__":
    main()
