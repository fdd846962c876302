"""What to compute ahead for the next iteration, and when to retarget or discard it
(``runner.speculate``; the design: docs/rule_search.md, "Speculation"; the runner's side:
``rollout_speculation.py``). Speculation decides only when work starts, never what is computed.
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
        """The running iteration's gate passed a candidate: speculate ``target``, the next
        iteration under its guidance, instead (this round's work is discarded)."""
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
        """During the runner's waits: once the speculated baseline is in, submit the target's
        proposer calls."""
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
        """After an iteration: discard the previous round's unclaimed work, and this round's
        unless it speculated ``next_input``'s iteration and guidance (None: the loop stops)."""
        self.runner.discard(self._previous)
        self._previous = []
        target = self._target
        if (next_input is None or target is None or target.iteration != next_input.iteration
                or (target.guidance.hash, target.guidance.step) != (next_input.guidance.hash, next_input.guidance.step)):
            self.runner.discard(self._keys)
            self._keys, self._target, self._base = [], None, None
