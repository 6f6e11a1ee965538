"""Run configuration: pydantic models, TOML files, dotted command-line overrides, --dry-run.

A run is described by one `RunConfig` (`run.py`), composed of sections (`sections.py`:
`model`, `lora`, `images`, `image_cache`, `engine`, `sampling`, `rollout`, `stall`,
`trainer`, `sft`, `env`, `eval`, `checkpoint`, `log`; `loss.py`: the `[loss]` union;
`launch.py`: the `[launch]` layout) and
the `[task]` union (`task.py`: one variant per kind of task, each with its own fields). A mode
is a union too, not a flag: `[stall]` by its `action`, `[loss]` by its `kind`,
`[trainer.lr_decay]` by its `kind`, and `lora` is a `[lora]` table or `false` (full
fine-tuning). Each section is a pydantic model with a docstring, a
description on every field and bounds wherever a bound means something; unknown keys are
refused everywhere (`extra="forbid"`), and assignment is validated too (`cfg.trainer.lr = -1`
raises).

Where the values come from, later wins (`loading.py`):
  1. the defaults (a CPU demo on the built-in tiny model),
  2. a TOML file (tables map to sections: ``[trainer]`` ``lr = 1e-5``); a file with an earlier
     day's keys is read as today's (`upgrade.py`: one table of moves, each dated), one from
     before the [task] section (2026-11-24) refused with each old key's new name (docs/config.md),
  3. dotted overrides from the command line: ``--trainer.lr 1e-5``, ``--trainer.lr=1e-5``,
     ``--lora.target_modules '["q_proj","v_proj"]'``, ``--rollout.reward_weights.format 0.1``
     (one key of a dict field), ``--task.kind scenes --task.max_turns 4``, ``--lora false``
     (full fine-tuning). A value is read as
     JSON when it parses (numbers, ``true``, ``false``, ``null``, lists, objects), else kept
     as a string; pydantic then validates and coerces it against the field's type. A string
     field keeps the raw text (``--log.name 123`` gives the string "123").

Every mistake is a `ConfigError` (a `ValueError`) whose message names where the bad value
came from (the file or the override) and the field path, e.g.
``--trainer.lr: input should be greater than 0 (got -1)``; an unknown key lists the valid
keys at that level with a "did you mean" suggestion.

This package imports neither torch nor any part of saccade above its utilities: entry points
parse and print the config (``--help``, ``--dry-run``, errors) before paying torch's import
time. What needs a user's code (their reward functions, their task, a verifiers environment)
is checked where tasks are built, `saccade.run.tasks.check_user_code`, which the entry points run
right after loading the config.

Entry-point pattern (argparse)::

    parser = argparse.ArgumentParser(prog="saccade rl")
    add_config_arguments(parser)                       # CONFIG (optional) and --dry-run
    known, overrides = split_overrides(sys.argv[1:])   # --a.b value tokens go to overrides
    args = parser.parse_args(known)
    cfg = load_config(RunConfig, args.config, overrides)   # ConfigError -> parser.error(...)
    check_user_code(cfg)                               # saccade.run.tasks: imports no torch
    if args.dry_run:
        print(describe(cfg))
        return 0
    import torch  # only now

Overrides are split off *before* argparse sees them: ``parse_known_args`` alone would hand
the value of ``--trainer.lr 1e-5`` to the optional CONFIG positional.
"""

from saccade.config.engine import (
    AdapterSyncConfig, AutoSyncConfig, CollectiveSyncConfig, EmbeddedEngineConfig, EngineConfig, FilesSyncConfig,
    ProbeConfig, VLLMEngineConfig, WeightSyncConfig,
)
from saccade.config.evaluation import EvalConfig
from saccade.config.launch import LaunchConfig, LaunchNode, is_loopback
from saccade.config.loading import add_config_arguments, load_config, parse_overrides, split_overrides
from saccade.config.loss import (
    DEFAULT_TIS_CAP, BaseLossConfig, CispoLossConfig, GspoLossConfig, LossConfig, PpoClipLossConfig,
    ReinforceLossConfig,
)
from saccade.config.run import RunConfig, effective_loss
from saccade.config.sections import (
    PRESET_NAMES, CheckpointConfig, ConfigError, ConstantDecayConfig, CosineDecayConfig, EnvConfig,
    GradSpikeConfig, ImageCacheConfig, ImagesConfig, LinearDecayConfig, LogConfig, LoraConfig, VideoConfig,
    LrDecayConfig, ModelConfig, RolloutConfig, SamplingConfig, Section, SftConfig, StallConfig, StallRollbackConfig,
    StallStopConfig, StallWarnConfig, StallWatchConfig, TrainerConfig,
)
from saccade.config.task import (
    DATASET_CONFIGS, DEFAULT_PROMPT_TEMPLATE, SCENE_QUESTION_KINDS, SHAPES_QUESTION_KINDS,
    TASK_CONFIGS, VIEW_COLORS, ColumnsConfig, DatasetTaskConfig, HubDatasetTaskConfig, ScoringConfig, OwnDatasetTaskConfig, PluginTaskConfig,
    ScenesTaskConfig, ShapesTaskConfig, TaskConfig, VerifiersTaskConfig, ViewsTaskConfig,
)
from saccade.config.toml import config_changes, config_to_toml, describe
from saccade.config.upgrade import LegacyConfigWarning

__all__ = [
    "DATASET_CONFIGS",
    "DEFAULT_PROMPT_TEMPLATE",
    "DEFAULT_TIS_CAP",
    "PRESET_NAMES",
    "SCENE_QUESTION_KINDS",
    "SHAPES_QUESTION_KINDS",
    "TASK_CONFIGS",
    "VIEW_COLORS",
    "BaseLossConfig",
    "CheckpointConfig",
    "CispoLossConfig",
    "ColumnsConfig",
    "ConfigError",
    "ConstantDecayConfig",
    "CosineDecayConfig",
    "AdapterSyncConfig",
    "AutoSyncConfig",
    "CollectiveSyncConfig",
    "EmbeddedEngineConfig",
    "EngineConfig",
    "FilesSyncConfig",
    "ProbeConfig",
    "VLLMEngineConfig",
    "WeightSyncConfig",
    "EnvConfig",
    "EvalConfig",
    "GradSpikeConfig",
    "GspoLossConfig",
    "DatasetTaskConfig",
    "HubDatasetTaskConfig",
    "ImageCacheConfig",
    "ImagesConfig",
    "LaunchConfig",
    "LaunchNode",
    "LinearDecayConfig",
    "LegacyConfigWarning",
    "LogConfig",
    "LoraConfig",
    "LossConfig",
    "LrDecayConfig",
    "ModelConfig",
    "OwnDatasetTaskConfig",
    "PluginTaskConfig",
    "PpoClipLossConfig",
    "ReinforceLossConfig",
    "RolloutConfig",
    "RunConfig",
    "SamplingConfig",
    "ScenesTaskConfig",
    "ScoringConfig",
    "Section",
    "SftConfig",
    "StallConfig",
    "StallRollbackConfig",
    "StallStopConfig",
    "StallWarnConfig",
    "StallWatchConfig",
    "ShapesTaskConfig",
    "TaskConfig",
    "TrainerConfig",
    "VerifiersTaskConfig",
    "ViewsTaskConfig",
    "add_config_arguments",
    "config_to_toml",
    "is_loopback",
    "describe",
    "config_changes",
    "effective_loss",
    "load_config",
    "parse_overrides",
    "split_overrides",
]
