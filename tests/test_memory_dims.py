"""A model's dimensions from its config.json (saccade.tools.memory_dims): the parameter counts equal the real
modules', every family's config is read, and the published sizes are the ones saccade had before
their configs were files."""

from __future__ import annotations

import dataclasses

import pytest

from saccade.tools.memory_dims import DIMS, LINEARS, TextDims, VisionDims, dims_from_hf_config, model_dims


@pytest.fixture(scope="module")
def tiny_dims(tiny_path):
    return model_dims(tiny_path)


def test_parameter_counts_equal_the_tiny_models(tiny_path, tiny_dims):
    from saccade.config import LoraConfig
    from saccade.models.lm import apply_lora, load_policy_lm
    from saccade.models.loading import load_vision_tower

    policy = load_policy_lm(tiny_path)
    assert tiny_dims.text.params == sum(p.numel() for p in policy.parameters())  # tied head counted once
    assert tiny_dims.vision.params == sum(p.numel() for p in load_vision_tower(tiny_path).parameters())
    for rank, targets in ((8, LINEARS), (4, ("q_proj", "v_proj")), (16, ("down_proj",))):
        peft_model = apply_lora(load_policy_lm(tiny_path), LoraConfig(rank=rank, target_modules=list(targets)))
        trainable = sum(p.numel() for p in peft_model.parameters() if p.requires_grad)
        assert tiny_dims.text.lora_params(rank, targets) == trainable


def test_an_untied_head_counts_twice(tiny_dims):
    untied = dataclasses.replace(tiny_dims.text, tie_word_embeddings=False)
    assert untied.params - tiny_dims.text.params == untied.vocab_size * untied.hidden_size


def test_published_model_sizes():
    # What the dimensions give; 8.77B is also the size LM Studio's card lists for Qwen3-VL-8B.
    names = ("Qwen/Qwen3-VL-2B-Instruct", "Qwen/Qwen3-VL-4B-Instruct", "Qwen/Qwen3-VL-8B-Instruct")
    sizes = {name: round(model_dims(name).params / 1e9, 2) for name in names}
    assert sizes == {"Qwen/Qwen3-VL-2B-Instruct": 2.13, "Qwen/Qwen3-VL-4B-Instruct": 4.44, "Qwen/Qwen3-VL-8B-Instruct": 8.77}


def test_dims_from_config_json(tiny_path, tiny_dims):
    import json

    config = json.loads((tiny_path / "config.json").read_text())
    assert dims_from_hf_config(config, tiny_dims.name) == tiny_dims
    assert tiny_dims.vision.deepstack_levels == len(config["vision_config"]["deepstack_visual_indexes"])
    with pytest.raises(ValueError, match="no dimensions"):
        model_dims("someone/Not-A-Known-Model")


def test_the_warm_start_has_the_tiny_models_dimensions(tiny_dims):
    """`saccade memory --model.path tiny-warm` sizes the tiny model without building the warm start
    (that trains)."""
    from dataclasses import replace

    assert model_dims("tiny-warm") == replace(tiny_dims, name="tiny-warm")


def test_every_family_has_a_reader():
    from saccade.models.families import FAMILIES

    assert sorted(DIMS) == sorted(t for f in FAMILIES for t in f.model_types)


def test_the_published_qwen3_vl_configs_give_the_dimensions_saccade_held_in_a_table():
    """Before their config.json were files, saccade.tools.memory held Qwen3-VL's sizes as numbers: the
    files give exactly those (every shipped config's header depends on them; tests/test_configs.py)."""
    assert model_dims("Qwen/Qwen3-VL-2B-Instruct") == dataclasses.replace(model_dims("Qwen/Qwen3-VL-2B-Instruct"),
        text=TextDims(151936, 2048, 28, 16, 8, 128, 6144, tie_word_embeddings=True),
        vision=VisionDims(1024, 24, 4096, 2048, 2304, deepstack_levels=3), lora_targets=LINEARS)
    assert (model_dims("Qwen/Qwen3-VL-4B-Instruct").text, model_dims("Qwen/Qwen3-VL-4B-Instruct").vision) == (
        TextDims(151936, 2560, 36, 32, 8, 128, 9728, tie_word_embeddings=True),
        VisionDims(1024, 24, 4096, 2560, 2304, deepstack_levels=3))
    assert (model_dims("Qwen/Qwen3-VL-8B-Instruct").text, model_dims("Qwen/Qwen3-VL-8B-Instruct").vision) == (
        TextDims(151936, 4096, 36, 32, 8, 128, 12288, tie_word_embeddings=False),
        VisionDims(1152, 27, 4304, 4096, 2304, deepstack_levels=3))


def test_hub_ids_and_presets_at_published_shapes_need_no_build(monkeypatch):
    """A hub id saccade holds the config of, and a preset at published shapes, are sized from
    config.json alone; only a tiny preset (its vocabulary is its tokenizer's) is built."""
    import saccade.models.presets as presets

    monkeypatch.setattr(presets, "preset_path", lambda *a, **k: pytest.fail("built a preset"))
    for name in (*presets.published_ids(), *(p for p, spec in presets.PRESETS.items() if not spec.tokenizer_vocab)):
        assert model_dims(name).params > 1e9, name
