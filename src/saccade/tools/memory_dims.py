"""A model's dimensions for `saccade memory`, from its config.json alone: no torch, nothing loaded.

`model_dims(model)` takes a hub id saccade holds the config of (`saccade.models.presets`' published
configs), a preset (at published shapes: its config, no build; a tiny one: built, its config.json
read), a warm start (its preset's shapes) or a local folder. `dims_from_hf_config` reads a config.json
dict with the reader of its model type (`DIMS`): each architecture's fields into `TextDims` and
`VisionDims`, whose counts `saccade.tools.memory` turns into bytes. Checked: the counts equal the real
modules' on the meta device at every published size and on every tiny preset (tests/tools/test_memory.py,
tests/models/test_*.py).
"""

from __future__ import annotations

import json
import os
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

# The dense decoder layer's linears: attention, then the MLP. What LoRA wraps when the family says
# nothing else (`ModelDims.lora_targets`), and what the activation formula names.
LINEARS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


@dataclass(frozen=True)
class TextDims:
    """The language model, field for field its config.json's text fields (`DIMS`)."""

    vocab_size: int
    hidden_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    intermediate_size: int
    tie_word_embeddings: bool
    qkv_bias: bool = False  # q/k/v with biases (Qwen2.5-VL); Qwen3-VL's have none
    qk_norm: bool = True  # RMSNorms over head_dim on q and k (Qwen3-VL); Qwen2.5-VL has none
    experts: Any = None  # a MoE's sparse layers, counted by `ExpertDims` (below); None: dense
    attention_output_gate: bool = False  # q_proj twice as wide: the query and a sigmoid gate (Qwen3.5)
    # A hybrid's linear-attention layers, whose mixer replaces attention, counted by
    # `LinearAttentionDims` (below: params, LoRA, activations, decode state); None: attention everywhere.
    linear_attention: Any = None

    def linear_shapes(self) -> dict[str, tuple[int, int]]:
        """(in_features, out_features) of each linear of one dense decoder layer."""
        h, q, kv, inter = self.hidden_size, self.q_dim, self.kv_dim, self.intermediate_size
        return {
            "q_proj": (h, 2 * q if self.attention_output_gate else q), "k_proj": (h, kv), "v_proj": (h, kv), "o_proj": (q, h),
            "gate_proj": (h, inter), "up_proj": (h, inter), "down_proj": (inter, h),
        }

    @property
    def q_dim(self) -> int:
        return self.num_attention_heads * self.head_dim

    @property
    def kv_dim(self) -> int:
        return self.num_key_value_heads * self.head_dim

    @property
    def moe_layers(self) -> int:
        return self.experts.layers if self.experts else 0

    @property
    def linear_layers(self) -> int:
        return self.linear_attention.layers if self.linear_attention else 0

    @property
    def attention_layers(self) -> int:
        """Layers with (full) attention: all but a hybrid's linear-attention ones."""
        return self.num_hidden_layers - self.linear_layers

    def _layer(self, experts: str | None = None) -> int:
        """One decoder layer: attention (q/k/v biases, q_norm and k_norm where the family has them),
        two RMSNorms over hidden, and the dense MLP, or a MoE layer's router and its experts
        (`experts` "all", or "active": those one token runs through)."""
        shapes = self.linear_shapes()
        mlp = sum(i * o for i, o in (shapes[n] for n in LINEARS[4:])) if experts is None else 0
        moe = self.experts.mlp_params(self.hidden_size, active=experts == "active") if experts else 0
        return self._attention_params + mlp + moe + 2 * self.hidden_size

    @property
    def layer_params(self) -> int:
        """The largest decoder layer (a MoE one where there are any): what FSDP gathers at once."""
        return self._layer("all" if self.moe_layers else None)

    def decoder_params(self, experts: str = "all") -> int:
        """All decoder layers, with every expert (what the trainer holds) or the active ones. A
        hybrid's linear-attention layers swap attention (and its norms) for their mixer."""
        moe = self.moe_layers * self._layer(experts) if self.moe_layers else 0
        swap = self.linear_layers * (self.linear_attention.mixer_params(self.hidden_size) - self._attention_params) \
            if self.linear_layers else 0
        return (self.num_hidden_layers - self.moe_layers) * self._layer() + moe + swap

    @property
    def _attention_params(self) -> int:
        """One layer's attention: q/k/v/o, their biases and q/k norms where the family has them."""
        shapes = self.linear_shapes()
        biases = self.q_dim + 2 * self.kv_dim if self.qkv_bias else 0
        return sum(i * o for i, o in (shapes[n] for n in LINEARS[:4])) + biases + (2 * self.head_dim if self.qk_norm else 0)

    @property
    def params(self) -> int:
        """Language model + lm_head (counted once when tied), as `load_policy_lm` holds them."""
        embed = self.vocab_size * self.hidden_size
        return embed + self.decoder_params() + self.hidden_size + (0 if self.tie_word_embeddings else embed)

    @property
    def active_params(self) -> int:
        """What one token runs through: `params` with only its experts in each MoE layer."""
        return self.params - self.decoder_params() + self.decoder_params("active")

    def lora_params(self, rank: int, targets: tuple[str, ...]) -> int:
        """A (rank x in) + B (out x rank) for each targeted linear of every layer (the MLP's only
        in dense layers); MoE layers add the family's expert adapters (`experts.lora_params`)."""
        shapes = self.linear_shapes()
        attention = sum(rank * (shapes[t][0] + shapes[t][1]) for t in targets if t in LINEARS[:4])
        dense_mlp = sum(rank * (shapes[t][0] + shapes[t][1]) for t in targets if t in LINEARS[4:])
        experts = self.moe_layers * self.experts.lora_params(rank, self.hidden_size, targets) if self.moe_layers else 0
        mixer = self.linear_layers * self.linear_attention.lora_params(rank, self.hidden_size, targets) \
            if self.linear_layers else 0
        return self.attention_layers * attention + (self.num_hidden_layers - self.moe_layers) * dense_mlp + experts \
            + mixer

    def kv_bytes_per_token(self, dtype_bytes: int = 2) -> int:
        """K and V of the attention layers (a hybrid's linear-attention layers hold a state per
        sequence instead, whatever its length: `linear_attention.state_bytes`, not counted here)."""
        return 2 * self.attention_layers * self.kv_dim * dtype_bytes


@dataclass(frozen=True)
class VisionDims:
    """The vision tower, field for field its config.json's `vision_config` (`DIMS`)."""

    hidden_size: int
    depth: int
    intermediate_size: int
    out_hidden_size: int
    num_position_embeddings: int
    deepstack_levels: int
    patch_size: int = 16
    temporal_patch_size: int = 2
    in_channels: int = 3
    spatial_merge_size: int = 2
    gated_mlp: bool = False  # the blocks' MLP: gate, up and down (Qwen2.5-VL) or fc1, fc2 (Qwen3-VL)
    rms_norm: bool = False  # RMSNorms (a weight) instead of LayerNorms (weight and bias)
    patch_bias: bool = True  # the patch embedding's Conv3d has a bias
    num_heads: int = 16
    # The video processor's pixel bounds: True, over all of a clip's frames together (Qwen3-VL's
    # video processor: Qwen3-VL, Qwen3.5 and their MoE); False, each frame's (Qwen2-VL's: Qwen2.5-VL).
    video_pixels_per_clip: bool = True

    @property
    def patch_values(self) -> int:
        """Values in one patch row of `pixel_values(_videos)`: channels x temporal patch x patch x patch."""
        return self.in_channels * self.temporal_patch_size * self.patch_size**2

    def block_activation_bytes(self, dtype_bytes: int, *, stats_bytes: int = 4, split_attention: bool = False) -> int:
        """Bytes one ViT block keeps for backward per patch when the tower trains, from transformers'
        Qwen3-VL and Qwen2.5-VL vision blocks: each norm's input and output and its statistics (a
        LayerNorm: mean and rstd, float32 on a GPU, `stats_bytes`; an RMSNorm: its float32 input,
        rstd and the normalised input), q and k after the rotation, the fused qkv output (v is a
        view of it, so all of it stays), the attention's output and its float32 logsumexp per head,
        and the MLP's intermediates (fc1's output and the GELU's; gated: gate, up, silu(gate) and
        their product). `split_attention`: the attention kernel runs frame group by frame group
        and concatenates the outputs (sdpa, eager; not flash-attention's varlen), one more b*h.
        Exact against autograd's saved tensors on the tiny towers on the CPU (`split_attention`,
        LayerNorm's statistics in the input dtype: tests/tools/test_memory.py); the GPU's layout
        (flash-attention's varlen kernel, no split; float32 statistics) is read from the code, not
        measured."""
        b, h, inter = dtype_bytes, self.hidden_size, self.intermediate_size
        norm = 4 * h + 4 + 2 * b * h if self.rms_norm else 2 * b * h + 2 * stats_bytes
        attention = 6 * b * h + 4 * self.num_heads + (b * h if split_attention else 0)
        mlp = (4 if self.gated_mlp else 2) * b * inter
        return 2 * norm + attention + mlp

    def tower_activation_bytes(self, dtype_bytes: int, **block) -> int:
        """Bytes the whole tower keeps for backward per patch when it trains: every block's
        (`block_activation_bytes`), the rotary cos and sin once (float32, head_dim each), and an
        estimate of the rest (not checked to the byte): the patch embedding's output and the
        learned positions added to it (2 b*h), and each merger (the main one and one per DeepStack
        level) its norm's input and output, fc1's output and the GELU's (4 b*h per patch)."""
        head_dim = self.hidden_size // self.num_heads
        outside = 2 * dtype_bytes * self.hidden_size + (1 + self.deepstack_levels) * 4 * dtype_bytes * self.hidden_size
        return self.depth * self.block_activation_bytes(dtype_bytes, **block) + 2 * 4 * head_dim + outside

    def block_transient_bytes(self, dtype_bytes: int) -> int:
        """Bytes per patch alive at once inside one block when the tower runs frozen (no_grad): the
        residual stream and the block's output, and the MLP's intermediates (two; gated: three).
        An estimate, not measured."""
        b, h, inter = dtype_bytes, self.hidden_size, self.intermediate_size
        return 2 * b * h + (3 if self.gated_mlp else 2) * b * inter

    @property
    def params(self) -> int:
        """Patch embedding (Conv3d), learned positions, ViT blocks (norms and linears with
        biases), the patch merger and one merger per DeepStack level (the DeepStack ones
        normalise after the 2x2 shuffle, over hidden * 4)."""
        h, inter = self.hidden_size, self.intermediate_size
        norm = h if self.rms_norm else 2 * h
        patch = self.in_channels * self.temporal_patch_size * self.patch_size**2 * h + (h if self.patch_bias else 0)
        mlp_in = (2 if self.gated_mlp else 1) * (h * inter + inter)
        block = 2 * norm + (3 * h * h + 3 * h) + (h * h + h) + mlp_in + (inter * h + h)
        merged = h * self.spatial_merge_size**2
        mlp = (merged * merged + merged) + (merged * self.out_hidden_size + self.out_hidden_size)
        merger = norm + mlp
        deepstack = 2 * merged + mlp
        return patch + self.num_position_embeddings * h + self.depth * block + merger + self.deepstack_levels * deepstack


@dataclass(frozen=True)
class ModelDims:
    name: str
    text: TextDims
    vision: VisionDims
    lora_targets: tuple[str, ...] = LINEARS  # the family's `lora_target_modules`: what LoRA wraps when unset

    @property
    def params(self) -> int:
        return self.text.params + self.vision.params


# ----------------------------------------------------------------- each architecture's reader


def _tied(config: dict) -> bool:
    """lm_head tied to the embeddings, as transformers' config class decides it (interface.py)."""
    from saccade.models.families.interface import ties_embeddings

    return ties_embeddings(config)


def qwen3_vl(config: dict) -> tuple[dict, dict]:
    """config.json -> the fields of `TextDims` and `VisionDims`."""
    t, v = config["text_config"], config["vision_config"]
    heads = t["num_attention_heads"]
    text = dict(
        vocab_size=t["vocab_size"], hidden_size=t["hidden_size"], num_hidden_layers=t["num_hidden_layers"],
        num_attention_heads=heads, num_key_value_heads=t.get("num_key_value_heads", heads),
        head_dim=t.get("head_dim") or t["hidden_size"] // heads, intermediate_size=t["intermediate_size"],
        tie_word_embeddings=_tied(config),
    )
    vision = dict(
        hidden_size=v["hidden_size"], depth=v["depth"], intermediate_size=v["intermediate_size"],
        out_hidden_size=v["out_hidden_size"], num_position_embeddings=v["num_position_embeddings"],
        deepstack_levels=len(v.get("deepstack_visual_indexes", [])), patch_size=v.get("patch_size", 16),
        temporal_patch_size=v.get("temporal_patch_size", 2), in_channels=v.get("in_channels", 3),
        spatial_merge_size=v.get("spatial_merge_size", 2), num_heads=v.get("num_heads", 16),
    )
    return text, vision


def qwen2_5_vl(config: dict) -> tuple[dict, dict]:
    """config.json -> the fields of `TextDims` and `VisionDims`. The text fields are
    nested (`text_config`, as transformers 5 saves) or flat at the top level (the hub's configs).
    q/k/v carry biases and there is no q/k norm; the tower has no learned position grid, no
    DeepStack, RMSNorms (no bias) and gated MLPs with biases."""
    t, v = config.get("text_config") or config, config["vision_config"]
    heads = t["num_attention_heads"]
    text = dict(
        vocab_size=t["vocab_size"], hidden_size=t["hidden_size"], num_hidden_layers=t["num_hidden_layers"],
        num_attention_heads=heads, num_key_value_heads=t.get("num_key_value_heads", heads),
        head_dim=t["hidden_size"] // heads, intermediate_size=t["intermediate_size"],
        tie_word_embeddings=_tied(config),
        qkv_bias=True, qk_norm=False,
    )
    vision = dict(
        hidden_size=v["hidden_size"], depth=v["depth"], intermediate_size=v["intermediate_size"],
        out_hidden_size=v.get("out_hidden_size", t["hidden_size"]), num_position_embeddings=0, deepstack_levels=0,
        patch_size=v.get("patch_size", 14), temporal_patch_size=v.get("temporal_patch_size", 2),
        in_channels=v.get("in_chans", v.get("in_channels", 3)), spatial_merge_size=v.get("spatial_merge_size", 2),
        gated_mlp=True, rms_norm=True, patch_bias=False, num_heads=v.get("num_heads", 16), video_pixels_per_clip=False,
    )
    return text, vision


def moe_layers(text: dict) -> int:
    """How many decoder layers are sparse (transformers' rule: not in mlp_only_layers, and every
    decoder_sparse_step-th)."""
    step, dense = text.get("decoder_sparse_step", 1), set(text.get("mlp_only_layers") or [])
    return sum(1 for i in range(text["num_hidden_layers"]) if i not in dense and (i + 1) % step == 0)


@dataclass(frozen=True)
class ExpertDims:
    """The sparse layers as `TextDims.experts` counts them: `layers` of the decoder
    layers replace the dense MLP with a router (E x hidden) and E experts of three (hidden x
    moe_intermediate) matrices, of which each token runs `per_token`."""

    num_experts: int
    per_token: int
    intermediate_size: int
    layers: int

    def mlp_params(self, hidden: int, active: bool = False) -> int:
        """One MoE layer's router and experts (all of them, or the `per_token` one token runs)."""
        experts = self.per_token if active else self.num_experts
        return experts * 3 * hidden * self.intermediate_size + self.num_experts * hidden

    def lora_params(self, rank: int, hidden: int, targets: Sequence[str] = ()) -> int:
        """One MoE layer's peft expert adapters (`target_parameters`, which the family always sets,
        whatever the `targets` modules): per fused parameter, A (rank*E x in) and B (out x rank*E);
        gate_up H -> 2I, down I -> H."""
        h, i = hidden, self.intermediate_size
        return rank * self.num_experts * ((h + 2 * i) + (i + h))

    def activation_bytes(self, dtype_bytes: int, hidden: int) -> int:
        """Per token, one MoE layer's MLP (an estimate, not checked against autograd): transformers'
        expert loop keeps, per chosen expert, the gathered input and the down projection's output
        (b*h each), the gate_up output, silu(gate) and its product with up (b*4I); the router its
        float32 softmax (4E)."""
        b = dtype_bytes
        return self.per_token * (2 * b * hidden + 4 * b * self.intermediate_size) + 4 * self.num_experts

    def merged_bytes(self, hidden: int, dtype_bytes: int) -> int:
        """LoRA: peft's expert adapters (ParamWrapper) run each MoE layer on W + delta, a whole
        (E x 3HI) tensor in the compute dtype that backward keeps (peft 0.21's _activate_lora)."""
        return self.num_experts * 3 * hidden * self.intermediate_size * dtype_bytes


def qwen3_vl_moe(config: dict) -> tuple[dict, dict]:
    """Qwen3-VL's fields, plus the experts (`ExpertDims`: total and active parameters)."""
    text, vision = qwen3_vl(config)
    t = config["text_config"]
    text["experts"] = ExpertDims(num_experts=t.get("num_experts", t.get("num_local_experts")),
                                 per_token=t["num_experts_per_tok"], intermediate_size=t["moe_intermediate_size"],
                                 layers=moe_layers(t))
    return text, vision


@dataclass(frozen=True)
class LinearAttentionDims:
    """The Gated DeltaNet layers as `TextDims.linear_attention` counts them: `layers`
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


def qwen3_5(config: dict) -> tuple[dict, dict]:
    """config.json -> the fields of `TextDims` and `VisionDims`: gated attention (q_proj
    twice as wide) with q/k norms on the full layers, the Gated DeltaNet layers
    (`LinearAttentionDims`), Qwen3-VL's tower without DeepStack."""
    t, v = config["text_config"], config["vision_config"]
    heads = t["num_attention_heads"]
    kinds = layer_types(t)
    text = dict(
        vocab_size=t["vocab_size"], hidden_size=t["hidden_size"], num_hidden_layers=t["num_hidden_layers"],
        num_attention_heads=heads, num_key_value_heads=t.get("num_key_value_heads", heads),
        head_dim=t.get("head_dim") or t["hidden_size"] // heads, intermediate_size=t["intermediate_size"],
        tie_word_embeddings=_tied(config),
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
        num_heads=v.get("num_heads", 16),
    )
    return text, vision


@dataclass(frozen=True)
class SharedExpertDims(ExpertDims):
    """Qwen3-VL-MoE's routed experts plus the shared expert every token runs: three (hidden x
    `shared_intermediate_size`) linears and its gate (hidden -> 1)."""

    shared_intermediate_size: int = 0

    def shared_shapes(self, hidden: int) -> dict[str, tuple[int, int]]:
        """(in_features, out_features) of the shared expert's linears."""
        s = self.shared_intermediate_size
        return {"gate_proj": (hidden, s), "up_proj": (hidden, s), "down_proj": (s, hidden)}

    def mlp_params(self, hidden: int, active: bool = False) -> int:
        """Router, routed experts (all or the `per_token` ones) and the shared expert with its gate,
        which every token runs."""
        shared = sum(i * o for i, o in self.shared_shapes(hidden).values()) + hidden
        return super().mlp_params(hidden, active) + shared

    def lora_params(self, rank: int, hidden: int, targets: Sequence[str] = ()) -> int:
        """The routed experts' adapters (always) and the shared expert's targeted linears."""
        shared = sum(rank * (i + o) for n, (i, o) in self.shared_shapes(hidden).items() if n in targets)
        return super().lora_params(rank, hidden) + shared

    def activation_bytes(self, dtype_bytes: int, hidden: int) -> int:
        """The routed experts' estimate plus the shared expert's (not checked against autograd): its
        gate and up outputs and their silu product (3b x S), its output before gating (b x hidden)
        and the gate's logit."""
        b = dtype_bytes
        return super().activation_bytes(b, hidden) + 3 * b * self.shared_intermediate_size + b * hidden + b


def qwen3_5_moe(config: dict) -> tuple[dict, dict]:
    """Dense Qwen3.5's fields (gated attention, the Gated DeltaNet layers, the tower without
    DeepStack) with no dense MLP (intermediate_size 0) and every layer sparse (`SharedExpertDims`)."""
    t = config["text_config"]
    text, vision = qwen3_5({**config, "text_config": {**t, "intermediate_size": 0}})
    text["experts"] = SharedExpertDims(
        num_experts=t["num_experts"], per_token=t["num_experts_per_tok"], intermediate_size=t["moe_intermediate_size"],
        layers=t["num_hidden_layers"], shared_intermediate_size=t["shared_expert_intermediate_size"])
    return text, vision


# config.json's model_type -> its reader: (TextDims fields, VisionDims fields). One per family
# (`saccade.models.families.FAMILIES`; tests/tools/test_memory.py keeps the two equal).
DIMS: dict[str, Callable[[dict], tuple[dict, dict]]] = {
    "qwen3_vl": qwen3_vl, "qwen2_5_vl": qwen2_5_vl, "qwen3_vl_moe": qwen3_vl_moe, "qwen3_5": qwen3_5,
    "qwen3_5_moe": qwen3_5_moe,
}


def dims_from_hf_config(config: dict, name: str = "model") -> ModelDims:
    """ModelDims from a config.json dict, read by its model type's reader (`DIMS`); LoRA's default
    targets are its family's."""
    from saccade.models.families import family_of

    family = family_of(config)  # a model type no family serves: refused, naming the known ones
    text, vision = DIMS[family.model_types[0]](config)
    return ModelDims(name, TextDims(**text), VisionDims(**vision), lora_targets=family.lora_target_modules)


def model_dims(model: str | os.PathLike) -> ModelDims:
    """The dimensions of `model`: a preset at published shapes (its config, no build), a published
    checkpoint saccade holds the config.json of (a hub id), a tiny preset (built offline on first
    use; that imports torch) or its warm start ('tiny-warm', 'qwen2.5vl-tiny-warm': the preset's
    shapes, nothing trained), or a local folder's config.json."""
    from saccade.models.presets import PRESETS, preset_config, preset_path, published_config, published_ids
    from saccade.models.presets import warm_start_base

    name = str(model)
    if name in PRESETS and not PRESETS[name].tokenizer_vocab:  # the published vocabulary: known unbuilt
        return dims_from_hf_config(preset_config(name), name)
    config = published_config(name)
    if config is not None:
        return dims_from_hf_config(config, name)
    preset = warm_start_base(name) or name
    if preset in PRESETS:
        return dims_from_hf_config(json.loads((preset_path(preset) / "config.json").read_text()), name)
    path = Path(model) / "config.json"
    if path.is_file():
        return dims_from_hf_config(json.loads(path.read_text()), name)
    raise ValueError(f"no dimensions for model {name!r}: give a local folder with a config.json, or one of "
                     f"{', '.join(published_ids())}")
