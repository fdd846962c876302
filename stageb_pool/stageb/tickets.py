"""Stage-A ticket files (upstream 1.2; docs/formats.md section 1): one JSON object per line,
each a ``Ticket`` keyed ``"{group_id}::{label}"``; every problem located at ``path:line``."""

from __future__ import annotations

import json
from collections import Counter
from collections.abc import Iterable
from datetime import datetime
from pathlib import Path

import msgspec

from . import inputs
from .errors import InputError
from .summaries import bbu_clean_summary, is_rru_mission
from .text import IndexTooLong, short, trailing_index

LABELS = ("pass", "fail")
_TYPE_NAMES = {dict: "object", list: "array", str: "string", int: "integer", float: "number", bool: "boolean", type(None): "null"}


class TicketText(msgspec.Struct, frozen=True):
    """What a worker needs of a ticket to render its prompt. The label never leaves the parent."""

    key: str
    mission: str
    per_image: dict[str, str]


class Ticket(msgspec.Struct, frozen=True):
    """One photo group with its reviewer label. ``per_image`` keys are ``image_1..image_n``."""

    key: str
    group_id: str
    mission: str
    label: str  # "pass" | "fail"
    per_image: dict[str, str]
    label_source: str = "human"
    label_timestamp: str | None = None

    def text(self) -> TicketText:
        return TicketText(self.key, self.mission, self.per_image)


class IngestReport(msgspec.Struct):
    tickets: list[Ticket]
    skipped: list[dict] = []  # {"location": "path:line", "error": "..."}
    excluded: int = 0
    # field -> how many values were converted to text, or ignored for their type
    converted: dict[str, int] = {}
    ignored: dict[str, int] = {}


class _BadLine(Exception):
    pass


class _UnreadableLine(_BadLine):
    """A line no record should look like (JSON nested too deep): an error in both modes."""


def _type_name(value) -> str:
    return _TYPE_NAMES.get(type(value), type(value).__name__)


def _unwrap(value: str) -> str:
    # Some writers JSON-encode a summary twice (upstream kept the quotes: nothing could read it).
    if value.strip().startswith('"'):
        try:
            inner = json.loads(value)
        except ValueError:
            return value
        if isinstance(inner, str):
            return inner
    return value


def _bbu_cleaned(mission: str, per_image: dict[str, str]) -> dict[str, str]:
    if is_rru_mission(mission):
        return per_image
    return {k: bbu_clean_summary(v) for k, v in per_image.items()}


def _summary_text(value) -> str:
    # Upstream str()-ed it (a Python repr); JSON text stays readable by the summary parser.
    return value if isinstance(value, str) else json.dumps(value, ensure_ascii=False, separators=(",", ":"))


def normalize_per_image(per_image: dict, notes: list[str] | None = None) -> dict[str, str]:
    """Keys -> ``image_{n}`` by trailing integer (none: 1-based position), sorted; values as text."""
    by_index: dict[int, tuple[str, str]] = {}
    for position, (key, value) in enumerate(per_image.items(), start=1):
        try:
            n = trailing_index(key)
        except IndexTooLong as err:
            raise _BadLine(f"per_image key {short(key)!r}: {err}") from None
        n = position if n is None else n
        if n in by_index:
            raise _BadLine(f"per_image keys {by_index[n][0]!r} and {key!r} both map to image_{n}")
        if type(value) is not str and notes is not None:
            notes.append("converted per_image")
        by_index[n] = (key, _unwrap(_summary_text(value)))
    return {f"image_{n}": by_index[n][1] for n in sorted(by_index)}


def _field(record: dict, name: str):
    if name not in record:
        raise _BadLine(f"missing field {name!r}")
    return record[name]


def _text_field(record: dict, name: str) -> str:
    value = _field(record, name)
    if not isinstance(value, str):
        raise _BadLine(f"field {name!r} must be a string, got {_type_name(value)}")
    if not value.strip():
        raise _BadLine(f"field {name!r} is empty")
    return value


def _group_id(record: dict, notes: list[str]) -> str:
    value = _field(record, "group_id")
    if type(value) is int:  # upstream str()-ed it: 15502 -> "15502"
        notes.append("converted group_id")
        return str(value)
    if not isinstance(value, str):
        raise _BadLine(f"field 'group_id' must be a string or an integer, got {_type_name(value)}")
    return value  # verbatim, empty allowed (upstream's key "::fail")


def _optional_text(record: dict, name: str, notes: list[str]) -> str | None:
    value = record.get(name)
    if value is not None and not isinstance(value, str):
        notes.append(f"ignored {name}")  # upstream ignored a non-string value
        return None
    return value


def _timestamp(value: str | None) -> str | None:
    # Upstream parsed with datetime.fromisoformat and kept None when that failed.
    if not value:
        return None
    try:
        datetime.fromisoformat(value)
    except ValueError:
        return None
    return value


def _decode_record(line: str) -> dict:
    try:
        record = inputs.loads(line)
    except inputs.JsonProblem as err:
        detail = f" (column {err.col})" if err.col else (f" at {err.keypath}" if err.keypath else "")
        kind = _UnreadableLine if "nested deeper" in err.message else _BadLine
        raise kind(err.message + detail) from None
    if not isinstance(record, dict):
        raise _BadLine(f"expected a JSON object, got {_type_name(record)}")
    return record


def _parse_record(record: dict, bbu_cleanup: bool) -> tuple[Ticket, list[str]]:
    notes: list[str] = []
    mission = _text_field(record, "mission")
    if "\x00" in mission:
        raise _BadLine("field 'mission' contains a NUL character")
    group_id = _group_id(record, notes)
    label = _text_field(record, "label").strip().lower()
    if label not in LABELS:
        raise _BadLine(f"label must be 'pass' or 'fail', got {record['label']!r}")
    per_image = _field(record, "per_image")
    if not isinstance(per_image, dict):
        raise _BadLine(f"field 'per_image' must be an object, got {_type_name(per_image)}")
    if not per_image:
        raise _BadLine("field 'per_image' is empty")
    summaries = normalize_per_image(per_image, notes)
    if bbu_cleanup:
        summaries = _bbu_cleaned(mission, summaries)
    source = _optional_text(record, "label_source", notes)
    ticket = Ticket(
        key=f"{group_id}::{label}",
        group_id=group_id,
        mission=mission,
        label=label,
        per_image=summaries,
        label_source=source.strip() if source and source.strip() else "human",
        label_timestamp=_timestamp(_optional_text(record, "label_timestamp", notes)),
    )
    return ticket, notes


def parse_ticket_line(line: str, *, bbu_cleanup: bool = False) -> Ticket:
    """One JSONL line -> Ticket; raises ``_BadLine`` with what is wrong."""
    return _parse_record(_decode_record(line), bbu_cleanup)[0]


MAX_LINE_BYTES = 1 << 20  # ingest.max_line_bytes' default: a real ticket is a few kB
_BLOCK = 1 << 20  # the rest of an over-long line is read past in blocks of this size


def _read_lines(path: Path, max_line_bytes: int = MAX_LINE_BYTES) -> Iterable[tuple[int, str | int | None]]:
    """(number, text) per non-blank line; text None if not UTF-8, the byte length if over the limit."""
    path = inputs.regular_file(path, "ticket file")
    try:
        with open(path, "rb") as f:
            if f.read(len(inputs.BOM)) != inputs.BOM:  # a leading byte-order mark is not text
                f.seek(0)
            number = 0
            while True:
                # +2: room for the "\r\n" of a line exactly at the limit
                chunk = f.readline(max_line_bytes + 2)
                if not chunk:
                    return
                number += 1
                if not chunk.endswith(b"\n") and len(chunk) >= max_line_bytes + 2:
                    size, tail = len(chunk), chunk[-2:]
                    while more := f.readline(_BLOCK):
                        size, tail = size + len(more), (tail + more)[-2:]
                        if more.endswith(b"\n"):
                            break
                    # The length reported is the line's text, without its line end.
                    ending = (2 if tail == b"\r\n" else 1) if tail.endswith(b"\n") else 0
                    yield number, size - ending
                    continue
                body = (chunk[:-1] if chunk.endswith(b"\n") else chunk).rstrip(b"\r")
                if len(body) > max_line_bytes:
                    yield number, len(body)
                elif body.strip():
                    try:
                        yield number, body.decode("utf-8")
                    except UnicodeDecodeError:
                        yield number, None
    except OSError as err:
        raise InputError(f"cannot read the ticket file: {err.strerror or err}", str(path)) from None


def _check_one_mission(tickets: list[Ticket], where: dict[str, str]) -> None:
    counts: dict[str, int] = {}
    first: dict[str, str] = {}
    for t in tickets:
        counts[t.mission] = counts.get(t.mission, 0) + 1
        first.setdefault(t.mission, where[t.key])
    if len(counts) > 1:
        listing = ", ".join(f"{m!r} ({c} tickets, first at {first[m]})" for m, c in counts.items())
        raise InputError(f"tickets hold {len(counts)} missions, a run takes one: {listing}")


def load_tickets(
    paths: str | Path | Iterable[str | Path],
    *,
    on_bad_line: str = "error",
    exclude_keys: frozenset[str] | set[str] = frozenset(),
    bbu_cleanup: bool = False,
    max_line_bytes: int = MAX_LINE_BYTES,
) -> IngestReport:
    """Tickets in file order; ``on_bad_line="skip"`` records bad lines in ``skipped``. Missing
    files, no tickets, duplicate keys and more than one mission always raise."""
    if on_bad_line not in ("error", "skip"):
        raise InputError(f"on_bad_line must be 'error' or 'skip', got {on_bad_line!r}", "ingest.on_bad_line")
    path_list = [Path(paths)] if isinstance(paths, (str, Path)) else [Path(p) for p in paths]
    if not path_list:
        raise InputError("no ticket files given", "stage_a_paths")
    tickets: list[Ticket] = []
    skipped: list[dict] = []
    where: dict[str, str] = {}
    excluded = 0
    notes: Counter = Counter()
    for path in path_list:
        for number, line in _read_lines(path, max_line_bytes):
            location = f"{path}:{number}"
            try:
                if line is None:
                    raise _BadLine("not valid UTF-8")
                if isinstance(line, int):
                    raise _BadLine(f"a line of {line} bytes, over ingest.max_line_bytes ({max_line_bytes})")
                ticket, line_notes = _parse_record(_decode_record(line), bbu_cleanup)
            except _BadLine as exc:
                if on_bad_line == "error" or isinstance(exc, _UnreadableLine):
                    raise InputError(str(exc), location) from None
                skipped.append({"location": location, "error": str(exc)})
                continue
            if ticket.key in exclude_keys:
                excluded += 1
                continue
            if ticket.key in where:
                raise InputError(f"duplicate ticket key {ticket.key!r} (first at {where[ticket.key]})", location)
            where[ticket.key] = location
            tickets.append(ticket)
            notes.update(line_notes)
    if not tickets:
        detail = f" ({excluded} excluded, {len(skipped)} bad lines skipped)" if excluded or skipped else ""
        raise InputError(f"no tickets{detail}", ", ".join(map(str, path_list)))
    _check_one_mission(tickets, where)
    return IngestReport(tickets=tickets, skipped=skipped, excluded=excluded,
                        converted=_counts(notes, "converted "), ignored=_counts(notes, "ignored "))


def _counts(notes: Counter, prefix: str) -> dict[str, int]:
    return {k[len(prefix):]: v for k, v in sorted(notes.items()) if k.startswith(prefix)}


def load_exclusions(keys: Iterable[str] | None, path: str | Path | None) -> frozenset[str]:
    """Inline keys plus the lines of ``path`` (``#`` comments ignored); a missing file raises."""
    result = {k.strip() for k in (keys or ()) if k.strip()}
    if path is not None:
        for line in inputs.read_text(path, "exclusion list").splitlines():
            line = line.strip()
            if line and not line.startswith("#"):
                result.add(line)
    return frozenset(result)


def bbu_clean_tickets(tickets: list[Ticket]) -> list[Ticket]:
    """``bbu_cleanup`` applied after loading (the profile is known once the mission is)."""
    return [msgspec.structs.replace(t, per_image=_bbu_cleaned(t.mission, t.per_image)) for t in tickets]
