"""Atomic, deterministic file writes. Only the parent process calls these.

JSON is written by msgspec: UTF-8 (no ASCII escaping), keys in field/insertion order,
floats in shortest round-trip form, so equal values always give equal bytes. Non-finite
floats become ``null`` (upstream wrote the non-standard token ``Infinity``).
"""

from __future__ import annotations

import os
import tempfile
from pathlib import Path

import msgspec

_encoder = msgspec.json.Encoder()


def to_json(value, *, indent: int = 0) -> bytes:
    data = _encoder.encode(value)
    return msgspec.json.format(data, indent=indent) if indent else data


def atomic_write_bytes(path: str | os.PathLike, data: bytes) -> None:
    """Write ``data`` so that ``path`` holds either the old or the new content, never a mix:
    temp file in the same directory, fsync, rename, fsync the directory."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        try:
            os.unlink(tmp)
        except FileNotFoundError:
            pass
        raise
    _fsync_dir(path.parent)


def _fsync_dir(directory: Path) -> None:
    fd = os.open(directory, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def json_document(value) -> bytes:
    """The bytes ``write_json`` writes: pretty-printed (indent 2), a trailing newline."""
    return to_json(value, indent=2) + b"\n"


def write_json(path: str | os.PathLike, value) -> None:
    """Pretty-printed (indent 2) JSON document with a trailing newline, written atomically."""
    atomic_write_bytes(path, json_document(value))


def write_jsonl(path: str | os.PathLike, rows) -> None:
    """A whole JSONL file, one compact row per line, written atomically."""
    atomic_write_bytes(path, b"".join(to_json(r) + b"\n" for r in rows))


def append_jsonl(path: str | os.PathLike, rows) -> None:
    """Append rows to a JSONL file (created if missing) and fsync.

    Appends are not atomic as a whole; a resumed run truncates such files back to the
    last completed iteration (see ``search``), so a torn last line never survives.
    """
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    data = b"".join(to_json(r) + b"\n" for r in rows)
    with open(path, "ab") as f:
        f.write(data)
        f.flush()
        os.fsync(f.fileno())


def read_json(path: str | os.PathLike, type=None):
    raw = Path(path).read_bytes()
    return msgspec.json.decode(raw, type=type) if type is not None else msgspec.json.decode(raw)


def read_jsonl(path: str | os.PathLike) -> list:
    path = Path(path)
    if not path.exists():
        return []
    return [msgspec.json.decode(line) for line in path.read_bytes().splitlines() if line.strip()]
