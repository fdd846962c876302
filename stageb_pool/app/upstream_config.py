"""Upstream Stage-B configs (``Pein2017/Qwen3-VL``, ``configs/stage_b/*.yaml``) read as written,
recognised by ``model.model_name_or_path``. ``translate`` turns one into the equivalent raw
mapping of our schema, key by key, as upstream's loader and runner read it (docs/migrating.md
has the table). A key with no counterpart that would change results is a located error; keys
upstream's loader never reads are ignored as upstream ignores them, and listed.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from typing import Any

from ..stageb.errors import InputError

PROFILE = "bbu_rru"  # upstream has one prompt family: the Chinese BBU/RRU prompts
DOMAINS = ("bbu", "rru")
ROLLOUT_GUARD = 4096  # upstream drops a ticket whose prompt exceeds this when no budget is set
ALLOWED_STOPS = ("<|endoftext|>", "<|im_end|>")  # the only stop strings upstream accepts (and its default)
DECODE_KEYS = ("temperature", "top_p", "max_new_tokens", "repetition_penalty", "seed")
# Keys of our schema that upstream would silently ignore: refused in an upstream config.
OURS_ONLY = ("prompt", "pool", "ingest", "headroom", "model.path", "model.dtype", "model.stop", "model.trust_remote_code",
             "output.save_rollouts", "rule_search.gate.eval_max_acc_drop")
REFUSED_BY_UPSTREAM = ("validate_size", "validate_fraction", "validate_with_replacement", "holdout")
# Copied unchanged: the same name, type and meaning in both schemas.
SAME_KEYS = (
    "seed", "guidance.retention", "runner.epochs", "runner.logging_steps", "ticket_filter.exclude_ticket_keys",
    "rule_search.proposer_temperature", "rule_search.proposer_top_p", "rule_search.proposer_repetition_penalty",
    "rule_search.proposer_max_new_tokens", "rule_search.proposer_max_prompt_tokens", "rule_search.reflect_size",
    "rule_search.num_candidate_rules", "rule_search.train_pool_size", "rule_search.train_pool_fraction",
    "rule_search.eval_pool_size", "rule_search.gate.min_relative_error_reduction",
    "rule_search.gate.max_fp_rate_increase", "rule_search.gate.bootstrap.iterations",
    "rule_search.gate.bootstrap.min_prob", "rule_search.gate.bootstrap.seed", "rule_search.early_stop.patience",
)
DISTILL_KEYS = ("distill_size", "distill_seed", "distill_temperature")
# Upstream keys with no effect in a rule search or here, and why (an import comment each).
NO_EFFECT = {
    "model.device_map": "each GPU runs its own worker with a whole model (choose GPUs with --gpus; a model larger "
    "than one GPU: --gpus-per-worker)",
    "guidance.reset_on_rerun": "a run starts from guidance.path unless it is resumed (--resume)",
    "reflection": "not used by the rule search: the proposer is configured by rule_search.proposer_*",
    "output.group_report": "upstream ignores it",
    "runner.rollout_batch_size": "upstream ignores it",
    "rule_search.reflect_order": "no effect upstream: proposer examples are always hardest first",
    "rule_search.train_with_replacement": "false: a train pool never holds a ticket twice here either",
    "rule_search.mining_sampler": "null: no mining rollout, as here",
    "max_token_length": "null: upstream's defaults, written out below",
}
_DROPPED_WHEN_NULL = ("rule_search.mining_sampler", "max_token_length")  # other values: translated or refused
REQUIRED = "missing required key {key!r} (upstream's loader requires it too)"
_MISSING = object()
_TRUE = ("true", "1", "yes", "y", "on")
_FALSE = ("false", "0", "no", "n", "off")


def is_upstream(raw: Any) -> bool:
    return isinstance(raw, dict) and isinstance(raw.get("model"), dict) and "model_name_or_path" in raw["model"]


@dataclass
class Translation:
    """An upstream config in our schema, and what became of each upstream key."""

    native: dict  # our raw config mapping (paths absolute)
    root: str  # the launch directory relative paths were resolved against
    origin: dict[str, str] = field(default_factory=dict)  # our key -> the upstream key it came from
    notes: dict[str, str] = field(default_factory=dict)  # our key -> how its value was derived
    dropped: dict[str, str] = field(default_factory=dict)  # upstream key -> why it has no effect here
    ignored: list[str] = field(default_factory=list)  # keys upstream's loader never reads
    relative: dict[str, str] = field(default_factory=dict)  # our key -> the relative path written upstream

    def summary(self, where: str) -> str:
        prompt = self.native["prompt"]
        domain = prompt["domain"] if "domain_map" not in prompt else f"from domain_map, else {prompt['domain']}"
        line = (f"{where}: upstream Stage-B config, translated to stageb-pool's schema (profile {PROFILE}, "
                f"domain {domain}, mode {self.native['mode']}, relative paths from {self.root})")
        if self.ignored:
            line += f"; ignored as upstream does: {', '.join(self.ignored)}"
        return line + "; `stageb-pool import-config` writes the equivalent config"


def translate(raw: dict, where: str, root: str) -> Translation:
    """Raises InputError located at ``where: upstream.key``."""
    return _Translator(raw, where, root).run()


class _Translator:
    def __init__(self, raw: dict, where: str, root: str):
        self.raw, self.where = raw, where
        self.out = Translation(native={}, root=os.path.abspath(root))

    def error(self, key: str, message: str) -> InputError:
        return InputError(message[:500], f"{self.where}: {key}")

    def get(self, key: str, *, required: bool = False):
        value = _get(self.raw, key)
        if value is _MISSING and required:
            raise self.error(key, REQUIRED.format(key=key))
        return value

    def section(self, key: str, *, required: bool = False) -> dict:
        value = self.get(key, required=required)
        if value is _MISSING or (value is None and not required):
            return {}
        if not isinstance(value, dict):
            raise self.error(key, f"expected a mapping, got {_type(value)}")
        return value

    def put(self, ours: str, value, upstream: str | None = None, note: str | None = None) -> None:
        _set(self.out.native, ours, value)
        if upstream:
            self.out.origin[ours] = upstream
        if note:
            self.out.notes[ours] = note

    def copy(self, upstream: str, ours: str | None = None, *, required: bool = False) -> None:
        value = self.get(upstream, required=required)
        if value is not _MISSING:
            self.put(ours or upstream, value, upstream, f"was {upstream}" if ours and ours != upstream else None)

    def path(self, upstream: str, ours: str | None = None, *, required: bool = False) -> None:
        value = self.get(upstream, required=required)
        if value is not _MISSING and value is not None:
            self.put(ours or upstream, self.resolve(value, upstream, ours or upstream), upstream)

    def resolve(self, value, upstream: str, ours: str) -> str:
        if not isinstance(value, str) or not value:
            raise self.error(upstream, f"expected a non-empty path, got {value!r}")
        if os.path.isabs(value):
            return value
        self.out.relative[ours] = value
        return os.path.normpath(os.path.join(self.out.root, value))

    def flag(self, key: str) -> bool | None:
        """Upstream's ``_coerce_bool``: booleans, 0/1 and true/false words; None when absent."""
        value = self.get(key)
        if value is _MISSING or value is None:
            return None
        if isinstance(value, bool) or (isinstance(value, int) and value in (0, 1)):
            return bool(value)
        if isinstance(value, str) and value.strip().lower() in _TRUE + _FALSE:
            return value.strip().lower() in _TRUE
        raise self.error(key, f"expected true or false, got {value!r}")

    def run(self) -> Translation:
        for key in OURS_ONLY:
            if self.get(key) is not _MISSING:
                raise self.error(key, "a stageb-pool key in an upstream config (upstream would ignore it): pass it "
                                      "with --set, or convert the file with `stageb-pool import-config`")
        for key in ("model", "guidance", "output", "runner", "rule_search"):
            self.section(key, required=True)
        for key in SAME_KEYS:
            self.copy(key, required=key in ("seed", "guidance.retention", "runner.epochs"))
        self.top_level()
        self.model()
        self.prompt()
        self.files()
        self.rule_search()
        self.distillation()
        for key, why in NO_EFFECT.items():
            if self.get(key) is not _MISSING and (key not in _DROPPED_WHEN_NULL or self.get(key) is None):
                self.out.dropped[key] = why
        read = set(self.out.origin.values()) | set(self.out.dropped) | {"default_domain", "domain_map"}
        self.out.ignored = sorted(set(self.out.ignored) | {k for k in _leaf_keys(self.raw) if not any(under(k, r) for r in read)})
        return self.out

    def top_level(self) -> None:
        paths = self.get("stage_a_paths", required=True)
        if not isinstance(paths, (str, list)):
            raise self.error("stage_a_paths", f"expected a path or a list of paths, got {_type(paths)}")
        paths = [paths] if isinstance(paths, str) else paths
        self.put("stage_a_paths", [self.resolve(p, "stage_a_paths", f"stage_a_paths[{i}]") for i, p in enumerate(paths)],
                 "stage_a_paths")
        audit = self.flag("jump_reflection")
        self.put("mode", "audit" if audit else "search", "jump_reflection" if audit is not None else None,
                 f"from jump_reflection: {str(audit).lower()}" if audit is not None else "upstream runs the rule search unless jump_reflection")
        per_rank = self.get("runner.per_rank_rollout_batch_size")
        self.put("runner.chunk_size", 1 if per_rank in (_MISSING, None) else per_rank,
                 "runner.per_rank_rollout_batch_size" if per_rank is not _MISSING else None,
                 "was runner.per_rank_rollout_batch_size (default 1): tickets per work item, the same for any "
                 "number of GPUs")

    def model(self) -> None:
        name = self.get("model.model_name_or_path", required=True)
        if not isinstance(name, str) or not name:
            raise self.error("model.model_name_or_path", f"expected a non-empty string, got {name!r}")
        # Upstream hands the value to from_pretrained: a local folder first, else a hub id.
        local = os.path.normpath(os.path.join(self.out.root, name))
        if not os.path.isabs(name) and os.path.exists(local):
            self.out.relative["model.path"] = name
            name = local
        self.put("model.path", name, "model.model_name_or_path", "was model.model_name_or_path")
        self.copy("model.torch_dtype", "model.dtype", required=True)
        key = "model.attn_implementation" if self.get("model.attn_implementation") is not _MISSING else "model.attn_impl"
        attn = self.get(key)
        if attn is not _MISSING:
            flash = attn == "flash_attn"
            self.put("model.attn_implementation", "flash_attention_2" if flash else attn, key,
                     "flash_attn means flash_attention_2 upstream" if flash else None if key.endswith("implementation")
                     else f"was {key}")
        self.put("model.trust_remote_code", True, None, "upstream always loads checkpoints with trust_remote_code")
        stop, where = self.stops()
        if stop is not None:
            self.put("model.stop", stop, where, "the grid entries' stop list")

    def stops(self) -> tuple[list[str] | None, str | None]:
        """The grid entries' ``stop`` lists as one ``model.stop`` (upstream's default pair is ours)."""
        lists: dict[tuple, str] = {}
        for name in ("train_sampler", "eval_sampler"):
            grid = _get(self.raw, f"rule_search.{name}.grid")
            for i, entry in enumerate(grid if isinstance(grid, list) else []):
                key = f"rule_search.{name}.grid[{i}].stop"
                stop = entry.get("stop") if isinstance(entry, dict) else None
                if stop is None:
                    continue
                if not isinstance(stop, list) or any(s not in ALLOWED_STOPS for s in stop):
                    raise self.error(key, f"upstream accepts only {list(ALLOWED_STOPS)} here, got {stop!r}")
                self.out.dropped[key] = "the tokenizer's end-of-turn tokens are the default stops (model.stop)"
                if stop and set(stop) != set(ALLOWED_STOPS):
                    lists.setdefault(tuple(stop), key)
        if len(lists) > 1:
            raise self.error(list(lists.values())[1], "a stop list that differs between decodes has no counterpart "
                                                      "(model.stop is one list for the run)")
        return next(((list(s), k) for s, k in lists.items()), (None, None))

    def prompt(self) -> None:
        default = self.get("default_domain")
        default = None if default in (_MISSING, None) or not str(default).strip() else default
        mapping = self.get("domain_map")
        mapping = {} if mapping in (_MISSING, None) else mapping
        if not isinstance(mapping, dict):
            raise self.error("domain_map", f"expected a mapping of mission -> domain, got {_type(mapping)}")
        if default is None and not mapping:
            raise self.error("default_domain", "upstream needs default_domain (bbu or rru) or a domain_map entry for "
                                               "the mission (without one it stops: 'domain is not configured')")
        self.put("prompt.profile", PROFILE, None, "upstream's Chinese BBU/RRU prompts")
        domain = None if default is None else self.domain(default, "default_domain")
        self.put("prompt.domain", domain, "default_domain", "was default_domain")
        if mapping:
            self.put("prompt.domain_map", {str(m): self.domain(d, f"domain_map.{m}") for m, d in mapping.items()},
                     "domain_map", "was domain_map: the mission's domain, before prompt.domain")

    def domain(self, value, key: str) -> str:
        text = str(value).strip().lower()
        if text not in DOMAINS:
            raise self.error(key, f"unknown domain {value!r}: upstream accepts bbu or rru")
        return text

    def files(self) -> None:
        self.path("guidance.path", required=True)
        self.path("output.root", required=True)
        name = self.get("output.run_name", required=True)
        self.put("output.run_name", str(name) if type(name) is int else name, "output.run_name")
        self.section("ticket_filter")
        self.path("ticket_filter.exclude_ticket_keys_path")

    def rule_search(self) -> None:
        for key in REFUSED_BY_UPSTREAM:
            if self.get(f"rule_search.{key}") is not _MISSING:
                raise self.error(f"rule_search.{key}", "upstream's own loader refuses this key ('rule_search legacy "
                                                       "keys are no longer supported'): use eval_pool_size")
        self.path("rule_search.proposer_prompt_path", required=True)
        self.changed_fraction()
        order = self.get("rule_search.reflect_order")
        if order not in (_MISSING, None, "hard_first", "easy_first"):
            raise self.error("rule_search.reflect_order", f"upstream accepts hard_first or easy_first, got {order!r}")
        if self.flag("rule_search.train_with_replacement"):
            raise self.error("rule_search.train_with_replacement", "true has no counterpart: a train pool never "
                             "holds a ticket twice here, which changes results (remove it or set it false)")
        if self.get("rule_search.mining_sampler") not in (_MISSING, None):
            raise self.error("rule_search.mining_sampler", "the mining rollout has no counterpart (it changes which "
                             "examples the proposer sees): remove it")
        limit = self.get("max_token_length")
        if limit not in (_MISSING, None):
            if type(limit) is not int or limit < 1:
                raise self.error("max_token_length", f"expected an integer > 0 or null, got {limit!r}")
            self.put("rule_search.proposer_max_prompt_tokens", limit, "max_token_length",
                     "max_token_length: upstream gives it to the proposer, over proposer_max_prompt_tokens")
        for name in ("train_sampler", "eval_sampler"):
            self.sampler(name, None if limit in (_MISSING, None) else limit)

    def changed_fraction(self) -> None:
        key = "rule_search.gate.max_changed_fraction"
        value = self.get(key)
        if value in (_MISSING, None) and self.get("rule_search.gate.min_changed_fraction") not in (_MISSING, None):
            key, value = "rule_search.gate.min_changed_fraction", self.get("rule_search.gate.min_changed_fraction")
            self.put("rule_search.gate.max_changed_fraction", value, key,
                     "was min_changed_fraction, which upstream reads as the upper bound")
        elif value is not _MISSING and (value is None or (type(value) in (int, float) and value == 0)):
            self.put("rule_search.gate.max_changed_fraction", 0.05, key, f"upstream reads {value!r} as 0.05 (x or 0.05)")
        elif value is not _MISSING:
            self.put("rule_search.gate.max_changed_fraction", value, key)

    def sampler(self, name: str, limit: int | None) -> None:
        prefix = f"rule_search.{name}"
        self.section(prefix, required=True)
        grid = self.get(f"{prefix}.grid", required=True)
        if not isinstance(grid, list) or not grid or not all(isinstance(d, dict) for d in grid):
            raise self.error(f"{prefix}.grid", "expected a non-empty list of decode mappings (as upstream)")
        for i, entry in enumerate(grid):
            key = f"{prefix}.grid[{i}]"
            missing = [k for k in ("temperature", "top_p", "max_new_tokens") if k not in entry]
            if missing:
                raise self.error(f"{key}.{missing[0]}", REQUIRED.format(key=f"{key}.{missing[0]}"))
            if entry.get("no_repeat_ngram_size") is not None:
                raise self.error(f"{key}.no_repeat_ngram_size", "no counterpart here (it changes what is generated): "
                                                                "remove it")
            if "no_repeat_ngram_size" in entry:
                self.out.dropped[f"{key}.no_repeat_ngram_size"] = "null: not used"
            self.out.ignored += [f"{key}.{k}" for k in entry if k not in DECODE_KEYS + ("stop", "no_repeat_ngram_size")]
        self.put(f"{prefix}.grid", [{k: d[k] for k in DECODE_KEYS if k in d} for d in grid], f"{prefix}.grid")
        self.copy(f"{prefix}.samples_per_decode", required=True)
        budget = self.get(f"{prefix}.max_prompt_tokens")
        if budget not in (_MISSING, None):
            self.put(f"{prefix}.max_prompt_tokens", budget, f"{prefix}.max_prompt_tokens")
        elif limit is not None:
            self.put(f"{prefix}.max_prompt_tokens", min(limit, ROLLOUT_GUARD), "max_token_length",
                     f"min(max_token_length, {ROLLOUT_GUARD}), as upstream")
        else:
            self.put(f"{prefix}.max_prompt_tokens", ROLLOUT_GUARD, None,
                     f"upstream drops a ticket whose prompt exceeds {ROLLOUT_GUARD} tokens when no budget is set")

    def distillation(self) -> None:
        """Off upstream, every key is left out: ours refuses them when the export is off."""
        section = self.section("stage_b_distillation")
        enabled = section.get("enabled", True)
        if enabled is not None and not isinstance(enabled, bool):
            raise self.error("stage_b_distillation.enabled", f"expected true or false, got {enabled!r} (upstream "
                                                             "reads any non-empty text, 'false' too, as true)")
        if enabled and section.get("distill_size") is not None:
            self.put("stage_b_distillation.enabled", True, "stage_b_distillation.enabled" if "enabled" in section
                     else None, None if "enabled" in section else "upstream's default: on")
            for key in DISTILL_KEYS:
                self.copy(f"stage_b_distillation.{key}")
            self.path("stage_b_distillation.log_chatml_path")
            return
        why = "enabled is false" if enabled is False or enabled is None else "no distill_size"
        for key in section:
            self.out.dropped[f"stage_b_distillation.{key}"] = f"the export is off upstream ({why})"


def _type(value) -> str:
    return type(value).__name__


def _get(raw: dict, dotted: str):
    node: Any = raw
    for part in dotted.split("."):
        if not isinstance(node, dict) or part not in node:
            return _MISSING
        node = node[part]
    return node


def _set(raw: dict, dotted: str, value) -> None:
    *parents, last = dotted.split(".")
    for part in parents:
        raw = raw.setdefault(part, {})
    raw[last] = value


def _leaf_keys(raw: dict, prefix: str = "") -> list[str]:
    keys = []
    for key, value in raw.items():
        path = f"{prefix}.{key}" if prefix else str(key)
        keys += _leaf_keys(value, path) if isinstance(value, dict) and value else [path]
    return keys


def under(key: str, prefix: str) -> bool:
    return key == prefix or key.startswith((prefix + ".", prefix + "["))
