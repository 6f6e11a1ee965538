"""The model families saccade trains, and `family_of`, which picks one for a model.

Each family is a module here with one `FAMILY` (a `ModelFamily`, see `interface.py` and
docs/families.md); `FAMILIES` lists them. Code outside this package never names a family: it
asks `family_of(config)` for the one that knows. The random models of each family (presets) are
`saccade.models.presets`'.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

from saccade.models.families import qwen2_5_vl, qwen3_5, qwen3_5_moe, qwen3_vl, qwen3_vl_moe
from saccade.models.families.interface import LM_HEAD_KEY, LM_PREFIX, VISION_PREFIX, ModelFamily, Positions

__all__ = ["FAMILIES", "LM_HEAD_KEY", "LM_PREFIX", "VISION_PREFIX", "ModelFamily", "Positions", "family_of",
           "model_type_of"]

FAMILIES: tuple[ModelFamily, ...] = (qwen3_vl.FAMILY, qwen2_5_vl.FAMILY, qwen3_vl_moe.FAMILY, qwen3_5.FAMILY,
                                     qwen3_5_moe.FAMILY)

# A sub-config (`config.vision_config`, `config.text_config`) names its family's type plus one of these.
_PART_SUFFIXES = ("_vision", "_text")


def model_type_of(config_or_path) -> str:
    """config.model_type of a transformers config, a config.json dict, or a model folder."""
    if isinstance(config_or_path, (str, os.PathLike)):
        path = Path(config_or_path)
        path = path / "config.json" if path.is_dir() else path
        if not path.is_file():
            raise ValueError(f"{config_or_path} has no config.json: give a model folder or its config")
        config_or_path = json.loads(path.read_text())
    if isinstance(config_or_path, dict):
        return str(config_or_path.get("model_type", ""))
    return str(getattr(config_or_path, "model_type", ""))


def family_of(config_or_path) -> ModelFamily:
    """The family serving this model (a transformers config, its vision or text part, a
    config.json dict, or a local model folder); a ValueError naming the known ones otherwise."""
    model_type = model_type_of(config_or_path)
    for suffix in ("", *_PART_SUFFIXES):
        if suffix and not model_type.endswith(suffix):
            continue
        base = model_type[: len(model_type) - len(suffix)] if suffix else model_type
        for family in FAMILIES:
            if base in family.model_types:
                return family
    known = ", ".join(f"{t!r} ({f.name})" for f in FAMILIES for t in f.model_types)
    raise ValueError(f"saccade has no model family for model_type {model_type!r}; it knows {known}. Use a "
                     "checkpoint of one of those, or add a family: one module in saccade/models/families "
                     "(docs/families.md)")
