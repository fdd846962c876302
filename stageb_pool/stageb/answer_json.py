"""Finding the JSON in a proposer's answer: upstream's candidate spans, the first that parses wins."""

from __future__ import annotations

import json
import re

from .text import brackets_outside_strings, normalize_spaces

_FENCE = re.compile(r"```(?:json)?\s*([\s\S]*?)\s*```", re.IGNORECASE)


def _balanced_span(text: str, start: int) -> str | None:
    """The bracket-balanced span opening at ``start``; None on a mismatched closer."""
    stack: list[str] = []
    for i, ch in brackets_outside_strings(text, start):
        if ch in "{[":
            stack.append(ch)
            continue
        if (stack[-1] == "{") != (ch == "}"):
            return None
        stack.pop()
        if not stack:
            return text[start:i + 1]
    return None


def _openers(text: str, limit: int) -> list[int]:
    return [i for i, ch in enumerate(text) if ch in "{["][:limit]


def json_candidates(text: str) -> list[str]:
    """Upstream's candidate spans in order: fenced blocks, balanced spans, widest spans, all."""
    raw = normalize_spaces(text or "").strip()
    spans: list[str] = []
    for m in _FENCE.finditer(raw):
        block = m.group(1).strip()
        if not block:
            continue
        found = next((s for s in (_balanced_span(block, i) for i in _openers(block, 3)) if s), None)
        spans.append(found or block)
    spans += [s for s in (_balanced_span(raw, i) for i in _openers(raw, 6)) if s]
    for open_, close in ("{}", "[]"):
        if open_ in raw and close in raw and raw.find(open_) < raw.rfind(close):
            spans.append(raw[raw.find(open_):raw.rfind(close) + 1])
    if raw[:1] + raw[-1:] in ("{}", "[]"):
        spans.append(raw)
    return list(dict.fromkeys(s.strip() for s in spans if s.strip()))


def extract_json(text: str | None) -> object:
    """The first candidate span that ``json.loads`` accepts; ValueError says why none did."""
    if not text or not text.strip():
        raise ValueError("empty response")
    spans = json_candidates(text)
    if not spans:
        raise ValueError("no JSON object or array in the response")
    last = None
    for span in spans:
        try:
            return json.loads(span)
        except ValueError as err:
            last = err
    raise ValueError(f"no valid JSON in the response ({len(spans)} candidate spans; last error: {last})")
