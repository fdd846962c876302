"""``load_config``: a config file (plus ``--set`` overrides) -> the run's frozen, resolved Config.

Resolution happens here and only here (paths absolute, default seeds filled in, input files and
the model path checked): callees read plain values and never resolve a default again.
"""

from __future__ import annotations

import logging
import os
import stat

import msgspec

from ...engine import models
from ...stageb.errors import InputError
from ..upstream_config import Translation, is_upstream, translate, under
from .checks import validate
from .schema import Config
from .source import apply_override, read_yaml

log = logging.getLogger("stageb_pool")


def absolute(path: str | os.PathLike, what: str) -> str:
    """``path`` made absolute; a located InputError when the current directory was deleted."""
    try:
        return os.path.abspath(os.fspath(path))
    except FileNotFoundError:
        raise InputError(f"cannot resolve {what}'s relative path: the current directory no longer exists "
                         "(deleted?); run from an existing directory or give an absolute path", os.fspath(path)) from None


def read_config(path: str | os.PathLike, *, upstream_root: str | None = None) -> tuple[str, dict, Translation | None]:
    """``(absolute path, raw mapping in our schema, translation)``; an upstream config's relative
    paths are resolved against ``upstream_root`` (default: the current directory, as upstream)."""
    where = absolute(path, "the config")
    raw = read_yaml(where)
    if raw is None:
        raw = {}
    if not isinstance(raw, dict):
        raise InputError(f"the config must be a YAML mapping of keys, not a {type(raw).__name__}", where)
    if not is_upstream(raw):
        if upstream_root is not None:
            raise InputError(f"{where} is a stageb-pool config (its relative paths are relative to its own folder); "
                             "the launch directory applies to upstream Stage-B configs only", "--upstream-root")
        return where, raw, None
    root = absolute(upstream_root if upstream_root is not None else ".", "the launch directory")
    if not os.path.isdir(root):
        raise InputError(f"not a directory: {root}", "--upstream-root")
    translation = translate(raw, where, root)
    return where, translation.native, translation


def load_config(path: str | os.PathLike, overrides=(), *, check_files: bool = True,
                upstream_root: str | None = None, announce: bool = True) -> Config:
    """``overrides``: ``--set`` strings, applied before validation; ``announce`` logs a translated upstream config."""
    return load_checked_config(path, overrides, check_files=check_files, upstream_root=upstream_root,
                               announce=announce)[0]


def load_checked_config(path: str | os.PathLike, overrides=(), *, check_files: bool = True,
                        upstream_root: str | None = None,
                        announce: bool = True) -> tuple[Config, models.ModelRef | None]:
    """``load_config``, and the model path its file checks checked (None without them)."""
    where, raw, translation = read_config(path, upstream_root=upstream_root)
    if translation is not None and announce:
        log.info("%s", translation.summary(where))
    overridden = [apply_override(raw, assignment) for assignment in overrides]
    base = os.path.dirname(where) if translation is None else translation.root
    model = None
    try:
        cfg = _resolve_paths(_resolve_seeds(_resolve_distillation(validate(raw, where), where)), base)
        if check_files:
            model = _check_files(cfg, where)
    except InputError as e:
        key = (e.location or "").partition(": ")[2]
        if any(under(key, k) for k in overridden):
            e.message += " (value from --set)"
        elif translation is not None:
            _locate_upstream(e, key, translation, where)
        raise
    return cfg, model


def _locate_upstream(err: InputError, key: str, translation: Translation, where: str) -> None:
    """An error about a translated key names the upstream key it came from."""
    ours = max((k for k in translation.origin if under(key, k)), key=len, default=None)
    if ours is None or translation.origin[ours] == ours:
        return
    err.location = f"{where}: {translation.origin[ours]}{key[len(ours):]}"
    err.message += f" (read as {key})"


def with_mode(cfg: Config, audit: bool) -> Config:
    return replace_at(cfg, "mode", "audit") if audit and cfg.mode != "audit" else cfg


def replace_at(struct, dotted: str, value):
    """A copy of a frozen Struct tree with the field at ``dotted`` (``a.b.c``) replaced."""
    head, _, rest = dotted.partition(".")
    if rest:
        value = replace_at(getattr(struct, head), rest, value)
    return msgspec.structs.replace(struct, **{head: value})


def config_document(cfg: Config) -> dict:
    """The resolved config as plain data without ``output`` (which changes nothing computed)."""
    data = msgspec.to_builtins(cfg)
    data.pop("output", None)
    return data


_DISTILL_KEYS = ("distill_size", "distill_seed", "distill_temperature", "log_chatml_path")


def _resolve_distillation(cfg: Config, where: str) -> Config:
    """``enabled`` as a bool (unset: on when ``distill_size`` is set, as upstream); a setting of
    an export that is off is an error, never ignored."""
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


def input_files(cfg: Config) -> list[tuple[str, str]]:
    """``(key, path)`` of every input file (not the profile folder): readable, never overwritten."""
    found = [(f"stage_a_paths[{i}]", p) for i, p in enumerate(cfg.stage_a_paths)]
    found.append(("guidance.path", cfg.guidance.path))
    if cfg.rule_search.proposer_prompt_path is not None:
        found.append(("rule_search.proposer_prompt_path", cfg.rule_search.proposer_prompt_path))
    if cfg.ticket_filter.exclude_ticket_keys_path is not None:
        found.append(("ticket_filter.exclude_ticket_keys_path", cfg.ticket_filter.exclude_ticket_keys_path))
    return found


def _check_files(cfg: Config, where: str) -> models.ModelRef:
    """Input files must be regular files (a FIFO would block the run forever)."""
    for key, path in input_files(cfg):
        problem = _not_a_regular_file(path)
        if problem:
            raise InputError(f"{problem}: {path}", f"{where}: {key}")
    if os.path.isabs(cfg.prompt.profile) and not os.path.isdir(cfg.prompt.profile):
        raise InputError(f"prompt profile directory not found: {cfg.prompt.profile}", f"{where}: prompt.profile")
    try:
        return models.check_model_path(cfg.model.path)
    except InputError as err:
        raise InputError(f"{err.message}: {cfg.model.path}", f"{where}: model.path") from None


def _not_a_regular_file(path: str) -> str | None:
    try:
        mode = os.stat(path).st_mode
    except FileNotFoundError:
        return "file not found"
    except OSError as err:
        return f"cannot read it ({err.strerror or err})"
    if stat.S_ISDIR(mode):
        return "is a directory, not a file"
    return None if stat.S_ISREG(mode) else "not a regular file (a FIFO, socket or device would block or fail)"
