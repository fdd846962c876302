"""The run configuration: one YAML schema, defined here as msgspec Structs.

The Struct definitions below are the single place where keys, types, ranges and defaults
are defined (docs/usage.md mirrors them; a test keeps the two in step). ``load_config``
reads a YAML file, applies ``--set`` overrides, rejects unknown and legacy keys with the
closest valid name, checks types strictly (the string ``"false"`` is not a bool) and
ranges, resolves every path relative to the config file and checks that input files exist.
Every problem is an ``InputError`` located as ``"file:line"`` or ``"file: key.path"``.
"""

from __future__ import annotations

import difflib
import math
import os
import re
from typing import Annotated, Any, Literal, Union, get_args, get_origin

import msgspec
import yaml
from msgspec import Meta

from ..engine.records import SamplerConfig
from ..stageb.errors import InputError
from ..stageb.hashing import content_hash

# Constrained scalar types: msgspec checks these while converting and reports the key path.
PosInt = Annotated[int, Meta(ge=1)]
NonNegInt = Annotated[int, Meta(ge=0)]
PosFloat = Annotated[float, Meta(gt=0)]
NonNegFloat = Annotated[float, Meta(ge=0)]
Probability = Annotated[float, Meta(ge=0, le=1)]
TopP = Annotated[float, Meta(gt=0, le=1)]
NonEmptyStr = Annotated[str, Meta(min_length=1)]


class _Section(msgspec.Struct, forbid_unknown_fields=True, kw_only=True):
    """Base of every config section: unknown keys are errors, fields are keyword-only."""


class ModelConfig(_Section, kw_only=True):
    path: NonEmptyStr = "embedded"  # "embedded" (SmolLM2-135M), "tiny" (test model), an HF checkpoint dir or a .gguf file
    dtype: str | None = None  # torch dtype name, e.g. "bfloat16"; None: the engine's default for the device
    attn_implementation: str | None = None  # e.g. "sdpa", "flash_attention_2"; None: transformers' default
    trust_remote_code: bool = False  # passed to transformers when loading a checkpoint
    stop: list[str] | None = None  # extra stop strings; None: the tokenizer's end-of-turn tokens


class PromptConfig(_Section, kw_only=True):
    profile: NonEmptyStr = "generic"  # a profile name under configs/prompts/ or a profile directory path
    domain: str | None = None  # domain hint for profiles that have one (bbu_rru: "bbu" | "rru"); None: from the mission


class GuidanceConfig(_Section, kw_only=True):
    path: NonEmptyStr  # seed guidance JSON (mission-keyed); copied into the run directory at start
    retention: PosInt = 5  # guidance snapshots kept in the run directory


class OutputConfig(_Section, kw_only=True):
    root: NonEmptyStr  # artifacts go to {root}/{mission}/{run_name}/
    run_name: NonEmptyStr  # name of the run directory (no path separators)
    save_rollouts: bool = False  # also write every generated text to rollouts/<rollout>.jsonl


class IngestConfig(_Section, kw_only=True):
    on_bad_line: Literal["error", "skip"] = "error"  # a malformed ticket line stops the run, or is skipped and counted


class TicketFilterConfig(_Section, kw_only=True):
    exclude_ticket_keys: list[str] = []  # ticket keys ("group_id::label") removed right after ingest
    exclude_ticket_keys_path: str | None = None  # file with one key per line (blank lines and # comments ignored)


class PoolConfig(_Section, kw_only=True):
    task_timeout: PosFloat = 600.0  # seconds a worker may spend on one request before it counts as stalled
    start_timeout: PosFloat = 900.0  # seconds a worker may take to start and load its model
    max_restarts: NonNegInt = 0  # worker replacements (with the work retried) before the run fails


class RunnerConfig(_Section, kw_only=True):
    epochs: PosInt = 10  # rule-search iteration budget
    chunk_size: PosInt = 16  # tickets per work item sent to a worker; generation seeds are per chunk, so it is part of the result
    logging_steps: PosInt = 256  # audit mode: a baseline_metrics_steps.jsonl row every this many tickets


class BootstrapConfig(_Section, kw_only=True):
    iterations: PosInt = 200  # paired ticket-level bootstrap resamples
    min_prob: Probability = 0.8  # required P(RER* >= min_relative_error_reduction)
    seed: int | None = None  # bootstrap RNG base (plus the iteration); None: the top-level seed


class GateConfig(_Section, kw_only=True):
    min_relative_error_reduction: NonNegFloat = 0.1  # tau: required relative error reduction on the train pool
    max_changed_fraction: Probability = 0.05  # churn cap: fraction of tickets whose majority may change (0 means 0)
    max_fp_rate_increase: Probability = 0.01  # largest allowed rise of the false-release rate, for every op
    bootstrap: BootstrapConfig = msgspec.field(default_factory=BootstrapConfig)
    eval_max_acc_drop: Probability | None = None  # veto when eval accuracy drops by more; None: log only


class EarlyStopConfig(_Section, kw_only=True):
    patience: PosInt = 3  # stop after this many consecutive iterations without an accepted edit


class RuleSearchConfig(_Section, kw_only=True):
    proposer_prompt_path: NonEmptyStr | None = None  # proposer system prompt file; None: the prompt profile's proposer.txt
    proposer_temperature: NonNegFloat = 0.4
    proposer_top_p: TopP = 0.9
    proposer_repetition_penalty: PosFloat = 1.05
    proposer_max_new_tokens: PosInt = 2048
    proposer_max_prompt_tokens: PosInt = 4096  # examples are dropped from the end until the prompt fits
    reflect_size: PosInt = 16  # confidently wrong tickets shown to the proposer
    num_candidate_rules: PosInt = 3  # candidates per iteration (proposer, then ablation fill)
    train_pool_size: PosInt = 512  # tickets per iteration's train pool
    train_pool_fraction: Annotated[float, Meta(gt=0, le=1)] | None = None  # overrides the size: round(N_train * f)
    eval_pool_size: NonNegInt = 128  # fixed stratified eval pool (0: no eval pool)
    gate: GateConfig = msgspec.field(default_factory=GateConfig)
    early_stop: EarlyStopConfig = msgspec.field(default_factory=EarlyStopConfig)
    train_sampler: SamplerConfig  # train baseline and candidate rollouts; also the audit rollout
    eval_sampler: SamplerConfig  # eval pool rollouts


class DistillConfig(_Section, kw_only=True):
    enabled: bool = False  # export ChatML distillation data once, after the loop, with the final guidance
    log_chatml_path: str | None = None  # None: {run_dir}/distill_chatml.jsonl
    distill_size: PosInt | None = None  # tickets to export; None: nothing is exported
    distill_seed: int | None = None  # ticket sampling seed; None: the top-level seed
    distill_temperature: NonNegFloat | None = None  # None: the lowest train-grid temperature


class Config(_Section, kw_only=True):
    seed: int  # the run seed: pools, generation seeds and the bootstrap derive from it
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


# Upstream keys that no longer exist, and what replaced them. "[]" stands for any list index.
LEGACY_KEYS: dict[str, str] = {
    "model.model_name_or_path": "replaced by model.path",
    "model.torch_dtype": "replaced by model.dtype",
    "model.device_map": "no longer needed: each GPU runs its own worker with a full model (choose GPUs with --gpus)",
    "model.attn_impl": "replaced by model.attn_implementation",
    "jump_reflection": "replaced by mode: audit (or the --audit flag)",
    "default_domain": "replaced by prompt.domain",
    "domain_map": "replaced by prompt.domain (one mission per run)",
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


# ----------------------------------------------------------------------------- YAML


class _Loader(yaml.SafeLoader):
    """safe_load with two traps fixed: duplicate keys are errors (PyYAML keeps the last one
    silently) and ``1e-3`` is a float (YAML 1.1 reads it as a string)."""


def _construct_mapping(loader: _Loader, node: yaml.MappingNode, deep: bool = False) -> dict:
    seen: dict = {}
    for key_node, _ in node.value:
        key = loader.construct_object(key_node, deep=deep)
        if not isinstance(key, (str, int, float, bool)):
            continue  # only scalar keys are tracked; construct_mapping rejects unhashable ones
        if key in seen:
            raise yaml.constructor.ConstructorError(
                None, None, f"duplicate key {key!r} (first on line {seen[key] + 1})", key_node.start_mark
            )
        seen[key] = key_node.start_mark.line
    return loader.construct_mapping(node, deep=deep)


_Loader.add_constructor(yaml.resolver.BaseResolver.DEFAULT_MAPPING_TAG, _construct_mapping)
_Loader.add_implicit_resolver(
    "tag:yaml.org,2002:float",
    re.compile(r"^[-+]?(?:[0-9][0-9_]*)(?:\.[0-9_]*)?[eE][-+]?[0-9]+$"),
    list("-+0123456789"),
)


def _read_yaml(path: str) -> Any:
    try:
        with open(path, "rb") as f:
            data = f.read()
    except FileNotFoundError:
        raise InputError("config file not found", path) from None
    except OSError as e:
        raise InputError(f"cannot read config file: {e.strerror}", path) from None
    try:
        return yaml.load(data.decode("utf-8-sig"), Loader=_Loader)
    except UnicodeDecodeError as e:
        raise InputError(f"not UTF-8 text (byte {e.start})", path) from None
    except yaml.YAMLError as e:
        mark = getattr(e, "problem_mark", None) or getattr(e, "context_mark", None)
        problem = getattr(e, "problem", None) or str(e)
        context = getattr(e, "context", None)
        text = f"invalid YAML: {problem}" + (f" ({context})" if context and getattr(e, "problem", None) else "")
        if mark is None:
            raise InputError(text, path) from None
        raise InputError(text, f"{path}:{mark.line + 1}") from None


# ----------------------------------------------------------------------------- schema walking


def _struct_of(tp) -> type | None:
    """The Struct type a field holds, looking through Annotated and ``X | None``."""
    tp = _strip(tp)
    if isinstance(tp, type) and issubclass(tp, msgspec.Struct):
        return tp
    return _first_in_union(tp, _struct_of)


def _list_item(tp):
    """The item type when the field is a list (looking through Annotated and Optional)."""
    tp = _strip(tp)
    if get_origin(tp) is list:
        return get_args(tp)[0]
    return _first_in_union(tp, _list_item)


def _first_in_union(tp, find):
    """``find(arg)`` for the first member of a union type that gives a result, else None."""
    if _is_union(tp):
        return next((r for r in map(find, get_args(tp)) if r is not None), None)
    return None


def _strip(tp):
    while get_origin(tp) is Annotated:
        tp = get_args(tp)[0]
    return tp


def _fields(struct: type) -> dict[str, msgspec.structs.FieldInfo]:
    return {f.encode_name: f for f in msgspec.structs.fields(struct)}


def join_key(prefix: str, key: str) -> str:
    """``prefix.key``, or ``key`` at the top level (dotted key paths in messages and diffs)."""
    return f"{prefix}.{key}" if prefix else key


def _legacy_name(path: str) -> str:
    return re.sub(r"\[\d+\]", "[]", path)


def _unknown_key(path: str, key: str, valid: list[str]) -> str:
    """The message for a key the schema does not have: legacy replacement or closest name."""
    full = join_key(path, key)
    legacy = LEGACY_KEYS.get(_legacy_name(full))
    if legacy:
        return f"legacy key {full!r}: {legacy}"
    close = difflib.get_close_matches(key, valid, n=1, cutoff=0.5)
    hint = f"; did you mean {join_key(path, close[0])!r}?" if close else f"; valid keys here: {', '.join(valid)}"
    return f"unknown key {full!r}{hint}"


def _check_keys(raw: Any, struct: type, path: str, where: str) -> None:
    """Reject unknown and legacy keys anywhere in ``raw`` before msgspec sees it, so that the
    message can name the closest valid key. Empty sections (``model:``) become ``{}``."""
    if not isinstance(raw, dict):
        return  # msgspec reports the wrong type with its path
    fields = _fields(struct)
    for key in list(raw):
        if not isinstance(key, str):
            raise InputError(f"key {key!r} is not a string", f"{where}: {path or '(top level)'}")
        if key not in fields:
            raise InputError(_unknown_key(path, key, list(fields)), f"{where}: {join_key(path, key)}")
        field = fields[key]
        sub = _struct_of(field.type)
        if sub is not None and raw[key] is None and not _optional(field.type):
            raw[key] = {}
        if sub is not None:
            _check_keys(raw[key], sub, join_key(path, key), where)
        item = _list_item(field.type)
        if item is not None and isinstance(raw[key], list):
            item_struct = _struct_of(item)
            if item_struct is not None:
                for i, value in enumerate(raw[key]):
                    _check_keys(value, item_struct, f"{join_key(path, key)}[{i}]", where)


def _is_union(tp) -> bool:
    """``Union[X, Y]`` or ``X | Y`` (the two spell different runtime types)."""
    return get_origin(tp) is Union or type(tp).__name__ == "UnionType"


def _optional(tp) -> bool:
    tp = _strip(tp)
    return _is_union(tp) and type(None) in get_args(tp)


# ----------------------------------------------------------------------------- --set overrides


def apply_override(raw: dict, assignment: str) -> str:
    """Apply one ``--set a.b.c=value`` to the raw mapping (the value is read as YAML) and
    return the key path it set, e.g. ``rule_search.train_sampler.grid[0].temperature``."""
    if "=" not in assignment:
        raise InputError(f"{assignment!r}: expected key.path=value", "--set")
    dotted, _, text = assignment.partition("=")
    dotted = dotted.strip()
    parts = dotted.split(".")
    if not dotted or any(not p for p in parts):
        raise InputError(f"{assignment!r}: expected key.path=value", "--set")
    try:
        value = yaml.load(text, Loader=_Loader) if text.strip() else None
    except yaml.YAMLError as e:
        raise InputError(f"{dotted}: cannot read value {text!r} as YAML: {getattr(e, 'problem', e)}", "--set") from None
    struct: type | None = Config
    node: Any = raw
    path = ""
    for i, part in enumerate(parts):
        last = i == len(parts) - 1
        if isinstance(node, list):  # a list index, e.g. rule_search.train_sampler.grid.0.temperature
            if not part.isdigit() or int(part) >= len(node):
                raise InputError(f"{dotted}: no list item {part!r} at {path} (it has {len(node)})", "--set")
            index = int(part)
            path = f"{path}[{index}]"
            if last:
                node[index] = value
                return path
            node = node[index]
            struct = _struct_of(_list_item(_type_at(path)))
            continue
        fields = _fields(struct) if struct is not None else {}
        if part not in fields:
            raise InputError(_unknown_key(path, part, list(fields)), "--set")
        field = fields[part]
        path = join_key(path, part)
        if last:
            node[part] = value
            return path
        if not isinstance(node.get(part), (dict, list)):
            if _list_item(field.type) is not None and _struct_of(field.type) is None:
                raise InputError(f"{dotted}: {path} has no items to index", "--set")
            node[part] = {}
        node = node[part]
        struct = _struct_of(field.type)
        if struct is None and not isinstance(node, list):
            raise InputError(f"{dotted}: {path} is not a section", "--set")


def _type_at(path: str):
    """The declared type of the field at a key path (list indices ignored)."""
    struct: type = Config
    tp = None
    for part in re.sub(r"\[\d+\]", "", path).split("."):
        tp = _fields(struct)[part].type
        struct = _struct_of(tp) or struct
    return tp


# ----------------------------------------------------------------------------- conversion


_MSGSPEC_AT = re.compile(r"^(?P<msg>.*?)(?: - at `\$(?P<path>[^`]*)`)?$", re.S)


def _lookup(raw: Any, path: str) -> Any:
    node = raw
    for name, index in re.findall(r"\.([^.\[]+)|\[(\d+)\]", path):
        try:
            node = node[name] if name else node[int(index)]
        except (KeyError, IndexError, TypeError):
            return None
    return node


def _translate(err: msgspec.ValidationError, raw: Any, where: str) -> InputError:
    m = _MSGSPEC_AT.match(str(err))
    msg, at = m.group("msg"), m.group("path") or ""
    key = at.lstrip(".")
    missing = re.match(r"Object missing required field `(.+)`", msg)
    if missing:
        full = join_key(key, missing.group(1))
        return InputError(f"missing required key {full!r}", f"{where}: {full}")
    value = _lookup(raw, at)
    text = msg.replace("`", "")
    if text.startswith("Expected "):
        text = "expected " + text[len("Expected ") :]
    if "enum value" in text and key:
        text = f"invalid value {value!r}: expected one of {_choices(key)}"
    elif value is not None or "got `null`" not in msg:
        text = f"{text}, got {value!r}" if ", got" not in text else f"{text} ({value!r})"
        if isinstance(value, str) and "float" in text and _looks_numeric(value):
            text += " (write a number without quotes)"
    return InputError(text, f"{where}: {key or '(top level)'}")


def _looks_numeric(text: str) -> bool:
    try:
        float(text)
        return True
    except ValueError:
        return False


def _choices(key: str) -> str:
    return ", ".join(repr(a) for a in get_args(_strip(_type_at(key))))


def _check_decodes(cfg: Config, where: str) -> None:
    """Ranges of the sampling grid entries (records.Decode carries no constraints itself)."""
    for sampler_name in ("train_sampler", "eval_sampler"):
        sampler = getattr(cfg.rule_search, sampler_name)
        for i, d in enumerate(sampler.grid):
            key = f"rule_search.{sampler_name}.grid[{i}]"
            _require(d.temperature >= 0, f"{key}.temperature", f"must be >= 0, got {d.temperature!r}", where)
            _require(0 < d.top_p <= 1, f"{key}.top_p", f"must be in (0, 1], got {d.top_p!r}", where)
            _require(d.max_new_tokens >= 1, f"{key}.max_new_tokens", f"must be >= 1, got {d.max_new_tokens!r}", where)
            _require(d.repetition_penalty > 0, f"{key}.repetition_penalty", f"must be > 0, got {d.repetition_penalty!r}", where)


def _require(ok: bool, key: str, message: str, where: str) -> None:
    if not ok:
        raise InputError(message, f"{where}: {key}")


def _check_finite(value: Any, path: str, where: str) -> None:
    """NaN and infinity pass msgspec's unconstrained float fields; no key wants them."""
    if isinstance(value, float) and not math.isfinite(value):
        raise InputError(f"must be a finite number, got {value!r}", f"{where}: {path}")
    if isinstance(value, dict):
        for k, v in value.items():
            _check_finite(v, join_key(path, str(k)), where)
    elif isinstance(value, list):
        for i, v in enumerate(value):
            _check_finite(v, f"{path}[{i}]", where)


# ----------------------------------------------------------------------------- paths


def _resolve(base: str, value: str) -> str:
    return os.path.normpath(os.path.join(base, os.path.expanduser(value)))


def _looks_like_path(value: str) -> bool:
    return os.sep in value or value.startswith((".", "~")) or (os.altsep is not None and os.altsep in value)


def _resolve_paths(cfg: Config, base: str) -> None:
    """Make every path absolute, relative to the config file's directory."""
    cfg.stage_a_paths = [_resolve(base, p) for p in cfg.stage_a_paths]
    cfg.guidance.path = _resolve(base, cfg.guidance.path)
    cfg.output.root = _resolve(base, cfg.output.root)
    if cfg.rule_search.proposer_prompt_path is not None:
        cfg.rule_search.proposer_prompt_path = _resolve(base, cfg.rule_search.proposer_prompt_path)
    tf = cfg.ticket_filter
    if tf.exclude_ticket_keys_path is not None:
        tf.exclude_ticket_keys_path = _resolve(base, tf.exclude_ticket_keys_path)
    dist = cfg.stage_b_distillation
    if dist.log_chatml_path is not None:
        dist.log_chatml_path = _resolve(base, dist.log_chatml_path)
    if _looks_like_path(cfg.prompt.profile):
        cfg.prompt.profile = _resolve(base, cfg.prompt.profile)
    model = cfg.model.path
    if model not in ("embedded", "tiny") and not os.path.isabs(model):
        candidate = _resolve(base, model)
        # "org/name" could be a hub id; only a path that exists or clearly is one is resolved.
        if os.path.exists(candidate) or model.startswith((".", "~")) or model.endswith(".gguf"):
            cfg.model.path = candidate


def _check_files(cfg: Config, where: str) -> None:
    """Input files must exist before a run starts (nothing is created for a missing input)."""
    wanted = [(f"stage_a_paths[{i}]", p) for i, p in enumerate(cfg.stage_a_paths)]
    wanted.append(("guidance.path", cfg.guidance.path))
    if cfg.rule_search.proposer_prompt_path is not None:
        wanted.append(("rule_search.proposer_prompt_path", cfg.rule_search.proposer_prompt_path))
    if cfg.ticket_filter.exclude_ticket_keys_path is not None:
        wanted.append(("ticket_filter.exclude_ticket_keys_path", cfg.ticket_filter.exclude_ticket_keys_path))
    for key, path in wanted:
        if not os.path.isfile(path):
            what = "is a directory, not a file" if os.path.isdir(path) else "file not found"
            raise InputError(f"{what}: {path}", f"{where}: {key}")
    if os.path.isabs(cfg.prompt.profile) and not os.path.isdir(cfg.prompt.profile):
        raise InputError(f"prompt profile directory not found: {cfg.prompt.profile}", f"{where}: prompt.profile")


# ----------------------------------------------------------------------------- public API


def load_config(path: str | os.PathLike, overrides=(), *, check_files: bool = True) -> Config:
    """Read, validate and resolve a config file.

    ``overrides`` are ``"a.b.c=value"`` strings (the CLI's ``--set``), applied to the YAML
    mapping before validation. ``check_files=False`` skips the existence checks of input
    files (for validating example configs on another machine). Raises ``InputError``.
    """
    where = os.path.abspath(os.fspath(path))
    raw = _read_yaml(where)
    if raw is None:
        raw = {}
    if not isinstance(raw, dict):
        raise InputError(f"the config must be a YAML mapping of keys, not a {type(raw).__name__}", where)
    overridden = [apply_override(raw, assignment) for assignment in overrides]
    try:
        cfg = _validate(raw, where)
    except InputError as e:
        key = (e.location or "").partition(": ")[2]
        if any(key == k or key.startswith((k + ".", k + "[")) for k in overridden):
            e.message += " (value from --set)"
        raise
    return _finish(cfg, where, check_files)


def _validate(raw: dict, where: str) -> Config:
    """Keys, types and ranges of the raw mapping -> Config (paths not yet resolved)."""
    if isinstance(raw.get("stage_a_paths"), str):
        raw["stage_a_paths"] = [raw["stage_a_paths"]]
    _check_keys(raw, Config, "", where)
    _check_finite(raw, "", where)
    try:
        cfg = msgspec.convert(raw, Config, strict=True)
    except msgspec.ValidationError as e:
        raise _translate(e, raw, where) from None
    _check_decodes(cfg, where)
    run_name = cfg.output.run_name
    _require("/" not in run_name and "\\" not in run_name and run_name not in (".", ".."), "output.run_name",
             f"must be a plain directory name, got {run_name!r}", where)
    return cfg


def _finish(cfg: Config, where: str, check_files: bool) -> Config:
    """Fill the seeds that default to the top-level seed, make paths absolute, check files."""
    if cfg.rule_search.gate.bootstrap.seed is None:
        cfg.rule_search.gate.bootstrap.seed = cfg.seed
    if cfg.stage_b_distillation.distill_seed is None:
        cfg.stage_b_distillation.distill_seed = cfg.seed
    _resolve_paths(cfg, os.path.dirname(where))
    if check_files:
        _check_files(cfg, where)
    return cfg


def to_dict(cfg: Config) -> dict:
    """The config as plain JSON-ready values (for run.json and hashing)."""
    return msgspec.to_builtins(cfg)


def config_hash(cfg: Config) -> str:
    """Content hash of the resolved config without ``output`` (where a run is written does not
    change what it computes): ``--resume`` refuses a run directory whose hash differs."""
    data = to_dict(cfg)
    data.pop("output", None)
    return content_hash(data)


def config_keys(struct: type = Config, prefix: str = "") -> list[tuple[str, Any]]:
    """Every leaf key of the schema as ``(dotted.key, default)``; the default is
    ``msgspec.NODEFAULT`` for required keys. Sampler keys appear once per sampler and the
    grid entries as ``...grid[].field``. Used by the docs test."""
    out: list[tuple[str, Any]] = []
    for f in msgspec.structs.fields(struct):
        key = join_key(prefix, f.encode_name)
        sub = _struct_of(f.type)
        item = _list_item(f.type)
        if sub is not None:
            out.extend(config_keys(sub, key))
            continue
        default = f.default if f.default_factory is msgspec.NODEFAULT else f.default_factory()
        out.append((key, default))
        if item is not None and _struct_of(item) is not None:
            out.extend(config_keys(_struct_of(item), f"{key}[]"))
    return out
