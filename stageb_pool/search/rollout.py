"""The parent-side rollout runner: tickets -> chunks -> pool -> per-ticket verdict statistics.

See docs/architecture.md and docs/rule_search.md ("The rollout runner caches..."). Contracts:
chunks of ``chunk_size`` in canonical ticket order, independent of the worker count, so the
generation seeds ``(seed_key, chunk_index, decode, sample)`` are too; ``wait`` drives ONE
``pool.gather`` over all pending rollouts, chat and verdict-probability chunks (so they share
the GPUs) and assembles results in ticket order; a chunk result is cached by content hash and
never generated twice within a run; speculative work is claimed by the submit of the same work.
"""

from __future__ import annotations

import logging
import time
from collections import Counter

import msgspec

from ..engine.records import (ChatRequest, ChatResult, ChunkResult, SamplerConfig, TicketRollout,
                              TicketVerdictProbability, VerdictChunk, VerdictChunkResult)
from ..pool import Pool, TaskHandle, WorkerError
from ..stageb import verdicts
from ..stageb.guidance import Guidance
from ..stageb.hashing import canonical_json, content_hash
from ..stageb.prompts import PromptProfile
from ..stageb.text import short
from ..stageb.tickets import Ticket
from ..stageb.verdicts import TicketStats
from .chunk_cost import chunk_cost, guidance_chars
from .chunk_items import ChunkItems
from .rollout_speculation import SpeculativeSubmissions, chat_key

log = logging.getLogger("stageb_pool")
DROPS_SHOWN = 5  # dropped tickets named in the warning of a rollout phase


class RolloutSpec(msgspec.Struct, frozen=True):
    """One rollout: ``tickets`` (canonical order) under ``guidance`` with ``sampler``.

    ``seed_key`` names the ticket pool, not the guidance: a baseline and its candidates share
    it, so they draw the same random numbers (common random numbers)."""

    name: str
    seed_key: str
    tickets: list[Ticket]
    guidance: dict[str, str]
    sampler: SamplerConfig
    guidance_hash: str  # the guidance's ``Guidance.hash``, carried so that no submit rehashes it


def rollout_spec(name: str, seed_key: str, tickets, guidance: Guidance, sampler: SamplerConfig) -> RolloutSpec:
    """The rollout of ``tickets`` under ``guidance``'s rules (its hash computed once per value)."""
    return RolloutSpec(name=name, seed_key=seed_key, tickets=list(tickets), guidance=dict(guidance.experiences),
                       sampler=sampler, guidance_hash=guidance.hash)


class RolloutResult(msgspec.Struct):
    """Per-ticket statistics in ticket order; overlength tickets only in ``dropped`` (key -> prompt
    tokens). ``chunk_done_s`` (volatile): per chunk, seconds from the gather's start to its result (0: cached)."""

    spec_name: str
    guidance_hash: str
    stats: dict[str, TicketStats]
    dropped: dict[str, int]
    rollouts: dict[str, TicketRollout]
    generations: int = 0
    cached_generations: int = 0
    chunk_done_s: list[float] = []


class ChatFailure(msgspec.Struct, frozen=True):
    """What ``wait`` returns for a chat call whose engine method raised: the engine's
    one-line error (``chat(): RuntimeError: ...``; not where it ran). The proposer's
    failure, not the run's (upstream: zero candidates)."""

    error: str


class _Part(msgspec.Struct):
    """One chunk of a pending rollout: its cache key, its tickets' keys and whether this rollout generates it."""

    key: str
    tickets: tuple[str, ...]
    owner: bool


class Pending(msgspec.Struct):
    """A submitted rollout or chat call; pass it to ``RolloutRunner.wait``."""

    spec: RolloutSpec | None = None
    parts: list[_Part] = []
    chat_task: TaskHandle | None = None
    request: ChatRequest | None = None  # a chat's request (submitted again after a failed gather)
    done: bool = False


class RolloutRunner(SpeculativeSubmissions):
    """``save_rollouts`` asks the engine for token ids too, for ``rollouts/*.jsonl``.
    ``progress`` is a ``progress.Progress`` (or None)."""

    def __init__(self, pool: Pool, profile: PromptProfile, *, chunk_size: int, progress=None,
                 save_rollouts: bool = False, engine_key: str = ""):
        if chunk_size < 1:
            raise ValueError(f"chunk_size must be >= 1, got {chunk_size}")
        self.pool = pool
        self.profile = profile
        self.profile_hash = content_hash(profile)
        self.chunk_size = chunk_size
        self.progress = progress
        self.save_rollouts = save_rollouts
        self.engine_key = engine_key  # hash of the engine's provenance (kind, versions, settings): part of every cache key
        # This process's counts: generated here, or served by this process's cache.
        self.generations_done = self.generations_saved = 0
        # The run's counts, continued from state.json on resume (docs/rule_search.md): done on a chunk's
        # first use in the run, saved on every later one, so a resumed run reports what an uninterrupted one does.
        self.run_done = self.run_saved = 0
        self.chunks_used: set[str] = set()
        self.tickets_by_rank: Counter[int] = Counter()  # tickets generated or scored, by the worker that ran them
        self.rollout_seconds = 0.0  # wall time spent gathering chunks: the rollout phase
        self._cache: dict[str, ChunkResult] = {}
        self._inflight: dict[str, TaskHandle] = {}  # cache key -> pool task, submitted, not yet gathered
        self._done_s: dict[str, float] = {}
        self._profile_shared = pool.share(profile)  # encoded once per runner
        self._tally = verdicts.TicketTally(profile.verdict)
        self._items = ChunkItems(save_rollouts=save_rollouts)
        self.on_progress = None  # called at the start of every wait and after each of its event-loop turns
        self._start_speculation()

    def submit(self, spec: RolloutSpec) -> Pending:
        """Queue every chunk of ``spec`` that is neither cached nor already in flight. What
        all chunks share (the guidance and profile as shared values, the guidance's part of the
        cost estimate, the sampler's fields) is encoded or computed once per rollout."""
        sampler = spec.sampler
        sampler_fields = msgspec.to_builtins(sampler)
        sampler_json = canonical_json(sampler_fields)  # the sampler's part of an item's memo key
        rules_chars = guidance_chars(spec.guidance)
        samples = len(sampler.grid) * sampler.samples_per_decode
        shared = None  # the shared values, encoded at the first chunk to generate
        parts = []
        for index, tickets in self._chunks(spec.tickets):
            keys = tuple([t.key for t in tickets])
            key = content_hash([keys, spec.guidance_hash, self.profile_hash, sampler_fields,
                                spec.seed_key, index, self.save_rollouts, self.engine_key])
            owner = key not in self._cache and key not in self._inflight
            if owner:
                item, chars = self._items.rollout(spec.seed_key, index, tickets, keys, sampler, sampler_json)
                if shared is None:
                    shared = dict(guidance=self.pool.share(spec.guidance), profile=self._profile_shared)
                # label: the report's timeline says which rollout kept a worker busy
                self._inflight[key] = self.pool.submit("rollout", item, result_type=ChunkResult, label=spec.name,
                                                       cost=chunk_cost(chars, len(keys), rules_chars, samples), **shared)
            parts.append(_Part(key, keys, owner))
        return Pending(spec, self._claim(parts, spec.name))

    def submit_chat(self, request: ChatRequest) -> Pending:
        """Queue one free-form generation (the proposer); ``wait`` returns its ChatResult
        (a speculative call of the same request is claimed instead)."""
        task = self._speculative.pop(chat_key(request), None)
        if task is not None:
            self._count_claim(task)
        else:
            task = self.pool.submit("chat", request, result_type=ChatResult, label="proposer")
        return Pending(chat_task=task, request=request)

    def wait(self, pendings: list[Pending]) -> list:
        """One ``pool.gather`` for all pendings; per pending, in order, a RolloutResult or a ChatResult.

        A chat whose engine method raises gives a ``ChatFailure``; the cancelled rest is resubmitted
        (finished chunks come from the cache) and gathered again. A worker's death or timeout, or an
        error in a rollout, still ends the wait."""
        current = list(pendings)  # per given pending, what is waited for (resubmitted after a failure)
        failed: dict[int, ChatFailure] = {}
        while True:
            live = [i for i in range(len(current)) if i not in failed]
            try:
                results = self._wait([current[i] for i in live])
                break
            except WorkerError as err:
                bad = next((i for i in live if current[i].chat_task is not None and current[i].chat_task.done()
                            and current[i].chat_task.exception() is err), None)
                if err.method != "chat" or bad is None:
                    raise
                # The engine's error, not where it ran: an artifact holds it, the same on any worker.
                failed[bad] = ChatFailure(f"{err.method}(): {err.summary}")
                for i in live:
                    if i != bad:
                        current[i] = self._again(current[i])
        for pending in pendings:
            pending.done = True
        out = {**dict(zip(live, results)), **failed}
        return [out[i] for i in range(len(current))]

    def _again(self, pending: Pending) -> Pending:
        """A pending of a failed gather, to be gathered again: a chat that finished keeps
        its result; anything else is submitted again."""
        task = pending.chat_task
        if task is not None and task.done() and not task.cancelled():
            return pending
        pending.done = True
        return self.submit(pending.spec) if task is None else self.submit_chat(pending.request)

    def _wait(self, pendings: list[Pending]) -> list:
        keys, tasks, counts = [], [], []
        seen: set[str] = set()
        for pending in pendings:
            if pending.done:
                raise ValueError("this pending rollout was already waited for")
            if pending.chat_task is not None:
                keys.append(None)
                tasks.append(pending.chat_task)
                counts.append(0)
            for part in pending.parts:
                if part.key in self._inflight and part.key not in seen:
                    seen.add(part.key)
                    keys.append(part.key)
                    tasks.append(self._inflight[part.key])
                    counts.append(len(part.tickets))
        started = time.monotonic()

        def keep(index, result):
            # Cached as it arrives: chunks finished before a failure are not generated again.
            if keys[index] is not None:
                self._cache[keys[index]] = result
                self._done_s[keys[index]] = time.monotonic() - started

        try:
            self._gather(_label(pendings), tasks, counts, keep)
        finally:
            # Done or cancelled: no longer in flight, so a later submit of an unfinished chunk regenerates it.
            for key in keys:
                if key is not None:
                    self._inflight.pop(key, None)
        for pending in pendings:
            pending.done = True
        out = [self._assemble(p) if p.chat_task is None else p.chat_task.result() for p in pendings]
        _warn_dropped(pendings, out)
        return out

    def verdict_probabilities(self, tickets: list[Ticket], guidance: dict[str, str], max_prompt_tokens: int | None,
                              *, label: str, phase: str) -> list[TicketVerdictProbability]:
        """The judge's P(pass) per ticket (``Engine.verdict_probabilities``), in ticket
        order: the tickets in the runner's chunks, each one batch, gathered like a rollout
        (``phase`` names it in the progress line, ``label`` in the timeline). Nothing is
        sampled and nothing cached: the headroom check scores its sample once."""
        chunks = self._chunks(tickets)
        shared = dict(guidance=self.pool.share(guidance), profile=self._profile_shared)
        rules_chars = guidance_chars(guidance)
        tasks = []
        for index, part in chunks:
            texts, chars = self._items.texts(part)
            chunk = VerdictChunk(index, texts, max_prompt_tokens)
            tasks.append(self.pool.submit("verdict_probabilities", chunk, result_type=VerdictChunkResult,
                                          cost=chunk_cost(sum(chars), len(part), rules_chars), label=label, **shared))
        results = self._gather(phase, tasks, [len(part) for _, part in chunks])
        for (_, part), result in zip(chunks, results):
            _check_chunk(result, [t.key for t in part], "verdict chunk")
        return [scored for result in results for scored in result.tickets]

    def _chunks(self, tickets: list[Ticket]) -> list[tuple[int, list[Ticket]]]:
        return [(index, tickets[start:start + self.chunk_size])
                for index, start in enumerate(range(0, len(tickets), self.chunk_size))]

    def _gather(self, phase: str, tasks: list, tickets: list[int], keep=None) -> list:
        """One ``pool.gather`` of ``tasks`` (``tickets[i]``: task i's tickets, 0 for a chat
        call) under the progress line ``phase``: its wall time is rollout time, each chunk's
        tickets are credited to the worker that ran it, ``keep(index, result)`` sees each
        result as it arrives."""
        started = time.monotonic()
        if self.progress is not None:
            self.progress.start(phase, sum(tickets))
        if self.on_progress is not None:
            self.on_progress()

        def on_result(index, result):
            if keep is not None:
                keep(index, result)
            if tickets[index]:
                self._credit(tasks[index], tickets[index])
                if self.progress is not None:
                    self.progress.advance(tickets[index])

        try:
            return self.pool.gather(tasks, on_result=on_result, between=self.on_progress) if tasks else []
        finally:
            if self.progress is not None:
                self.progress.finish()
            self.rollout_seconds += time.monotonic() - started

    def _credit(self, task, tickets: int) -> None:
        self.tickets_by_rank[task.ran_on] += tickets

    def continue_counts(self, chunks_used, done: int, saved: int) -> None:
        """Carry on the run's counts of an interrupted run (from its state.json)."""
        self.chunks_used = set(chunks_used)
        self.run_done, self.run_saved = int(done), int(saved)

    def run(self, spec: RolloutSpec) -> RolloutResult:
        return self.wait([self.submit(spec)])[0]

    def _assemble(self, pending: Pending) -> RolloutResult:
        """The rollout's result from the cache, counted: a chunk is generated by the
        rollout that owns it, cached for the others; done by the run the first time it is
        used, saved every later time."""
        result, samples = self._build(pending)
        generations = cached = 0
        for part, n in zip(pending.parts, samples):
            if part.owner:
                generations += n
            else:
                cached += n
            if part.key in self.chunks_used:
                self.run_saved += n
            else:
                self.run_done += n
                self.chunks_used.add(part.key)
        self.generations_done += generations
        self.generations_saved += cached
        result.generations, result.cached_generations = generations, cached
        return result

    def _build(self, pending: Pending) -> tuple[RolloutResult, list[int]]:
        """The rollout's result from the cache, uncounted, and the samples of each chunk."""
        spec = pending.spec
        stats, dropped, rollouts = {}, {}, {}
        done_s, samples = [], []
        position = 0
        tally = self._tally.stats
        for part in pending.parts:
            result = self._cache.get(part.key)
            if result is None:
                raise RuntimeError(f"rollout {spec.name!r}: a chunk was cancelled by a failed gather; submit it again")
            end = position + len(part.tickets)
            tickets, position = spec.tickets[position:end], end
            _check_chunk(result, part.tickets, "chunk")
            n = 0
            for ticket, rollout in zip(tickets, result.tickets):
                key = ticket.key
                if rollout.dropped:
                    dropped[key] = rollout.prompt_tokens
                    continue
                answers = rollout.samples
                stats[key] = tally(key, ticket.label, tuple([answer.text for answer in answers]))
                rollouts[key] = rollout
                n += len(answers)
            samples.append(n)
            done_s.append(self._done_s.get(part.key, 0.0) if part.owner else 0.0)
        result = RolloutResult(spec_name=spec.name, guidance_hash=spec.guidance_hash, stats=stats, dropped=dropped,
                               rollouts=rollouts, chunk_done_s=done_s)
        return result, samples


def _check_chunk(result, want, what: str) -> None:
    """The engine must answer every ticket of the chunk (keys ``want``), in order: anything
    else is a bug that would silently misattribute verdicts, so it stops the run."""
    got, want = [t.key for t in result.tickets], list(want)
    if got != want:
        raise RuntimeError(f"{what} {result.chunk_index} answered tickets {got[:3]}... for {want[:3]}...")


def _warn_dropped(pendings: list[Pending], results: list) -> None:
    """One warning per rollout phase naming the tickets dropped as overlength (the first few,
    in order, and how many): they were never judged. Logging only, nothing else changes."""
    dropped: dict[str, str] = {}
    for pending, result in zip(pendings, results):
        if isinstance(result, RolloutResult):
            cap = pending.spec.sampler.max_prompt_tokens
            for key, n in result.dropped.items():
                dropped.setdefault(key, f"{short(key, 80)} ({n} tokens > {cap})")
    if dropped:
        shown = list(dropped.values())[:DROPS_SHOWN]
        log.warning("%s: %d ticket(s) dropped, never judged: prompt over the sampler's max_prompt_tokens: %s%s",
                    _label(pendings), len(dropped), ", ".join(shown), ", ..." if len(dropped) > DROPS_SHOWN else "")


def _label(pendings: list[Pending]) -> str:
    names = [p.spec.name for p in pendings if p.spec is not None] or ["chat"]
    return names[0] if len(names) == 1 else f"{names[0]} +{len(names) - 1} more"


__all__ = ["ChatFailure", "RolloutSpec", "RolloutResult", "RolloutRunner", "Pending"]
