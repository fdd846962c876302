"""Atomic, deterministic file writes, by the parent process only. msgspec writes UTF-8 JSON,
keys in field/insertion order, shortest round-trip floats (non-finite: ``null``), so equal
values give equal bytes. Nothing is written through a link, and every file gets mode
``0666 & ~umask`` (docs/artifacts.md, "Never through a link" and "Modes").
"""

from __future__ import annotations

import os
import stat
import tempfile
from contextlib import contextmanager
from pathlib import Path

import msgspec

_encoder = msgspec.json.Encoder()
TMP_SUFFIX = ".tmp"  # temporary files are ".<name>.<random>.tmp" next to their target


class OutputError(OSError):
    """A file of the run could not be written: the OSError, with a message that names the
    file. What is on disk stays as it was (a torn append is cut back by ``--resume``)."""

    def __init__(self, path, err: OSError, action: str = "write"):
        super().__init__(err.errno, f"cannot {action} {path}: {err.strerror or err}")
        self.path = str(path)

    def __str__(self) -> str:
        return self.strerror


@contextmanager
def _located(path, action: str = "write"):
    try:
        yield
    except OutputError:
        raise
    except OSError as err:
        raise OutputError(path, err, action) from err


def file_mode() -> int:
    """``0666 & ~umask``: the mode ``open()`` gives a new file. Read from /proc (Linux): setting
    the umask to read it back would briefly change it for every thread of the process."""
    try:
        with open("/proc/self/status", "rb") as f:
            for line in f:
                if line.startswith(b"Umask:"):
                    return 0o666 & ~int(line.split()[1], 8)
    except (OSError, ValueError, IndexError):
        pass
    mask = os.umask(0o022)
    os.umask(mask)
    return 0o666 & ~mask


def atomic_write_bytes(path: str | os.PathLike, data: bytes) -> None:
    """``path`` holds either the old or the new content, never a mix: temp file, fsync,
    rename (which replaces a link rather than writing through it), fsync the directory."""
    path = Path(path)
    with _located(path):
        path.parent.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=TMP_SUFFIX, dir=path.parent)
        try:
            os.fchmod(fd, file_mode())
            with os.fdopen(fd, "wb") as f:
                f.write(data)
                f.flush()
                os.fsync(f.fileno())
            os.replace(tmp, path)
        except BaseException:
            Path(tmp).unlink(missing_ok=True)
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
    return msgspec.json.format(_encoder.encode(value), indent=2) + b"\n"


def write_json(path: str | os.PathLike, value) -> None:
    atomic_write_bytes(path, json_document(value))


def write_jsonl(path: str | os.PathLike, rows) -> None:
    atomic_write_bytes(path, _encoder.encode_lines(rows))


def append_jsonl(path: str | os.PathLike, rows) -> None:
    """Append rows (creating the file) and fsync. Not atomic: a resume cuts the file back to the
    last commit. A link is made private first and checked again once open (``O_NOFOLLOW``)."""
    path = Path(path)
    data = _encoder.encode_lines(rows)
    with _located(path):
        path.parent.mkdir(parents=True, exist_ok=True)
        make_private(path)
        fd = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT | os.O_NOFOLLOW | os.O_CLOEXEC, 0o666)
        with os.fdopen(fd, "ab") as f:
            info = os.fstat(fd)
            if not stat.S_ISREG(info.st_mode) or info.st_nlink != 1:  # linked between the check and the open
                raise OutputError(path, OSError(0, "it became a link while the run was appending to it"))
            f.write(data)
            f.flush()
            os.fsync(f.fileno())


def make_private(path: str | os.PathLike) -> bool:
    """Replace ``path``, when a symbolic link or a file with other hard links, by a regular file
    of the same bytes; whether it did. A link to anything but a regular file is refused."""
    path = Path(path)
    try:
        info = path.lstat()
    except FileNotFoundError:
        return False
    if stat.S_ISREG(info.st_mode) and info.st_nlink == 1:
        return False
    if stat.S_ISLNK(info.st_mode):
        try:
            target = path.stat()
        except FileNotFoundError:  # a dangling link: nothing to copy, a new empty file
            atomic_write_bytes(path, b"")
            return True
        if not stat.S_ISREG(target.st_mode):
            raise OutputError(path, OSError(0, "it is a symbolic link to something that is not a regular file"))
    elif not stat.S_ISREG(info.st_mode):
        raise OutputError(path, OSError(0, "it is not a regular file"))
    atomic_write_bytes(path, path.read_bytes())
    return True


def normalise_modes(root: str | os.PathLike) -> list[Path]:
    """Give every regular file under ``root`` (a run being resumed) ``file_mode()``; links and
    files whose mode cannot change are left alone. Returns the files changed."""
    mode, changed = file_mode(), []
    for folder, _dirs, names in os.walk(root):  # os.walk does not descend into linked folders
        for name in names:
            path = Path(folder, name)
            try:
                info = path.lstat()
                if stat.S_ISREG(info.st_mode) and stat.S_IMODE(info.st_mode) != mode:
                    os.chmod(path, mode)
                    changed.append(path)
            except OSError:
                continue
    return changed


def remove(path: str | os.PathLike) -> None:
    """Delete a file of the run (``unlink``: a link itself, never what it points to)."""
    with _located(path, "delete"):
        Path(path).unlink(missing_ok=True)


def read_prefix(path: str | os.PathLike, size: int) -> bytes:
    with _located(path, "read"), open(path, "rb") as f:
        return f.read(size)


def read_json(path: str | os.PathLike, type=None):
    raw = Path(path).read_bytes()
    return msgspec.json.decode(raw, type=type) if type is not None else msgspec.json.decode(raw)


def read_jsonl(path: str | os.PathLike) -> list:
    path = Path(path)
    if not path.exists():
        return []
    return [msgspec.json.decode(line) for line in path.read_bytes().splitlines() if line.strip()]
