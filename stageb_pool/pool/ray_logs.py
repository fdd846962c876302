"""Ray's forwarded log lines go to stderr, never to stdout (the CLI's summary stream), and its
``[state-dump]`` lines are dropped: this replaces ``ray._private.worker.print_worker_logs``, where
both of Ray's printing paths end (a private name: the pinned ray version).
"""

from __future__ import annotations

import sys


def ray_logs_to_stderr():
    """Redirect Ray's forwarded logs to stderr; returns the function that undoes it."""
    from ray._private import worker

    original = worker.print_worker_logs

    def to_stderr(data, print_file=None, ignore_prefix: bool = False):
        lines = [line for line in data.get("lines", []) if "[state-dump]" not in line]
        if lines:
            original({**data, "lines": lines}, sys.stderr, ignore_prefix)

    worker.print_worker_logs = to_stderr

    def undo() -> None:
        if worker.print_worker_logs is to_stderr:
            worker.print_worker_logs = original

    return undo
