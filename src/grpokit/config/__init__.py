"""What to run: the run configuration, torch-free.

    config = load_config("run.toml", overrides=["train.steps=50"])

`schema` holds the sections (frozen dataclasses, checked when built), `variants` the
names of every variant and the facts about them, `presets` the named bundles of
algorithm fields, `loading` TOML and overrides. Everything is re-exported here, so
`from grpokit.config import Config, load_config` keeps working.
"""

from grpokit.config.loading import config_from_dict, load_config, parse_override, to_toml
from grpokit.config.schema import (
    SECTIONS,
    AlgorithmConfig,
    Config,
    DataConfig,
    ModelConfig,
    OutputConfig,
    RewardConfig,
    RolloutConfig,
    ToolsConfig,
    TrainConfig,
)
from grpokit.errors import ConfigError

__all__ = ["SECTIONS", "AlgorithmConfig", "Config", "ConfigError", "DataConfig", "ModelConfig", "OutputConfig",
           "RewardConfig", "RolloutConfig", "ToolsConfig", "TrainConfig", "config_from_dict", "load_config",
           "parse_override", "to_toml"]
