"""The model families saccade trains, and `family_of`, which picks one for a model.

Each family is a module here with one `FAMILY` (a `ModelFamily`, see `interface.py` and
docs/families.md); `FAMILIES` lists them. Code outside this package never names a family: it
asks `family_of(config)` for the one that knows.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

from saccade.models.families import qwen2_5_vl, qwen3_5, qwen3_5_moe, qwen3_vl, qwen3_vl_moe
from saccade.models.families.interface import LM_HEAD_KEY, LM_PREFIX, VISION_PREFIX, ModelFamily

__all__ = ["FAMILIES", "LM_HEAD_KEY", "LM_PREFIX", "VISION_PREFIX", "ModelFamily", "family_of", "model_type_of",
           "preset_family", "resolve_model", "warm_start_base", "warm_start_names"]

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


def preset_family(name: str) -> ModelFamily | None:
    """The family whose random builds include preset `name` (a name belongs to one), else None."""
    return next((f for f in FAMILIES if name in f.tiny_presets), None)


# The demo's warm start of a family's tiny model is named "<preset>-warm" ("tiny-warm" is Qwen3-VL's).
WARM_SUFFIX = "-warm"


def warm_start_names() -> tuple[str, ...]:
    """The names of the warm starts: one per family, of its tiny preset (the first it lists, the
    one the demo's config is sized for)."""
    return tuple(f.tiny_presets[0] + WARM_SUFFIX for f in FAMILIES)


def warm_start_base(name: str) -> str | None:
    """The preset a warm start's name starts from ("qwen2.5vl-tiny-warm" -> "qwen2.5vl-tiny"), None
    for any other name; a ValueError for "<preset>-warm" of a preset that has none ("small-warm")."""
    if not name.endswith(WARM_SUFFIX):
        return None
    base = name.removesuffix(WARM_SUFFIX)
    if name in warm_start_names():
        return base
    if preset_family(base) is not None:
        raise ValueError(f"model {name!r}: only a family's tiny preset has a warm start, one of "
                         f"{', '.join(warm_start_names())} (docs/demo.md)")
    return None


def resolve_model(model: str) -> str:
    """A preset name of any family ("tiny", "qwen3vl-2b", "qwen2.5vl-tiny", ...) becomes its built
    folder; anything else is returned as is. A warm start ("tiny-warm", "qwen2.5vl-tiny-warm") is
    refused: it is built by training, which happens where a run starts
    (`saccade.demo.resolve_warm_start`), never down here."""
    if warm_start_base(model) is not None:
        raise ValueError(f"model {model!r} (the demo's warm start) is built by training and is resolved where "
                         "a run starts: run it through the saccade CLI, or call saccade.demo.resolve_warm_start "
                         "(a config) or saccade.demo.resolve_model_name (a name) and pass the folder it returns")
    family = preset_family(model)
    return str(family.tiny_model_path(model, 0)) if family else model
