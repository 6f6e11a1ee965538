"""Qwen2.5-VL: what saccade needs to know about this family, as plain module-level names.

Groundwork for issue 30's `ModelFamily` (models/families/__init__.py, landing separately): each
name here is one member of that interface (`NAME` -> `name`, `MODEL_TYPES` -> `model_types`,
the functions by their own names), so the family object is a mechanical wrap of this module.

How Qwen2.5-VL differs from Qwen3-VL, the family saccade started with (checked against
transformers 5.19's `models/qwen2_5_vl/` and vLLM 0.32's `model_executor/models/qwen2_5_vl.py`;
docs/families-qwen2_5_vl.md has the commands):
- Vision tower: patch 14 (not 16), no learned position grid (2-D rotary only), windowed
  attention (windows of `window_size` pixels, full attention only in `fullatt_block_indexes`),
  RMSNorm + 2-layer MLP merger, CLIP mean/std in the processor. No DeepStack: the tower's
  output is one (N, H) tensor, and the language model takes nothing but inputs_embeds.
- Language model: Qwen2 (q/k/v with bias, head_dim = hidden / heads, no q/k norm), M-RoPE
  with contiguous sections [16, 24, 24] (Qwen3-VL interleaves them).
- Positions: the same rule as Qwen3-VL for images (an image advances the text position by
  max(H', W')), so `saccade.models.positions.mrope_positions` is reused as is.
- Checkpoints on the hub are in the pre-4.52 layout (`model.layers.*`, `visual.*`);
  transformers 5.19 renames them on load and writes `model.language_model.*`,
  `model.visual.*` (`checkpoint_key` maps both).
- Hub config.json is flat: the text fields sit at the top level, only `vision_config` nests.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
from dataclasses import asdict, dataclass
from pathlib import Path

import torch
from torch import nn

from saccade.models.positions import mrope_positions as _shared_mrope_positions
from saccade.models.tiny import CHAT_TEMPLATE, build_once, build_tokenizer, cache_dir

NAME = "qwen2_5_vl"
MODEL_TYPES = ("qwen2_5_vl",)

# Bump when anything below changes what `build_tiny` writes, so stale caches are not reused.
BUILD_VERSION = 1

# The language model's linears, as in Qwen3-VL. No fused 3-D expert parameters (dense model).
LORA_TARGET_MODULES = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
LORA_TARGET_PARAMETERS: tuple[str, ...] = ()

# Canonical checkpoint names (what saccade's loaders read and its writers write).
LM_PREFIX = "model.language_model."
VISION_PREFIX = "model.visual."
LM_HEAD_KEY = "lm_head.weight"

# Processor defaults of Qwen2.5-VL (Qwen2VLImageProcessor's own): OpenAI CLIP mean and std.
CLIP_MEAN = [0.48145466, 0.4578275, 0.40821073]
CLIP_STD = [0.26862954, 0.26130258, 0.27577711]


# ------------------------------------------------------------------------------- classes


def text_model_class():
    from transformers.models.qwen2_5_vl.modeling_qwen2_5_vl import Qwen2_5_VLTextModel

    return Qwen2_5_VLTextModel


def vision_model_class():
    from transformers.models.qwen2_5_vl.modeling_qwen2_5_vl import Qwen2_5_VisionTransformerPretrainedModel

    return Qwen2_5_VisionTransformerPretrainedModel


def full_model_class():
    from transformers import Qwen2_5_VLForConditionalGeneration

    return Qwen2_5_VLForConditionalGeneration


# ------------------------------------------------------------------------- checkpoint keys

# The hub's Qwen2.5-VL checkpoints (written before transformers 4.52) hold `model.layers.*`,
# `model.embed_tokens.*`, `model.norm.*`, `visual.*` and `lm_head.weight`. transformers 5.19
# renames them on load (conversion_mapping.py: "Qwen2_5_VLForConditionalGeneration" ->
# "Qwen2VLForConditionalGeneration": `^visual` -> `model.visual`,
# `^model(?!\.(language_model|visual))` -> `model.language_model`) and save_pretrained writes the
# new names. vLLM 0.32 reads both (its hf_to_vllm_mapper lists the two layouts).
_HUB_LM = re.compile(r"^model\.(?!language_model\.|visual\.)")


def checkpoint_key(key: str) -> str | None:
    """A checkpoint tensor's canonical name (`model.language_model.*`, `model.visual.*`,
    `lm_head.weight`), from either layout; None for a key that is neither (not ours to read)."""
    if key.startswith((LM_PREFIX, VISION_PREFIX)) or key == LM_HEAD_KEY:
        return key
    if key.startswith("visual."):
        return "model." + key
    if _HUB_LM.match(key):
        return LM_PREFIX + key[len("model."):]
    return None


def engine_tensors(name: str, tensor: torch.Tensor) -> list[tuple[str, torch.Tensor]]:
    """The (name, tensor) pairs a canonical parameter goes to vLLM as. vLLM's Qwen2.5-VL maps
    `model.language_model.*` and `model.visual.*` itself (hf_to_vllm_mapper), and nothing is
    fused on the way: the canonical name as is."""
    return [(name, tensor)]


# ---------------------------------------------------------------------- tower and LM glue


def deepstack_levels(config) -> int:
    """Qwen2.5-VL has no DeepStack."""
    return 0


@torch.no_grad()
def run_tower(tower: nn.Module, pixel_values: torch.Tensor, grid_thw: torch.Tensor) -> tuple[torch.Tensor, list]:
    """The tower's merged features for these images, concatenated in image order (what
    `Qwen2_5_VLModel.get_image_features` gives, unsplit), and no DeepStack levels."""
    dtype = next(tower.parameters()).dtype
    out = tower(pixel_values.to(dtype), grid_thw=grid_thw, return_dict=True)
    return out.pooler_output, []


def prepare_language_model(language_model: nn.Module) -> nn.Module:
    """Nothing to patch: without DeepStack the text model takes only inputs_embeds."""
    return language_model


def language_model_kwargs(image_positions_N: torch.Tensor | None, deepstack_list: list | None) -> dict:
    """Extra keyword arguments for `Qwen2_5_VLTextModel.forward`: none. (Its **kwargs go to the
    attention kernels, so Qwen3-VL's `visual_pos_masks` must not be passed here.)"""
    if deepstack_list:
        raise ValueError("Qwen2.5-VL has no DeepStack, yet DeepStack features were given")
    return {}


def mrope_positions(mm_token_type_ids_L: torch.Tensor, grid_thw_N3: torch.Tensor | None, merge: int) -> torch.Tensor:
    """(3, L) M-RoPE positions of one sample. Qwen2.5-VL's rule for images equals Qwen3-VL's
    (`Qwen2_5_VLModel.get_rope_index`: text +1 a token; an image's patches at start + (t, i, j);
    the text after it at start + max(H', W')), so the shared function is used. Videos differ
    (Qwen2.5-VL spaces frames by tokens_per_second x seconds per grid) and are refused by it."""
    return _shared_mrope_positions(mm_token_type_ids_L, grid_thw_N3, spatial_merge_size=merge)


def processor_size(limits) -> dict[str, int]:
    """The image processor's `size` for saccade's image limits. transformers 5.19's
    Qwen2VLImageProcessor (Qwen2.5-VL's) takes pixel counts as shortest_edge / longest_edge;
    `min_pixels` / `max_pixels` in a processor call are deprecated (removed in 5.23), and in
    a preprocessor_config.json they are folded into `size` on load."""
    return {"shortest_edge": limits.min_pixels, "longest_edge": limits.max_pixels}


# ---------------------------------------------------------------------- memory dimensions


def _text_fields(config: dict) -> dict:
    """The text fields of a config.json dict: nested (`text_config`, as transformers 5 saves)
    or flat at the top level (as the hub's Qwen2.5-VL configs are)."""
    return config.get("text_config") or config


def memory_dims(config: dict) -> dict[str, dict]:
    """The shapes `saccade memory` counts, from a config.json dict: {"text": ..., "vision": ...},
    named like saccade.memory's TextDims / VisionDims fields. Qwen2.5-VL's tower has no learned
    position grid (num_position_embeddings 0), no DeepStack, and its merger is RMSNorm + MLP
    (4H -> 4H -> out), not Qwen3-VL's LayerNorm + MLP; its q/k/v carry biases."""
    t, v = _text_fields(config), config["vision_config"]
    heads = t["num_attention_heads"]
    tied = bool(config.get("tie_word_embeddings", t.get("tie_word_embeddings", False)))
    text = dict(vocab_size=t["vocab_size"], hidden_size=t["hidden_size"], num_hidden_layers=t["num_hidden_layers"],
                num_attention_heads=heads, num_key_value_heads=t.get("num_key_value_heads", heads),
                head_dim=t["hidden_size"] // heads, intermediate_size=t["intermediate_size"],
                tie_word_embeddings=tied, qkv_bias=True)
    vision = dict(hidden_size=v["hidden_size"], depth=v["depth"], intermediate_size=v["intermediate_size"],
                  out_hidden_size=v.get("out_hidden_size", t["hidden_size"]), num_position_embeddings=0,
                  deepstack_levels=0, patch_size=v.get("patch_size", 14),
                  temporal_patch_size=v.get("temporal_patch_size", 2), in_channels=v.get("in_channels", 3),
                  spatial_merge_size=v.get("spatial_merge_size", 2), window_size=v.get("window_size", 112),
                  fullatt_block_indexes=list(v.get("fullatt_block_indexes", ())))
    return {"text": text, "vision": vision}


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

# The real model a preset stands in for (the builder's shapes are scaled from it).
FULL_MODEL_NAME = "Qwen/Qwen2.5-VL-3B-Instruct"


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
    # Text weights' init std. transformers' 0.02 leaves a 128-wide Qwen2 (no q/k norm) nearly
    # blind to positions: swapping M-RoPE rows moved logprobs by 7e-5. At 0.1 attention logits
    # are O(1) and the logprobs are far from uniform, so parity tests can fail.
    text_init_std: float = 0.1


PRESETS: dict[str, Preset] = {
    # About 1M parameters. Text head_dim 32 (128 / 4): vLLM's CPU attention refuses 16. A window
    # of 56 px is 2 x 2 merged patches, so the tests' small images already span several windows
    # and ragged edges (the real models' 112 px would make most of them one window).
    "tiny": Preset(
        bpe_vocab_size=1024, text_hidden=128, text_layers=4, text_heads=4, text_kv_heads=2, text_intermediate=384,
        vision_hidden=64, vision_depth=4, vision_heads=2, vision_intermediate=128,
        fullatt_block_indexes=(1, 3), window_size=56,
    ),
}


def preset_folder(preset: str = "tiny", seed: int = 0) -> Path:
    if preset not in PRESETS:
        raise ValueError(f"unknown Qwen2.5-VL preset {preset!r}; choose one of {sorted(PRESETS)}")
    key = hashlib.sha256(json.dumps([BUILD_VERSION, asdict(PRESETS[preset]), seed]).encode()).hexdigest()[:10]
    return cache_dir() / f"qwen2_5_vl-{preset}-seed{seed}-{key}"


def tiny_model_path(preset: str = "tiny", seed: int = 0) -> Path:
    """The folder of a generated Qwen2.5-VL, built on first use (cached like models.tiny's)."""
    return build_once(preset_folder(preset, seed), lambda tmp: build_tiny(tmp, preset=preset, seed=seed))


def build_tiny(out_dir: str | os.PathLike, preset: str = "tiny", seed: int = 0) -> Path:
    """Write a complete random Qwen2.5-VL folder (tokenizer, processor, config, weights) that the
    Auto classes and vLLM load like a real checkpoint. The tokenizer and chat template are
    models.tiny's (Qwen's special tokens after a small BPE)."""
    spec = PRESETS[preset]
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    tokenizer = build_tokenizer(spec.bpe_vocab_size, seed=seed)
    build_processor(tokenizer, spec).save_pretrained(out)
    config = build_config(tokenizer, spec)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = full_model_class()(config)
    model.save_pretrained(out, safe_serialization=True)
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
            vocab_size=len(tokenizer), hidden_size=spec.text_hidden, intermediate_size=spec.text_intermediate,
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

    common = dict(patch_size=spec.patch_size, temporal_patch_size=2, merge_size=2, image_mean=CLIP_MEAN,
                  image_std=CLIP_STD)
    size = {"shortest_edge": spec.min_pixels, "longest_edge": spec.max_pixels}
    return Qwen2_5_VLProcessor(
        image_processor=Qwen2VLImageProcessor(size=size, **common),
        tokenizer=tokenizer,
        video_processor=Qwen2VLVideoProcessor(size={**size, "longest_edge": spec.max_pixels * 4}, **common),
        chat_template=CHAT_TEMPLATE,
    )


__all__ = [
    "NAME", "MODEL_TYPES", "LORA_TARGET_MODULES", "LORA_TARGET_PARAMETERS", "HUB_CONFIGS", "FULL_MODEL_NAME",
    "PRESETS", "text_model_class", "vision_model_class", "full_model_class", "checkpoint_key", "engine_tensors",
    "deepstack_levels", "run_tower", "prepare_language_model", "language_model_kwargs", "mrope_positions",
    "processor_size", "memory_dims", "build_tiny", "tiny_model_path", "preset_folder",
]
