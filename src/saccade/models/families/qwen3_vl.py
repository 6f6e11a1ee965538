"""Qwen3-VL (model_type `qwen3_vl`): what is particular to it, in one place.

- DeepStack: the tower returns, besides the merged features that replace the image pads, one
  feature map per `vision_config.deepstack_visual_indexes` entry; the language model adds level
  k to the image positions' hidden states after decoder layer k (`_add_deepstack`).
- Checkpoints are keyed as transformers 5 saves them (`model.language_model.*`,
  `model.visual.*`, `lm_head.weight`), saccade's canonical names: no key mapping, no layout
  conversion for vLLM.
- M-RoPE over (t, h, w) with interleaved sections; the rule is `saccade.models.positions`':
  images as Qwen2-VL places them, a clip's frame groups each as a one-frame image between its
  timestamps (`mrope_positions_frames`).
- The tower normalises inside itself in vLLM; the processor takes resize bounds in pixels.
"""

from __future__ import annotations

import types

import torch
from torch import nn

from saccade.models.families.interface import ModelFamily, transformers_class
from saccade.models.positions import mrope_positions_frames

# The dense language model's linears: attention and MLP of every decoder layer.
LORA_TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


MODELING = "transformers.models.qwen3_vl.modeling_qwen3_vl"
text_model_class = transformers_class(MODELING, "Qwen3VLTextModel")
vision_model_class = transformers_class(MODELING, "Qwen3VLVisionModel")
full_model_class = transformers_class("transformers", "Qwen3VLForConditionalGeneration")


def deepstack_levels(config) -> int:
    """From the whole model's config or the vision config alone."""
    vision = getattr(config, "vision_config", config)
    return len(vision.deepstack_visual_indexes)


def run_tower(tower: nn.Module, pixel_values: torch.Tensor, grid_thw_I3: torch.Tensor):
    """(merged features (N, H), [DeepStack level (N, H)]) for the images' N merged patches."""
    out = tower(pixel_values, grid_thw=grid_thw_I3, return_dict=True)
    return out.pooler_output, list(out.deepstack_features)


def prepare_language_model(language_model: nn.Module) -> None:
    """DeepStack takes the image positions as flat indices, not a boolean mask (`_add_deepstack`)."""
    language_model._deepstack_process = types.MethodType(_add_deepstack, language_model)


def _add_deepstack(language_model: nn.Module, hidden_states_BLH: torch.Tensor, image_positions_N: torch.Tensor,
                   visual_embeds_NH: torch.Tensor) -> torch.Tensor:
    """transformers' `Qwen3VLTextModel._deepstack_process` (hidden states + one DeepStack level at
    the image positions) for the positions `PolicyLM.embed_inputs` passes: flat indices into
    (B x L), not a boolean mask. index_add instead of boolean indexing, whose data-dependent size
    makes a GPU wait for the host at every level of every forward; the same sums (one add per
    image position), the same gradient."""
    H = hidden_states_BLH.shape[-1]
    flat_NH = hidden_states_BLH.reshape(-1, H)
    return flat_NH.index_add(0, image_positions_N, visual_embeds_NH.to(flat_NH.dtype)).view_as(hidden_states_BLH)


def language_model_kwargs(image_positions_N: torch.Tensor | None, deepstack: list[torch.Tensor] | None) -> dict:
    """`Qwen3VLTextModel.forward`'s DeepStack arguments (the positions go to `_add_deepstack`)."""
    if image_positions_N is None or not deepstack:
        return {}
    return {"visual_pos_masks": image_positions_N, "deepstack_visual_embeds": deepstack}


FAMILY = ModelFamily(
    name="Qwen3-VL",
    model_types=("qwen3_vl",),
    text_model_class=text_model_class,
    vision_model_class=vision_model_class,
    full_model_class=full_model_class,
    deepstack_levels=deepstack_levels,
    run_tower=run_tower,
    # Qwen2-VL's rule for images; a clip split into its frame groups (`Qwen3VLModel.get_rope_index`).
    mrope_positions=mrope_positions_frames,
    lora_target_modules=LORA_TARGETS,
    prepare_language_model=prepare_language_model,
    language_model_kwargs=language_model_kwargs,
)
