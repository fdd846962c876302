"""``load_config``: a config file (plus ``--set`` overrides) -> the run's frozen, resolved Config.

Resolution happens here and only here: every path is made absolute (relative to the config
file), the seeds that default to the top-level seed (the bootstrap's, the distillation's)
are filled in, and input files are checked to exist. Callees read plain values from the
result and never resolve a default again.
"""

from __future__ import annotations

import os

import msgspec

from ...stageb.errors import InputError
from .checks import validate
from .schema import Config
from .source import apply_override, read_yaml


def load_config(path: str | os.PathLike, overrides=(), *, check_files: bool = True) -> Config:
    """Read, validate and resolve a config file.

    ``overrides`` are ``"a.b.c=value"`` strings (the CLI's ``--set``), applied to the YAML
    mapping before validation. ``check_files=False`` skips the existence checks of input
    files (for validating example configs on another machine). Raises ``InputError``.
    """
    where = os.path.abspath(os.fspath(path))
    raw = read_yaml(where)
    if raw is None:
        raw = {}
    if not isinstance(raw, dict):
        raise InputError(f"the config must be a YAML mapping of keys, not a {type(raw).__name__}", where)
    overridden = [apply_override(raw, assignment) for assignment in overrides]
    try:
        cfg = _resolve_distillation(validate(raw, where), where)
    except InputError as e:
        key = (e.location or "").partition(": ")[2]
        if any(key == k or key.startswith((k + ".", k + "[")) for k in overridden):
            e.message += " (value from --set)"
        raise
    cfg = _resolve_paths(_resolve_seeds(cfg), os.path.dirname(where))
    if check_files:
        _check_files(cfg, where)
    return cfg


def with_mode(cfg: Config, audit: bool) -> Config:
    """The config with ``mode: audit`` when the ``--audit`` flag asks for it."""
    return replace_at(cfg, "mode", "audit") if audit and cfg.mode != "audit" else cfg


def replace_at(struct, dotted: str, value):
    """A copy of a frozen Struct tree with the field at ``dotted`` (``a.b.c``) replaced."""
    head, _, rest = dotted.partition(".")
    if rest:
        value = replace_at(getattr(struct, head), rest, value)
    return msgspec.structs.replace(struct, **{head: value})


def to_dict(cfg: Config) -> dict:
    """The config as plain JSON-ready values (for run.json and hashing)."""
    return msgspec.to_builtins(cfg)


def config_document(cfg: Config) -> dict:
    """The resolved config without ``output`` (where a run is written does not change what
    it computes), as plain data (``app/identity.py`` builds a resume's identity from it)."""
    data = to_dict(cfg)
    data.pop("output", None)
    return data


_DISTILL_KEYS = ("distill_size", "distill_seed", "distill_temperature", "log_chatml_path")


def _resolve_distillation(cfg: Config, where: str) -> Config:
    """``stage_b_distillation.enabled`` as a bool: unset means on when ``distill_size`` is set
    (upstream's default is on). No distillation setting is ignored: ``enabled: true`` needs a
    ``distill_size``, and a setting of an export that is off is an error."""
    dist = cfg.stage_b_distillation
    if dist.enabled and dist.distill_size is None:
        raise InputError("required when stage_b_distillation.enabled is true (the number of tickets to export)",
                         f"{where}: stage_b_distillation.distill_size")
    exporting = dist.distill_size is not None and dist.enabled is not False
    if not exporting:
        why = "enabled is false" if dist.enabled is False else "no distill_size is set"
        for key in _DISTILL_KEYS:
            if getattr(dist, key) is not None:
                raise InputError(f"has no effect: the distillation export is off ({why}); remove it or turn "
                                 "the export on", f"{where}: stage_b_distillation.{key}")
    return replace_at(cfg, "stage_b_distillation.enabled", exporting)


def _resolve_seeds(cfg: Config) -> Config:
    """The seeds documented as "null: the top-level seed", filled in once."""
    if cfg.rule_search.gate.bootstrap.seed is None:
        cfg = replace_at(cfg, "rule_search.gate.bootstrap.seed", cfg.seed)
    if cfg.stage_b_distillation.distill_seed is None:
        cfg = replace_at(cfg, "stage_b_distillation.distill_seed", cfg.seed)
    return cfg


def _resolve(base: str, value: str) -> str:
    return os.path.normpath(os.path.join(base, os.path.expanduser(value)))


def _looks_like_path(value: str) -> bool:
    return os.sep in value or value.startswith((".", "~")) or (os.altsep is not None and os.altsep in value)


def _resolve_paths(cfg: Config, base: str) -> Config:
    """Every path made absolute, relative to the config file's directory."""
    paths = {
        "stage_a_paths": [_resolve(base, p) for p in cfg.stage_a_paths],
        "guidance.path": _resolve(base, cfg.guidance.path),
        "output.root": _resolve(base, cfg.output.root),
    }
    optional = {
        "rule_search.proposer_prompt_path": cfg.rule_search.proposer_prompt_path,
        "ticket_filter.exclude_ticket_keys_path": cfg.ticket_filter.exclude_ticket_keys_path,
        "stage_b_distillation.log_chatml_path": cfg.stage_b_distillation.log_chatml_path,
    }
    paths.update({key: _resolve(base, value) for key, value in optional.items() if value is not None})
    if _looks_like_path(cfg.prompt.profile):
        paths["prompt.profile"] = _resolve(base, cfg.prompt.profile)
    model = cfg.model.path
    if model not in ("embedded", "tiny") and not os.path.isabs(model):
        candidate = _resolve(base, model)
        # "org/name" could be a hub id; only a path that exists or clearly is one is resolved.
        if os.path.exists(candidate) or model.startswith((".", "~")) or model.endswith(".gguf"):
            paths["model.path"] = candidate
    for key, value in paths.items():
        cfg = replace_at(cfg, key, value)
    return cfg


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
