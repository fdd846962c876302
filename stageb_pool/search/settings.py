"""The plain, frozen values the rule search reads, taken once from the resolved config.

``app/job.py`` builds a ``SearchSettings`` from the frozen config and the loaded inputs;
the search never sees the config file, its paths or its defaults. ``rule_search`` and
``distill`` are the config's own frozen sections (their fields are documented in
docs/usage.md), passed as they are.
"""

from __future__ import annotations

from typing import Any

import msgspec


class SearchSettings(msgspec.Struct, frozen=True, kw_only=True):
    seed: int  # the run seed: pools and seed keys derive from it
    mission: str
    epochs: int  # the iteration budget (runner.epochs)
    rule_search: Any  # the config's rule_search section (samplers, gate, pools, proposer decode)
    distill: Any  # the config's stage_b_distillation section (seeds resolved)
    proposer_system: str  # the proposer's system prompt text


class RunIdentity(msgspec.Struct, frozen=True, kw_only=True):
    """What a resumed search must match: the config (hash and document, to name the keys
    that changed) and the tickets in run order."""

    config_hash: str
    config: dict[str, Any]
    tickets_hash: str
