"""Qwen2.5-VL (model_type `qwen2_5_vl`): what is particular to it, in one place.

How it differs from Qwen3-VL (checked against transformers 5.19's `models/qwen2_5_vl/` and vLLM
0.32's `model_executor/models/qwen2_5_vl.py`; docs/families.md has the commands and figures):
- Vision tower: patch 14 (not 16), no learned position grid (2-D rotary only), windowed
  attention (windows of `window_size` pixels, full attention only in `fullatt_block_indexes`),
  RMSNorm and gated MLPs in its blocks, RMSNorm + 2-layer MLP merger, CLIP mean/std in the
  processor. No DeepStack: the tower's output is one (N, H) tensor, and the language model
  takes nothing but inputs_embeds (the interface's defaults: no hooks, no extra kwargs).
- Language model: Qwen2 (q/k/v with bias, head_dim = hidden / heads, no q/k norm), M-RoPE with
  contiguous sections [16, 24, 24] (Qwen3-VL interleaves them).
- Positions: the same rule as Qwen3-VL for images (an image advances the text position by
  max(H', W')); a clip is one run of pads whose temporal patches are spaced by the tower's
  `tokens_per_second` x the clip's seconds per temporal patch (`second_per_grid_ts`):
  `saccade.models.positions.mrope_positions_seconds`.
- Checkpoints on the hub are in the pre-4.52 layout (`model.layers.*`, `visual.*`), and
  transformers 5.19's save_pretrained writes that layout back; saccade reads it through
  transformers' own renames (`models/checkpoint_layout.py`). vLLM reads both layouts, so what
  saccade writes into a base folder keeps the base's own keys (the writer's rule).
- Hub config.json is flat: the text fields sit at the top level, only `vision_config` nests.
"""

from __future__ import annotations

import torch
from torch import nn

from saccade.models.families.interface import ModelFamily, transformers_class
from saccade.models.positions import mrope_positions_seconds

# The language model's linears, as in Qwen3-VL (dense: no fused expert parameters).
LORA_TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")



# ------------------------------------------------------------------------------- classes


MODELING = "transformers.models.qwen2_5_vl.modeling_qwen2_5_vl"
text_model_class = transformers_class(MODELING, "Qwen2_5_VLTextModel")
vision_model_class = transformers_class(MODELING, "Qwen2_5_VisionTransformerPretrainedModel")
full_model_class = transformers_class("transformers", "Qwen2_5_VLForConditionalGeneration")


# Checkpoint keys: the hub's Qwen2.5-VL checkpoints (written before transformers 4.52) hold
# `model.layers.*`, `model.embed_tokens.*`, `model.norm.*`, `visual.*` and `lm_head.weight`;
# transformers 5.19 renames them on load (conversion_mapping.py: "Qwen2_5_VLForConditionalGeneration"
# -> "Qwen2VLForConditionalGeneration"), and saccade reads through that same loader
# (`models/checkpoint_layout.py`). vLLM 0.32 reads both layouts (its hf_to_vllm_mapper).


def deepstack_levels(config) -> int:
    """Qwen2.5-VL has no DeepStack."""
    return 0


def run_tower(tower: nn.Module, pixel_values: torch.Tensor, grid_thw_I3: torch.Tensor):
    """(merged features (N, H), []) for the images' N merged patches: the tower's pooler_output,
    already put back in image order after the windowing (`get_image_features`, unsplit)."""
    out = tower(pixel_values, grid_thw=grid_thw_I3, return_dict=True)
    return out.pooler_output, []


FAMILY = ModelFamily(
    name="Qwen2.5-VL",
    model_types=("qwen2_5_vl",),
    text_model_class=text_model_class,
    vision_model_class=vision_model_class,
    full_model_class=full_model_class,
    deepstack_levels=deepstack_levels,
    run_tower=run_tower,
    # Qwen2.5-VL's rule for images equals Qwen3-VL's (`Qwen2_5_VLModel.get_rope_index`: text +1 a
    # token; an image's patches at start + (t, i, j); the text after it at start + max(H', W')).
    # Clips differ: a clip's temporal patch k at start + floor(k x tokens_per_second x seconds per
    # temporal patch), its own rule; the text after a long clip one past its last temporal patch,
    # as vLLM and Qwen's published code put it, not where transformers 5.19 does.
    mrope_positions=mrope_positions_seconds,
    transformers_clip_positions=False,
    lora_target_modules=LORA_TARGETS,
)
