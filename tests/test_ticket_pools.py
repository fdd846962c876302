"""Eval split and train pool sampler: upstream's draws, minus its duplicate tickets."""

from __future__ import annotations

import random
from dataclasses import dataclass

import msgspec
import pytest

from stageb_pool.stageb.ticket_pools import TrainPoolSampler, eval_quotas, resolve_train_pool_size, split_eval_pool


@dataclass(frozen=True)
class T:  # the two fields of tickets.Ticket the split reads
    key: str
    label: str


def make(n_pass: int, n_fail: int) -> list[T]:
    tickets = [T(f"p{i:03d}::pass", "pass") for i in range(n_pass)]
    tickets += [T(f"f{i:03d}::fail", "fail") for i in range(n_fail)]
    random.Random(7).shuffle(tickets)  # input order must not matter
    return tickets


def test_upstream_case_50_50_e20_gives_10_10():
    train, held = split_eval_pool(make(50, 50), 20, seed=1)
    assert len(held) == 20 and len(train) == 80
    assert sum(t.label == "pass" for t in held) == 10
    assert {t.key for t in train}.isdisjoint({t.key for t in held})


@pytest.mark.parametrize(
    "counts, size, expected",
    [
        ({"fail": 3, "pass": 7}, 5, {"fail": 2, "pass": 3}),  # 1.5/3.5: tie on .5 -> "fail" by name
        ({"fail": 1, "pass": 9}, 3, {"fail": 0, "pass": 3}),  # 0.3/2.7: .7 wins
        ({"fail": 2, "pass": 2}, 3, {"fail": 2, "pass": 1}),  # 1.5/1.5 tie -> fail
        ({"fail": 5, "pass": 5}, 4, {"fail": 2, "pass": 2}),
        ({"fail": 1, "pass": 1, "x": 1}, 2, {"fail": 1, "pass": 1, "x": 0}),
    ],
)
def test_quotas_largest_remainder_ties_by_label(counts, size, expected):
    assert eval_quotas(counts, size) == expected


def test_split_matches_upstream_draw_order():
    tickets = make(6, 4)
    train, held = split_eval_pool(tickets, 5, seed=3)
    rng = random.Random(3)
    fails = sorted((t for t in tickets if t.label == "fail"), key=lambda t: t.key)
    passes = sorted((t for t in tickets if t.label == "pass"), key=lambda t: t.key)
    of, op = list(range(4)), list(range(6))
    rng.shuffle(of)  # fail bucket first, same rng
    rng.shuffle(op)
    assert held == [fails[i] for i in of[:2]] + [passes[i] for i in op[:3]]
    assert train == [fails[i] for i in of[2:]] + [passes[i] for i in op[3:]]


def test_split_is_deterministic_and_seed_dependent():
    tickets = make(30, 30)
    assert split_eval_pool(tickets, 10, 5) == split_eval_pool(list(reversed(tickets)), 10, 5)
    assert split_eval_pool(tickets, 10, 5)[1] != split_eval_pool(tickets, 10, 6)[1]


@pytest.mark.parametrize("size", [0, -3])
def test_eval_size_zero_means_all_train(size):
    tickets = make(3, 3)
    train, held = split_eval_pool(tickets, size, 1)
    assert held == [] and train == tickets


@pytest.mark.parametrize("size", [6, 100])
def test_eval_size_at_least_n_falls_back_to_all_train_empty_eval(size):
    tickets = make(3, 3)
    train, held = split_eval_pool(tickets, size, 1)
    assert held == [] and train == tickets


def test_split_empty_input():
    assert split_eval_pool([], 5, 1) == ([], [])


@pytest.mark.parametrize(
    "n, size, fraction, expected",
    [(100, 512, None, 100), (100, 10, None, 10), (100, 0, None, 1), (100, 10, 0.255, 26),
     (100, 10, 0.001, 1), (0, 10, None, 0), (7, 10, 1.0, 7)],
)
def test_resolve_train_pool_size(n, size, fraction, expected):
    assert resolve_train_pool_size(n, size, fraction) == expected


def upstream_pools(n, size, seed, iterations):
    """Upstream's rolling window (reference 3.3), duplicates and all."""
    def perm(s):
        p = list(range(n))
        random.Random(s).shuffle(p)
        return p
    wraps, cursor, indices, out = 0, 0, perm(seed), []
    for _ in range(iterations):
        if cursor + size <= len(indices):
            out.append(indices[cursor:cursor + size])
            cursor += size
        else:
            rem = indices[cursor:]
            wraps += 1
            indices = perm(seed + wraps)
            need = size - len(rem)
            out.append(rem + indices[:need])
            cursor = need
    return out


def test_sampler_matches_upstream_before_first_wrap():
    s = TrainPoolSampler.start(100, 30, seed=11)
    ours = [s.next_pool() for _ in range(3)]
    assert ours == upstream_pools(100, 30, 11, 3)


@pytest.mark.parametrize("n, size", [(10, 4), (10, 7), (13, 5), (5, 5), (3, 2), (50, 49)])
def test_sampler_never_duplicates_and_equals_upstream_when_upstream_has_none(n, size):
    s = TrainPoolSampler.start(n, size, seed=2)
    ours = [s.next_pool() for _ in range(25)]
    for pool in ours:
        assert len(pool) == size and len(set(pool)) == size
        assert all(0 <= i < n for i in pool)
    theirs = upstream_pools(n, size, 2, 25)
    for mine, up in zip(ours, theirs):
        if len(set(up)) == len(up):
            assert mine == up
            # after a duplicate the cursors diverge, so compare only the prefix
        else:
            break


def test_upstream_would_have_duplicated_here():
    # guard that the parametrised cases above really exercise the fix
    assert any(len(set(p)) < len(p) for p in upstream_pools(10, 7, 2, 25))


def test_whole_set_every_iteration_when_pool_covers_it():
    s = TrainPoolSampler.start(6, 512, seed=0)
    for _ in range(4):
        assert sorted(s.next_pool()) == list(range(6))


def test_empty_train_set_gives_empty_pools():
    s = TrainPoolSampler.start(0, 10, seed=0)
    assert s.next_pool() == [] and s.next_pool() == []


def test_state_round_trip_through_msgspec_json_continues_identically():
    s = TrainPoolSampler.start(23, 6, seed=9)
    reference = TrainPoolSampler.start(23, 6, seed=9)
    expected = [reference.next_pool() for _ in range(12)]
    got = []
    for _ in range(12):
        got.append(s.next_pool())
        s = msgspec.json.decode(msgspec.json.encode(s), type=TrainPoolSampler)
    assert got == expected
    encoded = msgspec.json.decode(msgspec.json.encode(s))
    assert set(encoded) == {"n_train", "size", "seed", "cursor", "wraps"}
