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
  max(H', W')), so `saccade.models.positions.mrope_positions` serves as is.
- Checkpoints on the hub are in the pre-4.52 layout (`model.layers.*`, `visual.*`), and
  transformers 5.19's save_pretrained writes that layout back; saccade reads it through
  transformers' own renames (`models/checkpoint_layout.py`). vLLM reads both layouts, so what
  saccade writes into a base folder keeps the base's own keys (the writer's rule).
- Hub config.json is flat: the text fields sit at the top level, only `vision_config` nests.
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
BUILD_VERSION = 2

# The language model's linears, as in Qwen3-VL (dense: no fused expert parameters).
LORA_TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")

# Processor defaults of Qwen2.5-VL (Qwen2VLImageProcessor's own): OpenAI CLIP mean and std.
CLIP_MEAN = [0.48145466, 0.4578275, 0.40821073]
CLIP_STD = [0.26862954, 0.26130258, 0.27577711]


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


def mrope_positions(mm_token_type_ids_L: torch.Tensor, grid_thw_N3: torch.Tensor | None, merge: int) -> torch.Tensor:
    """(3, L) M-RoPE positions of one sample. Qwen2.5-VL's rule for images equals Qwen3-VL's
    (`Qwen2_5_VLModel.get_rope_index`: text +1 a token; an image's patches at start + (t, i, j);
    the text after it at start + max(H', W')), so the shared function is used. Videos differ
    (frames spaced by tokens_per_second x seconds per grid) and are refused by it."""
    return _shared_mrope_positions(mm_token_type_ids_L, grid_thw_N3, spatial_merge_size=merge)


# ---------------------------------------------------------------------- memory dimensions


def memory_dims(config: dict) -> tuple[dict, dict]:
    """config.json -> the fields of `saccade.memory.TextDims` and `VisionDims`. The text fields are
    nested (`text_config`, as transformers 5 saves) or flat at the top level (the hub's configs).
    q/k/v carry biases and there is no q/k norm; the tower has no learned position grid, no
    DeepStack, RMSNorms (no bias) and gated MLPs with biases."""
    t, v = config.get("text_config") or config, config["vision_config"]
    heads = t["num_attention_heads"]
    text = dict(
        vocab_size=t["vocab_size"], hidden_size=t["hidden_size"], num_hidden_layers=t["num_hidden_layers"],
        num_attention_heads=heads, num_key_value_heads=t.get("num_key_value_heads", heads),
        head_dim=t["hidden_size"] // heads, intermediate_size=t["intermediate_size"],
        tie_word_embeddings=ties_embeddings(config),
        qkv_bias=True, qk_norm=False,
    )
    vision = dict(
        hidden_size=v["hidden_size"], depth=v["depth"], intermediate_size=v["intermediate_size"],
        out_hidden_size=v.get("out_hidden_size", t["hidden_size"]), num_position_embeddings=0, deepstack_levels=0,
        patch_size=v.get("patch_size", 14), temporal_patch_size=v.get("temporal_patch_size", 2),
        in_channels=v.get("in_chans", v.get("in_channels", 3)), spatial_merge_size=v.get("spatial_merge_size", 2),
        gated_mlp=True, rms_norm=True, patch_bias=False,
    )
    return text, vision


# The hub's config.json of the two sizes saccade plans for, written from memory of
# Qwen/Qwen2.5-VL-7B-Instruct and Qwen/Qwen2.5-VL-3B-Instruct (no hub here to read them from:
# check against the real files before quoting a figure). Flat, as on the hub. Parameter counts
# these give with transformers 5.19 (meta device): tests/models/test_qwen2_5_vl.py.
HUB_CONFIGS: dict[str, dict] = {
    "Qwen/Qwen2.5-VL-7B-Instruct": {
        "architectures": ["Qwen2_5_VLForConditionalGeneration"], "model_type": "qwen2_5_vl",
        "vocab_size": 152064, "hidden_size": 3584, "intermediate_size": 18944, "num_hidden_layers": 28,
        "num_attention_heads": 28, "num_key_value_heads": 4, "max_position_embeddings": 128000,
        "max_window_layers": 28, "rms_norm_eps": 1e-06, "rope_theta": 1000000.0, "sliding_window": 32768,
        "use_sliding_window": False, "tie_word_embeddings": False, "hidden_act": "silu",
        "bos_token_id": 151643, "eos_token_id": 151645, "vision_start_token_id": 151652,
        "vision_end_token_id": 151653, "vision_token_id": 151654, "image_token_id": 151655,
        "video_token_id": 151656, "torch_dtype": "bfloat16",
        "rope_scaling": {"type": "mrope", "mrope_section": [16, 24, 24]},
        "vision_config": {
            "depth": 32, "hidden_act": "silu", "hidden_size": 1280, "intermediate_size": 3420, "num_heads": 16,
            "in_chans": 3, "out_hidden_size": 3584, "patch_size": 14, "spatial_merge_size": 2,
            "spatial_patch_size": 14, "window_size": 112, "fullatt_block_indexes": [7, 15, 23, 31],
            "tokens_per_second": 2, "temporal_patch_size": 2,
        },
    },
    "Qwen/Qwen2.5-VL-3B-Instruct": {
        "architectures": ["Qwen2_5_VLForConditionalGeneration"], "model_type": "qwen2_5_vl",
        "vocab_size": 151936, "hidden_size": 2048, "intermediate_size": 11008, "num_hidden_layers": 36,
        "num_attention_heads": 16, "num_key_value_heads": 2, "max_position_embeddings": 128000,
        "max_window_layers": 70, "rms_norm_eps": 1e-06, "rope_theta": 1000000.0, "sliding_window": 32768,
        "use_sliding_window": False, "tie_word_embeddings": True, "hidden_act": "silu",
        "bos_token_id": 151643, "eos_token_id": 151645, "vision_start_token_id": 151652,
        "vision_end_token_id": 151653, "vision_token_id": 151654, "image_token_id": 151655,
        "video_token_id": 151656, "torch_dtype": "bfloat16",
        "rope_scaling": {"type": "mrope", "mrope_section": [16, 24, 24]},
        "vision_config": {
            "depth": 32, "hidden_act": "silu", "hidden_size": 1280, "intermediate_size": 3420, "num_heads": 16,
            "in_chans": 3, "out_hidden_size": 2048, "patch_size": 14, "spatial_merge_size": 2,
            "spatial_patch_size": 14, "window_size": 112, "fullatt_block_indexes": [7, 15, 23, 31],
            "tokens_per_second": 2, "temporal_patch_size": 2,
        },
    },
}

# --------------------------------------------------------------------------- tiny builder


@dataclass(frozen=True)
class Preset:
    """Shapes of a generated Qwen2.5-VL. Field names follow Qwen2_5_VL{Text,Vision}Config."""

    bpe_vocab_size: int
    text_hidden: int
    text_layers: int
    text_heads: int  # head_dim = text_hidden / text_heads (Qwen2.5-VL has no head_dim field)
    text_kv_heads: int
    text_intermediate: int
    vision_hidden: int
    vision_depth: int
    vision_heads: int
    vision_intermediate: int
    fullatt_block_indexes: tuple[int, ...]
    window_size: int  # pixels; windows are window_size / patch / merge merged patches a side
    patch_size: int = 14
    min_pixels: int = 32 * 32
    max_pixels: int = 256 * 256
    tie_word_embeddings: bool = True
    vocab_size: int | None = None  # model vocabulary rows; None: the tokenizer's size
    weights_dtype: str = "float32"  # what the weights are saved in
    # Text weights' init std. transformers' 0.02 leaves a 128-wide Qwen2 (no q/k norm) nearly
    # blind to positions: swapping M-RoPE rows moved logprobs by 7e-5. At 0.1 attention logits
    # are O(1) and the logprobs are far from uniform, so parity tests can fail.
    text_init_std: float = 0.1


def _published(hub_id: str) -> Preset:
    """A random model at a published checkpoint's shapes (its vocabulary rows, a small BPE)."""
    c = HUB_CONFIGS[hub_id]
    v = c["vision_config"]
    return Preset(
        bpe_vocab_size=8192, text_hidden=c["hidden_size"], text_layers=c["num_hidden_layers"],
        text_heads=c["num_attention_heads"], text_kv_heads=c["num_key_value_heads"],
        text_intermediate=c["intermediate_size"], vision_hidden=v["hidden_size"], vision_depth=v["depth"],
        vision_heads=v["num_heads"], vision_intermediate=v["intermediate_size"],
        fullatt_block_indexes=tuple(v["fullatt_block_indexes"]), window_size=v["window_size"],
        max_pixels=448 * 448, tie_word_embeddings=c["tie_word_embeddings"], vocab_size=c["vocab_size"],
        weights_dtype="bfloat16", text_init_std=0.02,
    )


PRESETS: dict[str, Preset] = {
    # About 1M parameters. Text head_dim 32 (128 / 4): vLLM's CPU attention refuses 16. A window
    # of 56 px is 2 x 2 merged patches, so the tests' small images already span several windows
    # and ragged edges (the real models' 112 px would make most of them one window).
    "qwen2.5vl-tiny": Preset(
        bpe_vocab_size=1024, text_hidden=128, text_layers=4, text_heads=4, text_kv_heads=2, text_intermediate=384,
        vision_hidden=64, vision_depth=4, vision_heads=2, vision_intermediate=128,
        fullatt_block_indexes=(1, 3), window_size=56,
    ),
    # Random weights at Qwen2.5-VL-7B's and 3B's shapes (8.29B and 3.75B parameters), for
    # `saccade memory` and the benches on a GPU: 16.6 GB and 7.5 GB of bf16 once built.
    "qwen2.5vl-7b": _published("Qwen/Qwen2.5-VL-7B-Instruct"),
    "qwen2.5vl-3b": _published("Qwen/Qwen2.5-VL-3B-Instruct"),
}
# The config of the presets at published shapes: the hub's (`saccade memory` answers without building them).
PRESET_CONFIGS = {"qwen2.5vl-7b": HUB_CONFIGS["Qwen/Qwen2.5-VL-7B-Instruct"],
                  "qwen2.5vl-3b": HUB_CONFIGS["Qwen/Qwen2.5-VL-3B-Instruct"]}


# Where each preset's build is cached, and that folder built on first use (`build_tiny`, below).
preset_folder, tiny_model_path = cached_builds("Qwen2.5-VL", PRESETS, BUILD_VERSION,
                                               lambda out, preset, seed: build_tiny(out, preset, seed))


def build_tiny(out_dir: str | os.PathLike, preset: str, seed: int = 0) -> Path:
    """Write a complete random Qwen2.5-VL folder (tokenizer, processor, config, weights) that the
    Auto classes and vLLM load like a real checkpoint. The tokenizer and chat template are
    models.tiny's (Qwen's special tokens after a small BPE)."""
    from saccade.models.tiny import build_tokenizer, seeded_model

    spec = PRESETS[preset]
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    tokenizer = build_tokenizer(spec.bpe_vocab_size, seed=seed)
    build_processor(tokenizer, spec).save_pretrained(out)
    config = build_config(tokenizer, spec)
    model = seeded_model(full_model_class(), config, seed)
    model.to(getattr(torch, spec.weights_dtype)).save_pretrained(out, safe_serialization=True)
    return out


def build_config(tokenizer, spec: Preset):
    from transformers import Qwen2_5_VLConfig

    head_dim = spec.text_hidden // spec.text_heads
    assert head_dim * spec.text_heads == spec.text_hidden and head_dim % 8 == 0, head_dim
    # M-RoPE sections (t, h, w) over head_dim / 2 frequencies, contiguous, in Qwen2.5-VL's 16:24:24.
    half = head_dim // 2
    mrope_section = [half // 4, 3 * half // 8, 3 * half // 8]
    ids = tokenizer.convert_tokens_to_ids
    return Qwen2_5_VLConfig(
        text_config=dict(
            vocab_size=spec.vocab_size or len(tokenizer), hidden_size=spec.text_hidden, intermediate_size=spec.text_intermediate,
            num_hidden_layers=spec.text_layers, num_attention_heads=spec.text_heads,
            num_key_value_heads=spec.text_kv_heads, max_position_embeddings=8192, max_window_layers=spec.text_layers,
            rope_parameters={"rope_type": "default", "rope_theta": 1_000_000.0, "mrope_section": mrope_section},
            tie_word_embeddings=spec.tie_word_embeddings, pad_token_id=tokenizer.pad_token_id, bos_token_id=None,
            eos_token_id=ids("<|im_end|>"), initializer_range=spec.text_init_std,
        ),
        vision_config=dict(
            depth=spec.vision_depth, hidden_size=spec.vision_hidden, intermediate_size=spec.vision_intermediate,
            num_heads=spec.vision_heads, patch_size=spec.patch_size, spatial_merge_size=2, temporal_patch_size=2,
            out_hidden_size=spec.text_hidden, window_size=spec.window_size,
            fullatt_block_indexes=list(spec.fullatt_block_indexes), tokens_per_second=2,
        ),
        image_token_id=ids("<|image_pad|>"), video_token_id=ids("<|video_pad|>"),
        vision_start_token_id=ids("<|vision_start|>"), vision_end_token_id=ids("<|vision_end|>"),
        tie_word_embeddings=spec.tie_word_embeddings,
    )


def build_processor(tokenizer, spec: Preset):
    """Qwen2.5-VL's processor: Qwen2VLImageProcessor and Qwen2VLVideoProcessor at patch 14,
    merge 2, CLIP mean/std (the classes' own defaults), sized in pixels (shortest_edge /
    longest_edge: transformers 5's spelling of min_pixels / max_pixels)."""
    from transformers import Qwen2_5_VLProcessor, Qwen2VLImageProcessor
    from transformers.models.qwen2_vl.video_processing_qwen2_vl import Qwen2VLVideoProcessor

    from saccade.models.tiny import CHAT_TEMPLATE

    common = dict(patch_size=spec.patch_size, temporal_patch_size=2, merge_size=2, image_mean=CLIP_MEAN,
                  image_std=CLIP_STD)
    size = {"shortest_edge": spec.min_pixels, "longest_edge": spec.max_pixels}
    return Qwen2_5_VLProcessor(
        image_processor=Qwen2VLImageProcessor(size=size, **common),
        tokenizer=tokenizer,
        video_processor=Qwen2VLVideoProcessor(size={**size, "longest_edge": spec.max_pixels * 4}, **common),
        chat_template=CHAT_TEMPLATE,
    )


FAMILY = ModelFamily(
    name="Qwen2.5-VL",
    model_types=("qwen2_5_vl",),
    full_model_name="Qwen2_5_VLForConditionalGeneration",
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
    published_configs=HUB_CONFIGS,
    preset_configs=PRESET_CONFIGS,
)
