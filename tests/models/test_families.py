"""The model-family registry, and every family's parity on its own tiny model.

A new family joins the parametrised tests by being in `FAMILIES` with a tiny preset
(`saccade.models.presets`): the `family_model_path` fixture builds it (once, cached).
"""

from __future__ import annotations

import json

import pytest
import torch

from saccade.tools.memory_dims import LINEARS
from saccade.models.families import FAMILIES, LM_HEAD_KEY, LM_PREFIX, VISION_PREFIX, ModelFamily, family_of
from saccade.models.families import qwen3_vl
from saccade.models.presets import preset_path, tiny_preset
from saccade.tools.parity import parity_conversations, run_parity

TOLERANCE = 1e-5  # fp32, per-token logprob, max |Δ| (tests/models/test_lm.py's bar)
MISTAKE_FLOOR = 1e-2
# Gradients are compared relative to their largest entry, but never to less than 1: Qwen3.5's
# reference Gated DeltaNet kernel (always fp32 inside, chunks of 64 tokens) sums a shared or
# repeated prompt in another order, and parameters whose gradients are near 0 (dt_bias, A_log:
# largest entries 7e-3 and 1.3e-2) show that rounding, up to 1.2e-6 (2.1e-6 with the model in
# float64: the kernel's own fp32, not the model's dtype).
GRAD_FLOOR = 1.0
@pytest.fixture(scope="module", params=FAMILIES, ids=lambda f: f.name)
def family_model_path(request):
    """(family, the folder of its first tiny preset), for every registered family."""
    family: ModelFamily = request.param
    return family, preset_path(tiny_preset(family))


def test_an_unknown_model_type_is_refused_naming_the_known_ones(tmp_path):
    with pytest.raises(ValueError, match=r"'llava'.*'qwen3_vl' \(Qwen3-VL\).*docs/families.md"):
        family_of({"model_type": "llava"})
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "gemma3"}))
    with pytest.raises(ValueError, match="'gemma3'"):
        family_of(tmp_path)
    with pytest.raises(ValueError, match="no config.json"):
        family_of(tmp_path / "nowhere")


def test_loading_refuses_an_unknown_family(tmp_path, tiny_path):
    from saccade.models.loading import load_config

    config = json.loads((tiny_path / "config.json").read_text())
    config["model_type"] = "qwen2_vl"  # a real transformers type, but no saccade family
    (tmp_path / "config.json").write_text(json.dumps(config))
    with pytest.raises(ValueError, match="no model family for model_type 'qwen2_vl'"):
        load_config(tmp_path)


def test_family_of_finds_qwen3_vl_from_the_tiny_folder_and_its_configs(tiny_path):
    from saccade.models.loading import load_config

    assert family_of(tiny_path) is qwen3_vl.FAMILY
    config = load_config(tiny_path)
    for part in (config, config.vision_config, config.text_config):
        assert family_of(part) is qwen3_vl.FAMILY
    assert family_of(json.loads((tiny_path / "config.json").read_text())) is qwen3_vl.FAMILY


def test_qwen3_vl_members_are_the_canonical_layout():
    f = qwen3_vl.FAMILY
    t = torch.randn(3, 4)
    assert f.checkpoint.to_hub("lm_head.weight", t) is t
    assert f.lora_target_modules == LINEARS and f.lora_target_parameters == ()
    assert f.language_model_kwargs(None, None) == {}
    main, levels = f.split_served_features(torch.arange(24.0).view(2, 12), 2)
    assert main.shape == (2, 4) and [x.shape for x in levels] == [(2, 4), (2, 4)]
    assert torch.equal(levels[1], torch.arange(24.0).view(2, 12)[:, 8:])


def test_the_families_classes_build_their_configs(family_model_path):
    family, path = family_model_path
    from saccade.tools.memory_dims import dims_from_hf_config
    from saccade.models.loading import load_config

    config = load_config(path)
    assert family_of(config) is family
    assert family.full_model_class().__name__ == family.full_model_class.__name__  # named without importing
    assert family.deepstack_levels(config) == family.deepstack_levels(config.vision_config) >= 0
    dims = dims_from_hf_config(json.loads((path / "config.json").read_text()))
    assert dims.text.hidden_size == config.text_config.hidden_size and dims.lora_targets == family.lora_target_modules


@pytest.fixture(scope="module")
def parity_figures(family_model_path):
    family, path = family_model_path
    figures = run_parity(path)
    print(family.name, {name: case["lm_only_vs_full_max_abs"] for name, case in figures["cases"].items()},
          {k: v for k, v in figures.items() if k.endswith("_max_abs")})
    return figures


def test_the_lm_only_path_matches_the_full_model(family_model_path, parity_figures):
    """Invariant 2 for each family: cached tower outputs + the family's extras through the language
    model alone equal the full transformers model on pixels; the mistakes show."""
    family, path = family_model_path
    figures = parity_figures
    # single image, several images, text only, multi-turn: each within the bar
    for name in ("one_image", "several_images", "text_only", "multi_turn"):
        assert figures["cases"][name]["lm_only_vs_full_max_abs"] <= TOLERANCE, name
    assert figures["lm_only_vs_full_max_abs"] <= TOLERANCE
    assert figures["positions_1d_max_abs"] > MISTAKE_FLOOR
    assert figures["family"] == family.name
    from saccade.models.loading import load_config

    if family.deepstack_levels(load_config(path)):
        assert figures["deepstack_dropped_max_abs"] > MISTAKE_FLOOR
    else:  # nothing to drop: the same numbers
        assert figures["deepstack_dropped_max_abs"] == figures["lm_only_vs_full_max_abs"]


def test_the_packed_lm_only_path_matches_the_full_model(request, family_model_path, parity_figures):
    """The same five conversations packed in one row."""
    assert parity_figures["packed_vs_full_max_abs"] <= TOLERANCE


@pytest.fixture(scope="module")
def family_models(family_model_path):
    """(family, path, processor, full model, encoder on the family's tower) of the tiny preset."""
    from saccade.config import ImagesConfig
    from saccade.models.loading import load_full_model, load_processor, load_vision_tower
    from saccade.models.vision import EmbeddingCache, VisionEncoder

    family, path = family_model_path
    processor = load_processor(path)
    limits = ImagesConfig(min_pixels=32 * 32, max_pixels=256 * 256)
    encoder = VisionEncoder(load_vision_tower(path), processor, limits=limits, cache=EmbeddingCache())
    return family, path, processor, load_full_model(path), encoder


def test_positions_equal_the_full_models_get_rope_index(family_models):
    """The family's M-RoPE rule, as the embedded engine asks it (`VisionEncoder.positions`) and the
    trainer's samples do (`PolicyLM.positions`, the same rule at the same merge), against
    transformers' own `get_rope_index`, on every parity conversation."""
    from saccade.data.messages import messages_to_inputs

    family, _, processor, full, encoder = family_models
    # What `PolicyLM.positions` is for this model: the same rule at the same merge, so one object's answers.
    assert encoder.positions == family.positions_of(full.config)
    for name, messages in parity_conversations().items():
        inputs = messages_to_inputs(messages, processor, limits=encoder.limits, sample=name)
        ours = encoder.positions.mrope(inputs.mm_token_type_ids, inputs.image_grid_thw)
        with torch.no_grad():
            # by keyword: Qwen3.5's override takes video_grid_thw first
            ref, _ = full.model.get_rope_index(input_ids=inputs.input_ids[None],
                                               mm_token_type_ids=inputs.mm_token_type_ids[None],
                                               image_grid_thw=inputs.image_grid_thw)
        assert torch.equal(ours, ref[:, 0].long()), name


def test_the_tower_alone_equals_the_full_models_image_features(family_models):
    """`run_tower` on the tower `load_vision_tower` reads (through transformers' loader) equals the
    full model's `get_image_features`, main features and DeepStack levels alike."""
    from saccade.data.messages import messages_to_inputs

    family, _, processor, full, encoder = family_models
    inputs = messages_to_inputs(parity_conversations()["different_sizes"], processor, limits=encoder.limits)
    with torch.no_grad():
        main_NH, levels = family.run_tower(encoder.tower, inputs.pixel_values, inputs.image_grid_thw)
        ref = full.model.get_image_features(inputs.pixel_values, inputs.image_grid_thw)
    assert torch.equal(main_NH, torch.cat(ref.pooler_output))
    assert len(levels) == family.deepstack_levels(full.config)
    for ours, theirs in zip(levels, getattr(ref, "deepstack_features", None) or [], strict=True):
        assert torch.equal(ours, theirs if torch.is_tensor(theirs) else torch.cat(theirs))


def test_shared_prompts_give_each_familys_packed_logprobs_and_gradients(request, family_models):
    """A GRPO group's prompt computed once (packed_sdpa's shared prompts) gives every completion
    the logprobs and gradients of the sample packed whole (tests/trainer/test_shared_prompts.py
    shows it at length on Qwen3-VL)."""
    from saccade.models.lm import load_policy_lm, set_full_finetune
    from saccade.tools.parity import grouped_samples
    from saccade.trainer.forward import forward_logprobs
    from saccade.trainer.packing import pack

    family, path, processor, _, encoder = family_models
    # Three completions of different lengths per prompt.
    samples = grouped_samples(processor, encoder, (4, 5, 6), torch.Generator().manual_seed(0))
    results = {}
    for share in (False, True):
        model = set_full_finetune(load_policy_lm(path))
        logprobs = {}
        for mb in pack(samples, encoder.cache.get, max_tokens=4096, image_token_id=model.image_token_id,
                       spatial_merge_size=encoder.merge, share_prompts=share):
            lp, _ = forward_logprobs(model, mb, only_loss_tokens=True)
            for k, sid in enumerate(mb.sample_ids):
                lo, hi = int(mb.cu_seqlens[k]), int(mb.cu_seqlens[k + 1])
                logprobs[sid] = lp[lo:hi][mb.loss_mask[lo:hi]]
        sum((lp * (i % 3 - 1.0)).sum() for i, lp in enumerate(logprobs[s.sample_id] for s in samples)).backward()
        results[share] = logprobs, {n: p.grad.clone() for n, p in model.named_parameters()}
    (whole, whole_grads), (shared, shared_grads) = results[False], results[True]
    assert max(float((whole[k] - shared[k]).detach().abs().max()) for k in whole) <= TOLERANCE
    for name, grad in whole_grads.items():
        assert (shared_grads[name] - grad).abs().max() <= TOLERANCE * max(float(grad.abs().max()), GRAD_FLOOR), name


def test_to_hub_gives_back_the_bytes_the_tiny_folder_holds(family_model_path):
    """Loading goes through transformers' loader into the modules' layout; writing goes back
    through the family's `checkpoint.to_hub`, one tensor for one, to the bytes the (hub-layout)
    files hold."""
    from safetensors import safe_open

    from saccade.models.lm import load_policy_lm
    from saccade.models.loading import load_layout, safetensors_files

    family, path = family_model_path
    layout = load_layout(path)
    held = load_policy_lm(path).state_dict()
    for file in safetensors_files(path):
        with safe_open(str(file), framework="pt") as f:
            for key in f.keys():  # noqa: SIM118
                name, _ = layout.canonical(key)
                if name not in held:
                    continue
                stored = f.get_tensor(key)
                assert torch.equal(family.checkpoint.to_hub(name, held[name].to(stored.dtype)), stored), name