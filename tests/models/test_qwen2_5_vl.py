"""What is particular to Qwen2.5-VL (saccade.models.families.qwen2_5_vl): the tiny folder it
builds, its two checkpoint layouts, the published sizes. Parity and positions run for every
family in tests/models/test_families.py."""

from __future__ import annotations

import pytest
import torch

from saccade.models.families import qwen2_5_vl
from saccade.models.loading import load_layout
from saccade.models.presets import build_config, build_tokenizer, preset_path, published_config, tiny_preset
from saccade.models.presets.builder import CLIP_MEAN

FAMILY = qwen2_5_vl.FAMILY


@pytest.fixture(scope="module")
def path():
    return preset_path(tiny_preset(FAMILY))


def test_the_tiny_folder_loads_in_transformers_auto_classes(path):
    from transformers import (AutoModelForImageTextToText, AutoProcessor, Qwen2_5_VLForConditionalGeneration,
                              Qwen2_5_VLProcessor, Qwen2VLImageProcessor)

    processor = AutoProcessor.from_pretrained(path)
    assert type(processor) is Qwen2_5_VLProcessor and type(processor.image_processor) is Qwen2VLImageProcessor
    assert processor.image_processor.patch_size == 14 and processor.image_processor.merge_size == 2
    assert list(processor.image_processor.image_mean) == CLIP_MEAN
    model = AutoModelForImageTextToText.from_pretrained(path)
    assert type(model) is Qwen2_5_VLForConditionalGeneration
    vision, text = model.config.vision_config, model.config.text_config
    assert (vision.patch_size, vision.window_size, list(vision.fullatt_block_indexes)) == (14, 56, [1, 3])
    assert text.hidden_size // text.num_attention_heads == 32  # vLLM's CPU attention refuses 16
    assert 1.0e6 < sum(p.numel() for p in model.parameters()) < 1.5e6


def test_both_layouts_map_onto_the_canonical_names_through_transformers(path):
    """transformers' own renames (what saccade's loader runs) take the hub's names and the canonical ones."""
    key = lambda k: load_layout(path).canonical(k)[0]  # noqa: E731
    # The hub's layout (and what transformers 5.19's save_pretrained writes for Qwen2.5-VL).
    assert key("model.layers.0.self_attn.q_proj.bias") == "model.language_model.layers.0.self_attn.q_proj.bias"
    assert key("model.embed_tokens.weight") == "model.language_model.embed_tokens.weight"
    assert key("model.norm.weight") == "model.language_model.norm.weight"
    assert key("visual.merger.ln_q.weight") == "model.visual.merger.ln_q.weight"
    assert key("lm_head.weight") == "lm_head.weight"
    for k in ("model.language_model.layers.3.mlp.up_proj.weight", "model.visual.blocks.0.attn.qkv.weight"):
        assert key(k) == k  # the canonical layout, unchanged


def test_every_stored_tensor_maps_onto_the_full_model(path):
    """transformers 5.19 saves Qwen2.5-VL in the hub's layout; mapped, the stored keys are
    exactly the full model's state-dict names (the tied head aside)."""
    from safetensors import safe_open

    from saccade.models.loading import load_full_model

    with safe_open(str(path / "model.safetensors"), framework="pt") as f:
        stored = list(f.keys())
    assert "model.layers.0.self_attn.q_proj.weight" in stored and "visual.patch_embed.proj.weight" in stored
    layout = load_layout(path)
    assert {layout.canonical(k)[0] for k in stored} == set(load_full_model(path).state_dict()) - {"lm_head.weight"}


def test_a_weights_folder_in_either_layout_passes_the_servers_check(path, tmp_path):
    """/update_weights compares a pushed folder with the served one by canonical names: the
    engine-weights writer keeps the base's (hub) keys, an export may hold canonical ones."""
    from safetensors.torch import load_file, save_file

    from saccade.serving.validation import RequestError
    from saccade.serving.weights import check_weights_folder, reference_shapes

    layout = load_layout(path)
    canonical = lambda k: layout.canonical(k)[0]  # noqa: E731
    reference = reference_shapes(layout)
    assert "model.language_model.embed_tokens.weight" in reference and "model.embed_tokens.weight" not in reference
    tensors = load_file(path / "model.safetensors")
    for name, keys in (("hub", tensors), ("canonical", {canonical(k): v for k, v in tensors.items()})):
        (tmp_path / name).mkdir()
        save_file(dict(keys), tmp_path / name / "model.safetensors")
        assert check_weights_folder(str(tmp_path / name), reference, canonical) == len(tensors)
    (tmp_path / "bad").mkdir()
    save_file({"model.layers.0.self_attn.q_proj.bias": torch.zeros(3)}, tmp_path / "bad" / "model.safetensors")
    with pytest.raises(RequestError, match="wrong shape"):
        check_weights_folder(str(tmp_path / "bad"), reference, canonical)


@pytest.mark.parametrize("hub_id, preset, billions", [("Qwen/Qwen2.5-VL-7B-Instruct", "qwen2.5vl-7b", 8.29),
                                                      ("Qwen/Qwen2.5-VL-3B-Instruct", "qwen2.5vl-3b", 3.75)])
def test_published_configs_and_presets_give_the_published_sizes(hub_id, preset, billions):
    """The hub configs (written from memory) and the random presets at their shapes build,
    on the meta device, models of the sizes the model cards publish; `saccade memory` counts
    the same parameters, text and tower apart, without building anything."""
    from transformers import Qwen2_5_VLConfig

    from saccade.tools.memory_dims import model_dims

    config = Qwen2_5_VLConfig(**{k: v for k, v in published_config(hub_id).items() if k != "architectures"})
    preset_config = build_config(preset, build_tokenizer(1024))
    dims = model_dims(preset)
    assert (dims.text, dims.vision) == (model_dims(hub_id).text, model_dims(hub_id).vision)
    for c in (config, preset_config):
        with torch.device("meta"):
            model = FAMILY.full_model_class()(c)
        vision = sum(p.numel() for p in model.model.visual.parameters())
        assert (sum(p.numel() for p in model.parameters()) - vision, vision) == (dims.text.params, dims.vision.params)
        assert round((dims.text.params + vision) / 1e9, 2) == billions
    assert dims.text.head_dim == 128 and dims.vision.deepstack_levels == 0
