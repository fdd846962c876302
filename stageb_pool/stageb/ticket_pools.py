"""The fixed eval pool and the per-iteration train pool of the rule search.

Both follow upstream Stage-B (reference 3.3) draw for draw, so a run selects the same
tickets as upstream with the same seed, with two fixes: an empty eval pool is a normal
state, never a crash (upstream defect 9.3.2); a train pool never holds a ticket twice (when
the rolling window wraps, the new head skips tickets already in the pool; upstream 9.3.8),
and wherever upstream's pool had no duplicate, ours is identical. Sampling with
replacement is not supported: its only effect was duplicated tickets voting twice.
"""

from __future__ import annotations

import random
from typing import Sequence, TypeVar

import msgspec

T = TypeVar("T")


def eval_quotas(label_counts: dict[str, int], eval_size: int) -> dict[str, int]:
    """Eval slots per label: floors of ``E * n_l / N``, leftovers by largest fractional
    part, ties by label name (labels in sorted order)."""
    total = sum(label_counts.values())
    quotas: dict[str, int] = {}
    remainders: list[tuple[float, str]] = []
    for label in sorted(label_counts):
        raw = eval_size * label_counts[label] / total
        quotas[label] = int(raw)
        remainders.append((raw - int(raw), label))
    leftover = eval_size - sum(quotas.values())
    for _, label in sorted(remainders, key=lambda item: (-item[0], item[1]))[:max(0, leftover)]:
        quotas[label] += 1
    return quotas


def split_eval_pool(tickets: Sequence[T], eval_pool_size: int, seed: int) -> tuple[list[T], list[T]]:
    """Split ``tickets`` into ``(train, eval)``: a label-stratified, seeded eval pool
    (empty unless ``0 < eval_pool_size < len(tickets)``). Each label bucket (labels sorted,
    bucket sorted by key) has its index list shuffled by one ``random.Random(seed)``; the
    first ``quota`` go to eval. Both lists come out bucket by bucket, as upstream.
    """
    tickets = list(tickets)
    if not 0 < eval_pool_size < len(tickets):
        return tickets, []
    buckets: dict[str, list[T]] = {}
    for ticket in tickets:
        buckets.setdefault(str(ticket.label), []).append(ticket)
    quotas = eval_quotas({label: len(b) for label, b in buckets.items()}, int(eval_pool_size))
    rng = random.Random(int(seed))
    train: list[T] = []
    held: list[T] = []
    for label in sorted(buckets):
        bucket = sorted(buckets[label], key=lambda t: t.key)
        order = list(range(len(bucket)))
        rng.shuffle(order)
        cut = quotas[label]  # never above len(bucket): with E < N each floor is below n_l, plus at most 1
        held.extend(bucket[i] for i in order[:cut])
        train.extend(bucket[i] for i in order[cut:])
    return train, held


def resolve_train_pool_size(n_train: int, size: int, fraction: float | None = None) -> int:
    """``round(n_train * fraction)`` when a fraction is set, else ``size``; clamped to
    ``[1, n_train]`` (0 when there are no train tickets)."""
    if n_train <= 0:
        return 0
    target = int(round(n_train * float(fraction))) if fraction is not None else int(size)
    return min(max(1, target), n_train)


def _permutation(n: int, seed: int) -> list[int]:
    order = list(range(n))
    random.Random(seed).shuffle(order)
    return order


class TrainPoolSampler(msgspec.Struct, forbid_unknown_fields=True):
    """Rolling window over seeded permutations (``random.Random(seed + wraps)``) of the train
    indices. The whole state is these five integers, written to ``state.json`` as is, so a
    resumed run draws exactly the pools the uninterrupted run would."""

    n_train: int
    size: int
    seed: int
    cursor: int = 0
    wraps: int = 0

    @classmethod
    def start(cls, n_train: int, size: int, seed: int, *, fraction: float | None = None) -> "TrainPoolSampler":
        return cls(n_train=n_train, size=resolve_train_pool_size(n_train, size, fraction), seed=int(seed))

    def permutation(self) -> list[int]:
        return _permutation(self.n_train, self.seed + self.wraps)

    def next_pool(self) -> list[int]:
        """The next pool's train indices (never a duplicate); advances the state."""
        if self.size <= 0:
            return []
        perm = self.permutation()
        if self.cursor + self.size <= len(perm):
            pool = perm[self.cursor:self.cursor + self.size]
            self.cursor += self.size
            return pool
        pool = perm[self.cursor:]
        taken = set(pool)
        self.wraps += 1
        perm = self.permutation()
        cursor = 0
        # Take the new head, skipping what the remainder already holds (upstream added
        # them a second time). size <= n_train, so the loop always fills the pool.
        while len(pool) < self.size:
            index = perm[cursor]
            cursor += 1
            if index not in taken:
                pool.append(index)
                taken.add(index)
        self.cursor = cursor
        return pool
