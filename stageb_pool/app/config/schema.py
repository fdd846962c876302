"""The config schema: every key, type, range and default, as frozen msgspec Structs (the one
place the keys are defined, the sections the search and the engines read declared beside
that code: search/settings.py, engine.records, each engine's module; docs/usage.md documents
each, a test keeps the two in step), the legacy keys, and the helpers that walk the schema
for the key checks, ``--set`` and that test.
"""

from __future__ import annotations

import difflib
import re
from typing import Annotated, Any, Literal, Union, get_args, get_origin

import msgspec
from msgspec import Meta

from ...engine.registry import DEFAULT_ENGINE, ENGINES
from ...engine.simulated_engine import SimulatedSettings
from ...engine.vllm_engine import VllmSettings
from ...pool.devices import MAX_THREADS_PER_WORKER
from ...search.settings import DistillConfig, RuleSearchConfig
from ...stageb.config_types import TICKETS, TOKENS, Float, Int, NonEmptyStr, Section, Seed

WEEK = 7 * 24 * 3600.0  # timeouts, in seconds

# The sampler's fields are declared in engine.records (the wire schema, without ranges); their
# config ranges are here, checked by checks.check_samplers and documented like the others.
SAMPLER_RANGES: dict[str, Meta] = {"samples_per_decode": Meta(ge=1, le=1000), "max_prompt_tokens": Meta(ge=1, le=TOKENS)}
DECODE_RANGES: dict[str, Meta] = {
    "temperature": Meta(ge=0, le=100), "top_p": Meta(gt=0, le=1), "max_new_tokens": Meta(ge=1, le=1_000_000),
    "repetition_penalty": Meta(gt=0, le=100), "seed": Meta(ge=-(2**63), le=2**63 - 1),
}


class ModelConfig(Section, kw_only=True):
    path: NonEmptyStr = "embedded"  # "embedded" (SmolLM2-135M), "tiny" (test model), an HF checkpoint dir or a .gguf file
    dtype: str | None = None  # torch dtype name, e.g. "bfloat16"; None: the engine's default for the device
    attn_implementation: str | None = None  # e.g. "sdpa", "flash_attention_2"; None: transformers' default
    trust_remote_code: bool = False  # passed to transformers when loading a checkpoint
    stop: list[str] | None = None  # extra stop strings, added to the tokenizer's end-of-turn tokens (which always stop)
    engine: Literal[tuple(ENGINES)] = DEFAULT_ENGINE  # the names of engine/registry.py
    vllm: VllmSettings = msgspec.field(default_factory=VllmSettings)  # the vllm engine's pinned settings
    gpus_per_worker: Int(1, 16) = 1  # GPUs each worker shards its model over (--gpus-per-worker)
    simulated: SimulatedSettings = msgspec.field(default_factory=SimulatedSettings)  # the simulated engine's latency model


class PromptConfig(Section, kw_only=True):
    profile: NonEmptyStr = "generic"  # a profile name under configs/prompts/ or a profile directory path
    domain: str | None = None  # domain hint for profiles that have one (bbu_rru: "bbu" | "rru"); None: from the mission
    domain_map: dict[str, NonEmptyStr] = {}  # mission -> domain, before `domain` (upstream's domain_map)

    def domain_for(self, mission: str) -> str | None:
        """``domain_map[mission]``, else ``domain`` (None: the profile derives it from the mission)."""
        return self.domain_map.get(mission, self.domain)


class GuidanceConfig(Section, kw_only=True):
    path: NonEmptyStr  # seed guidance JSON (mission-keyed); copied into the run directory at start
    retention: Int(1, 1000) = 5  # guidance snapshots kept in the run directory


class OutputConfig(Section, kw_only=True):
    root: NonEmptyStr  # artifacts go to {root}/{mission}/{run_name}/
    run_name: NonEmptyStr  # name of the run directory (no path separators)
    save_rollouts: bool = False  # also write every generated text to rollouts/<rollout>.jsonl


class IngestConfig(Section, kw_only=True):
    on_bad_line: Literal["error", "skip"] = "error"  # a malformed ticket line stops the run, or is skipped and counted
    max_line_bytes: Int(1, 1 << 30) = 1 << 20  # a longer ticket line is a bad line (read past, never held whole)


class TicketFilterConfig(Section, kw_only=True):
    exclude_ticket_keys: list[str] = []  # ticket keys ("group_id::label") removed right after ingest
    exclude_ticket_keys_path: str | None = None  # file with one key per line (blank lines and # comments ignored)


class PoolConfig(Section, kw_only=True):
    task_timeout: Float(0, WEEK, open_low=True) = 600.0  # seconds per request before its worker counts as stalled
    start_timeout: Float(0, WEEK, open_low=True) = 900.0  # seconds a worker may take to start and load its model
    max_restarts: Int(0, 1000) = 0  # worker replacements (with the work retried) before the run fails
    threads_per_worker: Int(1, MAX_THREADS_PER_WORKER) = 1
    stall_warning: Float(0, WEEK, open_low=True) | None = 120.0  # seconds without a result before a warning
    connect_timeout: Float(0, WEEK, open_low=True) = 45.0  # --ray: seconds to reach the cluster before the run fails


class RunnerConfig(Section, kw_only=True):
    epochs: Int(1, 10_000) = 10  # rule-search iteration budget
    chunk_size: Int(1, 4096) = 16  # tickets per work item; seeds are per chunk, so part of the result
    logging_steps: Int(1, TICKETS) = 256  # audit mode: a baseline_metrics_steps.jsonl row every this many tickets
    speculate: bool = True  # idle workers compute ahead; same results either way


class HeadroomConfig(Section, kw_only=True):
    enabled: bool = True  # score the judge's P(pass) on a ticket sample before the audit or the search
    tickets: Int(2, 100_000) = 48  # tickets sampled (half of each label where possible)
    min_auc: Float(0.5, 1) = 0.6  # the judge separates the labels when the AUC of its P(pass) is at least this


class Config(Section, kw_only=True):
    seed: Seed  # the run seed: pools, generation seeds and the bootstrap derive from it
    stage_a_paths: Annotated[list[NonEmptyStr], Meta(min_length=1)]  # Stage-A JSONL ticket files (a single string is accepted)
    mode: Literal["search", "audit"] = "search"  # rule search, or the baseline audit (also: --audit)
    model: ModelConfig = msgspec.field(default_factory=ModelConfig)
    prompt: PromptConfig = msgspec.field(default_factory=PromptConfig)
    guidance: GuidanceConfig
    output: OutputConfig
    ingest: IngestConfig = msgspec.field(default_factory=IngestConfig)
    ticket_filter: TicketFilterConfig = msgspec.field(default_factory=TicketFilterConfig)
    pool: PoolConfig = msgspec.field(default_factory=PoolConfig)
    runner: RunnerConfig = msgspec.field(default_factory=RunnerConfig)
    rule_search: RuleSearchConfig
    stage_b_distillation: DistillConfig = msgspec.field(default_factory=DistillConfig)
    headroom: HeadroomConfig = msgspec.field(default_factory=HeadroomConfig)  # the judge-headroom check


# Upstream keys that no longer exist, and what replaced them. "[]" stands for any list index.
LEGACY_KEYS: dict[str, str] = {
    "model.model_name_or_path": "replaced by model.path",
    "model.torch_dtype": "replaced by model.dtype",
    "model.device_map": "no longer needed: each GPU runs its own worker with a full model (choose GPUs with --gpus); "
    "a model larger than one GPU is sharded over model.gpus_per_worker GPUs (or --gpus-per-worker)",
    "model.attn_impl": "replaced by model.attn_implementation",
    "jump_reflection": "replaced by mode: audit (or the --audit flag)",
    "default_domain": "replaced by prompt.domain, with prompt.profile: bbu_rru (the default profile, generic, "
    "has no domains)",
    "domain_map": "replaced by prompt.domain_map, with prompt.profile: bbu_rru",
    "max_token_length": "replaced by rule_search.train_sampler.max_prompt_tokens / "
    "rule_search.eval_sampler.max_prompt_tokens and rule_search.proposer_max_prompt_tokens",
    "reflection": "section no longer used: the proposer is configured by the rule_search.proposer_* keys",
    "guidance.reset_on_rerun": "removed: a run starts from guidance.path unless it is resumed with --resume",
    "runner.per_rank_rollout_batch_size": "replaced by runner.chunk_size (tickets per work item, the same for any GPU count)",
    "runner.rollout_batch_size": "replaced by runner.chunk_size",
    "rule_search.gate.min_changed_fraction": "replaced by rule_search.gate.max_changed_fraction "
    "(upstream read this lower-bound name as an upper bound)",
    "rule_search.validate_size": "removed: the held-out pool is rule_search.eval_pool_size",
    "rule_search.validate_fraction": "removed: the held-out pool is rule_search.eval_pool_size",
    "rule_search.validate_with_replacement": "removed: the held-out pool is rule_search.eval_pool_size",
    "rule_search.holdout": "removed: the held-out pool is rule_search.eval_pool_size",
    "rule_search.reflect_order": "removed: it had no effect upstream (examples are always hardest first)",
    "rule_search.train_with_replacement": "removed: a train pool never holds the same ticket twice",
    "rule_search.mining_sampler": "removed: the optional mining rollout is not supported",
    "rule_search.train_sampler.grid[].stop": "replaced by model.stop",
    "rule_search.eval_sampler.grid[].stop": "replaced by model.stop",
    "rule_search.train_sampler.grid[].no_repeat_ngram_size": "removed: not supported",
    "rule_search.eval_sampler.grid[].no_repeat_ngram_size": "removed: not supported",
}


def struct_of(tp) -> type | None:
    """The Struct type a field holds, looking through Annotated and ``X | None``."""
    tp = strip_annotated(tp)
    if isinstance(tp, type) and issubclass(tp, msgspec.Struct):
        return tp
    return first_in_union(tp, struct_of)


def list_item(tp):
    """The item type when the field is a list (looking through Annotated and Optional)."""
    tp = strip_annotated(tp)
    if get_origin(tp) is list:
        return get_args(tp)[0]
    return first_in_union(tp, list_item)


def first_in_union(tp, find):
    """``find(arg)`` for the first member of a union type that gives a result, else None."""
    if is_union(tp):
        return next((r for r in map(find, get_args(tp)) if r is not None), None)
    return None


def strip_annotated(tp):
    while get_origin(tp) is Annotated:
        tp = get_args(tp)[0]
    return tp


def fields_of(struct: type) -> dict[str, msgspec.structs.FieldInfo]:
    return {f.encode_name: f for f in msgspec.structs.fields(struct)}


def join_key(prefix: str, key: str) -> str:
    return f"{prefix}.{key}" if prefix else key


def unknown_key_message(path: str, key: str, valid: list[str]) -> str:
    """For a key the schema does not have: its legacy replacement, or the closest valid name."""
    full = join_key(path, key)
    legacy = LEGACY_KEYS.get(re.sub(r"\[\d+\]", "[]", full))  # LEGACY_KEYS writes list indices as []
    if legacy:
        return f"legacy key {full!r}: {legacy}"
    close = difflib.get_close_matches(key, valid, n=1, cutoff=0.5) if len(key) <= 100 else []
    hint = f"; did you mean {join_key(path, close[0])!r}?" if close else f"; valid keys here: {', '.join(valid)}"
    shown = repr(full) if len(full) <= 200 else f"{full[:200]!r}... ({len(full)} characters)"
    return f"unknown key {shown}{hint}"


def is_union(tp) -> bool:
    """``Union[X, Y]`` or ``X | Y`` (the two spell different runtime types)."""
    return get_origin(tp) is Union or type(tp).__name__ == "UnionType"


def optional(tp) -> bool:
    tp = strip_annotated(tp)
    return is_union(tp) and type(None) in get_args(tp)


def type_at(path: str):
    """The declared type of the field at a key path (list indices ignored)."""
    struct: type = Config
    tp = None
    for part in re.sub(r"\[\d+\]", "", path).split("."):
        tp = fields_of(struct)[part].type
        struct = struct_of(tp) or struct
    return tp


def range_of(key: str) -> Meta | None:
    """The bounds of a numeric key (``rule_search.train_sampler.grid[].seed``), else None."""
    m = re.match(r"^rule_search\.(?:train|eval)_sampler\.(grid\[\]\.)?(\w+)$", key)
    if m:
        return (DECODE_RANGES if m.group(1) else SAMPLER_RANGES).get(m.group(2))
    return _meta_of(type_at(key))


def _meta_of(tp) -> Meta | None:
    if get_origin(tp) is Annotated:
        return next((a for a in get_args(tp)[1:] if isinstance(a, Meta) and (a.ge, a.gt, a.le) != (None,) * 3), None)
    return first_in_union(tp, _meta_of)


def config_keys(struct: type = Config, prefix: str = "") -> list[tuple[str, Any]]:
    """Every leaf key as ``(dotted.key, default)`` (``msgspec.NODEFAULT``: required), grid entries
    as ``...grid[].field``; for the docs test."""
    out: list[tuple[str, Any]] = []
    for f in msgspec.structs.fields(struct):
        key = join_key(prefix, f.encode_name)
        sub = struct_of(f.type)
        item = list_item(f.type)
        if sub is not None:
            out.extend(config_keys(sub, key))
            continue
        default = f.default if f.default_factory is msgspec.NODEFAULT else f.default_factory()
        out.append((key, default))
        if item is not None and struct_of(item) is not None:
            out.extend(config_keys(struct_of(item), f"{key}[]"))
    return out
