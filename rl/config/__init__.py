"""Typed configuration: YAML files map onto nested dataclasses, one per component.

Strictness is the point: an unknown key, a wrong type or an out-of-range value raises
`ConfigError` naming `file:key`, the offending value and what was expected. Command-line
overrides use dotted keys (`trainer.lr=1e-6`); their values are parsed as YAML scalars.

Each component receives only its own dataclass (`cfg.trainer`, `cfg.rollout`, ...). The
dataclasses, with a docstring per field, are in `schema.py`; reading files and overrides onto
them is `loader.py`. Import from here: `from rl.config import Config, load_config, ConfigError`.
"""
from rl.config.loader import MOVED_KEYS, load_config, parse_override, save_config
from rl.config.schema import (MODEL_PRESETS, THINK_END, AlgorithmConfig, CheckpointConfig,
                              ClusterConfig, Config, ConfigError, DataConfig, DeadlinesConfig,
                              DeepSeekV4PromptConfig, EnvConfig, EvalConfig, FieldError,
                              LoggingConfig, MlflowConfig, ModelConfig, NetworkConfig, PlanConfig,
                              RewardConfig,
                              RewardSandboxConfig, RolloutConfig, SftConfig, SlurmGroupConfig,
                              SyncConfig, SyntheticConfig, TrainerConfig, WandbConfig, to_dict)

__all__ = [
    "MOVED_KEYS", "load_config", "parse_override", "save_config",
    "MODEL_PRESETS", "THINK_END", "AlgorithmConfig", "CheckpointConfig", "ClusterConfig", "Config",
    "ConfigError", "DataConfig", "DeadlinesConfig", "DeepSeekV4PromptConfig", "EnvConfig",
    "EvalConfig", "FieldError", "LoggingConfig", "MlflowConfig", "ModelConfig", "NetworkConfig",
    "PlanConfig", "RewardConfig",
    "RewardSandboxConfig", "RolloutConfig", "SftConfig", "SlurmGroupConfig", "SyncConfig",
    "SyntheticConfig", "TrainerConfig", "WandbConfig", "to_dict",
]
