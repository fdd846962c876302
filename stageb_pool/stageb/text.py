"""Text forms for comparing, ordering and scanning: nothing here changes what is stored or shown."""

from __future__ import annotations

import re
from collections.abc import Iterator

_CJK = "\u4e00-\u9fff"
_CJK_PUNCT = "，。；：！？、"
CJK_CHAR = re.compile(f"[{_CJK}]")
# Real keys carry a few digits; a longer run is refused before int() (4,300 digits raise).
MAX_INDEX_DIGITS = 18
_TRAILING_DIGITS = re.compile(r"(\d+)$")


_SPACE_RULES = [(re.compile(pattern), repl) for pattern, repl in (
    (r" +", " "),
    (rf"([{_CJK}])\s+([{_CJK}])", r"\1\2"),
    (rf"([{_CJK}])\s+([{_CJK_PUNCT}])", r"\1\2"),
    (rf"([{_CJK_PUNCT}])\s+([{_CJK}])", r"\1\2"),
    (rf"([{_CJK}])\s+([a-zA-Z]+)\s+([{_CJK}])", r"\1\2\3"),  # 挡 wind 板 -> 挡wind板
    (rf"([{_CJK}])([A-Z0-9]+)\s+([A-Z0-9]+)([{_CJK}])", r"\1\2\3\4"),  # 设备BB U设备
    (rf"^([A-Z0-9]+)\s+([A-Z0-9]+)([{_CJK}])", r"\1\2\3"),  # BB U设备
)]
_SPACE_RUN = re.compile(r" +")


def normalize_spaces(text: str) -> str:
    """Upstream's space normalisation: ASCII space runs collapsed, whitespace inside CJK text
    dropped, split tokens between CJK characters glued (the rules above), stripped."""
    if not text:
        return text
    for pattern, repl in _SPACE_RULES:
        text = pattern.sub(repl, text)
    return _SPACE_RUN.sub(" ", text.strip())


_WHITESPACE = re.compile(r"\s+")


def verdict_word_form(value: str, *, loose: bool = False) -> str:
    """Upstream's form of a verdict word (``"pass."`` stays distinct from ``"pass"``)."""
    if loose:
        return _WHITESPACE.sub("", value).lower().rstrip("。.")
    return normalize_spaces(value.strip()).strip().replace(" ", "").lower()


class IndexTooLong(ValueError):
    pass


def trailing_index(key: str) -> int | None:
    """``图片_01`` -> 1, no digits -> None; IndexTooLong past ``MAX_INDEX_DIGITS`` digits."""
    m = _TRAILING_DIGITS.search(key)
    if m is None:
        return None
    digits = m.group(1)
    if len(digits) > MAX_INDEX_DIGITS:
        raise IndexTooLong(f"{len(digits)} trailing digits (at most {MAX_INDEX_DIGITS})")
    return int(digits)


def regex_literal(text: str) -> str:
    """A literal for Python's re and llguidance's Rust regex (``re.escape`` escapes spaces: Rust refuses)."""
    return re.sub(r"([\\.^$|?*+()\[\]{}])", r"\\\1", text)


def short(text: str, limit: int = 40) -> str:
    """``text`` cut to ``limit`` characters for an error message (a key may be huge)."""
    return text if len(text) <= limit else f"{text[:limit]}…"


def brackets_outside_strings(text: str, start: int) -> Iterator[tuple[int, str]]:
    """``(index, char)`` of every bracket from ``start`` outside JSON strings, in any text."""
    in_string = escape = False
    for i in range(start, len(text)):
        ch = text[i]
        if in_string:
            if escape:
                escape = False
            elif ch == "\\":
                escape = True
            elif ch == '"':
                in_string = False
        elif ch == '"':
            in_string = True
        elif ch in "{}[]":
            yield i, ch
