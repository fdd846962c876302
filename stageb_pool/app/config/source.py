"""The YAML file and the ``--set`` overrides as a raw mapping, errors located at ``file:line``
or ``--set``. PyYAML's safe loader with its traps removed: YAML 1.2 scalars (``010``, ``1:30``,
``yes`` stay text, so a key that wants a number refuses them), and a key given twice, nesting
past ``MAX_DEPTH``, aliases past ``MAX_VALUES`` values or into themselves and an integer past
4,300 digits are errors.
"""

from __future__ import annotations

import re
from typing import Any

import yaml

from ...stageb import inputs
from ...stageb.errors import InputError
from .schema import Config, fields_of, join_key, list_item, struct_of, type_at, unknown_key_message

MAX_DEPTH = 100  # a config nests about 6 deep
MAX_VALUES = 100_000  # a config holds a few hundred values, aliases expanded


class _Resolver(yaml.resolver.BaseResolver):
    """YAML 1.2 core scalars, but an integer with a leading zero stays text: 1.1 reads ``010``
    as 8, 1.2 as 10, and nobody can tell which the author meant."""

    yaml_implicit_resolvers: dict = {}


for tag, pattern, first in (
    ("bool", r"true|True|TRUE|false|False|FALSE", "tTfF"),
    ("int", r"[-+]?(?:0|[1-9][0-9]*)", "-+0123456789"),
    ("float", (r"[-+]?(?:(?:[0-9]+\.[0-9]*|\.[0-9]+)(?:[eE][-+]?[0-9]+)?|[0-9]+[eE][-+]?[0-9]+)"
               r"|[-+]?\.(?:inf|Inf|INF)|\.(?:nan|NaN|NAN)"), "-+0123456789."),
    ("null", r"~|null|Null|NULL|", ["~", "n", "N", ""]),
    ("merge", r"<<", "<"),
):
    _Resolver.add_implicit_resolver(f"tag:yaml.org,2002:{tag}", re.compile(f"^(?:{pattern})$"), list(first))


class _Loader(inputs.StrictYaml, yaml.reader.Reader, yaml.scanner.Scanner, yaml.parser.Parser,
              yaml.composer.Composer, yaml.constructor.SafeConstructor, _Resolver):

    max_depth = MAX_DEPTH
    duplicate = "duplicate key {key!r} (first on line {line})"

    def __init__(self, stream):
        yaml.reader.Reader.__init__(self, stream)
        yaml.scanner.Scanner.__init__(self)
        yaml.parser.Parser.__init__(self)
        yaml.composer.Composer.__init__(self)
        yaml.constructor.SafeConstructor.__init__(self)
        _Resolver.__init__(self)

    def compose_document(self):
        node = super().compose_document()
        _check_expansion(node)
        return node

    def construct_yaml_int(self, node):
        try:
            return super().construct_yaml_int(node)
        except ValueError:  # Python converts at most 4,300 digits
            digits = sum(c.isdigit() for c in node.value)
            raise yaml.constructor.ConstructorError(None, None, f"an integer of {digits} digits is not a "
                                                    "usable number", node.start_mark) from None


_Loader.add_constructor("tag:yaml.org,2002:int", _Loader.construct_yaml_int)
_Loader.add_constructor(yaml.resolver.BaseResolver.DEFAULT_MAPPING_TAG, _Loader.construct_mapping)


def _check_expansion(root) -> None:
    """Sizes are computed once per node, so a billion laughs costs a few steps."""
    if root is None:
        return
    size: dict[int, tuple[int, int]] = {}  # id(node) -> (values, depth) once done
    open_nodes: set[int] = set()
    stack = [(root, False)]
    while stack:
        node, children_done = stack.pop()
        key = id(node)
        if children_done:
            open_nodes.discard(key)
            parts = [size[id(c)] for c in _children(node)]
            values, depth = 1 + sum(p[0] for p in parts), 1 + max((p[1] for p in parts), default=0)
            if values > MAX_VALUES or depth > MAX_DEPTH:
                what = f"{MAX_VALUES} values" if values > MAX_VALUES else f"{MAX_DEPTH} levels"
                raise yaml.composer.ComposerError(None, None, f"aliases expand this to more than {what}",
                                                  node.start_mark)
            size[key] = (values, depth)
            continue
        if key in size:
            continue
        if key in open_nodes:
            raise yaml.composer.ComposerError(None, None, "an alias refers to the node that contains it",
                                              node.start_mark)
        open_nodes.add(key)
        stack.append((node, True))
        stack.extend((child, False) for child in _children(node) if id(child) not in size)


def _children(node) -> list:
    if isinstance(node, yaml.SequenceNode):
        return list(node.value)
    if isinstance(node, yaml.MappingNode):
        return [n for pair in node.value for n in pair]
    return []


def load_yaml(text: str) -> Any:
    return yaml.load(text, Loader=_Loader)  # a SafeConstructor loader: no Python objects


def read_yaml(path: str) -> Any:
    """The YAML document of the config file at ``path``, read as every input (``stageb.inputs``)."""
    text = inputs.decode_utf8(inputs.read_bytes(path, "config file"), path)
    try:
        return load_yaml(text)
    except yaml.reader.ReaderError as e:  # a character YAML does not allow, e.g. a NUL byte
        line, _ = inputs.line_col(text, e.position)
        code = e.character if isinstance(e.character, int) else ord(e.character)
        raise InputError(f"invalid YAML: character {code:#06x} is not allowed", f"{path}:{line}") from None
    except yaml.YAMLError as e:
        mark = getattr(e, "problem_mark", None) or getattr(e, "context_mark", None)
        problem = getattr(e, "problem", None) or str(e)
        context = getattr(e, "context", None)
        text = f"invalid YAML: {problem}" + (f" ({context})" if context and getattr(e, "problem", None) else "")
        if mark is None:
            raise InputError(text, path) from None
        raise InputError(text, f"{path}:{mark.line + 1}") from None


def apply_override(raw: dict, assignment: str) -> str:
    """Apply one ``--set a.b.c=value`` (the value read as YAML); returns the key path it set."""
    dotted, equals, text = assignment.partition("=")
    dotted = dotted.strip()
    parts = dotted.split(".")
    if not equals or not all(parts):
        raise InputError(f"{assignment!r}: expected key.path=value"[:300], "--set")
    try:
        value = load_yaml(text) if text.strip() else None
    except yaml.YAMLError as e:
        raise InputError(f"{dotted}: cannot read value {text!r} as YAML: {getattr(e, 'problem', e)}"[:500],
                         "--set") from None
    struct: type | None = Config
    node: Any = raw
    path = ""
    for i, part in enumerate(parts):
        last = i == len(parts) - 1
        if isinstance(node, list):  # a list index, e.g. rule_search.train_sampler.grid.0.temperature
            if not part.isdigit() or int(part) >= len(node):
                raise InputError(f"{dotted}: no list item {part!r} at {path} (it has {len(node)})"[:500], "--set")
            index = int(part)
            path = f"{path}[{index}]"
            if last:
                node[index] = value
                return path
            node = node[index]
            struct = struct_of(list_item(type_at(path)))
            if not isinstance(node, dict):
                raise InputError(f"{dotted}: {path} is {_a(node)}, not a section with keys"[:500], "--set")
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


def _a(value) -> str:
    return {str: "a string", int: "an integer", float: "a number", bool: "a boolean", list: "a list",
            type(None): "null"}.get(type(value), f"a {type(value).__name__}")
