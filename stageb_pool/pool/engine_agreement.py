"""Whether the workers run the same engine: byte-identical results need the same GPU model
and software on every worker. The defaults per backend and the CLI's policy:
docs/architecture.md, "The Ray backend" (Same engine everywhere).
"""

from __future__ import annotations

import json
import logging
from collections import Counter
from dataclasses import dataclass
from typing import Callable

import msgspec

from .errors import PoolError


@dataclass(frozen=True)
class EngineAgreement:
    """What the pool does when its workers' ``engine.info()`` differ. ``refuse``: the facts every
    worker must share, or None for all of them (then the odd worker, outside the majority or a
    replacement, is named with each fact that differs). ``warn``: the logger for differences not
    refused (None: quiet). ``error``: makes a refusal's exception from its one-line text."""

    refuse: tuple[str, ...] | None = ()
    warn: logging.Logger | None = None
    error: Callable[[str], Exception] = PoolError

    def check(self, infos: dict[int, dict], names: list[str], *, newcomer: int | None = None) -> None:
        """Apply the policy to the running workers' ``infos`` (by rank; ``names``: their
        devices); ``newcomer``: a replacement's rank, compared with the others."""
        ranks = sorted(infos, key=lambda rank: (rank == newcomer, rank))  # the newcomer last
        if self.refuse is None:
            self._refuse_the_odd_one(infos, ranks, names, replacement=newcomer is not None)
        else:
            self._compare_with_the_first(infos, ranks)

    def _refuse_the_odd_one(self, infos: dict[int, dict], ranks: list[int], names: list[str], *,
                            replacement: bool) -> None:
        facts = {rank: _canonical(infos[rank]) for rank in ranks}
        majority = facts[ranks[0]] if replacement else Counter(facts.values()).most_common(1)[0][0]
        odd = next((rank for rank in ranks if facts[rank] != majority), None)
        if odd is None:
            return
        ref = next(rank for rank in ranks if facts[rank] == majority)
        info, reference = infos[odd], infos[ref]
        diff = "; ".join(f"{key}: {info.get(key)!r} where worker {ref} has {reference.get(key)!r}"
                         for key in sorted(set(info) | set(reference)) if info.get(key) != reference.get(key))
        raise self.error(f"worker {odd} ({names[odd]}) reports a different engine ({diff}): "
                         "results would depend on which worker ran which chunk; run on GPUs of one model "
                         "with the same software on every node")

    def _compare_with_the_first(self, infos: dict[int, dict], ranks: list[int]) -> None:
        facts = {rank: msgspec.to_builtins(infos[rank], enc_hook=str) for rank in ranks}
        first = ranks[0]
        engines = {rank: {key: facts[rank].get(key) for key in self.refuse} for rank in ranks}
        mixed = [rank for rank in ranks if engines[rank] != engines[first]]
        if mixed:  # another engine or version gives other bytes by construction: refuse, not warn
            raise self.error(f"workers {mixed} run another engine or version than worker {first} "
                             f"({engines[mixed[0]]} vs {engines[first]}): results would depend on which "
                             "worker ran which chunk")
        odd = [rank for rank in ranks if facts[rank] != facts[first]]
        if odd and self.warn is not None:
            self.warn.warning("workers %s report a different engine than worker %d (%s vs %s): results may "
                              "depend on which worker ran which chunk", odd, first, facts[odd[0]], facts[first])


ACCEPT_ANY = EngineAgreement()
REFUSE_ANY_DIFFERENCE = EngineAgreement(refuse=None)


def _canonical(info: dict) -> str:
    return json.dumps(info, sort_keys=True, default=str)
