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

from dataclasses import dataclass

import torch
from torch import nn

from saccade.models.families.interface import ModelFamily, ties_embeddings, transformers_class
from saccade.models.positions import mrope_positions as _shared_mrope_positions

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


def mrope_positions(mm_token_type_ids_L: torch.Tensor, grid_thw_N3: torch.Tensor | None, merge: int) -> torch.Tensor:
    """(3, L) M-RoPE positions of one sample: Qwen2-VL's rule for images, which Qwen3.5 inherits
    (`Qwen3_5Model.get_rope_index` changes videos only), so the shared function. The partial rotary
    and the interleaved sections act on the frequencies, not on the positions."""
    return _shared_mrope_positions(mm_token_type_ids_L, grid_thw_N3, spatial_merge_size=merge)


# ---------------------------------------------------------------------- memory dimensions


@dataclass(frozen=True)
class LinearAttentionDims:
    """The Gated DeltaNet layers as `saccade.memory.TextDims.linear_attention` counts them: `layers`
    of the decoder layers replace attention with this mixer (Qwen3_5GatedDeltaNet)."""

    layers: int
    num_key_heads: int
    num_value_heads: int
    key_head_dim: int
    value_head_dim: int
    conv_kernel: int

    @property
    def key_dim(self) -> int:
        return self.num_key_heads * self.key_head_dim

    @property
    def value_dim(self) -> int:
        return self.num_value_heads * self.value_head_dim

    def linear_shapes(self, hidden: int) -> dict[str, tuple[int, int]]:
        """(in_features, out_features) of the mixer's linears."""
        k, v, nv = self.key_dim, self.value_dim, self.num_value_heads
        return {"in_proj_qkv": (hidden, 2 * k + v), "in_proj_z": (hidden, v), "in_proj_b": (hidden, nv),
                "in_proj_a": (hidden, nv), "out_proj": (v, hidden)}

    def mixer_params(self, hidden: int) -> int:
        """The linears, the depthwise conv1d over q, k, v (no bias), dt_bias and A_log per value head,
        the gated RMSNorm over value_head_dim."""
        linears = sum(i * o for i, o in self.linear_shapes(hidden).values())
        conv = (2 * self.key_dim + self.value_dim) * self.conv_kernel
        return linears + conv + 2 * self.num_value_heads + self.value_head_dim

    def lora_params(self, rank: int, hidden: int, targets) -> int:
        """One layer's adapters on the targeted mixer linears."""
        return sum(rank * (i + o) for n, (i, o) in self.linear_shapes(hidden).items() if n in targets)

    def activation_bytes(self, dtype_bytes: int, hidden: int) -> int:
        """Per token, one mixer (an estimate, not checked against autograd): the projections'
        outputs (b * (2K + V + V + 2 nv)), the conv's output and its silu (2b(2K + V)), the float32
        q, k, v, beta and decay of the chunked rule (4(2K + V + 2nv)), and its float32 output and
        the gated norm's input (8V). The chunk-local (64 x 64) matrices are per chunk: not counted."""
        b, k, v, nv = dtype_bytes, self.key_dim, self.value_dim, self.num_value_heads
        qkv = 2 * k + v
        return b * (qkv + v + 2 * nv) + 2 * b * qkv + 4 * (qkv + 2 * nv) + 8 * v

    def state_bytes(self, dtype_bytes: int = 4) -> int:
        """What one sequence holds in all these layers while it decodes, whatever its length: the
        recurrent state (value heads x key_head_dim x value_head_dim, float32 in vLLM's default
        `mamba_ssm_dtype`) and the conv's last kernel - 1 inputs (in the model's dtype, here 2)."""
        recurrent = self.num_value_heads * self.key_head_dim * self.value_head_dim * dtype_bytes
        conv = (2 * self.key_dim + self.value_dim) * (self.conv_kernel - 1) * 2
        return self.layers * (recurrent + conv)


def layer_types(text: dict) -> list[str]:
    """The config's `layer_types`, or transformers' default from `full_attention_interval`."""
    if text.get("layer_types"):
        return list(text["layer_types"])
    every = text.get("full_attention_interval", 4)
    return ["linear_attention" if (i + 1) % every else "full_attention" for i in range(text["num_hidden_layers"])]


def memory_dims(config: dict) -> tuple[dict, dict]:
    """config.json -> the fields of `saccade.memory.TextDims` and `VisionDims`: gated attention (q_proj
    twice as wide) with q/k norms on the full layers, the Gated DeltaNet layers
    (`LinearAttentionDims`), Qwen3-VL's tower without DeepStack."""
    t, v = config["text_config"], config["vision_config"]
    heads = t["num_attention_heads"]
    kinds = layer_types(t)
    text = dict(
        vocab_size=t["vocab_size"], hidden_size=t["hidden_size"], num_hidden_layers=t["num_hidden_layers"],
        num_attention_heads=heads, num_key_value_heads=t.get("num_key_value_heads", heads),
        head_dim=t.get("head_dim") or t["hidden_size"] // heads, intermediate_size=t["intermediate_size"],
        tie_word_embeddings=ties_embeddings(config),
        attention_output_gate=True,
        linear_attention=LinearAttentionDims(
            layers=kinds.count("linear_attention"), num_key_heads=t.get("linear_num_key_heads", 16),
            num_value_heads=t.get("linear_num_value_heads", 32), key_head_dim=t.get("linear_key_head_dim", 128),
            value_head_dim=t.get("linear_value_head_dim", 128), conv_kernel=t.get("linear_conv_kernel_dim", 4)),
    )
    vision = dict(
        hidden_size=v["hidden_size"], depth=v["depth"], intermediate_size=v["intermediate_size"],
        out_hidden_size=v["out_hidden_size"], num_position_embeddings=v.get("num_position_embeddings", 2304),
        deepstack_levels=0, patch_size=v.get("patch_size", 16), temporal_patch_size=v.get("temporal_patch_size", 2),
        in_channels=v.get("in_channels", 3), spatial_merge_size=v.get("spatial_merge_size", 2),
    )
    return text, vision


# vLLM 0.32's CPU build runs the Gated DeltaNet with its own kernels, which take bf16 only: an fp32
# server starts and answers /health, then its engine dies at the first request.
CPU_DTYPE = ("bfloat16", "its CPU Gated DeltaNet kernel asserts it: vllm/model_executor/layers/mamba/ops/cpu/"
             "gdn_attention.py, 'CPU GDN attention requires BF16', at the first request, not at start")


FAMILY = ModelFamily(
    name="Qwen3.5",
    model_types=("qwen3_5",),
    full_model_name="Qwen3_5ForConditionalGeneration",
    text_model_class=text_model_class,
    vision_model_class=vision_model_class,
    full_model_class=full_model_class,
    deepstack_levels=deepstack_levels,
    run_tower=run_tower,
    mrope_positions=mrope_positions,
    memory_dims=memory_dims,
    lora_target_modules=LORA_TARGETS,
    prepare_language_model=prepare_language_model,
    vllm_cpu_dtype=CPU_DTYPE,
)
