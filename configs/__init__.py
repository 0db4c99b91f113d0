"""Configuration: one frozen pydantic schema (``schema.py``), YAML presets, dotted overrides."""

from configs.schema import HybridServeConfig, load_config

__all__ = ["HybridServeConfig", "load_config"]
