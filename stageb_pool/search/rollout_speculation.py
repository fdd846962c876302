"""The rollout runner's speculative submissions (``RolloutRunner`` inherits them; what to
speculate: ``speculation.py``). A later ``submit`` or ``submit_chat`` of the same work claims a
speculative task and counts it as generated there, so only the wall time depends on it.
"""

from __future__ import annotations

import msgspec

from ..engine.records import ChatRequest, ChatResult
from ..stageb.hashing import content_hash


class SpeculativeSubmissions:
    """The runner's speculative half: it uses the runner's ``pool``, ``submit``, ``_cache``,
    ``_inflight``, ``_credit`` and ``_build``, and keeps ``_speculative`` for ``submit`` to claim from."""

    def _start_speculation(self) -> None:
        self._speculative: dict[str, object] = {}  # cache key -> speculative pool task, not yet claimed
        self._discarded: list = []  # speculative tasks dropped unclaimed: their worker time was wasted
        self._speculating = False  # inside speculate(): a speculation claims nothing
        self.speculation_used = 0  # speculative tasks a submit claimed after they had started: work done ahead
        self.speculation_unstarted = 0  # claimed before any worker took them: nothing gained, nothing lost
        self.speculation_tasks = 0  # speculative tasks submitted

    def speculate(self, spec):
        """Submit ``spec``'s chunks that are neither cached nor in flight as speculative
        tasks; a pending for ``peek`` and ``discard``, never for ``wait``."""
        self._speculating = True  # a speculation claims nothing: the next real submit does
        try:
            with self.pool.speculation():
                pending = self.submit(spec)
        finally:
            self._speculating = False
        pending.done = True  # not to be waited for: a submit of the same spec claims it
        own = [part.key for part in pending.parts if part.owner]
        self._speculative.update((key, self._inflight[key]) for key in own)
        self.speculation_tasks += len(own)
        return pending

    def speculate_chat(self, request: ChatRequest) -> str:
        """Submit a proposer call as a speculative task; returns its key (for ``discard``)."""
        key = chat_key(request)
        if key not in self._speculative:
            with self.pool.speculation():
                self._speculative[key] = self.pool.submit("chat", request, result_type=ChatResult,
                                                          label="proposer")
            self.speculation_tasks += 1
        return key

    def peek(self, pending):
        """The speculated rollout's result once every chunk is cached or a finished speculative
        task (its result enters the cache, still unclaimed), else None. Never waits or counts."""
        done = {}
        for part in pending.parts:
            if part.key in self._cache:
                continue
            task = self._speculative.get(part.key)
            if task is None or not task.done() or task.exception() is not None:
                return None
            done[part.key] = task
        for key, task in done.items():
            self._cache[key] = task.result()
            self._inflight.pop(key, None)
            self._credit(task, len(task.result().tickets))
        return self._build(pending)[0]

    def discard(self, keys) -> None:
        """Drop the unclaimed speculative work of ``keys``: a queued task never runs, a result
        leaves the cache (a later submit generates it as if never speculated)."""
        for key in keys:
            task = self._speculative.pop(key, None)
            if task is None:  # claimed, or never speculated
                continue
            if self._inflight.get(key) is task:
                del self._inflight[key]
            else:
                self._cache.pop(key, None)  # peeked; chat keys are in neither
            if not task.done():
                self.pool.cancel([task])
            self._discarded.append(task)

    def speculation_summary(self) -> dict:
        """``summary.json`` ``timing.speculation`` (docs/artifacts.md); volatile."""
        return {"tasks": self.speculation_tasks, "used": self.speculation_used,
                "claimed_unstarted": self.speculation_unstarted,
                "discarded": len(self._discarded) + len(self._speculative),
                "hit_rate": round(self.speculation_used / self.speculation_tasks, 3) if self.speculation_tasks else None,
                "wasted_worker_s": round(sum(t.busy_s for t in [*self._discarded, *self._speculative.values()]), 3)}

    def _claim(self, parts: list, label: str) -> list:
        """Claim the parts whose chunk was speculated: counted as generated here, as without
        speculation, and named after this rollout in the timeline unless it ran already."""
        for part in parts:
            task = None if self._speculating else self._speculative.pop(part.key, None)
            if task is not None:
                part.owner, task.label = True, label
                self._count_claim(task)
        return parts

    def _count_claim(self, task) -> None:
        if task.ran_on is None:
            self.speculation_unstarted += 1
        else:
            self.speculation_used += 1


def chat_key(request: ChatRequest) -> str:
    """A proposer call's identity: its whole request (prompt, decode, seed key, schema)."""
    return content_hash(["chat", msgspec.to_builtins(request)])
