"""The vLLM engine (``model.engine: vllm``): ``model_engine.ModelEngine``'s methods generated
with continuous batching, paged attention and prefix caching. The engine core runs in the
worker's own process (``VLLM_ENABLE_V1_MULTIPROCESSING=0``), imported after the fork, so a
killed worker leaves no grandchild holding the device; a GPU group's worker is the exception
(``tensor_parallel_size`` with vLLM's ``mp`` executor, whose shard processes are its
children). Why its results are the same on any worker count:
docs/architecture.md, "The vLLM engine".
"""

from __future__ import annotations

import importlib.util
import os
from typing import Annotated

import msgspec
from msgspec import Meta

from ..pool.devices import Device
from ..stageb.errors import InputError
from ..stageb.hashing import stable_seed
from . import chat_text, model_cache, models, provenance
from .chat_text import Completion
from .model_engine import ModelEngine
from .models import ModelRef
from .records import ChatRequest, Decode, RolloutChunk, VerdictChunk

GIB = 1 << 30
NAME = "vllm"  # model.engine, the section of its settings, and info()'s key of vLLM's version
AGREEMENT = (NAME,)  # vLLM's version: every worker must run the same one


class VllmSettings(msgspec.Struct, forbid_unknown_fields=True, kw_only=True, frozen=True):
    """``model.vllm``: settings that change bytes, pinned (never from the machine), in run.json."""

    kv_cache_gib: Annotated[float, Meta(gt=0, le=4096)] = 1.0  # KV cache per worker, fixed (never profiled from free memory)
    max_model_len: Annotated[int, Meta(ge=64, le=10_000_000)] = 8192  # longest prompt + completion of one request
    max_num_seqs: Annotated[int, Meta(ge=1, le=100_000)] = 256  # requests scheduled together
    block_size: Annotated[int, Meta(ge=1, le=4096)] | None = None  # KV-cache block size; None: vLLM's default for the device
    # Threads of a CPU worker, fixed whatever the worker count: vLLM's CPU kernels give other
    # low bits with another thread count. None: the pool's threads_per_worker, as transformers.
    cpu_threads: Annotated[int, Meta(ge=1, le=4096)] | None = 1


def kv_cache_bytes(config) -> int:
    """The GPU memory a worker holds besides the weights: the pinned KV cache."""
    return int(config.vllm.kv_cache_gib * GIB)


def check_installed() -> None:
    if importlib.util.find_spec(NAME) is None:
        raise InputError("vllm is not installed in this environment: create the vLLM environment with "
                         "bin/setup-vllm and run .venv-vllm/bin/stageb-pool", f"model.engine: {NAME}")


def prepare_environment(threads: int) -> None:
    """What vLLM reads from the environment, set before vllm (or torch) is imported."""
    os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"  # engine core in this process: no grandchild
    os.environ.setdefault("VLLM_NO_USAGE_STATS", "1")
    os.environ.setdefault("DO_NOT_TRACK", "1")
    os.environ.setdefault("VLLM_LOGGING_LEVEL", "WARNING")
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    # vLLM's CPU worker turns torch.set_num_threads into a no-op after start-up: the thread
    # count must come from OMP_NUM_THREADS, before torch is imported.
    os.environ["OMP_NUM_THREADS"] = str(max(1, threads))
    # VLLM_CPU_KVCACHE_SPACE would override the pinned KV-cache size (and "" crashes vLLM).
    os.environ.pop("VLLM_CPU_KVCACHE_SPACE", None)


def llm_args(device: Device, settings: VllmSettings, dtype: str) -> dict:
    """The pinned ``vllm.LLM`` arguments of a worker on ``device`` (the model's own come after)."""
    args = dict(
        dtype=dtype, enforce_eager=True, max_model_len=settings.max_model_len,
        kv_cache_memory_bytes=int(settings.kv_cache_gib * GIB), enable_prefix_caching=True,
        enable_chunked_prefill=False, max_num_seqs=settings.max_num_seqs, seed=0,
        generation_config="vllm",  # the checkpoint's sampling defaults never apply
    )
    if settings.block_size is not None:
        args["block_size"] = settings.block_size
    if device.group_size > 1:
        args["tensor_parallel_size"] = device.group_size
        args["distributed_executor_backend"] = "mp"
    return args


def build_vllm_engine(device: Device, model: ModelRef, config, preloaded=None) -> VllmEngine:
    pinned = config.vllm
    threads = (pinned.cpu_threads or device.threads) if device.kind == "cpu" else device.threads
    prepare_environment(threads)
    folder = models.checkpoint_dir(model)
    tokenizer = models.load_tokenizer(folder, config.trust_remote_code)
    models.require_chat_template(tokenizer, model.path)
    dtype = config.dtype or models.default_dtype(device.kind)
    args = llm_args(device, pinned, dtype)
    if models.is_vision_language(models.read_config(folder)):
        args["limit_mm_per_prompt"] = {"image": 0, "video": 0}  # Qwen-VL checkpoints, text only
    from vllm import LLM

    try:
        llm = LLM(model=str(folder), tokenizer=str(folder), trust_remote_code=config.trust_remote_code,
                  disable_log_stats=True, structured_outputs_config={"backend": "guidance"}, **args)
    except Exception as err:
        raise InputError(f"vLLM cannot load the model: {type(err).__name__}: {models.one_line(err)}",
                         model.path) from err
    # The tiny model vLLM loads is the one saved with head size 32, not the in-code one.
    name = model_cache.TINY_CHECKPOINT_NAME if model.kind == "tiny" else model.name
    return VllmEngine(llm, tokenizer, device, stop=config.stop, model_path=model.path, model_name=name,
                      settings=dict(args, kv_cache_gib=pinned.kv_cache_gib, threads=threads))


class VllmEngine(ModelEngine):
    """An in-process ``vllm.LLM`` and the Hugging Face tokenizer of the same checkpoint."""

    def __init__(self, llm, tokenizer, device: Device, *, stop: list[str] | None = None, model_path: str = "",
                 model_name: str = "", settings: dict | None = None):
        self.llm = llm
        self.tokenizer = tokenizer
        self.device = device
        self.model_path = model_path
        self.model_name = model_name
        self.text = chat_text.ChatText(tokenizer, stop)
        self.settings = dict(settings or {})
        self.max_model_len = self.settings.get("max_model_len") or llm.llm_engine.model_config.max_model_len
        self._broken = ""

    def info(self) -> dict:
        import vllm

        return provenance.engine_info(
            NAME, self.device, engine_version=vllm.__version__, dtype=self.settings.get("dtype"),
            model_path=self.model_path, model_name=self.model_name, stop=self.text.stop_strings,
            engine_settings={"vllm_settings": self.settings},  # holds tensor_parallel_size for a group of GPUs
            sharding="tensor_parallel")

    def _sample(self, chunk: RolloutChunk, ids: list[list[int]], kept: list[int],
                regex: str | None) -> list[Completion]:
        """One ``generate`` with one seeded request per (kept ticket, decode, sample)."""
        requests, where = [], []
        for d, decode in enumerate(chunk.grid):
            for s in range(chunk.samples_per_decode):
                for i in kept:
                    seed = stable_seed(chunk.seed_key, chunk.chunk_index, d, decode.seed, s, i)
                    requests.append((ids[i], self._params(decode, seed, regex)))
                    where.append((i, d, s))
        return [Completion(i, d, s, row, reason) for (i, d, s), (row, reason) in zip(where, self._generate(requests))]

    def _score_answers(self, chunk: VerdictChunk, ids: list[list[int]], kept: list[int],
                       answers: tuple[list[int], ...]) -> list[tuple[float, ...]]:
        """One request per (kept ticket, answer): prompt + answer, asking for their log-probabilities."""
        from vllm import SamplingParams

        # One greedy token is generated and ignored: vLLM has no zero-token request. Prompt
        # log-prob requests never read the prefix cache (vLLM skips it for them).
        params = SamplingParams(temperature=0.0, max_tokens=1, prompt_logprobs=0, detokenize=False)
        rows = [(ids[i] + answer, len(answer)) for i in kept for answer in answers]
        outs = self._run([(row, params) for row, _ in rows])
        sums = [_answer_logprob(out.prompt_logprobs, row, n) for (row, n), out in zip(rows, outs)]
        k = len(answers)
        return [tuple(sums[n * k:(n + 1) * k]) for n in range(len(kept))]

    def _complete(self, request: ChatRequest, row: list[int]) -> tuple[list[int], str]:
        params = self._params(request.decode, stable_seed(request.seed_key), json_schema=request.json_schema)
        ((out, reason),) = self._generate([(row, params)])
        return out, reason

    def _params(self, decode: Decode, seed: int, regex: str | None = None, json_schema: str | None = None):
        from vllm import SamplingParams
        from vllm.sampling_params import StructuredOutputsParams

        common = dict(
            max_tokens=decode.max_new_tokens,
            repetition_penalty=decode.repetition_penalty,
            # Stop where the transformers engine stops: on our stop ids and stop strings only.
            ignore_eos=True,
            stop_token_ids=list(self.text.stop_ids),
            stop=list(self.text.multi_token_stops) or None,
            include_stop_str_in_output=True,
            detokenize=bool(self.text.multi_token_stops),  # stop strings need vLLM's detokenizer
            skip_special_tokens=True,
        )
        if regex is not None:
            common["structured_outputs"] = StructuredOutputsParams(regex=regex)
        elif json_schema is not None:  # the schema's JSON text, compiled by the guidance backend
            common["structured_outputs"] = StructuredOutputsParams(json=json_schema)
        if decode.temperature > 0:
            return SamplingParams(temperature=decode.temperature, top_p=decode.top_p, top_k=0, seed=seed, **common)
        return SamplingParams(temperature=0.0, **common)

    def _generate(self, requests: list[tuple[list[int], object]]) -> list[tuple[list[int], str]]:
        """``(completion ids up to and including the stop, finish reason)`` per request."""
        return [(list(o.outputs[0].token_ids), "stop" if o.outputs[0].finish_reason == "stop" else "length")
                for o in self._run(requests)]

    def _run(self, requests: list[tuple[list[int], object]]) -> list:
        """One ``generate`` for all requests (prompt ids, SamplingParams): vLLM's outputs in order."""
        from vllm.inputs import TokensPrompt

        if not requests:
            return []
        longest = max(len(p) + sp.max_tokens for p, sp in requests)
        if longest > self.max_model_len:
            raise ValueError(f"a prompt plus max_new_tokens needs {longest} tokens, over model.vllm.max_model_len "
                             f"{self.max_model_len}: lower the sampler's max_prompt_tokens or raise max_model_len")
        if self._broken:
            raise RuntimeError(f"the vLLM engine failed earlier ({self._broken}); the worker must be replaced")
        self.llm.reset_prefix_cache()  # nothing carried over from the previous chunk
        try:
            outs = self.llm.generate([TokensPrompt(prompt_token_ids=list(p)) for p, _ in requests],
                                     [sp for _, sp in requests], use_tqdm=False)
        except Exception as err:
            # A request that failed inside the in-process engine can stay queued and hang the
            # next generate forever: refuse further work instead (the pool reports it).
            self._broken = f"{type(err).__name__}: {models.one_line(err)}"
            raise
        return outs


def _answer_logprob(prompt_logprobs, row: list[int], n: int) -> float:
    """The last ``n`` tokens' log-probabilities, summed in token order as transformers does."""
    if prompt_logprobs is None or len(prompt_logprobs) != len(row):
        raise RuntimeError(f"vLLM returned {len(prompt_logprobs or [])} prompt log-probs for {len(row)} tokens")
    total = 0.0  # a loop, not sum(): sum() compensates float rounding since Python 3.12
    for position in range(len(row) - n, len(row)):
        total += prompt_logprobs[position][row[position]].logprob
    return total
