"""The run configuration: ``schema`` (every key, type, range and default), ``source`` (the YAML
file and ``--set``), ``checks`` (validation into located InputErrors) and ``load`` (resolved once
into the frozen value the run uses)."""

from ...engine.records import SamplerConfig
from .load import config_document, input_files, load_checked_config, load_config, replace_at, with_mode
from .schema import Config, ModelConfig, config_keys, join_key, struct_of

__all__ = [
    "Config", "ModelConfig", "SamplerConfig", "config_document", "config_keys", "input_files", "join_key",
    "load_checked_config", "load_config", "replace_at", "struct_of", "with_mode",
]
