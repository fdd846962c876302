"""Errors about the user's input. The CLI turns them into one line and exit code 2."""

from __future__ import annotations

import re

MAX_ERROR_CHARS = 2000  # an error quoting a huge value must not flood the terminal
_LINE_BREAKING = re.compile("[\x00-\x1f\x7f-\x9f\u2028\u2029]")


class InputError(Exception):
    """``location``: ``path:line``, ``path: key.path`` or a path; ``str(err)`` is the CLI's line."""

    def __init__(self, message: str, location: str | None = None):
        super().__init__(message)
        self.message = message
        self.location = location

    def __str__(self) -> str:
        return f"{self.location}: {self.message}" if self.location else self.message


class UsageError(InputError):
    """A command-line mistake, located at its command; printed as ``stageb-pool run: error: ...``."""

    def __str__(self) -> str:
        return f"{self.location}: error: {self.message}"


def capped(text: str, limit: int = MAX_ERROR_CHARS) -> str:
    """One printable line: control characters escaped, the middle cut past ``limit`` (both ends matter)."""
    text = _LINE_BREAKING.sub(lambda m: f"\\x{ord(m.group()):02x}" if ord(m.group()) < 0x100
                              else f"\\u{ord(m.group()):04x}", text)
    if len(text) <= limit:
        return text
    tail = limit // 4
    return f"{text[:limit - tail]} ... ({len(text) - limit} characters left out) ... {text[-tail:]}"
