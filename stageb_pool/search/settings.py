"""The config sections the rule search and the audit read (``rule_search``, ``stage_b_distillation``:
declared beside their reader, held by app/config/schema.py, keys in docs/usage.md), and the frozen
``SearchSettings`` app/job.py builds: the search never sees the config file, its paths or defaults.
"""

from __future__ import annotations

from typing import Any

import msgspec

from ..engine.records import SamplerConfig
from ..stageb.config_types import (TICKETS, TOKENS, Float, Int, NonEmptyStr, Penalty, Probability, Section, Seed,
                                   Temperature, TopP)


class BootstrapConfig(Section, kw_only=True):
    iterations: Int(1, 10_000) = 200  # paired ticket-level bootstrap resamples
    min_prob: Probability = 0.8  # required P(RER* >= min_relative_error_reduction)
    seed: Seed | None = None  # bootstrap RNG base (plus the iteration); None: the top-level seed


class GateConfig(Section, kw_only=True):
    min_relative_error_reduction: Probability = 0.1  # tau: required relative error reduction on the train pool
    max_changed_fraction: Probability = 0.05  # churn cap: fraction of tickets whose majority may change (0 means 0)
    max_fp_rate_increase: Probability = 0.01  # largest allowed rise of the false-release rate, for every op
    bootstrap: BootstrapConfig = msgspec.field(default_factory=BootstrapConfig)
    eval_max_acc_drop: Probability | None = None  # veto when eval accuracy drops by more; None: log only


class EarlyStopConfig(Section, kw_only=True):
    patience: Int(1, 10_000) = 3  # stop after this many consecutive iterations without an accepted edit


class RuleSearchConfig(Section, kw_only=True):
    proposer_prompt_path: NonEmptyStr | None = None  # proposer system prompt file; None: the prompt profile's proposer.txt
    proposer_temperature: Temperature = 0.4
    proposer_top_p: TopP = 0.9
    proposer_repetition_penalty: Penalty = 1.05
    proposer_max_new_tokens: Int(1, 1_000_000) = 2048
    proposer_max_prompt_tokens: Int(1, TOKENS) = 4096  # examples are dropped from the end until the prompt fits
    constrain_proposer: bool = False  # hold the answer to its JSON schema (stageb/proposer_schema.py); off: upstream
    reflect_size: Int(1, 10_000) = 16  # confidently wrong tickets shown to the proposer
    num_candidate_rules: Int(1, 100) = 3  # candidates per iteration (proposer, then ablation fill)
    proposer_calls: Int(1, 64) = 1  # proposer calls per iteration, each with its own seed, candidates merged (1: upstream)
    train_pool_size: Int(1, TICKETS) = 512  # tickets per iteration's train pool
    train_pool_fraction: Float(0, 1, open_low=True) | None = None  # overrides the size: round(N_train * f)
    eval_pool_size: Int(0, TICKETS) = 128  # fixed stratified eval pool (0: no eval pool)
    gate: GateConfig = msgspec.field(default_factory=GateConfig)
    early_stop: EarlyStopConfig = msgspec.field(default_factory=EarlyStopConfig)
    train_sampler: SamplerConfig  # train baseline and candidate rollouts; also the audit rollout
    eval_sampler: SamplerConfig  # eval pool rollouts


class DistillConfig(Section, kw_only=True):
    enabled: bool | None = None  # None: on when distill_size is set (upstream's default true); resolved to a bool
    log_chatml_path: str | None = None  # None: {run_dir}/distill_chatml.jsonl
    distill_size: Int(1, TICKETS) | None = None  # tickets to export; None: nothing is exported
    distill_seed: Seed | None = None  # ticket sampling seed; None: the top-level seed
    distill_temperature: Temperature | None = None  # None: the lowest train-grid temperature


class SearchSettings(msgspec.Struct, frozen=True, kw_only=True):
    seed: int  # the run seed: pools and seed keys derive from it
    mission: str
    epochs: int  # the iteration budget (runner.epochs)
    rule_search: RuleSearchConfig
    distill: DistillConfig  # seeds resolved
    proposer_system: str  # the proposer's system prompt text


class RunIdentity(msgspec.Struct, frozen=True, kw_only=True):
    """What a resumed search must match: the config (hash and document, to name the keys
    that changed) and the tickets in run order."""

    config_hash: str
    config: dict[str, Any]
    tickets_hash: str
