"""The checks every user input file gets: a regular file (a FIFO would block the run), UTF-8,
strict JSON and YAML (duplicate keys, deep nesting, 4,300-digit integers, lone surrogates are
located errors). Failures are ``InputError``, or ``JsonProblem`` for callers that locate them."""

from __future__ import annotations

import json
import os
import re
import stat
from pathlib import Path

import yaml

from .errors import InputError
from .text import short

BOM = b"\xef\xbb\xbf"
MAX_DEPTH = 100  # Stage-A summaries and guidance files nest about 5 deep
_JSON_STRING = re.compile(r'"[^"\\]*(?:\\.[^"\\]*)*"')
_JSON_TOKEN = re.compile(_JSON_STRING.pattern + r"|[\[\]{}]")
_SURROGATE_ESCAPE = re.compile(r"\\u[dD][89a-fA-F][0-9a-fA-F]{2}")
_SURROGATE = re.compile("[\ud800-\udfff]")
_LONG_INT = re.compile(r"\d{4301,}")


def regular_file(path: str | Path, what: str) -> Path:
    """``path`` if it names a regular file (symbolic links followed), else InputError."""
    path = Path(path)
    try:
        mode = os.stat(path).st_mode
    except FileNotFoundError:
        raise InputError(f"{what} not found", str(path)) from None
    except OSError as err:
        raise InputError(f"cannot read the {what}: {err.strerror or err}", str(path)) from None
    if not stat.S_ISREG(mode):
        raise InputError(f"the {what} is not a regular file", str(path))
    return path


def read_bytes(path: str | Path, what: str) -> bytes:
    path = regular_file(path, what)
    try:
        data = path.read_bytes()
    except OSError as err:
        raise InputError(f"cannot read the {what}: {err.strerror or err}", str(path)) from None
    return data[len(BOM):] if data.startswith(BOM) else data


def line_col(text: str, pos: int) -> tuple[int, int]:
    line = text.count("\n", 0, pos) + 1
    return line, pos - (text.rfind("\n", 0, pos) + 1) + 1


def decode_utf8(data: bytes, where: str) -> str:
    """``data`` as text; an invalid byte is located at ``where:line:column``."""
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError as err:
        line, col = line_col(data[: err.start].decode("utf-8", "replace"), err.start)
        raise InputError(f"not valid UTF-8 (byte 0x{data[err.start]:02x})", f"{where}:{line}:{col}") from None


def read_text(path: str | Path, what: str) -> str:
    return decode_utf8(read_bytes(path, what), str(path))


class JsonProblem(ValueError):
    """Why a JSON text was refused; ``line``/``col`` (1-based) or ``keypath`` say where."""

    def __init__(self, message: str, *, line: int | None = None, col: int | None = None, keypath: str = ""):
        super().__init__(message)
        self.message, self.line, self.col, self.keypath = message, line, col, keypath

    def where(self, prefix: str) -> str:
        if self.line is not None:
            return f"{prefix}:{self.line}:{self.col}"
        return f"{prefix}: {self.keypath}" if self.keypath else prefix


class _Duplicate:
    """Stands in for the value of a key given twice, so its key path can be found."""

    __slots__ = ("key",)

    def __init__(self, key: str):
        self.key = key


def nesting_exceeds(text: str, limit: int) -> int | None:
    """Position of the first bracket nested deeper than ``limit`` (strings skipped), or None."""
    if text.count("{") + text.count("[") <= limit:
        return None
    skeleton = _JSON_STRING.sub('""', text)  # brackets inside summaries are text, not depth
    if skeleton.count("{") + skeleton.count("[") <= limit:
        return None
    depth = 0
    for m in _JSON_TOKEN.finditer(text):
        token = m.group()
        if token in "[{":
            depth += 1
            if depth > limit:
                return m.start()
        elif token in "]}":
            depth -= 1
    return None


def _walk(value, path: tuple = ()):
    stack = [(path, value)]
    while stack:
        path, value = stack.pop()
        yield path, value
        if isinstance(value, dict):
            stack.extend((path + (k,), v) for k, v in reversed(list(value.items())))
        elif isinstance(value, list):
            stack.extend((path + (i,), v) for i, v in reversed(list(enumerate(value))))


def first_lone_surrogate(value) -> tuple[tuple, str] | None:
    """The key path and text of the first string holding a lone surrogate, or None."""
    for path, item in _walk(value):
        if isinstance(item, str) and _SURROGATE.search(item):
            return path, item
    return None


def _printable(text: str) -> str:
    return _SURROGATE.sub(lambda m: f"\\u{ord(m.group()):04x}", text)


def _keypath(path: tuple) -> str:
    return ".".join(_printable(short(str(p))) for p in path)


def _content_problems(value, *, duplicates: bool, surrogates: bool) -> None:
    for path, item in _walk(value):
        if duplicates and isinstance(item, _Duplicate):
            raise JsonProblem(f"key {short(item.key)!r} is given twice in one object", keypath=_keypath(path[:-1]))
        if surrogates:
            for text in ([path[-1]] if path and isinstance(path[-1], str) else []) + (
                    [item] if isinstance(item, str) else []):
                if _SURROGATE.search(text):
                    raise JsonProblem("lone surrogate escape (\\ud800-\\udfff) in a string", keypath=_keypath(path))


def loads(text: str) -> object:
    deep = nesting_exceeds(text, MAX_DEPTH)
    if deep is not None:
        line, col = line_col(text, deep)
        raise JsonProblem(f"JSON nested deeper than {MAX_DEPTH} levels", line=line, col=col)
    seen_duplicate = []

    def hook(pairs):
        obj: dict = {}
        for key, value in pairs:
            if key in obj:
                seen_duplicate.append(True)
                value = _Duplicate(key)
            obj[key] = value
        return obj

    try:
        value = json.loads(text, object_pairs_hook=hook)
    except json.JSONDecodeError as err:
        raise JsonProblem(f"invalid JSON: {err.msg}", line=err.lineno, col=err.colno) from None
    except ValueError as err:  # an integer over Python's 4,300-digit conversion limit
        m = _LONG_INT.search(text)
        line, col = line_col(text, m.start()) if m else (None, None)
        raise JsonProblem(f"invalid JSON: {err}".split(";")[0], line=line, col=col) from None
    duplicates = bool(seen_duplicate)
    surrogates = _SURROGATE_ESCAPE.search(text) is not None
    if duplicates or surrogates:
        _content_problems(value, duplicates=duplicates, surrogates=surrogates)
    return value


def load_json_file(path: str | Path, what: str) -> object:
    text = read_text(path, what)
    try:
        return loads(text)
    except JsonProblem as err:
        raise InputError(err.message, err.where(str(path))) from None


class StrictYaml:
    """PyYAML loader mixin: deep nesting and a duplicate key (PyYAML keeps the last) are errors."""

    max_depth = MAX_DEPTH
    duplicate = "key {key!r} is given twice (first on line {line})"
    _depth = 0

    def compose_node(self, parent, index):
        self._depth += 1
        try:
            if self._depth > self.max_depth:
                raise yaml.composer.ComposerError(None, None, f"nested deeper than {self.max_depth} levels",
                                                  self.peek_event().start_mark)
            return super().compose_node(parent, index)
        finally:
            self._depth -= 1

    def construct_mapping(self, node, deep=False):
        seen: dict = {}
        for key_node, _ in node.value:
            key = self.construct_object(key_node, deep=deep)
            try:
                first = seen.get(key)
            except TypeError:
                continue  # an unhashable key: construct_mapping refuses it with its own message
            if first is not None:
                message = self.duplicate.format(key=key, line=first + 1)[:300]  # a key may be huge
                raise yaml.constructor.ConstructorError(None, None, message, key_node.start_mark)
            seen[key] = key_node.start_mark.line
        return super().construct_mapping(node, deep=deep)


class _StrictLoader(StrictYaml, yaml.SafeLoader):
    pass


def load_yaml_file(path: str | Path, what: str) -> object:
    text = read_text(path, what)
    try:
        return yaml.load(text, Loader=_StrictLoader)  # noqa: S506 - a SafeLoader subclass
    except yaml.YAMLError as err:
        mark = getattr(err, "problem_mark", None) or getattr(err, "context_mark", None)
        problem = getattr(err, "problem", None) or str(err)
        raise InputError(f"invalid YAML: {problem}", f"{path}:{mark.line + 1}" if mark else str(path)) from None
