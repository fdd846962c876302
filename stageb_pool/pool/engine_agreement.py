"""Whether the workers run the same engine: byte-identical results need the same GPU model
and software on every worker (docs/architecture.md, determinism contract).

One policy, ``EngineAgreement``, passed to the pool (``Pool(engine_agreement=...)``) and
applied by its dispatcher once every worker is ready and again to each replacement. Its
parameters are the outcomes:

- ``REFUSE_ANY_DIFFERENCE``, the Ray backend's default (its nodes may be of other makes): a
  worker whose ``engine.info()`` differs from the others' in any fact is refused, a
  ``PoolError`` naming it and every fact that differs;
- ``ACCEPT_ANY``, the fork backend's default (one machine, one installation): nothing is
  compared;
- the CLI's, on one machine (``app/job.py``): named facts (the engine and its versions) must
  agree, refused as the CLI's own input error, and any other difference (a machine that
  mixes GPU models) is a warning.

Inline mode has one worker: nothing to compare.
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
    """What the pool does when its workers' ``engine.info()`` differ.

    ``refuse``: the facts every worker must share, or None for all of them. All of them: the
    odd worker is named with each fact that differs (at start the odd one is the one outside
    the majority, a replacement is compared with the workers running). Named facts: the
    workers whose facts differ from the first one's are listed, with those facts.
    ``warn``: the logger that reports any difference not refused as a warning (None: quiet).
    ``error``: makes a refusal's exception from its one-line text (the CLI's is located at
    ``--gpus``)."""

    refuse: tuple[str, ...] | None = ()
    warn: logging.Logger | None = None
    error: Callable[[str], Exception] = PoolError

    def check(self, infos: dict[int, dict], names: list[str], *, newcomer: int | None = None) -> None:
        """Apply the policy to the running workers' ``infos`` (by rank; ``names``: each
        rank's device); ``newcomer``: the rank of a replacement, compared with the others."""
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
