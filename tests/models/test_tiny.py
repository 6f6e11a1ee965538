"""Tests for saccade.models.tiny: the offline random Qwen3-VL every other test stands on."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from saccade.models.families import resolve_model
from saccade.models.tiny import (
    BUILD_VERSION,
    CHAT_TEMPLATE,
    PRESETS,
    build_config,
    build_tiny_qwen3vl,
    build_tokenizer,
    tiny_model_path,
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
    a = build_tiny_qwen3vl(tmp_path / "a", seed=0)
    b = build_tiny_qwen3vl(tmp_path / "b", seed=0)
    c = build_tiny_qwen3vl(tmp_path / "c", seed=1)
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


def test_tiny_model_path_returns_the_cached_folder(tiny_path, monkeypatch):
    assert (tiny_path / ".complete").exists()
    assert (tiny_path / "config.json").exists()
    assert (tiny_path / "model.safetensors").exists()
    assert "seed0" in tiny_path.name and "tiny" in tiny_path.name
    import saccade.models.tiny as tiny

    mtime = (tiny_path / "model.safetensors").stat().st_mtime_ns

    def no_build(*args, **kwargs):
        raise AssertionError("tiny_model_path rebuilt a model it had cached")

    monkeypatch.setattr(tiny, "build_tiny_qwen3vl", no_build)
    again = tiny_model_path("tiny", seed=0)
    assert again == tiny_path
    assert (tiny_path / "model.safetensors").stat().st_mtime_ns == mtime  # the very file written before
    # No half-built temp folders are left beside it.
    assert not [p for p in tiny_path.parent.glob(f".{tiny_path.name}.*")]
    assert BUILD_VERSION >= 1


def test_tiny_model_path_rejects_unknown_preset():
    with pytest.raises(ValueError, match="unknown preset"):
        tiny_model_path("huge")


def test_small_preset_parameter_count_without_building():
    from transformers import Qwen3VLForConditionalGeneration

    spec = PRESETS["small"]
    tokenizer = build_tokenizer(spec.bpe_vocab_size, seed=0)
    config = build_config(tokenizer, spec)
    with torch.device("meta"):
        model = Qwen3VLForConditionalGeneration(config)
    n = sum(p.numel() for p in model.parameters())
    assert 50_000_000 <= n <= 150_000_000, n
    assert config.text_config.head_dim >= 32
    assert len(config.vision_config.deepstack_visual_indexes) >= 2
    assert max(config.vision_config.deepstack_visual_indexes) < config.text_config.num_hidden_layers
    assert sum(config.text_config.rope_parameters["mrope_section"]) == config.text_config.head_dim // 2


def test_the_2b_preset_has_exactly_qwen3_vl_2bs_shapes():
    """The GPU benchmarks' random model: its config (built here without its 4 GB of weights)
    has Qwen3-VL-2B-Instruct's dimensions, parameter count included."""
    from saccade.memory import QWEN3_VL, dims_from_hf_config, model_dims
    from saccade.models.tiny import PRESETS, build_config, build_tokenizer

    spec = PRESETS["qwen3vl-2b"]
    config = build_config(build_tokenizer(1024), spec).to_dict()
    real = QWEN3_VL["Qwen/Qwen3-VL-2B-Instruct"]
    dims = dims_from_hf_config(config)
    assert (dims.text, dims.vision) == (real.text, real.vision)
    assert round(dims.params / 1e9, 2) == 2.13
    assert config["text_config"]["rope_parameters"]["mrope_section"] == [24, 20, 20]  # Qwen3-VL's
    assert model_dims("qwen3vl-2b") == real and spec.weights_dtype == "bfloat16"


def test_the_4b_preset_has_exactly_qwen3_vl_4bs_shapes():
    """`saccade bench gpu`'s second parity shape: Qwen3-VL-4B-Instruct's dimensions."""
    from saccade.memory import QWEN3_VL, dims_from_hf_config, model_dims
    from saccade.models.tiny import PRESETS, build_config, build_tokenizer

    spec = PRESETS["qwen3vl-4b"]
    config = build_config(build_tokenizer(1024), spec).to_dict()
    real = QWEN3_VL["Qwen/Qwen3-VL-4B-Instruct"]
    dims = dims_from_hf_config(config)
    assert (dims.text, dims.vision) == (real.text, real.vision)
    assert round(dims.params / 1e9, 2) == 4.44
    assert config["text_config"]["rope_parameters"]["mrope_section"] == [24, 20, 20]
    assert model_dims("qwen3vl-4b") == real and spec.weights_dtype == "bfloat16"


# ----------------------------------------------------------------- model names


def test_a_preset_name_resolves_to_its_folder_and_a_path_to_itself(tiny_path):
    assert resolve_model("tiny") == str(tiny_model_path("tiny"))
    assert resolve_model(str(tiny_path)) == str(tiny_path)
    assert resolve_model("Qwen/Qwen3-VL-2B-Instruct") == "Qwen/Qwen3-VL-2B-Instruct"


def test_the_warm_start_is_never_built_down_here():
    """"tiny-warm" is built by training (SFT): resolving it from `models/` would train inside
    whatever asked, a vLLM server included. It is refused with the place that resolves it."""
    with pytest.raises(ValueError, match="resolve_warm_start"):
        resolve_model("tiny-warm")
