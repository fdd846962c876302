"""The transformers engine (``model.engine: transformers``, the default): how transformers
generates and scores under ``model_engine.ModelEngine``'s methods: one seeded, batched
``generate`` per (decode, sample) over a chunk's tickets in chunk order, and two forward
passes over a KV cache.
"""

from __future__ import annotations

import contextlib
import inspect

import torch

from ..pool import cancellation
from ..pool.devices import Device
from ..stageb.hashing import stable_seed
from . import chat_text, models, provenance, sharding
from .chat_text import Completion
from .constrained import Grammars
from .model_engine import ModelEngine
from .models import ModelRef
from .records import ChatRequest, Decode, RolloutChunk, VerdictChunk


class ChunkOutOfMemory(RuntimeError):
    """Out of device memory, naming the work and its prompt lengths (which tickets to cap)."""


def build_transformers_engine(device: Device, model: ModelRef, config, preloaded=None) -> TransformersEngine:
    prepare_device(device)
    dtype = config.dtype or models.default_dtype(device.kind)
    attn = config.attn_implementation or models.default_attn_implementation(device.kind, dtype)
    shard_over = device.torch_devices if device.group_size > 1 else None
    loaded, tokenizer = models.load(model, dtype=dtype, attn_implementation=attn,
                                    trust_remote_code=config.trust_remote_code, device=device.torch_device,
                                    shard_over=shard_over)
    return TransformersEngine(loaded, tokenizer, device, stop=config.stop, model_path=model.path,
                              model_name=model.name)


def prepare_device(device: Device) -> None:
    """Before a worker's first torch op: its thread count, and on a GPU the deterministic settings."""
    torch.set_num_threads(max(1, device.threads))
    if device.kind == "cuda":
        torch.use_deterministic_algorithms(True, warn_only=True)
        torch.backends.cudnn.benchmark = False
        torch.backends.cudnn.deterministic = True
        # TF32 pinned off, so a run does not depend on a default that differs between versions.
        torch.backends.cuda.matmul.fp32_precision = "ieee"
        torch.backends.cudnn.fp32_precision = "ieee"
        # cuDNN's attention (sdpa's choice for bfloat16 on Hopper) did not repeat its results
        # on an H100: docs/architecture.md, determinism point 4.
        torch.backends.cuda.enable_cudnn_sdp(False)


class TransformersEngine(ModelEngine):
    """A model and its tokenizer on one device. ``stop``: ``model.stop`` (``chat_text.ChatText``)."""

    def __init__(self, model, tokenizer, device: Device, *, stop: list[str] | None = None,
                 model_path: str = "", model_name: str = ""):
        from transformers import GenerationConfig, StoppingCriteriaList

        tokenizer.padding_side = "left"
        if tokenizer.pad_token is None:
            tokenizer.pad_token = tokenizer.eos_token
        self.model = model.eval()
        self.tokenizer = tokenizer
        self.device = device
        self.model_path = model_path
        self.model_name = model_name or getattr(model.config, "name_or_path", "") or type(model).__name__
        self.text = chat_text.ChatText(tokenizer, stop)
        self.dtype = str(model.dtype).removeprefix("torch.")
        self.attn_implementation = getattr(model.config, "_attn_implementation", None)
        self.pad_id = tokenizer.pad_token_id
        # Start from transformers' defaults, not the checkpoint's generation_config (which
        # may carry top_k, min_p, ...): every sampling knob comes from the Decode. One-token
        # stops end generation through eos_token_id; longer ones go to generate's stop_strings.
        self.model.generation_config = GenerationConfig(pad_token_id=self.pad_id, eos_token_id=self.text.stop_ids or None)
        self._grammars: Grammars | None = None
        self._stopping = StoppingCriteriaList([_StopWhenCancelled()])
        # transformers 5.x renamed forward's past_key_values to cache (the old name warns).
        self._cache_argument = "cache" if "cache" in inspect.signature(model.forward).parameters else "past_key_values"

    def info(self) -> dict:
        return provenance.engine_info(
            "transformers", self.device, dtype=self.dtype, model_path=self.model_path, model_name=self.model_name,
            stop=self.text.stop_strings, model_options={"attn_implementation": self.attn_implementation},
            sharding=sharding.SHARDING)

    def _sample(self, chunk: RolloutChunk, ids: list[list[int]], kept: list[int],
                regex: str | None) -> list[Completion]:
        """Per (decode, sample), one seeded generate whose batch is the chunk's kept tickets."""
        batch = self._pad([ids[i] for i in kept])
        completions = []
        for d, decode in enumerate(chunk.grid):
            for s in range(chunk.samples_per_decode):
                seed = stable_seed(chunk.seed_key, chunk.chunk_index, d, decode.seed, s)
                with _located_oom(lambda: _chunk_oom_message(chunk, kept, ids, d, s)):
                    outs = self._generate(batch, decode, seed, regex=regex)
                completions += [Completion(i, d, s, row, reason) for i, (row, reason) in zip(kept, outs)]
        return completions

    def _score_answers(self, chunk: VerdictChunk, ids: list[list[int]], kept: list[int],
                       answers: tuple[list[int], ...]) -> list[tuple[float, ...]]:
        """The kept tickets' prompts scored as one batch in chunk order (``_answer_logprobs``)."""
        with _located_oom(lambda: f"verdict probabilities of chunk {chunk.chunk_index} "
                                  f"({', '.join(str(len(ids[i])) for i in kept)} prompt tokens)"):
            return self._answer_logprobs([ids[i] for i in kept], answers)

    def _answer_logprobs(self, prompts: list[list[int]], answers: tuple[list[int], ...]) -> list[tuple[float, ...]]:
        """Per prompt, the summed log-probability of each answer's tokens after it, in two
        forward passes: the left-padded prompts once (their KV cache kept), then every (prompt,
        answer) row on that cache, so a long prompt is computed once. Positions count real
        tokens only (as generate does): a padded row gets the positions it would have alone."""
        k = len(answers)
        batch = self._pad(prompts)
        mask = batch["attention_mask"]
        positions = (mask.cumsum(-1) - 1).clamp(min=0)
        width = max(len(a) for a in answers)
        device = mask.device
        # Answers right-padded to one width: a pad only follows the tokens that are scored.
        tokens = torch.tensor([a + [self.pad_id] * (width - len(a)) for a in answers], device=device)
        real = torch.tensor([[1] * len(a) + [0] * (width - len(a)) for a in answers], device=device)
        with torch.inference_mode():
            # Only the last prompt column's logits (they predict every answer's first token):
            # the whole vocabulary at every prompt position would take gigabytes.
            head = self.model(**batch, position_ids=positions, use_cache=True, logits_to_keep=1)
            first = head.logits[:, -1].float().log_softmax(-1)
            cache = getattr(head, "cache", None) or head.past_key_values
            cache.batch_repeat_interleave(k)  # rows: prompt 0 x each answer, prompt 1 x each answer, ...
            rest = self.model(
                **{self._cache_argument: cache},
                input_ids=tokens.repeat(len(prompts), 1),
                attention_mask=torch.cat([mask.repeat_interleave(k, 0), real.repeat(len(prompts), 1)], dim=1),
                position_ids=positions[:, -1:].repeat_interleave(k, 0) + 1 + torch.arange(width, device=device),
            ).logits.float().log_softmax(-1)
        out = []
        for n in range(len(prompts)):
            sums = []
            for a, answer in enumerate(answers):
                row = n * k + a
                # Token j > 0 of the answer is predicted at the answer's column j - 1.
                later = rest[row, : len(answer) - 1].gather(-1, tokens[a, 1: len(answer), None]).sum()
                sums.append(float(first[n, answer[0]] + later))
            out.append(tuple(sums))
        return out

    def _complete(self, request: ChatRequest, row: list[int]) -> tuple[list[int], str]:
        with _located_oom(lambda: f"proposer chat {request.seed_key!r} ({len(row)} prompt tokens)"):
            ((out, reason),) = self._generate(self._pad([row]), request.decode, stable_seed(request.seed_key),
                                              json_schema=request.json_schema)
        return out, reason

    def _pad(self, rows: list[list[int]]) -> dict:
        batch = self.tokenizer.pad({"input_ids": rows}, padding=True, return_tensors="pt")
        return {k: v.to(self.device.torch_device) for k, v in batch.items()}

    def _generate(self, batch: dict, decode: Decode, seed: int, *, regex: str | None = None,
                  json_schema: str | None = None) -> list[tuple[list[int], str]]:
        """``(completion ids up to and including the stop, finish reason)`` per row."""
        sampling = decode.temperature > 0
        options = dict(
            do_sample=sampling,
            max_new_tokens=decode.max_new_tokens,
            repetition_penalty=decode.repetition_penalty,
            eos_token_id=self.text.stop_ids or None,  # stop=[]: always run to max_new_tokens
            pad_token_id=self.pad_id,
            stopping_criteria=self._stopping,
        )
        if sampling:
            options.update(temperature=decode.temperature, top_p=decode.top_p, top_k=0)
        if self.text.multi_token_stops:
            options.update(stop_strings=self.text.multi_token_stops, tokenizer=self.tokenizer)
        if regex is not None or json_schema is not None:
            rows, width = batch["input_ids"].shape
            options["logits_processor"] = [self._grammar().processor(rows, width, regex=regex, json_schema=json_schema)]
        torch.manual_seed(seed)
        with torch.inference_mode():
            out = self.model.generate(**batch, **options)
        return [self.text.cut(row, self.pad_id) for row in out[:, batch["input_ids"].shape[1]:].tolist()]

    def _grammar(self) -> Grammars:
        if self._grammars is None:  # built on first use: llguidance reads the whole vocabulary
            width = self.model.get_output_embeddings().weight.shape[0]
            self._grammars = Grammars(self.tokenizer, width)
        return self._grammars


class _StopWhenCancelled:
    """A stopping criterion of ``generate``, asked at every decode step: it raises
    ``TaskCancelled`` once the parent has cancelled the task (``pool.cancellation``: one
    non-blocking peek at the worker's channel), and otherwise stops no row, so the tokens are
    those generated without it."""

    def __init__(self):
        self._none = None  # "stop no row", made once per batch shape

    def __call__(self, input_ids, scores, **kwargs):
        cancellation.checkpoint()
        if self._none is None or self._none.shape[0] != input_ids.shape[0] or self._none.device != input_ids.device:
            self._none = torch.zeros(input_ids.shape[0], dtype=torch.bool, device=input_ids.device)
        return self._none


@contextlib.contextmanager
def _located_oom(where):
    """Turn a device out-of-memory error into one line naming the work (``where()``)."""
    try:
        yield
    except torch.OutOfMemoryError as err:
        if torch.cuda.is_available() and torch.cuda.is_initialized():
            torch.cuda.empty_cache()  # the worker may be asked for more work (or be replaced)
        cause = str(err).strip().splitlines()[0] if str(err).strip() else "out of memory"
        raise ChunkOutOfMemory(f"out of memory ({cause}) on {where()}") from None


def _chunk_oom_message(chunk: RolloutChunk, kept: list[int], ids: list[list[int]], d: int, s: int) -> str:
    tickets = ", ".join(f"{chunk.tickets[i].key} ({len(ids[i])} prompt tokens)" for i in kept)
    return (f"chunk {chunk.chunk_index} of rollout {chunk.seed_key!r} (decode {d}, sample {s}; "
            f"max_prompt_tokens {chunk.max_prompt_tokens}): {tickets}. Lower the sampler's "
            f"max_prompt_tokens or runner.chunk_size")
