"""The random models saccade builds offline (presets), and the names that resolve to them.

A preset is data (`table.py`: a published config.json plus changes), built by one builder
(`builder.py`) and cached. A preset's family is the family of its config's model_type; each
family's first preset is its tiny one, which the tests build and whose demo warm start is named
"<preset>-warm" (docs/families.md, "Presets").
"""

from __future__ import annotations

from saccade.models.families import FAMILIES, ModelFamily, family_of
from saccade.models.presets.builder import (
    BUILD_VERSION, CHAT_TEMPLATE, build, build_config, build_once, build_tokenizer, cache_dir, is_built, preset_folder,
    preset_path,
)
from saccade.models.presets.table import PRESETS, Preset, preset_config, published_config, published_ids

__all__ = ["BUILD_VERSION", "CHAT_TEMPLATE", "PRESETS", "Preset", "build", "build_config", "build_once", "build_tokenizer",
           "cache_dir", "is_built", "preset_config", "preset_family", "preset_folder", "preset_path", "presets_of",
           "published_config", "published_ids", "resolve_model", "tiny_preset", "warm_start_base", "warm_start_names"]


def preset_family(name: str) -> ModelFamily | None:
    """The family that preset `name` is a model of, None for a name that is no preset."""
    preset = PRESETS.get(name)
    return family_of(published_config(preset.published)) if preset else None


def presets_of(family: ModelFamily) -> tuple[str, ...]:
    """A family's presets, its tiny one first."""
    return tuple(name for name in PRESETS if preset_family(name) is family)


def tiny_preset(family: ModelFamily) -> str:
    """The family's tiny preset: the one the tests build and the demo's config is sized for."""
    return presets_of(family)[0]


# The demo's warm start of a family's tiny model is named "<preset>-warm" ("tiny-warm" is Qwen3-VL's).
WARM_SUFFIX = "-warm"


def warm_start_names() -> tuple[str, ...]:
    """The names of the warm starts: one per family, of its tiny preset."""
    return tuple(tiny_preset(f) + WARM_SUFFIX for f in FAMILIES)


def warm_start_base(name: str) -> str | None:
    """The preset a warm start's name starts from ("qwen2.5vl-tiny-warm" -> "qwen2.5vl-tiny"), None
    for any other name; a ValueError for "<preset>-warm" of a preset that has none ("small-warm")."""
    if not name.endswith(WARM_SUFFIX):
        return None
    base = name.removesuffix(WARM_SUFFIX)
    if name in warm_start_names():
        return base
    if base in PRESETS:
        raise ValueError(f"model {name!r}: only a family's tiny preset has a warm start, one of "
                         f"{', '.join(warm_start_names())} (docs/demo.md)")
    return None


def resolve_model(model: str) -> str:
    """A preset's name ("tiny", "qwen3vl-2b", "qwen2.5vl-tiny", ...) becomes its built folder;
    anything else is returned as is. A warm start ("tiny-warm", "qwen2.5vl-tiny-warm") is
    refused: it is built by training, which happens where a run starts
    (`saccade.tools.demo.resolve_warm_start`), never down here."""
    if warm_start_base(model) is not None:
        raise ValueError(f"model {model!r} (the demo's warm start) is built by training and is resolved where "
                         "a run starts: run it through the saccade CLI, or call saccade.tools.demo.resolve_warm_start "
                         "(a config) or saccade.tools.demo.resolve_model_name (a name) and pass the folder it returns")
    return str(preset_path(model)) if model in PRESETS else model
