"""SIGTERM and SIGHUP to a run: raised as ``Terminated`` where the run was, as Ctrl-C is,
for a run's life only (an in-process caller of ``cli.main`` gets its own handlers back)."""

from __future__ import annotations

import contextlib
import signal

STOP_SIGNALS = (signal.SIGTERM, signal.SIGHUP)


class Terminated(KeyboardInterrupt):
    """SIGTERM or SIGHUP to the main process, raised where the run was so that every
    ``finally`` on the way out runs.

    A KeyboardInterrupt, because Ray's blocking calls pass on only a KeyboardInterrupt raised
    by a signal handler (any other exception is lost and the run goes on). Ray then raises one
    of its own, so the signal is also kept in ``received`` for ``main`` to name."""

    received: int | None = None  # the stop signal of this process's run, once one came

    def __init__(self, signum: int):
        super().__init__(signum)
        self.signum = signum


def _raise_terminated(signum, frame):
    # A second signal while the pool closes would abort the close and leave workers behind
    # for a moment; the close is bounded (seconds), so later ones are ignored (SIGKILL still works).
    for sig in STOP_SIGNALS:
        signal.signal(sig, signal.SIG_IGN)
    Terminated.received = signum
    raise Terminated(signum)


@contextlib.contextmanager
def stop_signals_raise_terminated():
    """SIGTERM and SIGHUP raise ``Terminated`` in this process until the block ends; the
    handlers before it are put back after."""
    Terminated.received = None
    previous = {sig: signal.signal(sig, _raise_terminated) for sig in STOP_SIGNALS}
    try:
        yield
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)
