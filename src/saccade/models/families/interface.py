"""What saccade asks of a model family, and the defaults most families share.

A family is one `ModelFamily` value (`FAMILY` in its own module under `saccade.models.families`):
plain data and small pure functions, no state. Everything outside `models/families/` that
depends on the architecture asks the family of the model at hand (`family_of`), so adding a
family is one module plus one line in the registry (docs/families.md).

This module holds the type apart from the registry in `__init__`: the family modules import the
type and the registry imports the family modules, and `tests/test_imports.py` forbids the cycle
that one file holding both would make.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
from torch import nn

from saccade.config import ImagesConfig
from saccade.models.positions import with_text_row

if TYPE_CHECKING:
    from saccade.data.videos import ClipRefs

# The canonical checkpoint names (transformers 5's layout for the whole VLM): what saccade's
# trainer holds, writes and reads, whatever layout a family's hub checkpoints use.
LM_PREFIX = "model.language_model."
VISION_PREFIX = "model.visual."
LM_HEAD_KEY = "lm_head.weight"


def ties_embeddings(config: dict) -> bool:
    """Whether lm_head is the embeddings, by config.json alone: transformers' config class decides
    (`tie_word_embeddings` of the composite config, which the model's loader and vLLM read), so
    each family's own rule holds: Qwen3-VL-MoE's text config defaults the flag to true and is not
    read; Qwen2.5-VL's forwards a pre-v5 text-level true to the top. With the weights at hand,
    `models/checkpoint_layout.py` asks transformers' loader (which also looks at the tensors)."""
    from transformers import AutoConfig

    fields = {k: v for k, v in config.items() if k != "model_type"}
    return bool(AutoConfig.for_model(config["model_type"], **fields).tie_word_embeddings)


def transformers_class(module: str, name: str) -> Callable[[], type]:
    """A function that imports `module` and returns its class `name` when called: families name
    their transformers classes without importing transformers until a model is built."""
    def load() -> type:
        import importlib

        return getattr(importlib.import_module(module), name)

    load.__name__ = name
    return load


def no_hooks(language_model: nn.Module) -> None:
    """A language model that takes image features in its input embeddings only."""


def no_kwargs(image_positions_N: torch.Tensor | None, deepstack_levels: list[torch.Tensor] | None) -> dict:
    """A language model whose forward needs nothing about the images beyond its embeddings."""
    return {}


@dataclass(frozen=True)
class HubCheckpoint:
    """How a family's published checkpoints hold the model: the layout saccade writes back for vLLM,
    for exports and for its random builds. Reading goes the other way through transformers' own
    loader (`models/checkpoint_layout.py`: its renames, expert merges, transposes and tie), so only
    the way out is the family's (torchtitan's StateDictAdapter has both `to_hf` and `from_hf`;
    transformers' conversion mapping is saccade's `from_hf`). Names never change on the way out:
    the writer keeps the base file's own key for each tensor (`trainer/engine_weights.py`)."""

    # Key suffixes of 3-D tensors the hub stores with their last two dims swapped from
    # transformers' modules: Qwen3-VL-MoE's fused experts, (E, 2I, H) / (E, H, I) in memory,
    # (E, H, 2I) / (E, I, H) on the hub and in what vLLM reads.
    transposed: tuple[str, ...] = ()
    # Whether transformers' `save_pretrained` default (`save_original_format=True`) writes the hub's
    # names and packing (Qwen2.5-VL's pre-4.52 names: yes); False where its memory layout is the
    # hub's instead (Qwen3.5-MoE: the default splits the fused experts one tensor per expert).
    saved_as_published: bool = True
    # text_config keys transformers writes -> the hub's spelling of them in config.json.
    config_names: Mapping[str, str] = field(default_factory=dict)

    def to_hub(self, name: str, tensor: torch.Tensor) -> torch.Tensor:
        """A tensor under its canonical `name`, in the modules' layout -> the hub's layout: one
        tensor for one, as the streamed engine-weights writer needs."""
        if name.endswith(self.transposed):
            assert tensor.dim() == 3, (name, tuple(tensor.shape))
            return tensor.transpose(1, 2).contiguous()
        return tensor

    def save(self, model: nn.Module, out: Path) -> None:
        """Write `model` (transformers' whole model) into `out` as the hub's files hold it: transformers'
        `save_pretrained`, then each tensor through `to_hub` and config.json's keys respelled."""
        import json

        model.save_pretrained(out, safe_serialization=True, save_original_format=self.saved_as_published)
        if self.transposed:
            from safetensors import safe_open
            from safetensors.torch import save_file

            for file in sorted(Path(out).glob("*.safetensors")):
                with safe_open(str(file), framework="pt") as f:
                    metadata = f.metadata() or {"format": "pt"}
                    tensors = {key: self.to_hub(key, f.get_tensor(key)) for key in f.keys()}  # noqa: SIM118
                save_file(tensors, str(file), metadata=metadata)
        config_file = Path(out) / "config.json"
        config = json.loads(config_file.read_text())
        text = config.get("text_config", config)
        if any(k in text for k in self.config_names):
            for written, published in self.config_names.items():
                if written in text:
                    text[published] = text.pop(written)
            config_file.write_text(json.dumps(config, indent=2, sort_keys=True) + "\n")


@dataclass
class Routing:
    """What a MoE family's `record_routing` fills while it is open: each MoE layer's chosen
    experts, (N, top_k) int64 over a forward's N tokens (row order), layer after layer, forward
    after forward."""

    num_experts: int
    layers: int = 0  # MoE layers: how many entries of `chosen` one forward appends
    chosen: list[torch.Tensor] = field(default_factory=list)

    @property
    def id_dtype(self) -> torch.dtype:
        """The narrowest dtype that holds every expert id: what a sample carries per token, layer
        and choice, a byte up to 256 experts (vLLM's routing capture narrows the same way)."""
        return torch.uint8 if self.num_experts <= 256 else torch.int16

    def take(self) -> torch.Tensor:
        """What one forward recorded, as (N, MoE layers, top_k) in `id_dtype`, and forget it:
        a caller that runs many forwards (the embedded engine, a token at a time) keeps only
        the rows it wants."""
        assert len(self.chosen) == self.layers, f"{len(self.chosen)} layers recorded, one forward has {self.layers}"
        chosen_NLK = torch.stack(self.chosen, dim=1).to(self.id_dtype)
        self.chosen.clear()
        return chosen_NLK


@contextlib.contextmanager
def no_routing(language_model: nn.Module) -> Iterator[None]:
    """A dense language model: no router, nothing recorded."""
    yield None


def split_concatenated(features_NW: torch.Tensor, levels: int) -> tuple[torch.Tensor, list[torch.Tensor]]:
    """vLLM's tower output for one image, (n, H * (1 + levels)): the main features first, then
    each DeepStack level, side by side along the hidden axis. -> (main (n, H), [level (n, H)])."""
    width = features_NW.shape[1]
    if width % (1 + levels):
        raise RuntimeError(f"tower output width {width} is not a multiple of 1 + {levels} DeepStack levels")
    chunks = features_NW.split(width // (1 + levels), dim=1)
    return chunks[0], list(chunks[1:])


def resize_bounds(limits: ImagesConfig) -> dict[str, int]:
    """The Qwen2-VL image processor's `size`: resize bounds in pixels (h * w)."""
    from saccade.data.messages import processor_size

    return processor_size(limits)


@dataclass(frozen=True)
class Positions:
    """One model's M-RoPE positions: its family's rule (`ModelFamily.mrope_positions`) at its tower's
    merge size and temporal rate. The one object every stage asks: the engines for the prompts they
    run, the trainer for its samples (`saccade.trainer.samples.make_sample`), the multi-turn check for
    what the engine ran (`saccade.envs.trajectory.check_consistency`). A run gets it from its model
    (`PolicyLM.positions`, kept as `Setup.positions`), an engine from its family
    (`VisionEncoder.positions`; the vLLM engine's `family`), so a family with another rule changes
    its `mrope_positions` and nothing else.

    Clips (mm_token_type 2) are placed by the family's rule from `ClipRefs` (their grids and seconds
    per temporal patch): Qwen2.5-VL spaces a clip's temporal patches by `tokens_per_second` x its
    seconds per patch, the Qwen3 generations place each frame group as an image between its
    timestamps (`saccade.models.positions`)."""

    rule: Callable[..., torch.Tensor]  # the family's mrope_positions
    merge: int  # the tower's spatial merge size: merge x merge patches per image token
    tokens_per_second: float = 1.0  # the tower's temporal positions per second of clip (Qwen2.5-VL's vision config)

    def mrope(self, mm_token_type_ids_L: torch.Tensor, image_grid_thw_N3: torch.Tensor | None,
              clips: ClipRefs | None = None) -> torch.Tensor:
        """(3, L) int64 (t, h, w) positions of one prompt or sample; its images and clips in order."""
        return self.rule(mm_token_type_ids_L, image_grid_thw_N3, self.merge, clips, self.tokens_per_second)

    def with_text_row(self, mm_token_type_ids_L: torch.Tensor, image_grid_thw_N3: torch.Tensor | None,
                      clips: ClipRefs | None = None) -> torch.Tensor:
        """(4, L) int64, a training sample's: the per-sample text position 0..L-1 packing relies on
        (docs/packing.md), then `mrope`'s three rows."""
        return with_text_row(self.mrope(mm_token_type_ids_L, image_grid_thw_N3, clips))


@dataclass(frozen=True, eq=False)
class ModelFamily:
    """One architecture family as saccade sees it. Members are data or functions of their
    arguments alone; docs/families.md describes each one. A family is a singleton: compared and
    hashed by identity."""

    name: str  # what errors and docs call it, e.g. "Qwen3-VL"
    model_types: tuple[str, ...]  # config.json's model_type values it serves
    text_model_class: Callable[[], type]  # the language model alone (imported when called)
    vision_model_class: Callable[[], type]  # the vision tower alone
    full_model_class: Callable[[], type]  # the whole model: the parity reference; its __name__ the class's
    deepstack_levels: Callable[[Any], int]  # the config's DeepStack levels (0: none)
    run_tower: Callable[[nn.Module, torch.Tensor, torch.Tensor], tuple[torch.Tensor, list[torch.Tensor]]]
    # (mm_token_type_ids_L, image_grid_thw_N3, merge, clips, tokens_per_second) -> (3, L): the rule;
    # every stage asks `positions(...)`.
    mrope_positions: Callable[..., torch.Tensor]
    lora_target_modules: tuple[str, ...]  # the language model's linears LoRA wraps by default
    lora_target_parameters: tuple[str, ...] = ()  # parameters (not modules) LoRA wraps: MoE experts
    prepare_language_model: Callable[[nn.Module], None] = no_hooks  # once, after it is built
    language_model_kwargs: Callable[[torch.Tensor | None, list[torch.Tensor] | None], dict] = no_kwargs
    # The hub's checkpoint layout, what saccade writes for vLLM, exports and random builds (reading
    # goes through transformers: `models/checkpoint_layout.py`).
    checkpoint: HubCheckpoint = field(default_factory=HubCheckpoint)
    # MoE: a context manager over the language model's forwards, yielding a `Routing` that fills
    # with each MoE layer's chosen experts; None for dense models.
    record_routing: Callable[[nn.Module], contextlib.AbstractContextManager] = no_routing
    # None: a vLLM CPU server reloads this family's weights in place (/update_weights); else why it cannot.
    vllm_cpu_weight_updates: str | None = None
    # None: a vLLM CPU server serves this family in any dtype; else (the one dtype it serves it in,
    # why): `saccade serve` on a CPU takes that dtype when --dtype is not given and refuses another.
    vllm_cpu_dtype: tuple[str, str] | None = None
    split_served_features: Callable[[torch.Tensor, int], tuple[torch.Tensor, list[torch.Tensor]]] = (
        split_concatenated)
    processor_size: Callable[[ImagesConfig], dict] = resize_bounds
    # False where transformers' get_rope_index departs from the family's published rule for some
    # clips (Qwen2.5-VL after a long clip: saccade.models.positions, "After a long clip"); the
    # parity reference then runs the full model on the published positions.
    transformers_clip_positions: bool = True

    def __post_init__(self):
        assert self.model_types, self.name

    def positions(self, merge: int, tokens_per_second: float = 1.0) -> Positions:
        """This family's M-RoPE rule at a tower's merge size (and, for clips, its temporal rate):
        what every stage computes positions with."""
        return Positions(self.mrope_positions, int(merge), tokens_per_second)

    def positions_of(self, config) -> Positions:
        """`positions` of a model from its config (the whole model's or its vision config's): the
        merge size, and the tower's `tokens_per_second` where it has one (Qwen2.5-VL)."""
        vision = getattr(config, "vision_config", config)
        return self.positions(vision.spatial_merge_size, getattr(vision, "tokens_per_second", 1.0))
