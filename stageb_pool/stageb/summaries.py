"""Stage-A summary text, read by upstream's exact rules (``summary_json.py``, the obj estimate,
the BBU clean-up; docs/formats.md section 1). Never raises: what does not parse is free text."""

from __future__ import annotations

import json
import re

from .inputs import MAX_DEPTH, nesting_exceeds
from .text import brackets_outside_strings, normalize_spaces

IRRELEVANT = "无关图片"
STATION_DISTANCE = "站点距离"
STATS = "统计"
# The ingest clean-up removes this header form (comma required); the prompt a looser one.
HEADER_LINE = re.compile(r"^<DOMAIN=.*>\s*,\s*<TASK=.*>$")


def loads_or_none(text: str):
    """``json.loads`` or None: never an exception, whatever the text (nesting bounded)."""
    if nesting_exceeds(text, MAX_DEPTH) is not None:
        return None
    try:
        return json.loads(text)
    except ValueError:  # invalid JSON, or an integer over Python's 4,300-digit limit
        return None


def _object(candidate: str) -> dict | None:
    c = candidate.strip()
    if not (c.startswith("{") and c.endswith("}")):
        return None
    parsed = loads_or_none(c)
    return parsed if isinstance(parsed, dict) else None


def _is_header(line: str) -> bool:
    return line.startswith("<DOMAIN=") and "<TASK=" in line and line.endswith(">")


def strip_summary_headers(text: str) -> str:
    """The summary as the prompt shows it: lines stripped, blank and header lines dropped."""
    if not text:
        return ""
    lines = (line.strip() for line in text.splitlines() if line.strip())
    return "\n".join(line for line in lines if not _is_header(line)).strip()


def _closing(text: str, start: int) -> int | None:
    """Index of the bracket closing the one at ``start`` (only its kind counted, as upstream) or None."""
    opener = text[start]
    closer = "]" if opener == "[" else "}"
    depth = 0
    for i, ch in brackets_outside_strings(text, start):
        if ch == opener:
            depth += 1
        elif ch == closer:
            depth -= 1
            if depth == 0:
                return i
    return None


def _list_assignment(text: str, key: str) -> list | None:
    # First occurrence of "key=" then "key:" (so "分组统计=" also counts for "统计=", as upstream).
    for sep in ("=", ":"):
        pos = text.find(f"{key}{sep}")
        if pos < 0:
            continue
        bracket = text.find("[", pos + len(key) + 1)
        end = _closing(text, bracket) if bracket >= 0 else None
        span = text[bracket:end + 1] if end is not None else None
        parsed = loads_or_none(span) if span else None
        if isinstance(parsed, list):
            return parsed
    return None


def extract_summary_json(text: str) -> dict | None:
    """The JSON object with a ``统计`` key: the whole text, else each line from the last up, else
    the widest ``{...}``, else a ``统计=[...]`` assignment; None for free text."""
    stripped = strip_summary_headers(text)
    if not stripped or stripped.startswith(IRRELEVANT):
        return None
    candidates = [stripped, *reversed(stripped.split("\n"))]
    start, end = stripped.find("{"), stripped.rfind("}")
    if 0 <= start < end:
        candidates.append(stripped[start:end + 1])
    for candidate in candidates:
        obj = _object(candidate)
        if obj is not None and STATS in obj:
            return obj
    stats = _list_assignment(stripped, STATS)
    return {STATS: stats} if stats is not None else None


def summary_entries(obj: dict) -> list[dict]:
    """The object entries of ``统计`` (non-object entries and a non-list ``统计`` give none)."""
    entries = obj.get(STATS)
    return [e for e in entries if isinstance(e, dict)] if isinstance(entries, list) else []


def entry_by_category(entries: list[dict], category: str) -> dict | None:
    return next((e for e in entries if e.get("类别") == category), None)


def categories(entries: list[dict]) -> set[str]:
    """The ``类别`` names of the entries (a non-string 类别 names nothing; upstream crashed)."""
    return {e["类别"] for e in entries if isinstance(e.get("类别"), str)}


def _count(value) -> int | None:
    if isinstance(value, bool) or value is None:
        return None
    if isinstance(value, int):
        return value
    if isinstance(value, float) and value.is_integer():
        return int(value)
    if isinstance(value, str) and value.strip().isdigit():
        try:
            return int(value.strip())
        except ValueError:  # a digit that int() refuses ("²"), or over 4,300 digits
            return None
    return None


def _total(value) -> int:
    if isinstance(value, dict):
        return sum(c for c in map(_count, value.values()) if c is not None and c > 0)
    if isinstance(value, list):
        return sum(1 for item in value if item is not None)
    return 0 if value is None else 1


def _entry_objects(entry: dict) -> int:
    totals = {key: _total(value) for key, value in entry.items() if key != "类别"}
    count = max(1, max(totals.values(), default=0))
    category = entry.get("类别")
    if isinstance(category, str) and category.strip() == "标签":
        count = max(count, totals.get("文本", 0) + totals.get("可读性", 0))
    return count


def estimate_objects(summary: str) -> int:
    """Upstream's ``obj`` estimate for one photo summary (docs/formats.md section 3)."""
    summary = summary or ""
    if IRRELEVANT in summary and normalize_spaces(summary).strip() == IRRELEVANT:
        return 0
    obj = extract_summary_json(summary)
    if obj is not None:
        return sum(_entry_objects(e) for e in summary_entries(obj))
    text = normalize_spaces(summary).strip()
    segments = [s for s in text.split("，") if s.strip()]
    return len(segments) if segments else (1 if text else 0)


def canonical_summary(obj: dict) -> str:
    """One JSON line, keys 统计, 备注, 分组统计 first, separators ", " and ": "."""
    first = [k for k in (STATS, "备注", "分组统计") if k in obj]
    ordered = {k: obj[k] for k in first + [k for k in obj if k not in first]}
    return json.dumps(ordered, ensure_ascii=False, separators=(", ", ": "))


def _cut(text: str, start: int, end: int) -> str:
    """``text`` without ``[start, end)``, with one comma separator eaten (right first)."""
    left, right = text[:start].rstrip(), text[end:].lstrip()
    if right.startswith(","):
        right = right[1:].lstrip()
    elif left.endswith(","):
        left = left[:-1].rstrip()
    return left + right


def _drop_station_objects(text: str) -> str:
    """Every ``{...}`` holding ``"类别": "站点距离"`` removed (an unclosed one: to the end)."""
    needle = f'"类别": "{STATION_DISTANCE}"'
    while (hit := text.find(needle)) >= 0:
        start = text.rfind("{", 0, hit)
        if start < 0:
            return text
        end = _closing(text, start)
        text = _cut(text, start, len(text) if end is None else end + 1)
    return text


def _drop_station_keys(text: str) -> str:
    """Every ``"站点距离": <value>`` fragment removed with its leading comma (objects brace-matched)."""
    needle = f'"{STATION_DISTANCE}"'
    while (hit := text.find(needle)) >= 0:
        start = hit
        before = text[:hit].rstrip()
        if before.endswith(","):
            start = len(before) - 1
        colon = text.find(":", hit + len(needle))
        if colon < 0:
            return text
        k = colon + 1
        while k < len(text) and text[k].isspace():
            k += 1
        if k >= len(text):
            return text
        if text[k] == "{":
            end = _closing(text, k)
            end = len(text) if end is None else end + 1
        else:
            end = text.find(",", k)
            end = len(text) if end < 0 else end
        left, right = text[:start].rstrip(), text[end:].lstrip()
        text = left + (right[1:].lstrip() if right.startswith(",") else right)
    return text


def _parse_for_cleanup(text: str):
    if text.startswith("{") and text.endswith("}"):
        return loads_or_none(text)
    start, end = text.find("{"), text.rfind("}")
    if start >= 0 and end > start:
        return _object(text[start:end + 1])
    return None


def bbu_clean_summary(text: str) -> str:
    """Upstream's BBU clean-up: the station distance (an RRU concept) removed from the summary
    object (re-serialised canonically), else from the text; an irrelevant photo -> 无关图片."""
    stripped = (text or "").strip()
    if stripped.startswith(IRRELEVANT):
        return IRRELEVANT
    lines = [line for line in stripped.splitlines() if line.strip()]
    cleaned = "\n".join(line for line in lines if not HEADER_LINE.match(line.strip())).strip()
    if not cleaned:
        return ""
    obj = _parse_for_cleanup(cleaned)
    if isinstance(obj, dict) and isinstance(obj.get(STATS), list):
        obj[STATS] = [e for e in obj[STATS] if not (isinstance(e, dict) and e.get("类别") == STATION_DISTANCE)]
        if isinstance(obj.get("分组统计"), dict):
            obj["分组统计"].pop(STATION_DISTANCE, None)
        return canonical_summary(obj).replace(STATION_DISTANCE, "")
    return _drop_station_keys(_drop_station_objects(cleaned)).replace(STATION_DISTANCE, "").strip()


def is_rru_mission(mission: str) -> bool:
    """Upstream's test for the clean-up: RRU missions keep their station distances."""
    return mission.strip().startswith("RRU")
