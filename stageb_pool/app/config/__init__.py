"""The run configuration: ``schema`` (every key, type, range and default), ``source`` (the YAML
file and ``--set``), ``checks`` (validation into located InputErrors) and ``load`` (resolved once
into the frozen value the run uses)."""

from ...engine.records import SamplerConfig
from .load import config_document, input_files, load_checked_config, load_config, replace_at, with_mode
from .schema import (
    LEGACY_KEYS,
    BootstrapConfig,
    Config,
    DistillConfig,
    EarlyStopConfig,
    GateConfig,
    GuidanceConfig,
    IngestConfig,
    ModelConfig,
    OutputConfig,
    PoolConfig,
    PromptConfig,
    RuleSearchConfig,
    RunnerConfig,
    TicketFilterConfig,
    config_keys,
    join_key,
    struct_of,
)
from .source import apply_override

__all__ = [
    "LEGACY_KEYS", "BootstrapConfig", "Config", "DistillConfig", "EarlyStopConfig", "GateConfig", "GuidanceConfig",
    "IngestConfig", "ModelConfig", "OutputConfig", "PoolConfig", "PromptConfig", "RuleSearchConfig", "RunnerConfig",
    "SamplerConfig", "TicketFilterConfig", "apply_override", "input_files", "config_document", "config_keys", "join_key",
    "load_checked_config", "load_config", "replace_at", "struct_of", "with_mode",
]
