"""Validating a raw config mapping against the schema, and translating every problem into
an ``InputError`` located at ``"file: key.path"``.

Unknown and legacy keys are caught before msgspec sees the mapping, so the message can name
the closest valid key; msgspec then checks types strictly (``"false"`` is not a bool) and
the ranges declared in the schema; the few ranges msgspec cannot express (the decodes of a
sampling grid, finite numbers) are checked last.
"""

from __future__ import annotations

import math
import re
from typing import Any, get_args

import msgspec

from ...stageb.errors import InputError
from .schema import (
    Config,
    fields_of,
    join_key,
    list_item,
    optional,
    strip_annotated,
    struct_of,
    type_at,
    unknown_key_message,
)


def validate(raw: dict, where: str) -> Config:
    """Keys, types and ranges of the raw mapping -> Config (paths not yet resolved)."""
    if isinstance(raw.get("stage_a_paths"), str):
        raw["stage_a_paths"] = [raw["stage_a_paths"]]
    check_keys(raw, Config, "", where)
    check_finite(raw, "", where)
    try:
        cfg = msgspec.convert(raw, Config, strict=True)
    except msgspec.ValidationError as e:
        raise translate(e, raw, where) from None
    check_decodes(cfg, where)
    check_domain(cfg, where)
    run_name = cfg.output.run_name
    require("/" not in run_name and "\\" not in run_name and run_name not in (".", ".."), "output.run_name",
            f"must be a plain directory name, got {run_name!r}", where)
    return cfg


def check_keys(raw: Any, struct: type, path: str, where: str) -> None:
    """Reject unknown and legacy keys anywhere in ``raw`` before msgspec sees it, so that the
    message can name the closest valid key. Empty sections (``model:``) become ``{}``."""
    if not isinstance(raw, dict):
        return  # msgspec reports the wrong type with its path
    fields = fields_of(struct)
    for key in list(raw):
        if not isinstance(key, str):
            raise InputError(f"key {key!r} is not a string", f"{where}: {path or '(top level)'}")
        if key not in fields:
            raise InputError(unknown_key_message(path, key, list(fields)), f"{where}: {join_key(path, key)}")
        field = fields[key]
        sub = struct_of(field.type)
        if sub is not None and raw[key] is None and not optional(field.type):
            raw[key] = {}
        if sub is not None:
            check_keys(raw[key], sub, join_key(path, key), where)
        item = list_item(field.type)
        if item is not None and isinstance(raw[key], list):
            item_struct = struct_of(item)
            if item_struct is not None:
                for i, value in enumerate(raw[key]):
                    check_keys(value, item_struct, f"{join_key(path, key)}[{i}]", where)


_MSGSPEC_AT = re.compile(r"^(?P<msg>.*?)(?: - at `\$(?P<path>[^`]*)`)?$", re.S)


def _lookup(raw: Any, path: str) -> Any:
    node = raw
    for name, index in re.findall(r"\.([^.\[]+)|\[(\d+)\]", path):
        try:
            node = node[name] if name else node[int(index)]
        except (KeyError, IndexError, TypeError):
            return None
    return node


def translate(err: msgspec.ValidationError, raw: Any, where: str) -> InputError:
    """msgspec's ``Expected `int`, got `str` - at `$.runner.epochs``` as a located InputError
    that shows the offending value."""
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
    return ", ".join(repr(a) for a in get_args(strip_annotated(type_at(key))))


def check_decodes(cfg: Config, where: str) -> None:
    """Ranges of the sampling grid entries (records.Decode carries no constraints itself)."""
    for sampler_name in ("train_sampler", "eval_sampler"):
        sampler = getattr(cfg.rule_search, sampler_name)
        for i, d in enumerate(sampler.grid):
            key = f"rule_search.{sampler_name}.grid[{i}]"
            require(d.temperature >= 0, f"{key}.temperature", f"must be >= 0, got {d.temperature!r}", where)
            require(0 < d.top_p <= 1, f"{key}.top_p", f"must be in (0, 1], got {d.top_p!r}", where)
            require(d.max_new_tokens >= 1, f"{key}.max_new_tokens", f"must be >= 1, got {d.max_new_tokens!r}", where)
            require(d.repetition_penalty > 0, f"{key}.repetition_penalty", f"must be > 0, got {d.repetition_penalty!r}", where)


def check_domain(cfg: Config, where: str) -> None:
    """A domain needs a profile that has domains: the generic profile would silently use its
    one English prompt for a BBU mission."""
    if cfg.prompt.profile == "generic" and (cfg.prompt.domain is not None or cfg.prompt.domain_map):
        key = "prompt.domain" if cfg.prompt.domain is not None else "prompt.domain_map"
        raise InputError("the generic profile has no domains: set prompt.profile: bbu_rru (upstream's BBU/RRU "
                         "prompts) or a profile directory of your own", f"{where}: {key}")


def require(ok: bool, key: str, message: str, where: str) -> None:
    """An InputError at ``where: key`` unless ``ok``."""
    if not ok:
        raise InputError(message, f"{where}: {key}")


def check_finite(value: Any, path: str, where: str) -> None:
    """NaN and infinity pass msgspec's unconstrained float fields; no key wants them."""
    if isinstance(value, float) and not math.isfinite(value):
        raise InputError(f"must be a finite number, got {value!r}", f"{where}: {path}")
    if isinstance(value, dict):
        for k, v in value.items():
            check_finite(v, join_key(path, str(k)), where)
    elif isinstance(value, list):
        for i, v in enumerate(value):
            check_finite(v, f"{path}[{i}]", where)
