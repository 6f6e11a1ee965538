"""Tests for saccade.models.presets: the offline random models every other test stands on (Qwen3-VL's
tiny one first), the one builder that makes every family's, and the names that resolve to them."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest
import torch

from saccade.models.families import FAMILIES
from saccade.models.presets import (
    BUILD_VERSION,
    CHAT_TEMPLATE,
    PRESETS,
    build,
    build_config,
    build_tokenizer,
    preset_family,
    preset_path,
    presets_of,
    resolve_model,
    tiny_preset,
)

QWEN_SPECIAL = [
    "<|im_start|>",
    "<|im_end|>",
    "<|vision_start|>",
    "<|vision_end|>",
    "<|image_pad|>",
    "<|video_pad|>",
]


# ----------------------------------------------------------------- loading by Auto


def test_auto_classes_load_the_folder(tiny_path):
    from transformers import AutoModelForImageTextToText, AutoProcessor, Qwen2VLImageProcessor
    from transformers import Qwen3VLForConditionalGeneration, Qwen3VLProcessor
    from transformers.models.qwen3_vl.video_processing_qwen3_vl import Qwen3VLVideoProcessor

    processor = AutoProcessor.from_pretrained(tiny_path)
    assert type(processor) is Qwen3VLProcessor
    assert isinstance(processor.image_processor, Qwen2VLImageProcessor)
    assert isinstance(processor.video_processor, Qwen3VLVideoProcessor)
    # Qwen3-VL's own preprocessing: patch 16, merge 2, mean = std = 0.5.
    assert processor.image_processor.patch_size == 16
    assert processor.image_processor.merge_size == 2

    model = AutoModelForImageTextToText.from_pretrained(tiny_path)
    assert type(model) is Qwen3VLForConditionalGeneration
    assert model.config.model_type == "qwen3_vl"
    # Nothing was left randomly initialised on load: every checkpoint tensor was found.
    from safetensors import safe_open

    with safe_open(str(tiny_path / "model.safetensors"), framework="pt") as f:
        keys = set(f.keys())
    state = model.state_dict()
    for key in ("model.visual.patch_embed.proj.weight", "model.language_model.layers.0.self_attn.q_proj.weight"):
        assert key in keys
        with safe_open(str(tiny_path / "model.safetensors"), framework="pt") as f:
            assert torch.equal(state[key], f.get_tensor(key))


def test_config_has_deepstack_and_vllm_compatible_head_dim(tiny_path):
    from transformers import AutoConfig

    config = AutoConfig.from_pretrained(tiny_path)
    levels = list(config.vision_config.deepstack_visual_indexes)
    assert len(levels) >= 2
    assert levels == sorted(set(levels))
    # DeepStack level k is added after LM layer k: every level needs a layer to land on.
    assert max(levels) < config.text_config.num_hidden_layers
    assert max(levels) < config.vision_config.depth
    # vLLM's CPU attention refuses head_dim 16.
    assert config.text_config.head_dim >= 32
    assert config.vision_config.out_hidden_size == config.text_config.hidden_size
    assert config.vision_config.spatial_merge_size == 2
    assert config.vision_config.patch_size == 16
    # M-RoPE sections cover head_dim / 2 frequencies.
    section = config.text_config.rope_parameters["mrope_section"]
    assert len(section) == 3 and sum(section) == config.text_config.head_dim // 2


def test_tiny_preset_is_about_one_million_parameters(full_model):
    n = sum(p.numel() for p in full_model.parameters())
    assert 300_000 <= n <= 3_000_000, n


# ----------------------------------------------------------------------- tokenizer


@pytest.mark.parametrize("token", QWEN_SPECIAL)
def test_special_tokens_are_single_tokens(processor, token):
    tok = processor.tokenizer
    ids = tok.encode(token, add_special_tokens=False)
    assert len(ids) == 1, (token, ids)
    assert tok.convert_ids_to_tokens(ids[0]) == token
    assert ids[0] != tok.unk_token_id
    # Also inside running text: never split into pieces, never merged with neighbours.
    ids_in_text = tok.encode(f"red{token}blue", add_special_tokens=False)
    assert ids_in_text.count(ids[0]) == 1
    assert token in tok.convert_ids_to_tokens(ids_in_text)


def test_special_token_ids_are_distinct_and_after_the_bpe_vocab(processor):
    tok = processor.tokenizer
    ids = [tok.convert_tokens_to_ids(t) for t in QWEN_SPECIAL]
    assert len(set(ids)) == len(ids)
    # Appended after the BPE vocabulary, as in Qwen's tokenizer.
    base = tok.backend_tokenizer.get_vocab(with_added_tokens=False)
    assert max(base.values()) < min(ids)
    assert max(ids) < len(tok)


def test_config_token_ids_match_the_tokenizer(tiny_path, processor):
    from transformers import AutoConfig

    config = AutoConfig.from_pretrained(tiny_path)
    tok = processor.tokenizer
    assert config.image_token_id == tok.convert_tokens_to_ids("<|image_pad|>")
    assert config.video_token_id == tok.convert_tokens_to_ids("<|video_pad|>")
    assert config.vision_start_token_id == tok.convert_tokens_to_ids("<|vision_start|>")
    assert config.vision_end_token_id == tok.convert_tokens_to_ids("<|vision_end|>")
    assert config.text_config.eos_token_id == tok.convert_tokens_to_ids("<|im_end|>")
    assert config.text_config.pad_token_id == tok.pad_token_id == tok.convert_tokens_to_ids("<|endoftext|>")
    assert config.text_config.vocab_size == len(tok)
    # The processor's own idea of the image token is the same id.
    assert processor.image_token_id == config.image_token_id
    assert processor.video_token_id == config.video_token_id


def test_chat_template_renders_qwen_layout(processor):
    text = processor.apply_chat_template(
        [{"role": "user", "content": "How many shapes?"}], tokenize=False, add_generation_prompt=True
    )
    assert text == "<|im_start|>user\nHow many shapes?<|im_end|>\n<|im_start|>assistant\n"

    conversation = [
        {"role": "system", "content": "Answer briefly."},
        {"role": "user", "content": [{"type": "image"}, {"type": "text", "text": "What color?"}]},
        {"role": "assistant", "content": [{"type": "text", "text": "Red."}]},
    ]
    text = processor.apply_chat_template(conversation, tokenize=False, add_generation_prompt=False)
    assert text == (
        "<|im_start|>system\nAnswer briefly.<|im_end|>\n"
        "<|im_start|>user\n<|vision_start|><|image_pad|><|vision_end|>What color?<|im_end|>\n"
        "<|im_start|>assistant\nRed.<|im_end|>\n"
    )
    # The tokenizer carries the same template (vLLM reads it from there).
    assert processor.tokenizer.chat_template == CHAT_TEMPLATE


# ------------------------------------------------------------------ build & caching


def _state(path: Path) -> dict[str, torch.Tensor]:
    from safetensors.torch import load_file

    return load_file(str(path / "model.safetensors"))


@pytest.mark.slow
def test_build_is_deterministic_in_the_seed(tmp_path):
    rng_before = torch.random.get_rng_state()
    a = build(tmp_path / "a", "tiny", seed=0)
    b = build(tmp_path / "b", "tiny", seed=0)
    c = build(tmp_path / "c", "tiny", seed=1)
    # The build forks the RNG: the caller's random stream is untouched.
    assert torch.equal(torch.random.get_rng_state(), rng_before)

    for name in ("model.safetensors", "tokenizer.json", "config.json"):
        assert (a / name).read_bytes() == (b / name).read_bytes(), name

    sa, sc = _state(a), _state(c)
    assert sa.keys() == sc.keys()
    differing = [k for k in sa if sa[k].is_floating_point() and sa[k].shape == sc[k].shape and not torch.equal(sa[k], sc[k])]
    # Every randomly initialised matrix differs (norm weights are ones in both and may match).
    for key in ("model.visual.patch_embed.proj.weight", "model.language_model.layers.0.self_attn.q_proj.weight"):
        assert key in differing
    assert (a / "model.safetensors").read_bytes() != (c / "model.safetensors").read_bytes()


def test_preset_path_returns_the_cached_folder(tiny_path, monkeypatch):
    assert (tiny_path / ".complete").exists()
    assert (tiny_path / "config.json").exists()
    assert (tiny_path / "model.safetensors").exists()
    assert "seed0" in tiny_path.name and "tiny" in tiny_path.name
    import saccade.models.presets.builder as builder

    mtime = (tiny_path / "model.safetensors").stat().st_mtime_ns

    def no_build(*args, **kwargs):
        raise AssertionError("preset_path rebuilt a model it had cached")

    monkeypatch.setattr(builder, "build", no_build)
    again = preset_path("tiny", seed=0)
    assert again == tiny_path
    assert (tiny_path / "model.safetensors").stat().st_mtime_ns == mtime  # the very file written before
    # No half-built temp folders are left beside it.
    assert not [p for p in tiny_path.parent.glob(f".{tiny_path.name}.*")]
    assert BUILD_VERSION >= 1


def test_preset_path_rejects_unknown_preset():
    with pytest.raises(ValueError, match="unknown preset"):
        preset_path("huge")


def test_small_preset_parameter_count_without_building():
    from transformers import Qwen3VLForConditionalGeneration

    tokenizer = build_tokenizer(PRESETS["small"].bpe_vocab_size, seed=0)
    config = build_config("small", tokenizer)
    with torch.device("meta"):
        model = Qwen3VLForConditionalGeneration(config)
    n = sum(p.numel() for p in model.parameters())
    assert 50_000_000 <= n <= 150_000_000, n
    assert config.text_config.head_dim >= 32
    assert len(config.vision_config.deepstack_visual_indexes) >= 2
    assert max(config.vision_config.deepstack_visual_indexes) < config.text_config.num_hidden_layers
    assert sum(config.text_config.rope_parameters["mrope_section"]) == config.text_config.head_dim // 2


@pytest.mark.parametrize("preset, hub, billions, tied", [
    ("qwen3vl-2b", "Qwen/Qwen3-VL-2B-Instruct", 2.13, True),  # the GPU benchmarks' random model
    ("qwen3vl-4b", "Qwen/Qwen3-VL-4B-Instruct", 4.44, True),  # `saccade bench gpu`'s second parity shape
    ("qwen3vl-8b", "Qwen/Qwen3-VL-8B-Instruct", 8.77, False),  # its 8B trainer stage: the 8B configs' estimate
])
def test_a_real_shape_preset_has_exactly_its_published_models_shapes(preset, hub, billions, tied):
    """The config (built here without its gigabytes of weights) has the published model's
    dimensions, parameter count and tie included, and `saccade memory` sizes it unbuilt."""
    from saccade.tools.memory_dims import dims_from_hf_config, model_dims

    config = build_config(preset, build_tokenizer(1024)).to_dict()
    real = model_dims(hub)
    dims = dims_from_hf_config(config)
    assert (dims.text, dims.vision) == (real.text, real.vision)
    assert round(dims.params / 1e9, 2) == billions and dims.text.tie_word_embeddings is tied
    assert config["text_config"]["rope_parameters"]["mrope_section"] == [24, 20, 20]  # Qwen3-VL's
    assert model_dims(preset) == dataclasses.replace(real, name=preset) and PRESETS[preset].dtype == "bfloat16"


# ----------------------------------------------------------------- model names


def test_a_preset_name_resolves_to_its_folder_and_a_path_to_itself(tiny_path):
    assert resolve_model("tiny") == str(preset_path("tiny"))
    assert resolve_model(str(tiny_path)) == str(tiny_path)
    assert resolve_model("Qwen/Qwen3-VL-2B-Instruct") == "Qwen/Qwen3-VL-2B-Instruct"


def test_the_warm_start_is_never_built_down_here():
    """"tiny-warm" is built by training (SFT): resolving it from `models/` would train inside
    whatever asked, a vLLM server included. It is refused with the place that resolves it."""
    with pytest.raises(ValueError, match="resolve_warm_start"):
        resolve_model("tiny-warm")


def test_every_preset_is_named_once_and_each_family_has_its_tiny_one():
    from saccade.config import PRESET_NAMES

    assert tuple(PRESETS) == PRESET_NAMES  # the config's list (it sits below the models and cannot ask)
    assert all(preset_family(p) in FAMILIES for p in PRESETS) and preset_family("x") is None
    assert [p for f in FAMILIES for p in presets_of(f)] == list(PRESETS)  # FAMILIES' order, each family's together
    assert [tiny_preset(f) for f in FAMILIES] == ["tiny", "qwen2.5vl-tiny", "moe-tiny", "qwen3.5-tiny", "qwen3.5-moe-tiny"]


def test_a_preset_of_any_family_resolves_to_its_folder():
    for family in FAMILIES:
        preset = tiny_preset(family)
        assert resolve_model(preset) == str(preset_path(preset))
    assert resolve_model("Org/Model") == "Org/Model"


def test_every_familys_tiny_preset_has_a_warm_start_resolved_only_where_a_run_starts():
    """"<tiny preset>-warm" names the demo's warm start of that preset (built by training, so never
    resolved down here); another preset's "-warm" is refused naming the ones that exist."""
    from saccade.models.presets import warm_start_base, warm_start_names

    assert warm_start_names()[:2] == ("tiny-warm", "qwen2.5vl-tiny-warm")
    for family in FAMILIES:
        name = tiny_preset(family) + "-warm"
        assert warm_start_base(name) == tiny_preset(family)
        with pytest.raises(ValueError, match="resolve_warm_start"):
            resolve_model(name)
    with pytest.raises(ValueError, match="qwen2.5vl-tiny-warm"):
        warm_start_base("small-warm")
    assert warm_start_base("tiny") is None and warm_start_base("runs/sft-warm") is None


# ----------------------------------------------------------------- presets as data


def test_mrope_sections_keep_the_published_proportions_over_the_rotary_half():
    from saccade.models.presets.builder import mrope_section

    assert mrope_section([24, 20, 20], 64) == [24, 20, 20] and mrope_section([24, 20, 20], 16) == [6, 5, 5]  # Qwen3-VL
    assert mrope_section([24, 20, 20], 32) == [12, 10, 10]  # small: head_dim 64
    assert mrope_section([16, 24, 24], 16) == [4, 6, 6]  # Qwen2.5-VL's, contiguous, at head_dim 32
    assert mrope_section([11, 11, 10], 32) == [11, 11, 10]  # Qwen3.5-9B's: head_dim 256 x 0.25
    assert mrope_section([11, 11, 10], 8) == [3, 3, 2]  # the tiny preset's: head_dim 64 x 0.25


def test_a_preset_is_its_published_config_with_its_changes():
    """The presets at published shapes change nothing in their config.json but what the builder owns
    (and the cut MoE its depth); a tiny one replaces the fields it names, keeps the rest, and drops a
    per-layer list its new depth would contradict."""
    from saccade.models.presets import preset_config, published_config

    for name, preset in PRESETS.items():
        if not preset.tokenizer_vocab and name != "qwen3vl-30b-a3b-l6":
            assert preset_config(name) == published_config(preset.published), name
    cut = preset_config("qwen3vl-30b-a3b-l6")
    assert cut["text_config"]["num_hidden_layers"] == 6 and cut["vision_config"] == published_config(
        "Qwen/Qwen3-VL-30B-A3B-Instruct")["vision_config"]
    tiny = preset_config("qwen3.5-tiny")
    assert tiny["text_config"]["hidden_size"] == 128 and "layer_types" not in tiny["text_config"]
    assert tiny["text_config"]["linear_conv_kernel_dim"] == 4 and tiny["tie_word_embeddings"] is True
    assert tiny["text_config"]["tie_word_embeddings"] is True  # both levels, as the builder writes them
    flat = preset_config("qwen2.5vl-tiny")  # the hub's Qwen2.5-VL configs are flat: the text fields on top
    assert flat["hidden_size"] == 128 and flat["vision_config"]["window_size"] == 56


def test_the_cache_key_follows_the_published_config(monkeypatch):
    """A preset's folder changes with the config it starts from, not only with the preset."""
    import saccade.models.presets.table as table
    from saccade.models.presets import preset_folder

    before = preset_folder("tiny")
    assert preset_folder("tiny", seed=1) != before
    real = table.published_config
    monkeypatch.setattr(table, "published_config", lambda hub_id: {**real(hub_id), "rms_norm_eps": 1e-5})
    assert preset_folder("tiny") != before
