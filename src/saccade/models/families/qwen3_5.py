"""Qwen3.5, dense (model_type `qwen3_5`: Qwen3.5-9B, 27B, ...): what is particular to it, in one place.

Checked against transformers 5.19's `models/qwen3_5/` (modular_qwen3_5.py; docs/families.md has
the commands and figures):
- Language model: hybrid. `layer_types` (default: every 4th layer full, `full_attention_interval`)
  gives each decoder layer either a Gated DeltaNet (`linear_attn`: in_proj_qkv, in_proj_z,
  in_proj_b, in_proj_a, a depthwise causal conv1d, dt_bias, A_log, a gated RMSNorm, out_proj)
  or gated full attention (`self_attn`: q_proj is twice as wide, query and a sigmoid output
  gate; q/k RMSNorms over head_dim). Every layer has the dense SwiGLU MLP. RMSNorms are
  zero-centred (weight + 1).
- Rotary: partial (`partial_rotary_factor`, 0.25: 64 of head_dim 256 rotate), M-RoPE interleaved
  as in Qwen3-VL (`Qwen3VLTextRotaryEmbedding.recomposition_frequencies`), `mrope_section` over
  the rotary half ([11, 11, 10] = 32 = 64 / 2). Positions do not depend on either: the rule is
  `Qwen2VLModel.get_rope_index` for images (Qwen3.5 only splits videos by frame), the shared one.
- Linear-attention layers take no positions: they see the order of the row. Packing several
  samples in one row therefore needs their state reset at each boundary (issue 32, second part:
  `prepare_language_model`).
- Vision tower: Qwen3-VL's (patch 16, learned 48 x 48 position grid, 2-D rotary, LayerNorms,
  merger) without DeepStack (`Qwen3_5VisionModel` deletes the DeepStack mergers): the tower's
  output is one (N, H) tensor, the language model takes nothing but inputs_embeds.
- Processor: Qwen3VLProcessor with Qwen2VLImageProcessor (transformers' auto mapping for
  `qwen3_5`), patch 16, merge 2, mean = std = 0.5, as Qwen3-VL: one image token per 32 x 32 px.
- Checkpoints: transformers 5's canonical names (`model.language_model.*`, `model.visual.*`,
  `lm_head.weight`); the hub's files add `mtp.*` (a multi-token-prediction head saccade never
  reads: transformers' `_keys_to_ignore_on_load_unexpected` names it, and saccade's loader, which
  is transformers', leaves it unread on purpose).
"""

from __future__ import annotations

import torch
from torch import nn

from saccade.models.families.interface import ModelFamily, transformers_class
from saccade.models.positions import mrope_positions_frames

# The full-attention layers' and every layer's MLP linears, then the Gated DeltaNet's linears.
DENSE_TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
LINEAR_ATTENTION_TARGETS = ("in_proj_qkv", "in_proj_z", "in_proj_b", "in_proj_a", "out_proj")
LORA_TARGETS = DENSE_TARGETS + LINEAR_ATTENTION_TARGETS

MODELING = "transformers.models.qwen3_5.modeling_qwen3_5"
text_model_class = transformers_class(MODELING, "Qwen3_5TextModel")
vision_model_class = transformers_class(MODELING, "Qwen3_5VisionModel")
full_model_class = transformers_class("transformers", "Qwen3_5ForConditionalGeneration")


def deepstack_levels(config) -> int:
    """Qwen3.5's tower has no DeepStack (`Qwen3_5VisionModel.__init__` deletes its mergers)."""
    return 0


def run_tower(tower: nn.Module, pixel_values: torch.Tensor, grid_thw_I3: torch.Tensor):
    """(merged features (N, H), []) for the images' N merged patches: the tower's pooler_output."""
    out = tower(pixel_values, grid_thw=grid_thw_I3, return_dict=True)
    return out.pooler_output, []


def prepare_language_model(language_model: nn.Module) -> None:
    """Packing exact for the Gated DeltaNet layers: each sample of a packed row starts from a zero
    convolution history and recurrent state (`saccade.models.linear_attention`; without it they
    carry over from one sample into the next, 0.084 off on the parity conversations)."""
    from saccade.models.linear_attention import make_packing_exact

    make_packing_exact(language_model)


# vLLM 0.32's CPU build runs the Gated DeltaNet with its own kernels, which take bf16 only: an fp32
# server starts and answers /health, then its engine dies at the first request.
CPU_DTYPE = ("bfloat16", "its CPU Gated DeltaNet kernel asserts it: vllm/model_executor/layers/mamba/ops/cpu/"
             "gdn_attention.py, 'CPU GDN attention requires BF16', at the first request, not at start")


FAMILY = ModelFamily(
    name="Qwen3.5",
    model_types=("qwen3_5",),
    text_model_class=text_model_class,
    vision_model_class=vision_model_class,
    full_model_class=full_model_class,
    deepstack_levels=deepstack_levels,
    run_tower=run_tower,
    # Qwen2-VL's rule for images, which Qwen3.5 inherits; `Qwen3_5Model.get_rope_index` splits a
    # clip by frame group, as Qwen3-VL. The partial rotary and the interleaved sections act on the
    # frequencies, not on the positions.
    mrope_positions=mrope_positions_frames,
    lora_target_modules=LORA_TARGETS,
    prepare_language_model=prepare_language_model,
    vllm_cpu_dtype=CPU_DTYPE,
)
