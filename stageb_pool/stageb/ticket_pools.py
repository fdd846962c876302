"""The fixed eval pool and the per-iteration train pool of the rule search: upstream's draws
(reference 3.3), so the same seed selects the same tickets, except that an empty eval pool is
normal and a train pool never holds a ticket twice (docs/rule_search.md, "Pools")."""

from __future__ import annotations

import random
from typing import Sequence, TypeVar

import msgspec

T = TypeVar("T")


def eval_quotas(label_counts: dict[str, int], eval_size: int) -> dict[str, int]:
    """Eval slots per label: floors, leftovers by largest fractional part, ties by label."""
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
    """``(train, eval)``, label-stratified and bucket by bucket, as upstream; eval may be empty."""
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
    """``round(n_train * fraction)`` or ``size``, clamped to ``[1, n_train]`` (0 without tickets)."""
    if n_train <= 0:
        return 0
    target = int(round(n_train * float(fraction))) if fraction is not None else int(size)
    return min(max(1, target), n_train)


class TrainPoolSampler(msgspec.Struct, forbid_unknown_fields=True):
    """Rolling window over ``random.Random(seed + wraps)`` permutations of the train indices.
    These five integers are the whole state (``state.json``), so a resume draws the same pools."""

    n_train: int
    size: int
    seed: int
    cursor: int = 0
    wraps: int = 0

    @classmethod
    def start(cls, n_train: int, size: int, seed: int, *, fraction: float | None = None) -> "TrainPoolSampler":
        return cls(n_train=n_train, size=resolve_train_pool_size(n_train, size, fraction), seed=int(seed))

    def permutation(self) -> list[int]:
        order = list(range(self.n_train))
        random.Random(self.seed + self.wraps).shuffle(order)
        return order

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
        # The new head skips what the remainder holds (upstream added them twice); size <= n_train.
        while len(pool) < self.size:
            index = perm[cursor]
            cursor += 1
            if index not in taken:
                pool.append(index)
                taken.add(index)
        self.cursor = cursor
        return pool
