"""The run configuration, in four modules by concept:

- ``schema``: the frozen msgspec Structs that define every key, type, range and default
  (the single source of truth; docs/usage.md mirrors it), the legacy keys, schema walking;
- ``source``: reading the YAML file and applying ``--set`` overrides (a raw mapping);
- ``checks``: validating the raw mapping and translating errors into located InputErrors;
- ``load``: ``load_config``, which resolves a config once (absolute paths, filled-in seeds)
  into the frozen value the run uses (``load_checked_config``: with the model path it checked).
"""

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
