"""Whether the workers run the same engine: byte-identical results need the same GPU model
and software on every worker (docs/architecture.md, determinism contract). The Ray backend,
whose workers may sit on nodes of other make, refuses a worker whose ``engine.info()``
differs from the others'."""

from __future__ import annotations

import json
from collections import Counter

from .errors import PoolError


def refuse_different_engines(worker_info: list[dict], ready: list[int], names: list[str], *,
                             newcomer: int | None = None) -> None:
    """PoolError naming the odd worker and every differing fact, if the ``ready`` ranks'
    ``worker_info`` differ: at start the odd one is the one outside the majority; a
    ``newcomer`` (a replacement) is compared with the workers already running."""
    if newcomer is not None:
        ready = [r for r in ready if r != newcomer] + [newcomer]
    kinds = Counter(_canonical(worker_info[r]) for r in ready)
    majority = kinds.most_common(1)[0][0] if newcomer is None else _canonical(worker_info[ready[0]])
    odd = next((r for r in ready if _canonical(worker_info[r]) != majority), None)
    if odd is None:
        return
    ref = next(r for r in ready if _canonical(worker_info[r]) == majority)
    info, reference = worker_info[odd], worker_info[ref]
    diff = "; ".join(f"{key}: {info.get(key)!r} where worker {ref} has {reference.get(key)!r}"
                     for key in sorted(set(info) | set(reference)) if info.get(key) != reference.get(key))
    raise PoolError(f"worker {odd} ({names[odd]}) reports a different engine ({diff}): "
                    "results would depend on which worker ran which chunk; run on GPUs of one model "
                    "with the same software on every node")


def _canonical(info: dict) -> str:
    return json.dumps(info, sort_keys=True, default=str)
