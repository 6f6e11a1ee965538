"""Qwen3-VL-MoE (Qwen3-VL-30B-A3B, 235B-A22B): what saccade must know about the family.

Groundwork for issue 30's `ModelFamily`: module-level functions and constants named after the
interface's members (`name`, `model_types`, `text_model_class()`, ..., `engine_tensors`,
`build_tiny`), so that turning this module into the family object is mechanical. Facts, each
with the command behind it: docs/families-qwen3_vl_moe.md.

What differs from Qwen3-VL: the decoder's MLP is a sparse mixture of experts (a router
`mlp.gate.weight` (E, H) and the experts fused into two 3-D parameters); the vision tower,
DeepStack and M-RoPE are Qwen3-VL's (the same rule, the same code in transformers).

The trap is the experts' layout, which differs between memory and disk:

    tensor                          transformers in memory    hub checkpoint = what vLLM reads
    mlp.experts.gate_up_proj        (E, 2 x I, H)             (E, H, 2 x I)
    mlp.experts.down_proj           (E, H, I)                 (E, I, H)

(E experts, H hidden_size, I moe_intermediate_size; gate rows first, then up.) transformers
5.19 transposes on load only when the file's shape differs from the parameter's
(`Transpose(1, 2, check_dims=True)` in conversion_mapping.py), and its reverse on save is the
same check, which then never fires: `save_pretrained` writes the memory layout, which vLLM
0.32 (`is_fused_checkpoint_transposed=True`: it always transposes) refuses, or, when
H == I, loads transposed without a word. `engine_tensors` turns memory into the hub's layout;
`checkpoint_tensors` is its inverse, for saccade's own loaders, which read safetensors by
key and so bypass transformers' conversion.

The hub's text config also carries `norm_topk_prob: true`, which transformers' config class
lacks (its router always renormalises the top-k weights) and vLLM reads (`renormalize=`):
`build_config` sets it.
"""

from __future__ import annotations

import hashlib
import json
import os
from collections.abc import Iterable, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path

import torch
from torch import nn

from saccade.models.positions import mrope_positions as _mrope_positions
from saccade.models.tiny import PRESETS as QWEN3_VL_PRESETS
from saccade.models.tiny import TinyPreset, build_once, build_processor, build_tokenizer, cache_dir, is_built
from saccade.models.tiny import build_config as build_qwen3_vl_config

name = "qwen3_vl_moe"
model_types = ("qwen3_vl_moe",)
# The smallest real member; what the presets' shapes are scaled from.
full_model_name = "Qwen/Qwen3-VL-30B-A3B-Instruct"

# Checkpoint key prefixes (the same as Qwen3-VL's).
VISION_PREFIX = "model.visual."
LM_PREFIX = "model.language_model."
LM_HEAD_KEY = "lm_head.weight"

# The fused expert parameters (key suffixes), and the two dims their layouts swap.
GATE_UP = "mlp.experts.gate_up_proj"
DOWN = "mlp.experts.down_proj"
EXPERT_PARAMS = (GATE_UP, DOWN)

# LoRA: the attention projections are nn.Linear (peft's target_modules). The router
# (`mlp.gate`, Qwen3VLMoeTextTopKRouter) is not a Linear; the experts are bare 3-D
# parameters, which peft reaches only through `target_parameters` (docs: what vLLM makes of it).
lora_target_modules = ("q_proj", "k_proj", "v_proj", "o_proj")
lora_target_parameters = EXPERT_PARAMS


def text_model_class():
    from transformers.models.qwen3_vl_moe.modeling_qwen3_vl_moe import Qwen3VLMoeTextModel

    return Qwen3VLMoeTextModel


def vision_model_class():
    from transformers.models.qwen3_vl_moe.modeling_qwen3_vl_moe import Qwen3VLMoeVisionModel

    return Qwen3VLMoeVisionModel


def full_model_class():
    from transformers import Qwen3VLMoeForConditionalGeneration

    return Qwen3VLMoeForConditionalGeneration


def checkpoint_key(key: str) -> str | None:
    """A checkpoint key under saccade's canonical names (the hub's: `model.language_model.*`,
    `model.visual.*`, `lm_head.weight`), or None for a key saccade does not load."""
    if key.startswith((LM_PREFIX, VISION_PREFIX)) or key == LM_HEAD_KEY:
        return key
    return None


def is_expert_param(key: str) -> bool:
    return key.endswith(EXPERT_PARAMS)


def engine_tensors(key: str, tensor: torch.Tensor) -> Iterable[tuple[str, torch.Tensor]]:
    """What saccade writes for vLLM, exports and the tiny builder, from one tensor as
    transformers holds it in memory: the fused experts transposed to the hub's layout
    (gate_up (E, 2I, H) -> (E, H, 2I); down (E, H, I) -> (E, I, H)), everything else as is."""
    if is_expert_param(key):
        assert tensor.dim() == 3, (key, tuple(tensor.shape))
        yield key, tensor.transpose(1, 2).contiguous()
    else:
        yield key, tensor


def checkpoint_tensors(key: str, tensor: torch.Tensor) -> Iterable[tuple[str, torch.Tensor]]:
    """The inverse of `engine_tensors`: a hub checkpoint's tensor in transformers' memory layout
    (for loaders that read safetensors by key, as saccade's `read_state_dict` does)."""
    if is_expert_param(key):
        assert tensor.dim() == 3, (key, tuple(tensor.shape))
        yield key, tensor.transpose(1, 2).contiguous()
    else:
        yield key, tensor


def hub_expert_shapes(text_config) -> dict[str, tuple[int, int, int]]:
    """The fused experts' shapes in a hub checkpoint (what vLLM reads), from the text config."""
    E, H, I = text_config.num_experts, text_config.hidden_size, text_config.moe_intermediate_size
    return {GATE_UP: (E, H, 2 * I), DOWN: (E, I, H)}


def memory_expert_shapes(text_config) -> dict[str, tuple[int, int, int]]:
    """The same parameters' shapes in transformers' modules."""
    E, H, I = text_config.num_experts, text_config.hidden_size, text_config.moe_intermediate_size
    return {GATE_UP: (E, 2 * I, H), DOWN: (E, H, I)}


def check_hub_layout(key: str, shape: Sequence[int], text_config) -> None:
    """ValueError unless an expert tensor about to be written has the hub's shape. A square
    expert (hidden_size == moe_intermediate_size) cannot be told apart: said so, not guessed."""
    for suffix, want in hub_expert_shapes(text_config).items():
        if key.endswith(suffix):
            if tuple(shape) != want:
                raise ValueError(f"{key}: shape {tuple(shape)} is not the hub layout {want} (E, H, 2I) / (E, I, H); "
                                 "transformers' in-memory layout must go through engine_tensors first")
            return


def deepstack_levels(config) -> int:
    return len(config.vision_config.deepstack_visual_indexes)


def run_tower(tower: nn.Module, pixel_values: torch.Tensor, grid_thw: torch.Tensor):
    """(main_NH, [deepstack_NH per level]): the tower's merged output and its DeepStack features,
    the images concatenated in order (Qwen3-VL's tower, unchanged in the MoE)."""
    out = tower(pixel_values, grid_thw=grid_thw, return_dict=True)
    return out.pooler_output, list(out.deepstack_features)


def prepare_language_model(language_model: nn.Module) -> nn.Module:
    """DeepStack by index_add at flat image positions (`saccade.models.lm._add_deepstack`), as for
    Qwen3-VL: `Qwen3VLMoeTextModel._deepstack_process` has the same signature and sums."""
    import types

    from saccade.models.lm import _add_deepstack

    language_model._deepstack_process = types.MethodType(_add_deepstack, language_model)
    return language_model


def language_model_kwargs(image_positions_N: torch.Tensor | None,
                          deepstack_list: list[torch.Tensor] | None) -> dict:
    """The DeepStack arguments of `Qwen3VLMoeTextModel.forward` (after `prepare_language_model`)."""
    return dict(visual_pos_masks=image_positions_N, deepstack_visual_embeds=deepstack_list)


def mrope_positions(mm_token_type_ids_L: torch.Tensor, image_grid_thw_N3: torch.Tensor | None, *,
                    spatial_merge_size: int) -> torch.Tensor:
    """Qwen3-VL's M-RoPE rule (`saccade.models.positions`); the MoE's `get_rope_index` is the same."""
    return _mrope_positions(mm_token_type_ids_L, image_grid_thw_N3, spatial_merge_size=spatial_merge_size)


# ---------------------------------------------------------------- router load balance


def router_load(router_logits: Sequence[torch.Tensor], top_k: int,
                token_mask_N: torch.Tensor | None = None) -> dict[str, torch.Tensor | float]:
    """Per-layer expert load of one forward, from transformers' `output_router_logits`.

    router_logits: one (N, E) tensor per MoE layer (N tokens of the forward, flattened).
    token_mask_N: which of the N tokens count (e.g. not padding); None: all.
    Returns
      load_LE: (layers, E) float32, the fraction of the layer's top-k assignments each expert
        got (each row sums to 1; a balanced router gives 1/E everywhere);
      max_over_mean_L: (layers,) max load / mean load (1 = balanced, E/top_k at worst: every
        token to the same top_k experts);
      cv_L: (layers,) coefficient of variation of the load (std / mean, population std);
      max_over_mean, cv: their means over layers (the figures to log per step);
      dead_experts: experts that got no token in some layer, counted over layers.
    """
    if not router_logits:
        raise ValueError("no router logits: run the forward with output_router_logits=True on a MoE model")
    loads = []
    for logits_NE in router_logits:
        N, E = logits_NE.shape
        if not 1 <= top_k <= E:
            raise ValueError(f"top_k {top_k} outside 1..{E} experts")
        chosen_NK = logits_NE.float().topk(top_k, dim=-1).indices  # softmax is monotone: the router's choice
        weight_NK = torch.ones_like(chosen_NK, dtype=torch.float32)
        if token_mask_N is not None:
            weight_NK = weight_NK * token_mask_N.reshape(N, 1).to(weight_NK.device, torch.float32)
        counts_E = torch.zeros(E, dtype=torch.float32, device=logits_NE.device).scatter_add_(
            0, chosen_NK.reshape(-1), weight_NK.reshape(-1))
        total = counts_E.sum()
        loads.append(counts_E / total if total > 0 else counts_E)
    load_LE = torch.stack(loads).cpu()
    mean_L = load_LE.mean(dim=1)
    max_over_mean_L = load_LE.max(dim=1).values / mean_L
    cv_L = load_LE.std(dim=1, unbiased=False) / mean_L
    return {
        "load_LE": load_LE,
        "max_over_mean_L": max_over_mean_L,
        "cv_L": cv_L,
        "max_over_mean": float(max_over_mean_L.mean()),
        "cv": float(cv_L.mean()),
        "dead_experts": int((load_LE == 0).sum()),
    }


# ---------------------------------------------------------------- memory dims


def text_params(text_config) -> dict[str, int]:
    """Language-model parameter counts: `total` (what the trainer holds, lm_head once if tied)
    and `active` (what one token runs through: top-k experts of each MoE layer)."""
    c = text_config
    H, E, K, I = c.hidden_size, c.num_experts, c.num_experts_per_tok, c.moe_intermediate_size
    q, kv = c.num_attention_heads * c.head_dim, c.num_key_value_heads * c.head_dim
    attention = H * q + 2 * H * kv + q * H + 2 * c.head_dim + 2 * H  # projections, q/k norms, layer norms
    moe_layers = [i for i in range(c.num_hidden_layers)
                  if i not in (c.mlp_only_layers or []) and (i + 1) % c.decoder_sparse_step == 0]
    dense_layers = c.num_hidden_layers - len(moe_layers)
    expert = 3 * H * I
    dense_mlp = 3 * H * c.intermediate_size
    embed = c.vocab_size * H
    head = 0 if c.tie_word_embeddings else embed
    outside = embed + head + H
    total = outside + c.num_hidden_layers * attention + dense_layers * dense_mlp + len(moe_layers) * (E * expert + E * H)
    active = outside + c.num_hidden_layers * attention + dense_layers * dense_mlp + len(moe_layers) * (K * expert + E * H)
    return {"total": total, "active": active, "moe_layers": len(moe_layers), "experts": E, "top_k": K}


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


presets: dict[str, MoePreset] = {
    # ~1.3M parameters: 8 experts, top-2, H 128 against I 48 (gate_up (8, 96, 128), down (8, 128, 48)).
    "tiny": MoePreset(base=QWEN3_VL_PRESETS["tiny"], num_experts=8, top_k=2, moe_intermediate=48),
}

# Bump when anything the builder writes changes.
BUILD_VERSION = 2


def preset_folder(preset: str = "tiny", seed: int = 0) -> Path:
    if preset not in presets:
        raise ValueError(f"unknown Qwen3-VL-MoE preset {preset!r}; choose one of {sorted(presets)}")
    key = hashlib.sha256(json.dumps([BUILD_VERSION, asdict(presets[preset]), seed]).encode()).hexdigest()[:10]
    return cache_dir() / f"qwen3vlmoe-{preset}-seed{seed}-{key}"


def tiny_model_path(preset: str = "tiny", seed: int = 0) -> Path:
    """The folder of a generated Qwen3-VL-MoE, built on first use (cached like `tiny.tiny_model_path`)."""
    return build_once(preset_folder(preset, seed), lambda tmp: build_tiny(tmp, preset=preset, seed=seed))


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


def build_tiny(out_dir: str | os.PathLike, *, preset: str = "tiny", seed: int = 0) -> Path:
    """Write a complete random Qwen3-VL-MoE folder in the hub's layout (tokenizer, processor, config,
    weights), which transformers' Auto classes and vLLM both load. Returns the folder."""
    spec = presets[preset]
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    tokenizer = build_tokenizer(spec.base.bpe_vocab_size, seed=seed)
    build_processor(tokenizer, spec.base).save_pretrained(out)
    config = build_config(tokenizer, spec)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = full_model_class()(config)
    model.to(getattr(torch, spec.base.weights_dtype))
    save_hub_layout(model, out)
    return out


def save_hub_layout(model: nn.Module, out_dir: str | os.PathLike) -> None:
    """`model.save_pretrained(out_dir)`, then every safetensors file rewritten through
    `engine_tensors` (transformers writes the experts in its memory layout), each expert tensor
    checked against the hub's shape from the config."""
    from safetensors import safe_open
    from safetensors.torch import save_file

    out = Path(out_dir)
    model.save_pretrained(out, safe_serialization=True)
    text_config = model.config.text_config
    for file in sorted(out.glob("*.safetensors")):
        with safe_open(str(file), framework="pt") as f:
            metadata = f.metadata() or {"format": "pt"}
            tensors = {}
            for key in f.keys():  # noqa: SIM118
                for k, t in engine_tensors(key, f.get_tensor(key)):
                    check_hub_layout(k, t.shape, text_config)
                    tensors[k] = t
        save_file(tensors, str(file), metadata=metadata)
    # transformers writes `num_local_experts` (its attribute_map's target); the hub's configs, and
    # readers of config.json that are not transformers, say `num_experts`. transformers reads both.
    config_file = out / "config.json"
    config = json.loads(config_file.read_text())
    text = config["text_config"]
    if "num_local_experts" in text:
        text["num_experts"] = text.pop("num_local_experts")
    config_file.write_text(json.dumps(config, indent=2, sort_keys=True) + "\n")


def read_hub_state_dict(path: str | os.PathLike, prefix: str, *,
                        dtype: torch.dtype | None = None) -> dict[str, torch.Tensor]:
    """A hub-layout folder's tensors under `prefix`, in transformers' memory layout
    (`saccade.models.loading.read_state_dict` + `checkpoint_tensors`)."""
    from saccade.models.loading import read_state_dict

    out = {}
    for key, t in read_state_dict(Path(path), prefix, dtype=dtype).items():
        out.update(checkpoint_tensors(key, t))
    return out


__all__ = [
    "name", "model_types", "full_model_name", "text_model_class", "vision_model_class", "full_model_class",
    "checkpoint_key", "engine_tensors", "checkpoint_tensors", "deepstack_levels", "run_tower",
    "prepare_language_model", "language_model_kwargs", "mrope_positions", "lora_target_modules",
    "lora_target_parameters", "router_load", "text_params", "presets", "build_tiny", "tiny_model_path",
    "is_built",
]
