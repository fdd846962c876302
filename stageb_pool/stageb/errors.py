"""Errors about the user's input. The CLI turns them into one line and exit code 2."""

from __future__ import annotations


class InputError(Exception):
    """Bad input (config, tickets, guidance, prompt profile, arguments), with its location.

    ``location`` is ``"path:line"`` for line-oriented files, ``"path: key.path"`` for
    structured files, or just a path. ``str(err)`` is the one line the CLI prints.
    """

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
