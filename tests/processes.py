"""Process listings from /proc, for tests that check no process is left behind; and the CPU
affinity a layout comparison pins one side to."""

from __future__ import annotations

import contextlib
import os
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


@contextlib.contextmanager
def pinned(cores):
    """This process allowed only ``cores`` (as ``taskset -c`` would), and with it every process
    it forks meanwhile (a pool's zygote and workers inherit the mask); restored after."""
    before = os.sched_getaffinity(0)
    os.sched_setaffinity(0, cores)
    try:
        yield
    finally:
        os.sched_setaffinity(0, before)


# The cores this process may use, and the first alone: the two sides of a layout comparison.
CORES = sorted(os.sched_getaffinity(0))
ONE_CORE = CORES[:1]
