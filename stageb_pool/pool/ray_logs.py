"""Ray's forwarded log lines go to stderr, never to stdout (the CLI's summary stream).

With ``log_to_driver`` Ray prints, in this process, every line its actors and raylets write:
actor output and raylet notices (``(raylet) A worker died ...``, about 20 ``[state-dump]``
lines on a node loss, "marked dead" notices) go to **stdout** unless the line came from a
stderr stream. Both of Ray's printing paths (the log subscriber's handler and the error
listener) end in ``ray._private.worker.print_worker_logs(data, file)``; replacing that
function (a private name, hence the pinned ray version) sends every line to stderr and
drops the ``[state-dump]`` lines, which describe Ray's internals, not the run.
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
