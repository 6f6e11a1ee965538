"""saccade loads every checkpoint as transformers does: the variant matrix.

For each family, one random model built by transformers itself (other shapes than the presets,
non-square experts) saved in every layout the outside world writes (`saccade.tools.bench.checkpoint_variants`:
save_pretrained's default, memory layout, sharded bf16 with an index, the hub's files). Each must
load into saccade's trainer (language model + lm_head) and tower with exactly the tensors
transformers' `from_pretrained` of the whole model holds, and the LM-only path must give the full
model's logprobs on the parity bench's cases (fp32, <= 1e-5; measured 0.0 everywhere, packed <= 9.5e-7).
"""

from __future__ import annotations

import json
import shutil

import pytest
import torch

from saccade.tools.bench.checkpoint_variants import VARIANTS, build_variants, family_named, random_model, save_variant
from saccade.models.families import FAMILIES, LM_HEAD_KEY, LM_PREFIX
from saccade.models.loading import load_layout
from saccade.models.presets import tiny_preset

# LM-only vs the full model on the parity cases, fp32: transformers' own bar (tests/models/test_families.py).
PARITY_FP32 = 1e-5


@pytest.fixture(scope="module")
def variants(tmp_path_factory):
    root = tmp_path_factory.mktemp("variants")
    return {f.name: build_variants(root / tiny_preset(f), f) for f in FAMILIES}


def saccade_state(path) -> dict[str, torch.Tensor]:
    """What saccade's trainer and tower hold, under the full model's names."""
    from saccade.models.lm import load_policy_lm
    from saccade.models.loading import load_vision_tower

    policy = load_policy_lm(path)
    tower = load_vision_tower(path)
    return {**policy.state_dict(), **{f"model.visual.{k}": v for k, v in tower.state_dict().items()}}


@pytest.mark.parametrize("variant", VARIANTS)
@pytest.mark.parametrize("family", [f.name for f in FAMILIES])
def test_every_variant_loads_as_transformers_loads_it(variants, family, variant):
    from saccade.models.loading import load_full_model
    from saccade.tools.parity import run_parity

    path = variants[family][variant]
    reference = load_full_model(path).state_dict()
    held = saccade_state(path)
    assert set(held) == set(reference)
    differ = [k for k in reference if not torch.equal(held[k], reference[k])]
    assert not differ, f"{family} {variant}: {differ[:5]}"
    figures = run_parity(path)
    assert figures["lm_only_vs_full_max_abs"] <= PARITY_FP32
    assert figures["packed_vs_full_max_abs"] <= PARITY_FP32


def stored(path) -> dict[str, tuple[int, ...]]:
    from saccade.models.checkpoint_layout import safetensors_files
    from safetensors import safe_open

    out = {}
    for f in safetensors_files(path):
        with safe_open(str(f), framework="pt") as h:
            out.update({k: tuple(h.get_slice(k).get_shape()) for k in h.keys()})  # noqa: SIM118
    return out


def test_the_variants_hold_the_layouts_they_are_named_for(variants):
    """The matrix tests what it says: each variant's files are in the layout the outside world writes."""
    moe35 = variants["Qwen3.5-MoE"]
    assert any(".mlp.experts.0.gate_proj.weight" in k and k.startswith(LM_PREFIX) for k in stored(moe35["save_pretrained"]))
    hub35 = stored(moe35["hub"])
    assert any(k.startswith("mtp.layers.0.mlp.experts.0.") for k in hub35)  # the MTP layer split per expert
    assert not any(k.startswith(LM_PREFIX) and ".experts.0." in k for k in hub35)  # the main layers fused
    vlmoe = variants["Qwen3-VL-MoE"]
    key = f"{LM_PREFIX}layers.0.mlp.experts.gate_up_proj"
    E, H, I = 6, 128, 40
    assert stored(vlmoe["memory"])[key] == (E, 2 * I, H)
    assert stored(vlmoe["save_pretrained"])[key] == (E, 2 * I, H)  # transformers writes its memory layout
    assert stored(vlmoe["hub"])[key] == (E, H, 2 * I)
    hub_config = json.loads((vlmoe["hub"] / "config.json").read_text())
    assert "tie_word_embeddings" not in hub_config["text_config"] and hub_config["tie_word_embeddings"] is False
    assert LM_HEAD_KEY in stored(vlmoe["hub"])
    assert any(k.startswith("model.layers.") for k in stored(variants["Qwen2.5-VL"]["save_pretrained"]))
    assert (variants["Qwen3-VL"]["sharded-bf16"] / "model.safetensors.index.json").is_file()


def test_the_head_is_tied_as_transformers_ties_it(variants):
    """Qwen3-VL-MoE's text config defaults `tie_word_embeddings` to true; transformers (and vLLM)
    decide from the top-level config, which says false: the checkpoint's own lm_head is used. The
    rule saccade had (tie when either level says so) tied it to the embeddings: 2.63 max |Δ logprob|
    on such a checkpoint."""
    from saccade.models.lm import load_policy_lm

    path = variants["Qwen3-VL-MoE"]["hub"]
    layout = load_layout(path)
    assert layout.config.text_config.tie_word_embeddings is True  # what the old rule read
    policy = load_policy_lm(path)
    assert policy.lm_head.weight is not policy.language_model.embed_tokens.weight
    from safetensors import safe_open

    with safe_open(str(path / "model.safetensors"), framework="pt") as f:
        assert torch.equal(policy.lm_head.weight, f.get_tensor(LM_HEAD_KEY))
    tied = variants["Qwen3-VL"]["save_pretrained"]  # tied at the top level: no lm_head in the files
    assert LM_HEAD_KEY not in stored(tied)
    policy = load_policy_lm(tied)
    assert policy.lm_head.weight is policy.language_model.embed_tokens.weight


def test_every_stored_tensor_is_read_or_named_unused(variants):
    """The hub's Qwen3.5 files carry `mtp.*`, which the model declares it does not read: named
    unused. A tensor nobody reads is an error naming it."""
    for family in ("Qwen3.5", "Qwen3.5-MoE"):
        path = variants[family]["hub"]
        classified = load_layout(path).classify(stored(path))
        assert classified.unused and all(k.startswith("mtp.") for k in classified.unused)
        assert not any(k.startswith("mtp.") for k in classified.parts)


def test_a_tensor_nobody_reads_is_refused_by_name(variants, tmp_path):
    from safetensors.torch import load_file, save_file

    from saccade.models.lm import load_policy_lm

    path = tmp_path / "stray"
    shutil.copytree(variants["Qwen3-VL"]["memory"], path)
    weights = load_file(str(path / "model.safetensors"))
    weights["model.language_model.layers.0.mlp.extra_proj.weight"] = torch.zeros(4, 4)
    save_file(weights, str(path / "model.safetensors"), metadata={"format": "pt"})
    with pytest.raises(ValueError, match=r"belong to no part.*extra_proj"):
        load_policy_lm(path)


def test_a_missing_tensor_is_refused_by_name(variants, tmp_path):
    from safetensors.torch import load_file, save_file

    from saccade.models.lm import load_policy_lm

    path = tmp_path / "missing"
    shutil.copytree(variants["Qwen3.5-MoE"]["memory"], path)
    weights = load_file(str(path / "model.safetensors"))
    del weights[LM_HEAD_KEY]  # untied: the head must be there
    save_file(weights, str(path / "model.safetensors"), metadata={"format": "pt"})
    with pytest.raises(ValueError, match=r"lacks 1 tensors.*lm_head.weight.*tie_word_embeddings is false"):
        load_policy_lm(path)


def test_a_square_expert_shape_is_refused_with_the_folder_named(tmp_path):
    """hidden_size == 2 x moe_intermediate_size: transformers reads the fused gate_up as stored,
    vLLM transposes it; the shape cannot tell which layout the file holds."""
    from saccade.models.lm import load_policy_lm

    family = family_named("Qwen3-VL-MoE")
    model, preset = random_model(family, text={"moe_intermediate_size": 64, "num_experts": 4})
    path = save_variant(model, preset, tmp_path / "square", "memory")
    with pytest.raises(ValueError, match=r"square.*cannot say") as err:
        load_policy_lm(path)
    assert str(path) in str(err.value)


def test_the_tie_rule_from_config_json_alone_is_each_config_class_own():
    """`ties_embeddings` (what `saccade memory` counts by) asks transformers' config classes, whose
    rules differ by family: a text-level true is not read for Qwen3-VL-MoE, forwarded for Qwen2.5-VL."""
    from saccade.models.families.interface import ties_embeddings

    text_says_tie = {"text_config": {"tie_word_embeddings": True}}
    assert ties_embeddings({"model_type": "qwen3_vl_moe", **text_says_tie}) is False
    assert ties_embeddings({"model_type": "qwen2_5_vl", **text_says_tie}) is True
    assert ties_embeddings({"model_type": "qwen3_vl", "tie_word_embeddings": True}) is True
    assert ties_embeddings({"model_type": "qwen3_5"}) is False
