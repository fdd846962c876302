"""The generation engine that lives in each worker: Stage-B prompts in, sampled texts out.

One ``Engine`` per worker process, built by the pool's engine factory after fork. Its
methods are what the parent calls through the pool: ``rollout`` (a chunk of tickets under a
guidance snapshot) and ``chat`` (a free-form prompt, used by the rule proposer).

Determinism: every generate call is seeded from the work it does (``chunk.seed_key``,
chunk index, decode index, decode seed, sample index), never from a rank, and a chunk is
always generated as one batch in its own ticket order. So a chunk gives the same bytes on
whichever worker runs it, and a rollout gives the same bytes on 1 or N workers, as long as
the software, hardware, dtype and chunk size stay the same (docs/architecture.md).
"""

from __future__ import annotations

import os
import time

import msgspec
import torch

from ..pool.devices import Device
from ..stageb import prompts
from ..stageb.hashing import stable_seed
from . import models
from .records import (
    ChatRequest,
    ChatResult,
    ChunkResult,
    Decode,
    RolloutChunk,
    Sample,
    TicketRollout,
)

_DETERMINISTIC_CUBLAS = (":4096:8", ":16:8")


class Engine:
    """A model and its tokenizer on one device, ready to generate.

    ``path``: ``"embedded"``, ``"tiny"``, a checkpoint directory or a ``.gguf`` file.
    ``dtype`` defaults to bfloat16 on CUDA and float32 on CPU; ``attn_implementation`` to
    flash_attention_2 when installed, on CUDA with a 16-bit dtype, else sdpa. ``stop``: stop strings (default:
    the tokenizer's eos plus ``<|im_end|>`` / ``<|endoftext|>`` when they exist).
    """

    def __init__(self, device, *, path="embedded", dtype=None, attn_implementation=None,
                 trust_remote_code=False, stop=None):
        self.device = device if isinstance(device, Device) else msgspec.convert(device, Device)
        torch.set_num_threads(max(1, self.device.threads))  # before the first op (fork rule)
        if self.device.kind == "cuda":
            _pin_cuda_determinism()
        self.path = path
        self.dtype = dtype or models.default_dtype(self.device.kind)
        attn = attn_implementation or models.default_attn_implementation(self.device.kind, self.dtype)
        self.model, self.tokenizer, self.model_name = models.load(
            path, dtype=self.dtype, attn_implementation=attn, trust_remote_code=trust_remote_code,
            device=self.device.torch_device,
        )
        self.attn_implementation = getattr(self.model.config, "_attn_implementation", attn)
        self._setup_tokens(stop)
        self._profiles: dict[int, tuple[object, object]] = {}

    # ------------------------------------------------------------ set-up

    def _setup_tokens(self, stop) -> None:
        from transformers import GenerationConfig

        tok = self.tokenizer
        tok.padding_side = "left"
        if tok.pad_token is None:
            tok.pad_token = tok.eos_token
        vocab = tok.get_vocab()
        if stop is None:
            stop = [t for t in (tok.eos_token, "<|im_end|>", "<|endoftext|>") if t and t in vocab]
        self.stop_strings = list(dict.fromkeys(stop))
        # A stop string that is one token stops generation through eos_token_id; longer ones
        # go to generate's stop_strings and the decoded text is cut at them.
        self.stop_ids = [vocab[s] for s in self.stop_strings if s in vocab]
        self._multi_token_stops = [s for s in self.stop_strings if s not in vocab]
        self.pad_id = tok.pad_token_id
        # Start from transformers' defaults, not the checkpoint's generation_config (which
        # may carry top_k, min_p, ...): every sampling knob comes from the Decode.
        self.model.generation_config = GenerationConfig(pad_token_id=self.pad_id, eos_token_id=self.stop_ids or None)

    def info(self) -> dict:
        """Provenance that bit-identical results depend on (recorded in run.json)."""
        import transformers

        facts = {
            "torch": str(torch.__version__),  # a TorchVersion, not JSON-encodable as is
            "transformers": transformers.__version__,
            "device": torch.cuda.get_device_name(0) if self.device.kind == "cuda" else "cpu",
            "dtype": self.dtype,
            "model_path": models.check_model_path(self.path),  # "embedded", "tiny" or an absolute path
            "model": self.model_name,
            "attn_implementation": self.attn_implementation,
            "stop": self.stop_strings,
        }
        if self.device.kind == "cuda":
            facts["cuda"] = str(torch.version.cuda)
            facts["cudnn"] = torch.backends.cudnn.version()
        return facts

    # ------------------------------------------------------------ rollout

    def rollout(self, chunk, *, guidance, profile) -> ChunkResult:
        """Generate every candidate of every ticket of ``chunk`` under ``guidance``.

        Tickets whose prompt is longer than ``chunk.max_prompt_tokens`` come back dropped
        (with their token count) and are not generated. Then, for every (decode, sample), one
        seeded, batched generate over the kept tickets in chunk order.
        """
        start = time.perf_counter()
        chunk = chunk if isinstance(chunk, RolloutChunk) else msgspec.convert(chunk, RolloutChunk)
        profile = self._profile(profile)
        texts = [self._render(prompts.build_messages(profile, guidance, t)) for t in chunk.tickets]
        ids = self.tokenizer(texts, add_special_tokens=False)["input_ids"]
        limit = chunk.max_prompt_tokens
        kept = [i for i, row in enumerate(ids) if limit is None or len(row) <= limit]
        samples: list[list[Sample]] = [[] for _ in chunk.tickets]
        generated = 0
        if kept:
            batch = self._pad([ids[i] for i in kept])
            for d, decode in enumerate(chunk.grid):
                for s in range(chunk.samples_per_decode):
                    seed = stable_seed(chunk.seed_key, chunk.chunk_index, d, decode.seed, s)
                    outs = self._generate(batch, decode, seed)
                    for i, (text, row, reason) in zip(kept, outs):
                        generated += len(row)
                        samples[i].append(Sample(d, s, text, len(row), reason,
                                                 row if chunk.return_token_ids else None))
        kept_set = set(kept)
        tickets = [
            TicketRollout(t.key, len(ids[i]), dropped=i not in kept_set, samples=samples[i])
            for i, t in enumerate(chunk.tickets)
        ]
        return ChunkResult(chunk.chunk_index, tickets, generated, time.perf_counter() - start)

    def _profile(self, profile):
        """The PromptProfile of a snapshot. The pool hands the worker the same cached value for
        the same snapshot, so conversions are cached by identity (the value is kept alive in
        the cache so its id cannot be reused)."""
        if isinstance(profile, prompts.PromptProfile):
            return profile
        hit = self._profiles.get(id(profile))
        if hit is not None and hit[0] is profile:
            return hit[1]
        converted = msgspec.convert(profile, prompts.PromptProfile)
        if len(self._profiles) >= 16:
            self._profiles.clear()
        self._profiles[id(profile)] = (profile, converted)
        return converted

    # ------------------------------------------------------------ chat

    def chat(self, request) -> ChatResult:
        """One free-form generation. Examples are dropped from the end until the rendered
        prompt fits ``max_prompt_tokens``; ``text`` is None when even zero examples do not fit."""
        request = request if isinstance(request, ChatRequest) else msgspec.convert(request, ChatRequest)
        limit = request.max_prompt_tokens
        for k in range(len(request.examples), -1, -1):
            user = "\n\n".join(p for p in [request.user_head, *request.examples[:k], request.user_tail] if p)
            messages = [{"role": "system", "content": request.system}, {"role": "user", "content": user}]
            row = self.tokenizer(self._render(messages), add_special_tokens=False)["input_ids"]
            if limit is None or len(row) <= limit:
                break
        else:
            return ChatResult(None, 0, len(row))
        ((text, out, reason),) = self._generate(self._pad([row]), request.decode, stable_seed(request.seed_key))
        return ChatResult(text, k, len(row), len(out), reason)

    # ------------------------------------------------------------ shared steps

    def _render(self, messages: list[dict]) -> str:
        try:
            return self.tokenizer.apply_chat_template(
                messages, add_generation_prompt=True, tokenize=False, enable_thinking=False
            )
        except TypeError:  # a template (or tokenizer) that does not know enable_thinking
            return self.tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)

    def _pad(self, rows: list[list[int]]) -> dict:
        batch = self.tokenizer.pad({"input_ids": rows}, padding=True, return_tensors="pt")
        return {k: v.to(self.device.torch_device) for k, v in batch.items()}

    def _generate(self, batch: dict, decode: Decode, seed: int) -> list[tuple[str, list[int], str]]:
        """One seeded batched generate: ``(text, completion ids, finish reason)`` per row.
        Completion ids run up to and including the stop token."""
        sampling = decode.temperature > 0
        options = dict(
            do_sample=sampling,
            max_new_tokens=decode.max_new_tokens,
            repetition_penalty=decode.repetition_penalty,
            eos_token_id=self.stop_ids or None,  # stop=[]: always run to max_new_tokens
            pad_token_id=self.pad_id,
        )
        if sampling:
            options.update(temperature=decode.temperature, top_p=decode.top_p, top_k=0)
        if self._multi_token_stops:
            options.update(stop_strings=self._multi_token_stops, tokenizer=self.tokenizer)
        torch.manual_seed(seed)
        with torch.inference_mode():
            out = self.model.generate(**batch, **options)
        new = out[:, batch["input_ids"].shape[1]:].tolist()
        rows, reasons = [], []
        for row in new:
            row, reason = self._cut(row)
            rows.append(row)
            reasons.append(reason)
        texts = self.tokenizer.batch_decode(rows, skip_special_tokens=True)
        return [(self._clean(t), r, why) for t, r, why in zip(texts, rows, reasons)]

    def _cut(self, row: list[int]) -> tuple[list[int], str]:
        stops = self.stop_ids
        for n, token in enumerate(row):
            if token in stops:
                return row[: n + 1], "stop"
        if self._multi_token_stops:
            # A stop-string finish pads the rest of the row; trailing pads are not output.
            end = len(row)
            while end and row[end - 1] == self.pad_id:
                end -= 1
            text = self.tokenizer.decode(row[:end], skip_special_tokens=True)
            if any(s in text for s in self._multi_token_stops):
                return row[:end], "stop"
        return row, "length"

    def _clean(self, text: str) -> str:
        cut = min((i for i in (text.find(s) for s in self.stop_strings) if i >= 0), default=len(text))
        return text[:cut].strip()  # a role echo is the verdict parser's business


def _pin_cuda_determinism() -> None:
    """Knobs that must be set before the CUDA context exists (a forked worker's first step)."""
    if os.environ.get("CUBLAS_WORKSPACE_CONFIG") not in _DETERMINISTIC_CUBLAS:
        os.environ["CUBLAS_WORKSPACE_CONFIG"] = ":4096:8"
    torch.use_deterministic_algorithms(True, warn_only=True)
    torch.backends.cudnn.benchmark = False
    torch.backends.cudnn.deterministic = True
    # TF32 pinned off, so a run does not depend on a default that differs between versions.
    torch.backends.cuda.matmul.fp32_precision = "ieee"
    torch.backends.cudnn.fp32_precision = "ieee"
