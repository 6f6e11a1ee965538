"""The weights saccade writes for vLLM and `saccade export` come out in the hub's layout whatever
layout the base folder is in, and load back through the same reader (transformers')."""

from __future__ import annotations

import json

import pytest
import torch

from saccade.tools.bench.checkpoint_variants import build_variants, family_named
from saccade.models.families import LM_PREFIX


def stored_shapes(path) -> dict[str, tuple[int, ...]]:
    from safetensors import safe_open

    from saccade.models.loading import safetensors_files

    out = {}
    for f in safetensors_files(path):
        with safe_open(str(f), framework="pt") as h:
            out.update({k: tuple(h.get_slice(k).get_shape()) for k in h.keys()})  # noqa: SIM118
    return out


@pytest.mark.parametrize("family, variant", [
    ("Qwen3.5-MoE", "save_pretrained"),  # experts one tensor per expert
    ("Qwen3-VL-MoE", "save_pretrained"),  # experts in transformers' memory layout
    ("Qwen3.5-MoE", "hub"),  # fused experts beside a split MTP layer, which is copied as it is
    ("Qwen2.5-VL", "save_pretrained"),  # the pre-4.52 names, kept
    ("Qwen3-VL", "sharded-bf16"),  # several files and an index
])
def test_engine_weights_are_the_hub_layout_and_load_back(tmp_path, family, variant):
    from saccade.models.lm import load_policy_lm, set_full_finetune
    from saccade.models.loading import load_vision_tower
    from saccade.trainer.checkpoint.engine_weights import merge_full_weights_for_engine

    base = build_variants(tmp_path / "base", family_named(family), (variant,))[variant]
    dtype = torch.bfloat16 if "bf16" in variant else torch.float32
    model = set_full_finetune(load_policy_lm(base, dtype=dtype))
    with torch.no_grad():  # a trained model: every weight moved
        for p in model.parameters():
            p.add_(0.01)
    out = merge_full_weights_for_engine(model, base, tmp_path / "engine")

    shapes = stored_shapes(out)
    if family.endswith("MoE"):
        key = f"{LM_PREFIX}layers.0.mlp.experts.gate_up_proj"
        text = model.config.text_config
        E, H, I = text.num_experts, text.hidden_size, text.moe_intermediate_size
        assert shapes[key] == ((E, H, 2 * I) if family == "Qwen3-VL-MoE" else (E, 2 * I, H))  # the hub's
        assert not any(k.startswith(LM_PREFIX) and ".experts.0." in k for k in shapes)
    base_shapes = stored_shapes(base)
    untouched = [k for k in base_shapes if not k.startswith(("model.language_model.", "model.layers.", "model.embed",
                                                            "model.norm", "lm_head"))]
    assert all(shapes[k] == base_shapes[k] for k in untouched)  # the tower and mtp.* as they were
    if family == "Qwen2.5-VL":
        assert "model.layers.0.self_attn.q_proj.weight" in shapes  # the base's own names kept
    if (base / "model.safetensors.index.json").is_file():
        index = json.loads((out / "model.safetensors.index.json").read_text())["weight_map"]
        assert set(index) == set(shapes)

    back = load_policy_lm(out, dtype=dtype).state_dict()
    trained = model.state_dict()
    assert set(back) == set(trained)
    assert all(torch.equal(back[k], trained[k]) for k in trained)
    tower_out, tower_base = load_vision_tower(out).state_dict(), load_vision_tower(base).state_dict()
    assert all(torch.equal(tower_out[k], tower_base[k]) for k in tower_base)
