"""``stageb-pool diff``: compare two run directories, ignoring the volatile fields and files
``artifacts.py`` names (docs/usage.md, "diff"). JSON is compared with its types (``1`` is not
``1.0``). A directory that cannot be read as a run (a FIFO, JSON nested deeper than any artifact)
is bad input: a located error, never a hang or a RecursionError.
"""

from __future__ import annotations

import itertools
import os
from pathlib import Path

import msgspec

from .. import artifacts
from ..stageb.errors import InputError
from ..stageb.inputs import MAX_DEPTH, line_col, nesting_exceeds, regular_file
from .config import join_key


def is_volatile_file(name: str) -> bool:
    """``name``: relative to the run directory."""
    entry = artifacts.by_name(name)
    return entry is not None and entry.volatile_file


# input values (at most MAX_DEPTH) plus an artifact's own levels; deeper would overflow the decoder
MAX_NESTING = 2 * MAX_DEPTH


class _Absent:
    def __repr__(self) -> str:
        return "(absent)"


ABSENT = _Absent()  # the value shown for a key or file that exists on one side only


class Difference(msgspec.Struct, frozen=True):
    """``where``: ``"line N"``, or ``""`` for a whole JSON document; ``key``: ``""`` for the whole value."""

    file: str
    where: str
    key: str
    a: object
    b: object


def _files(root: Path) -> list[str]:
    out = []
    for folder, dirs, names in os.walk(root):
        dirs.sort()
        for name in sorted(names):
            out.append(Path(folder, name).relative_to(root).as_posix())
    return out


def compare_values(a, b, *, skip: tuple[str, ...] = (), path: str = ""):
    """``(key_path, a, b)`` per difference, without ``VOLATILE_KEYS`` (any depth) and ``skip``."""
    if path in skip:
        return
    if isinstance(a, dict) and isinstance(b, dict):
        for key in list(a) + [k for k in b if k not in a]:
            if key in artifacts.VOLATILE_KEYS:
                continue
            sub = join_key(path, str(key))
            if key not in a or key not in b:
                if sub not in skip:
                    yield sub, a.get(key, ABSENT), b.get(key, ABSENT)
                continue
            yield from compare_values(a[key], b[key], skip=skip, path=sub)
    elif isinstance(a, list) and isinstance(b, list):
        for i in range(max(len(a), len(b))):
            sub = f"{path}[{i}]"
            if i >= len(a) or i >= len(b):
                yield sub, a[i] if i < len(a) else ABSENT, b[i] if i < len(b) else ABSENT
            else:
                yield from compare_values(a[i], b[i], skip=skip, path=sub)
    elif type(a) is not type(b) or a != b:
        yield path, a, b


def _decode(data: bytes, path: Path, line: int = 1):
    """``(True, value)``, or ``(False, None)`` for bytes that are not JSON; ``line``: where ``data`` starts."""
    text = data.decode("utf-8", "replace")
    deep = nesting_exceeds(text, MAX_NESTING)
    if deep is not None:
        row, col = line_col(text, deep)
        raise InputError(f"JSON nested deeper than {MAX_NESTING} levels: not an artifact of a run",
                         f"{path}:{line + row - 1}:{col}")
    try:
        return True, msgspec.json.decode(data)
    except msgspec.DecodeError:
        return False, None


def _compare_file(name: str, paths: tuple[Path, Path]):
    a, b = (_read(path) for path in paths)
    if a == b:
        return
    entry = artifacts.by_name(name)
    skip = entry.volatile if entry is not None else ()
    if name.endswith(".json"):
        ok_a, va = _decode(a, paths[0])
        ok_b, vb = _decode(b, paths[1])
        if ok_a and ok_b:
            for key, x, y in compare_values(va, vb, skip=skip):
                yield Difference(name, "", key, x, y)
            return
    yield from _compare_lines(name, (a, b), paths, skip, structured=name.endswith(".jsonl"))


def _read(path: Path) -> bytes:
    """Regular files only: a FIFO would block the diff forever."""
    try:
        return regular_file(path, "run file").read_bytes()
    except OSError as err:
        raise InputError(f"cannot read the run file: {err.strerror or err}", str(path)) from None


def _compare_lines(name: str, data: tuple[bytes, bytes], paths: tuple[Path, Path], skip, *, structured: bool):
    a, b = data
    lines_a, lines_b = a.splitlines(), b.splitlines()
    for i in range(max(len(lines_a), len(lines_b))):
        where = f"line {i + 1}"
        if i >= len(lines_a) or i >= len(lines_b):
            yield Difference(name, where, "", _text(lines_a, i), _text(lines_b, i))
            continue
        if lines_a[i] == lines_b[i]:
            continue
        if structured:
            ok_a, va = _decode(lines_a[i], paths[0], i + 1)
            ok_b, vb = _decode(lines_b[i], paths[1], i + 1)
            if ok_a and ok_b:
                for key, x, y in compare_values(va, vb, skip=skip):
                    yield Difference(name, where, key, x, y)
                continue
        yield Difference(name, where, "", _text(lines_a, i), _text(lines_b, i))
    if a != b and lines_a == lines_b:  # only line endings or the final newline differ
        yield Difference(name, "", "(bytes)", f"{len(a)} bytes", f"{len(b)} bytes")


def _text(lines: list[bytes], i: int):
    return lines[i].decode("utf-8", "replace") if i < len(lines) else ABSENT


def diff_runs(run_a: str | os.PathLike, run_b: str | os.PathLike, *, limit: int | None = 10) -> list[Difference]:
    """The first ``limit`` differences (all when ``None``); empty: identical."""
    root_a, root_b = Path(run_a), Path(run_b)
    for root in (root_a, root_b):
        if not root.is_dir():
            raise InputError("not a run directory" if root.exists() else "no such directory", str(root))
    return list(itertools.islice(_differences(root_a, root_b), limit))


def _differences(root_a: Path, root_b: Path):
    """Every difference, file by file in sorted order (lazily: diff_runs stops at its limit)."""
    set_a, set_b = set(_files(root_a)), set(_files(root_b))
    for name in sorted(n for n in set_a | set_b if not is_volatile_file(n)):
        if name not in set_b:
            yield Difference(name, "", "(file)", "present", ABSENT)
        elif name not in set_a:
            yield Difference(name, "", "(file)", ABSENT, "present")
        else:
            yield from _compare_file(name, (root_a / name, root_b / name))


def _show(value, width: int = 120) -> str:
    if value is ABSENT:
        return "(absent)"
    text = value if isinstance(value, str) else msgspec.json.encode(value).decode()
    return text if len(text) <= width else text[: width - 3] + "..."


def format_differences(differences: list[Difference], run_a: str, run_b: str) -> str:
    lines = [f"runs differ (first {len(differences)} difference{'s' if len(differences) != 1 else ''}):",
             f"  A = {run_a}", f"  B = {run_b}"]
    for d in differences:
        place = " ".join(p for p in (d.file, d.where, d.key) if p)
        lines.append(f"  {place}:\n    A: {_show(d.a)}\n    B: {_show(d.b)}")
    return "\n".join(lines)
