"""Process listings from /proc, for tests that check no process is left behind."""

from __future__ import annotations

from pathlib import Path


def _stat(pid: int) -> list[str] | None:
    """The fields of /proc/PID/stat after the command name (state first, then ppid)."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    except OSError:
        return None


def gone(pid: int) -> bool:
    """The process no longer exists (or is a zombie waiting for its parent)."""
    fields = _stat(pid)
    return fields is None or fields[0] == "Z"


def descendants(pid: int) -> list[int]:
    """Pids of every living process below ``pid``."""
    parents = {}
    for entry in Path("/proc").iterdir():
        fields = _stat(int(entry.name)) if entry.name.isdigit() else None
        if fields is not None and fields[0] != "Z":
            parents[int(entry.name)] = int(fields[1])
    found, frontier = [], [pid]
    while frontier:
        current = frontier.pop()
        children = [c for c, parent in parents.items() if parent == current]
        found += children
        frontier += children
    return found


def parent_pid(pid: int) -> int:
    """The parent of a living process (e.g. the pool's zygote, from a worker's pid)."""
    return int(_stat(pid)[1])
