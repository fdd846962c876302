"""The next iteration computed ahead on idle workers (``runner.speculate``).

While iteration i runs, iteration i+1's train pool is known (the sampler does not depend on
what i decides) and, if i accepts nothing (the common case), so is its guidance. So idle
workers compute i+1's train baseline, then start its proposer calls; when i's gate passes
a candidate, the speculation is retargeted to the guidance that candidate makes. The runner
claims speculative work when i+1 submits the same work (``rollout_speculation``); what is
not claimed is discarded. Speculation decides only when work starts, never what is computed.
"""

from __future__ import annotations

from ..stageb import proposer
from .iteration import IterationInput, baseline_spec, proposer_requests
from .settings import SearchSettings


class Speculation:
    """One round of speculation at a time (the iteration after the running one), plus the
    previous round until the iteration it was for has claimed what it could."""

    def __init__(self, runner, settings: SearchSettings, *, enabled: bool):
        self.runner, self.settings, self.enabled = runner, settings, enabled
        self._target: IterationInput | None = None  # the iteration speculated
        self._base = None  # its train baseline, submitted speculatively
        self._chats_sent = False
        self._keys: list[str] = []  # this round's speculative work
        self._previous: list[str] = []  # the previous round's, until its iteration has run

    def ahead(self, target: IterationInput | None) -> None:
        """Before an iteration runs: speculate ``target``, the iteration after it as it
        will be if nothing is accepted (None: none will run then, nothing to do)."""
        self._previous, self._keys = self._keys, []
        self._start(target)

    def retarget(self, target: IterationInput | None) -> None:
        """The running iteration's gate passed a candidate: the next iteration most likely
        starts from its guidance; speculate that one instead (what this round speculated
        under the old guidance is discarded)."""
        self.runner.discard(self._keys)
        self._keys = []
        self._start(target)

    def _start(self, target: IterationInput | None) -> None:
        self._target, self._base, self._chats_sent = None, None, False
        if not self.enabled or target is None:
            return
        self._target = target
        self._base = self.runner.speculate(baseline_spec(target, self.settings))
        self._keys = [part.key for part in self._base.parts]
        self.runner.on_progress = self._poll

    def _poll(self) -> None:
        """Called by the runner during its waits: once the speculated baseline is in, the
        target's proposer calls are submitted, built as the iteration will build them."""
        if self._target is None or self._chats_sent:
            return
        base = self.runner.peek(self._base)
        if base is None:
            return
        self._chats_sent = True
        target, rs = self._target, self.settings.rule_search
        examples = proposer.select_examples(base.stats, {t.key: t for t in target.pool}, rs.reflect_size)
        for request in proposer_requests(target, self.settings, self.runner.profile, examples):
            self._keys.append(self.runner.speculate_chat(request))

    def settle(self, next_input: IterationInput | None) -> None:
        """After an iteration: the previous round's unclaimed work is discarded, and this
        round's too unless it speculated ``next_input`` (None: the loop stops) as it is:
        the same iteration and guidance (the pool always is)."""
        self.runner.discard(self._previous)
        self._previous = []
        target = self._target
        if (next_input is None or target is None or target.iteration != next_input.iteration
                or (target.guidance.hash, target.guidance.step) != (next_input.guidance.hash, next_input.guidance.step)):
            self.runner.discard(self._keys)
            self._keys, self._target, self._base = [], None, None
