"""Reading a run directory for the report: only what can be read, only as what it should be.

A report is built from whatever directory it is given, also a damaged or crafted one, so
each file is read defensively: a regular file only (a FIFO would block, /dev/zero never
ends), never through a symbolic link out of the run directory, at most ``MAX_FILE_BYTES``,
and decoded into a record (``records.py`` for what the page draws; a registered artifact it
does not draw, into its row record). A file that fails is named on the page with the line
and the reason. Nothing here raises for a file's content; a directory that is not a run is a
``ReportError``.
"""

from __future__ import annotations

import os
import stat
from pathlib import Path

import msgspec

from .. import artifacts

MAX_FILE_BYTES = 256 << 20  # far above any run's file the report reads (a 30,000-ticket audit: ~30 MB)
NEWLINE = b"\n"
OPEN_FLAGS = os.O_RDONLY | os.O_NONBLOCK | os.O_NOFOLLOW | os.O_CLOEXEC  # NONBLOCK: opening a FIFO must not wait


class ReportError(ValueError):
    """The directory cannot be reported on (it does not exist, or is not a run)."""

    def __init__(self, message: str, location: str):
        super().__init__(f"{location}: {message}")
        self.message, self.location = message, location


class Unreadable(Exception):
    """A file the report leaves out; ``where`` locates the fault ("line 3", "$.workers") or is empty."""

    def __init__(self, why: str, where: str = ""):
        super().__init__(why)
        self.why, self.where = why, where


class RunFiles:
    """A missing or unreadable file reads as None, noted in ``missing`` with what the report would draw from it."""

    def __init__(self, run_dir):
        self.root = Path(run_dir)
        if not self.root.is_dir():
            raise ReportError("not a run directory" if self.root.exists() else "no such directory", str(self.root))
        if not (self.root / artifacts.RUN.name).is_file():
            raise ReportError(f"not a stageb-pool run directory (it has no {artifacts.RUN.name})", str(self.root))
        self.real_root = os.path.realpath(self.root)
        self.missing: list[tuple[str, str]] = []
        self.read: set[str] = set()  # the names asked for

    def check_the_rest(self) -> None:
        """Decode every registered artifact with a row record that was not read yet, present
        or not: one that is there but is not of its record's shape is named in ``missing``."""
        for entry in artifacts.ARTIFACTS:
            if entry.record is not None and entry.name not in self.read:
                (self.jsonl if entry.rows else self.json)(entry.name, entry.record, None)

    def json(self, name: str, record_type, shows: str | None):
        """The document ``name`` decoded as ``record_type``, or None (noted in ``missing``)."""
        self.read.add(name)
        try:
            return _decode(msgspec.json.Decoder(record_type), self.read_bytes(name))
        except (OSError, Unreadable) as err:
            self._note(name, shows, err)
            return None

    def jsonl(self, name: str, record_type, shows: str | None) -> list | None:
        """Every row of ``name`` decoded as ``record_type`` (blank lines skipped), or None when
        the file is missing or any row is unreadable (noted in ``missing`` with its line)."""
        self.read.add(name)
        decoder = msgspec.json.Decoder(record_type)
        try:
            lines = enumerate(self.read_bytes(name).split(NEWLINE), 1)
            return [_decode(decoder, line, number) for number, line in lines if line.strip()]
        except (OSError, Unreadable) as err:
            self._note(name, shows, err)
            return None

    def read_bytes(self, name: str) -> bytes:
        """The bytes of the regular file ``name`` inside the run directory. Raises
        FileNotFoundError when there is none, Unreadable when it is something else or too large."""
        path = os.path.realpath(self.root / name)  # a link inside the run directory is followed; one out is not
        if os.path.commonpath([path, self.real_root]) != self.real_root:
            if not os.path.lexists(self.root / name):
                raise FileNotFoundError(name)
            raise Unreadable("outside the run directory, through a symbolic link")
        fd = os.open(path, OPEN_FLAGS)
        try:
            info = os.fstat(fd)
            if not stat.S_ISREG(info.st_mode):
                raise Unreadable("not a regular file")
            if info.st_size > MAX_FILE_BYTES:
                raise Unreadable(f"larger than {MAX_FILE_BYTES >> 20} MiB")
            chunks, size = [], 0
            while size <= MAX_FILE_BYTES:  # the file may grow while it is read: the cap holds anyway
                chunk = os.read(fd, min(1 << 20, MAX_FILE_BYTES + 1 - size))
                if not chunk:
                    break
                chunks.append(chunk)
                size += len(chunk)
            if size > MAX_FILE_BYTES:
                raise Unreadable(f"larger than {MAX_FILE_BYTES >> 20} MiB")
            return b"".join(chunks)
        finally:
            os.close(fd)

    def _note(self, name: str, shows: str | None, err: Exception) -> None:
        # shows=None: a file a finished run may lack (no edit accepted), named only when unreadable
        if isinstance(err, FileNotFoundError):
            if shows is not None:
                self.missing.append((name, f"missing: {shows}"))
            return
        if isinstance(err, Unreadable):
            why = f"{err.where}: {err.why}" if err.where else err.why
        else:  # permissions, a folder of that name, a name the OS refuses...
            why = err.strerror or type(err).__name__
        self.missing.append((name, f"unreadable ({why}): {shows or 'left out'}"))


def _decode(decoder: msgspec.json.Decoder, data: bytes, line: int | None = None):
    """``data`` decoded, or Unreadable located at ``line`` (a JSONL row's) or, in a whole
    document, at its syntax error's line; and at the field's path for a value of another type."""
    try:
        return decoder.decode(data)
    except msgspec.ValidationError as err:
        why, path = _split_path(str(err))
        raise Unreadable(why, ", ".join(p for p in (line and f"line {line}", path) if p)) from None
    except msgspec.DecodeError as err:
        raise Unreadable(f"not JSON ({err})", f"line {line}" if line else _line_of(data, err)) from None


def _split_path(message: str) -> tuple[str, str]:
    """msgspec's "Expected `int`, got `null` - at `$.d_acc`" as ("Expected `int`, got `null`", "$.d_acc")."""
    why, sep, path = message.rpartition(" - at ")
    return (why, path.strip("`")) if sep else (message, "")


def _line_of(data: bytes, err: msgspec.DecodeError) -> str:
    """The line of a JSON document's syntax error, where msgspec names its byte ("... (byte 41)")."""
    text = str(err)
    if "(byte " not in text:
        return ""
    try:
        offset = int(text.rsplit("(byte ", 1)[1].rstrip(")"))
    except ValueError:
        return ""
    return f"line {data.count(NEWLINE, 0, offset) + 1}"
