"""``stageb-pool import-config``: an upstream config as our config file (the same resolved
config), with a comment on every key whose name or value differs from upstream's."""

from __future__ import annotations

import copy
import os
import re

import yaml

from .config.schema import Config, fields_of, struct_of
from .upstream_config import Translation

_PLAIN_KEY = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*$")


def native_yaml(translation: Translation, source: str, *, out_dir: str | None = None) -> str:
    """Paths relative upstream are written relative to ``out_dir`` (the file's), else absolute."""
    native = _in_schema_order(_with_relative_paths(translation, out_dir), Config)
    lines = _header(translation, source, out_dir)
    for key, value in native.items():
        lines += _entry(key, value, key, translation.notes, 0)
    return "\n".join(lines) + "\n"


def _in_schema_order(raw: dict, struct) -> dict:
    fields = fields_of(struct) if struct is not None else {}
    order = {name: i for i, name in enumerate(fields)}
    out = {}
    for key in sorted(raw, key=lambda k: order.get(k, len(order))):
        sub = struct_of(fields[key].type) if key in fields else None
        value = raw[key]
        out[key] = _in_schema_order(value, sub) if isinstance(value, dict) and sub is not None else value
    return out


def _header(t: Translation, source: str, out_dir: str | None) -> list[str]:
    where = "relative to this file's folder" if out_dir else "as absolute paths"
    lines = [
        "# stageb-pool config written by `stageb-pool import-config` from the upstream Stage-B config",
        f"#   {source}",
        f"# Upstream resolves relative paths against its launch directory, here {t.root};",
        f"# they are written {where}. Every key is described in docs/usage.md, every upstream key",
        "# in docs/migrating.md.",
    ]
    if t.dropped:
        lines.append("# Upstream keys with no effect in stageb-pool (left out):")
        lines += [f"#   {key}: {why}" for key, why in sorted(t.dropped.items())]
    if t.ignored:
        lines.append("# Keys upstream's loader never reads (ignored there too, left out):")
        lines += [f"#   {key}" for key in t.ignored]
    return lines


def _with_relative_paths(t: Translation, out_dir: str | None) -> dict:
    native = copy.deepcopy(t.native)
    if out_dir is None:
        return native
    for key in t.relative:
        node, slot = _locate(native, key)
        node[slot] = os.path.relpath(node[slot], out_dir)
    return native


def _locate(native: dict, key: str):
    """``(container, slot)`` of a dotted key, ``name[i]`` naming a list item."""
    m = re.match(r"^(.*?)(?:\[(\d+)\])?$", key)
    node = native
    for part in m.group(1).split("."):
        parent, node = node, node[part]
    return (parent, part) if m.group(2) is None else (node, int(m.group(2)))


def _entry(name: str, value, path: str, notes: dict[str, str], depth: int) -> list[str]:
    pad = "  " * depth
    label = name if _PLAIN_KEY.match(name) else _scalar(name)
    note = f"  # {notes[path]}" if path in notes else ""
    if isinstance(value, dict) and value:
        lines = [f"{pad}{label}:{note}"]
        for key, item in value.items():
            lines += _entry(str(key), item, f"{path}.{key}", notes, depth + 1)
        return lines
    if isinstance(value, list) and value and all(isinstance(v, dict) for v in value):
        return [f"{pad}{label}:{note}"] + [f"{pad}  - {_flow(v)}" for v in value]
    return [f"{pad}{label}: {_flow(value)}{note}"]


def _flow(value) -> str:
    if isinstance(value, dict):
        return "{" + ", ".join(f"{k if _PLAIN_KEY.match(str(k)) else _scalar(str(k))}: {_flow(v)}"
                               for k, v in value.items()) + "}"
    if isinstance(value, list):
        return "[" + ", ".join(_flow(v) for v in value) + "]"
    return _scalar(value)


def _scalar(value) -> str:
    """Strings double-quoted, so no reader takes a path or name for a number, boolean or null."""
    if isinstance(value, str):
        text = yaml.safe_dump(value, default_style='"', allow_unicode=True, width=float("inf"))
    else:
        text = yaml.safe_dump(value, allow_unicode=True, width=float("inf"))
    return text.removesuffix("\n").removesuffix("\n...").strip()
