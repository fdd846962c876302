"""Rollout progress on stderr: a tqdm bar on a terminal, a periodic log line otherwise.
``advance`` is on the parent's hot path: it only adds and compares numbers.
"""

from __future__ import annotations

import logging
import sys
import time

import tqdm

# tqdm's monitor is a thread, which would make the parent's later forks (a replaced worker) unsafe
tqdm.tqdm.monitor_interval = 0


class Progress:
    """One gather at a time. ``stats_fn``: the pool's items per rank (a list or {rank: n}).
    Without a terminal, a line every ``interval_s`` seconds or ``every_chunks`` chunks."""

    def __init__(self, *, stream=None, tty: bool | None = None, log: logging.Logger | None = None,
                 stats_fn=None, interval_s: float = 10.0, every_chunks: int = 200):
        self.stream = stream if stream is not None else sys.stderr
        self.tty = _isatty(self.stream) if tty is None else tty
        self.log = log or logging.getLogger("stageb_pool.progress")
        self.stats_fn = stats_fn
        self.interval_s = interval_s
        self.every_chunks = every_chunks
        self._bar = None
        self._label = ""
        self._total = self._done = self._chunks = 0
        self._logged = -1
        self._t0 = self._last = 0.0
        self._base = {}

    def start(self, label: str, total: int) -> None:
        self._label, self._total, self._done, self._chunks = label, total, 0, 0
        self._logged = -1
        self._t0 = self._last = time.monotonic()
        self._base = self._per_rank()
        if total and self.tty:
            self._bar = tqdm.tqdm(total=total, desc=label, unit="ticket", file=self.stream,
                                  dynamic_ncols=True, mininterval=0.2, leave=False)

    def advance(self, tickets: int) -> None:
        self._done += tickets
        self._chunks += 1
        now = time.monotonic()
        if self._bar is not None:
            self._bar.update(tickets)
            if now - self._last >= 1.0:
                self._last = now
                share = self._share_text()
                if share:
                    self._bar.set_postfix_str(share, refresh=False)
        elif now - self._last >= self.interval_s or self._chunks % self.every_chunks == 0:
            self._last = now
            self._logged = self._done
            self.log.info(self.line())

    def finish(self) -> None:
        if self._bar is not None:
            self._bar.close()
            self._bar = None
        if self._total and self._logged != self._done:  # the last periodic line may be the final one
            self.log.info(self.line())
        self._total = 0

    def line(self) -> str:
        """``audit: 120/512 tickets (23%), 4.1 tickets/s, ETA 96 s, workers 0:50% 1:50%``"""
        elapsed = max(time.monotonic() - self._t0, 1e-9)
        rate = self._done / elapsed
        pct = 100.0 * self._done / self._total if self._total else 100.0
        text = f"{self._label}: {self._done}/{self._total} tickets ({pct:.0f}%), {rate:.1f} tickets/s"
        if self._done < self._total and rate > 0:
            text += f", ETA {(self._total - self._done) / rate:.0f} s"
        else:
            text += f", {elapsed:.1f} s"
        share = self._share_text()
        return f"{text}, workers {share}" if share else text

    def _per_rank(self) -> dict:
        if self.stats_fn is None:
            return {}
        try:
            counts = self.stats_fn()
        except Exception:  # progress display must never break a run
            return {}
        if isinstance(counts, dict):
            return {int(k): v for k, v in counts.items()}
        return dict(enumerate(counts or ()))

    def _share_text(self) -> str:
        now = self._per_rank()
        delta = {r: n - self._base.get(r, 0) for r, n in now.items()}
        total = sum(delta.values())
        if len(delta) < 2 or total <= 0:
            return ""
        return " ".join(f"{r}:{100 * n / total:.0f}%" for r, n in sorted(delta.items()))


def pool_items_per_rank(pool):
    return lambda: pool.stats.items


def _isatty(stream) -> bool:
    try:
        return stream.isatty()
    except (AttributeError, ValueError):
        return False
