"""Run configuration: one dataclass per section, presets as functions, TOML and CLI overrides.

The package is the configuration's public face; its modules, bottom up:

- ``sections``: the section dataclasses (``ModelConfig`` ... ``RayConfig``) and ``Config``. Every
  field carries a docstring (the string literal under it); ``describe_fields`` reads them back
  for ``--help-config`` and the generated reference.
- ``presets``: the presets, plain functions (``tiny``, ``tiny_motion``, the paper's ``dit-*``, the
  Wan 2.x sizes) and ``preset(name)``.
- ``validate``: every rule a config must meet, run before Ray starts; each message names the
  field, the value and the fix.
- ``loading``: a config from a preset, a TOML file and ``--section.field value`` overrides
  (``build_config``), and back to TOML (``to_toml``; a run's ``config.toml``).
- ``reference``: docs/configuration.md, generated from the field docstrings
  (``python -m megaslide_ray.config --write docs/configuration.md``).
"""

from megaslide_ray.config.loading import (
    ADDED_LATER,
    apply_overrides,
    build_config,
    config_from_dict,
    describe_fields,
    load_toml,
    parse_overrides,
    to_toml,
)
from megaslide_ray.config.presets import PRESETS, WAN_WINDOW, preset
from megaslide_ray.config.reference import REFERENCE_COMMAND, REFERENCE_PATH, reference_markdown
from megaslide_ray.config.sections import (
    SECTIONS,
    AttentionConfig,
    Config,
    ConfigError,
    DataConfig,
    ModelConfig,
    OptimizerConfig,
    RayConfig,
    RuntimeConfig,
    TrainingConfig,
)
from megaslide_ray.config.validate import sample_prompt_images, sample_prompts, validate

__all__ = [
    "ADDED_LATER", "PRESETS", "REFERENCE_COMMAND", "REFERENCE_PATH", "SECTIONS", "WAN_WINDOW", "AttentionConfig",
    "Config", "ConfigError", "DataConfig", "ModelConfig", "OptimizerConfig", "RayConfig", "RuntimeConfig",
    "TrainingConfig", "apply_overrides", "build_config", "config_from_dict", "describe_fields", "load_toml",
    "parse_overrides", "preset", "reference_markdown", "sample_prompt_images", "sample_prompts", "to_toml", "validate",
]
