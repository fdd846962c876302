"""SIGTERM and SIGHUP to a run: raised as ``Terminated`` where the run was, as Ctrl-C is."""

from __future__ import annotations

import contextlib
import signal

STOP_SIGNALS = (signal.SIGTERM, signal.SIGHUP)


class Terminated(KeyboardInterrupt):
    """Raised so that every ``finally`` on the way out runs. A KeyboardInterrupt, because Ray's
    blocking calls pass on only that (any other exception is lost and the run goes on); Ray
    raises one of its own, so the signal is also kept in ``received`` for ``main`` to name."""

    received: int | None = None  # the stop signal of this process's run, once one came

    def __init__(self, signum: int):
        super().__init__(signum)
        self.signum = signum


def _raise_terminated(signum, frame):
    # a second signal would abort the (bounded) close and leave workers behind: ignored
    for sig in STOP_SIGNALS:
        signal.signal(sig, signal.SIG_IGN)
    Terminated.received = signum
    raise Terminated(signum)


@contextlib.contextmanager
def stop_signals_raise_terminated():
    """Until the block ends; then the handlers before it are put back (``cli.main`` in-process)."""
    Terminated.received = None
    previous = {sig: signal.signal(sig, _raise_terminated) for sig in STOP_SIGNALS}
    try:
        yield
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)
