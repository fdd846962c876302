"""A raw config mapping validated against the schema, every problem an InputError located at
``"file: key.path"``: unknown keys first (so the message can name the closest valid key), then
msgspec's types and ranges, then what msgspec cannot express."""

from __future__ import annotations

import math
import re
from typing import Any, get_args

import msgspec

from ...search.rundir import run_name_problem
from ...stageb.errors import InputError
from .schema import (
    DECODE_RANGES,
    SAMPLER_RANGES,
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
    """The raw mapping as a Config (paths not yet resolved)."""
    if isinstance(raw.get("stage_a_paths"), str):
        raw["stage_a_paths"] = [raw["stage_a_paths"]]
    check_values(raw, "", where)
    check_keys(raw, Config, "", where)
    try:
        cfg = msgspec.convert(raw, Config, strict=True)
    except msgspec.ValidationError as e:
        raise translate(e, raw, where) from None
    check_samplers(cfg, where)
    check_domain(cfg, where)
    problem = run_name_problem(cfg.output.run_name)
    require(problem is None, "output.run_name", f"{problem}, got {shown(cfg.output.run_name)}", where)
    return cfg


def check_keys(raw: Any, struct: type, path: str, where: str) -> None:
    """Reject unknown and legacy keys anywhere in ``raw``; empty sections (``model:``) become ``{}``."""
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
    """A msgspec error as a located InputError that shows the offending value."""
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
        text = f"invalid value {shown(value)}: expected one of {_choices(key)}"
    elif value is not None or "got `null`" not in msg:
        text = f"{text}, got {shown(value)}" if ", got" not in text else f"{text} ({shown(value)})"
        text += _hint(value, text)
    return InputError(text, f"{where}: {key or '(top level)'}")


_YAML11 = re.compile(r"[-+]?(?:0[0-7_]+|0x[0-9a-fA-F_]+|0b[01_]+|[0-9][0-9_]*(?::[0-5]?[0-9])+|[0-9][0-9_]*_[0-9_]*)")


def _hint(value: Any, text: str) -> str:
    if not isinstance(value, str):
        return ""
    if "bool" in text and value.lower() in ("yes", "no", "on", "off", "y", "n"):
        return " (YAML 1.1 read it as a boolean; write true or false)"
    if ("int" in text or "float" in text) and _YAML11.fullmatch(value.strip()):
        return " (YAML 1.1 read it as an octal, hexadecimal or base-60 number; write the plain decimal number)"
    if ("float" in text or "int" in text) and _looks_numeric(value):
        return " (write a number without quotes)"
    return ""


def _looks_numeric(text: str) -> bool:
    try:
        float(text)
        return True
    except ValueError:
        return False


def _choices(key: str) -> str:
    return ", ".join(repr(a) for a in get_args(strip_annotated(type_at(key))))


def check_samplers(cfg: Config, where: str) -> None:
    for sampler_name in ("train_sampler", "eval_sampler"):
        sampler = getattr(cfg.rule_search, sampler_name)
        key = f"rule_search.{sampler_name}"
        for name, meta in SAMPLER_RANGES.items():
            check_range(getattr(sampler, name), meta, f"{key}.{name}", where)
        for i, decode in enumerate(sampler.grid):
            for name, meta in DECODE_RANGES.items():
                check_range(getattr(decode, name), meta, f"{key}.grid[{i}].{name}", where)


def check_range(value, meta: msgspec.Meta, key: str, where: str) -> None:
    if value is None:
        return
    low_ok = (meta.ge is None or value >= meta.ge) and (meta.gt is None or value > meta.gt)
    high_ok = (meta.le is None or value <= meta.le) and (meta.lt is None or value < meta.lt)
    require(low_ok and high_ok, key, f"must be in {range_text(meta)}, got {value!r}", where)


def range_text(meta: msgspec.Meta) -> str:
    """``[1, 1000]``, ``(0, 1]`` or ``[-2^63, 2^63-1]``: a Meta's bounds as docs/usage.md writes them."""
    low = f"[{_number(meta.ge)}" if meta.gt is None else f"({_number(meta.gt)}"
    high = f"{_number(meta.le)}]" if meta.lt is None else f"{_number(meta.lt)})"
    return f"{low}, {high}"


def _number(x) -> str:
    names = {-(2**63): "-2^63", 2**63 - 1: "2^63-1"}
    if x in names and isinstance(x, int):
        return names[x]
    return str(int(x)) if isinstance(x, float) and x.is_integer() else str(x)


def check_domain(cfg: Config, where: str) -> None:
    """The generic profile would silently use its one English prompt for a BBU mission."""
    if cfg.prompt.profile == "generic" and (cfg.prompt.domain is not None or cfg.prompt.domain_map):
        key = "prompt.domain" if cfg.prompt.domain is not None else "prompt.domain_map"
        raise InputError("the generic profile has no domains: set prompt.profile: bbu_rru (upstream's BBU/RRU "
                         "prompts) or a profile directory of your own", f"{where}: {key}")


def require(ok: bool, key: str, message: str, where: str) -> None:
    if not ok:
        raise InputError(message, f"{where}: {key}")


def check_values(value: Any, path: str, where: str) -> None:
    """NaN and infinity (msgspec's float fields take them), and text no file or path can hold."""
    if isinstance(value, float) and not math.isfinite(value):
        raise InputError(f"must be a finite number, got {value!r}", f"{where}: {path}")
    if isinstance(value, str):
        check_text(value, path, where)
    elif isinstance(value, dict):
        for k, v in value.items():
            if isinstance(k, str):
                check_text(k, path or "(top level)", where)
            check_values(v, join_key(path, str(k)), where)
    elif isinstance(value, list):
        for i, v in enumerate(value):
            check_values(v, f"{path}[{i}]", where)


_UNWRITABLE = re.compile("[\x00\ud800-\udfff]")


def check_text(text: str, path: str, where: str) -> None:
    """No path holds a NUL, no UTF-8 file (run.json) a lone surrogate."""
    m = _UNWRITABLE.search(text)
    if m:
        what = "a NUL character" if m.group() == "\x00" else "a lone surrogate"
        raise InputError(f"text with {what} (at character {m.start()}) is not allowed", f"{where}: {path}")


def shown(value: Any, limit: int = 200) -> str:
    """``repr(value)`` cut to ``limit`` characters: an error quotes what it refuses, never megabytes."""
    text = repr(value)
    return text if len(text) <= limit else f"{text[:limit]}... ({len(text)} characters)"
