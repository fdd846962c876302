"""SIGTERM and SIGHUP to a run: raised as ``Terminated`` where the run was, as Ctrl-C is.

The CLI installs the handlers for a run's life only (``stop_signals_raise_terminated``), so a
caller of ``cli.main`` in-process gets its own handlers back; ``cli.main`` turns the exception
into the exit status 128 + signal and the resume line.
"""

from __future__ import annotations

import contextlib
import signal

STOP_SIGNALS = (signal.SIGTERM, signal.SIGHUP)


class Terminated(KeyboardInterrupt):
    """SIGTERM or SIGHUP to the main process. Raised where the run was (as Ctrl-C's
    KeyboardInterrupt is, so no ``except Exception`` catches it) so that every ``finally`` on
    the way out runs: the pool stops and reaps its workers, nothing is left half-written.

    A KeyboardInterrupt, because Ray's blocking calls (``ray.wait`` under ``--ray``) pass on
    only a KeyboardInterrupt raised by a signal handler: any other exception is lost there and
    the run goes on (measured: a SIGHUP'd ``--ray local`` run did not exit). Ray then raises a
    KeyboardInterrupt of its own, so the signal is also kept in ``received`` for ``main`` to
    name."""

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
