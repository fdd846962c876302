"""Reading a config: the YAML file and the ``--set`` overrides, as a raw mapping.

Nothing here knows about ranges or types; it turns text into the raw mapping that
``checks.validate`` then checks against the schema. Errors are ``InputError`` located as
``file:line`` (YAML syntax) or ``--set`` (an override).
"""

from __future__ import annotations

import re
from typing import Any

import yaml

from ...stageb.errors import InputError
from .schema import Config, fields_of, join_key, list_item, struct_of, type_at, unknown_key_message


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


def read_yaml(path: str) -> Any:
    """The YAML document of the file at ``path`` (located InputError when it cannot be read)."""
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
            struct = struct_of(list_item(type_at(path)))
            continue
        fields = fields_of(struct) if struct is not None else {}
        if part not in fields:
            raise InputError(unknown_key_message(path, part, list(fields)), "--set")
        field = fields[part]
        path = join_key(path, part)
        if last:
            node[part] = value
            return path
        if not isinstance(node.get(part), (dict, list)):
            if list_item(field.type) is not None and struct_of(field.type) is None:
                raise InputError(f"{dotted}: {path} has no items to index", "--set")
            node[part] = {}
        node = node[part]
        struct = struct_of(field.type)
        if struct is None and not isinstance(node, list):
            raise InputError(f"{dotted}: {path} is not a section", "--set")
    raise AssertionError("unreachable: the loop returns at the last part")
