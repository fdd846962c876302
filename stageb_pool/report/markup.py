"""Text from a run's files as HTML: made safe to show (one rule for the page and its
charts), and the small builders of the page's elements.

A run directory may hold any text (ticket keys, model answers, a crafted file), shown as text
and never as markup: ``esc`` escapes the markup characters (in the charts, matplotlib does),
and the characters that would change how the page parses or reads are shown as visible
``\\uXXXX`` escapes: NUL (a parse error in HTML), the bidirectional embedding, override and
isolate controls (U+202A-U+202E, U+2066-U+2069: they display text in another order than it
reads) and lone surrogates (not encodable as UTF-8). Other control characters are inert in a
page and kept, so the report of a real run (a small model's answers hold DEL) keeps its bytes.
"""

from __future__ import annotations

import html
import re

SHOWN_TEXT = 160  # characters of a rule or answer shown in a table cell (the rest on hover or unfolded)
_ACTING = re.compile("[\x00\u202a-\u202e\u2066-\u2069\ud800-\udfff]")


def visible(text: str) -> str:
    """``text`` with every acting character written as its ``\\uXXXX`` escape."""
    return _ACTING.sub(lambda m: f"\\u{ord(m.group()):04x}", text)


def esc(value) -> str:
    """Any value as HTML text: markup escaped, acting characters made visible."""
    return html.escape(visible("" if value is None else str(value)))


def given(value, default):
    return default if value is None else value


def filled(record):
    """``record``, or None where it is absent or holds none of its fields (an empty ``{}``)."""
    return None if record is None or record == type(record)() else record


def num(value, digits: int = 3) -> str:
    if value is None:
        return "–"
    if isinstance(value, int):  # bool included
        return str(value)
    return f"{value:.{digits}f}" if isinstance(value, float) else esc(value)


def short(text, limit: int = SHOWN_TEXT) -> str:
    text = "" if text is None else str(text)
    if len(text) <= limit:
        return esc(text)
    return f'<span title="{esc(text)}">{esc(text[:limit])}…</span>'


def table(headers: list[str], rows: list[list[str]], classes: list[str] | None = None) -> str:
    """Cells are HTML already; a cell starting with a digit, a sign or a dash is right-aligned."""
    head = "".join(f"<th>{esc(h)}</th>" for h in headers)
    body = []
    for i, row in enumerate(rows):
        cls = f' class="{classes[i]}"' if classes and classes[i] else ""
        cells = "".join(f'<td class="n">{c}</td>' if c[:1].isdigit() or c[:1] in "-–+" else f"<td>{c}</td>"
                        for c in row)
        body.append(f"<tr{cls}>{cells}</tr>")
    return f'<div class="scroll"><table><tr>{head}</tr>{"".join(body)}</table></div>'


def cards(items: list[tuple[str, str]]) -> str:
    return '<div class="cards">' + "".join(f'<div class="card"><b>{v}</b><span>{esc(k)}</span></div>'
                                           for k, v in items) + "</div>"


def section(anchor: str, title: str, body: str) -> str:
    return f'<section id="{anchor}"><h2>{esc(title)}</h2>{body}</section>'


def verdict(ok: bool | None, yes: str = "yes", no: str = "no") -> str:
    return '<span class="muted">–</span>' if ok is None else (f'<span class="ok">{yes}</span>' if ok
                                                             else f'<span class="bad">{no}</span>')
