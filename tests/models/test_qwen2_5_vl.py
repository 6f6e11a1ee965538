"""Qwen2.5-VL groundwork (saccade.models.families.qwen2_5_vl): the tiny builder, checkpoint keys,
M-RoPE positions against transformers' get_rope_index, the tower, and the language model alone
(inputs_embeds + 4-row positions, as saccade trains) against the full model from pixels.

Self-contained: builds its own tiny Qwen2.5-VL (cached like the Qwen3-VL one)."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from saccade.config import ImagesConfig
from saccade.data.messages import messages_to_inputs
from saccade.data.synthetic import synthetic_image
from saccade.models.families import qwen2_5_vl as family
from saccade.models.loading import read_state_dict
from saccade.models.positions import with_text_row
from saccade.parity import parity_conversations

LIMITS = ImagesConfig(min_pixels=32 * 32, max_pixels=256 * 256)


def img(w: int, h: int, seed: int) -> dict:
    return {"type": "image", "image": synthetic_image(w, h, seed)}


def conversations() -> dict[str, list[dict]]:
    """The parity cases (one image, several, sizes, text only, multi-turn), images back to back,
    and a large image whose 7 x 5 merged grid cuts ragged 2 x 2 windows."""
    return {
        **parity_conversations(),
        "back_to_back": [{"role": "user", "content": [img(64, 64, 6), img(96, 64, 7), {"type": "text", "text": "Which?"}]}],
        "large_ragged": [
            {"role": "user", "content": [img(200, 150, 11), {"type": "text", "text": "Describe it."}]},
            {"role": "assistant", "content": "A red circle on the left."},
        ],
    }


@pytest.fixture(scope="module")
def path():
    return family.tiny_model_path("tiny", seed=0)


@pytest.fixture(scope="module")
def processor(path):
    from transformers import AutoProcessor

    return AutoProcessor.from_pretrained(path)


@pytest.fixture(scope="module")
def full_model(path):
    from transformers import AutoModelForImageTextToText

    return AutoModelForImageTextToText.from_pretrained(path, dtype=torch.float32, attn_implementation="sdpa").eval()


@pytest.fixture(scope="module")
def cases(processor):
    return {name: messages_to_inputs(m, processor, limits=LIMITS, sample=name) for name, m in conversations().items()}


# ------------------------------------------------------------------------ builder and keys


def test_auto_classes_load_the_folder(path, processor, full_model):
    from transformers import Qwen2_5_VLForConditionalGeneration, Qwen2_5_VLProcessor, Qwen2VLImageProcessor

    assert type(processor) is Qwen2_5_VLProcessor
    assert type(processor.image_processor) is Qwen2VLImageProcessor
    assert processor.image_processor.patch_size == 14 and processor.image_processor.merge_size == 2
    assert list(processor.image_processor.image_mean) == family.CLIP_MEAN
    assert type(full_model) is Qwen2_5_VLForConditionalGeneration
    vision = full_model.config.vision_config
    assert (vision.patch_size, vision.spatial_merge_size, vision.window_size) == (14, 2, 56)
    assert list(vision.fullatt_block_indexes) == [1, 3]
    text = full_model.config.text_config
    assert text.hidden_size // text.num_attention_heads == 32  # vLLM's CPU attention refuses 16
    n = sum(p.numel() for p in full_model.parameters())
    assert 1.0e6 < n < 1.5e6, n


def test_checkpoint_key_maps_both_layouts():
    key = family.checkpoint_key
    # The hub's layout (and what transformers 5.19's save_pretrained writes for Qwen2.5-VL).
    assert key("model.layers.0.self_attn.q_proj.bias") == "model.language_model.layers.0.self_attn.q_proj.bias"
    assert key("model.embed_tokens.weight") == "model.language_model.embed_tokens.weight"
    assert key("model.norm.weight") == "model.language_model.norm.weight"
    assert key("visual.merger.ln_q.weight") == "model.visual.merger.ln_q.weight"
    assert key("lm_head.weight") == "lm_head.weight"
    # The canonical layout, unchanged.
    for k in ("model.language_model.layers.3.mlp.up_proj.weight", "model.visual.blocks.0.attn.qkv.weight"):
        assert key(k) == k
    # Not ours.
    assert key("mtp.layers.0.weight") is None
    assert key("model") is None


def test_every_checkpoint_tensor_maps_onto_the_full_model(path, full_model):
    from safetensors import safe_open

    with safe_open(str(path / "model.safetensors"), framework="pt") as f:
        stored = list(f.keys())
    # transformers 5.19 writes Qwen2.5-VL in the hub's layout (it reverses its load-time renames).
    assert "model.layers.0.self_attn.q_proj.weight" in stored and "visual.patch_embed.proj.weight" in stored
    canonical = {family.checkpoint_key(k) for k in stored}
    names = set(full_model.state_dict()) - {"lm_head.weight"}  # tied to the embeddings: not stored
    assert canonical == names


# ------------------------------------------------------------------------------- positions


def test_processor_returns_token_types(cases, processor):
    for name, inputs in cases.items():
        assert inputs.mm_token_type_ids.shape == inputs.input_ids.shape, name
        assert torch.equal(inputs.mm_token_type_ids == 1, inputs.input_ids == processor.image_token_id), name
    assert cases["text_only"].mm_token_type_ids.sum() == 0


@pytest.mark.parametrize("name", list(conversations()))
def test_mrope_positions_equal_get_rope_index(full_model, cases, name):
    inputs = cases[name]
    ours = family.mrope_positions(inputs.mm_token_type_ids, inputs.image_grid_thw, 2)
    with torch.no_grad():
        ref, _ = full_model.model.get_rope_index(inputs.input_ids[None], inputs.mm_token_type_ids[None],
                                                 image_grid_thw=inputs.image_grid_thw)
    assert torch.equal(ours, ref[:, 0].long())


# ---------------------------------------------------------------------- tower and LM alone


def test_run_tower_equals_get_image_features(path, full_model, cases):
    tower = family.vision_model_class()._from_config(full_model.config.vision_config)
    state = {family.checkpoint_key(k): v for k, v in read_state_dict(path, "visual.").items()}
    tower.load_state_dict({k[len(family.VISION_PREFIX):]: v for k, v in state.items()}, strict=True)
    tower.eval()
    for name in ("several_images", "large_ragged"):
        inputs = cases[name]
        main_NH, deepstack = family.run_tower(tower, inputs.pixel_values, inputs.image_grid_thw)
        with torch.no_grad():
            ref = full_model.model.get_image_features(inputs.pixel_values, inputs.image_grid_thw).pooler_output
        assert deepstack == [] and family.deepstack_levels(full_model.config) == 0
        assert main_NH.shape == (int(inputs.mm_token_type_ids.sum()), full_model.config.text_config.hidden_size)
        assert torch.equal(main_NH, torch.cat(ref)), name


class LanguageModelOnly(nn.Module):
    """What saccade's trainer holds for this family: the text model and lm_head, read from the
    checkpoint through `checkpoint_key` (the vision weights are never read)."""

    def __init__(self, path, config):
        super().__init__()
        text_config = config.text_config
        text_config._attn_implementation = "sdpa"
        self.language_model = family.prepare_language_model(family.text_model_class()._from_config(text_config))
        state = {}
        for k, v in read_state_dict(path, "model.").items():
            canonical = family.checkpoint_key(k)
            if canonical.startswith(family.LM_PREFIX):
                state[canonical[len(family.LM_PREFIX):]] = v
        self.language_model.load_state_dict(state, strict=True)
        assert config.tie_word_embeddings
        self.image_token_id = config.image_token_id

    def logprobs(self, input_ids_L, position_ids_4L, image_embeds_NH) -> torch.Tensor:
        """(L,) logprob of each token given those before it; [0] = 0 (and at no other place)."""
        embeds_LH = self.language_model.embed_tokens(input_ids_L)
        positions_N = (input_ids_L == self.image_token_id).nonzero().squeeze(1)
        if positions_N.numel():
            embeds_LH = embeds_LH.index_copy(0, positions_N, image_embeds_NH)
        out = self.language_model(inputs_embeds=embeds_LH[None], position_ids=position_ids_4L[:, None],
                                  use_cache=False, **family.language_model_kwargs(positions_N, []))
        logits_LV = out.last_hidden_state[0] @ self.language_model.embed_tokens.weight.T
        return next_token_logprobs(logits_LV, input_ids_L)


def next_token_logprobs(logits_LV: torch.Tensor, input_ids_L: torch.Tensor) -> torch.Tensor:
    lp = torch.log_softmax(logits_LV.float(), -1)[:-1].gather(1, input_ids_L[1:, None])[:, 0]
    return torch.cat([lp.new_zeros(1), lp])


@pytest.fixture(scope="module")
def lm_only(path, full_model):
    return LanguageModelOnly(path, full_model.config).eval()


def full_logprobs(full_model, inputs) -> torch.Tensor:
    with torch.no_grad():
        out = full_model(input_ids=inputs.input_ids[None], pixel_values=inputs.pixel_values,
                         image_grid_thw=inputs.image_grid_thw, mm_token_type_ids=inputs.mm_token_type_ids[None],
                         use_cache=False)
    return next_token_logprobs(out.logits[0], inputs.input_ids)


def features(full_model, inputs) -> torch.Tensor | None:
    if inputs.pixel_values is None:
        return None
    return family.run_tower(full_model.model.visual, inputs.pixel_values, inputs.image_grid_thw)[0]


def positions(inputs) -> torch.Tensor:
    return with_text_row(family.mrope_positions(inputs.mm_token_type_ids, inputs.image_grid_thw, 2))


@pytest.mark.parametrize("name", list(parity_conversations()))
def test_language_model_alone_equals_full_model(full_model, lm_only, cases, name):
    inputs = cases[name]
    ref_L = full_logprobs(full_model, inputs)
    with torch.no_grad():
        ours_L = lm_only.logprobs(inputs.input_ids, positions(inputs), features(full_model, inputs))
    assert (ours_L - ref_L).abs().max() <= 1e-5, (ours_L - ref_L).abs().max()


def test_packed_row_equals_each_sample_alone(full_model, lm_only, cases):
    a, b = cases["different_sizes"], cases["multi_turn"]
    ids = torch.cat([a.input_ids, b.input_ids])
    pos = torch.cat([positions(a), positions(b)], dim=1)  # the text row restarts at 0 for b
    with torch.no_grad():
        packed = lm_only.logprobs(ids, pos, torch.cat([features(full_model, a), features(full_model, b)]))
    ref = torch.cat([full_logprobs(full_model, a), full_logprobs(full_model, b)])
    ref[len(a.input_ids)] = packed[len(a.input_ids)]  # b's first token has no prediction of its own
    assert (packed - ref).abs().max() <= 1e-5, (packed - ref).abs().max()
    # Negative control: a text row that runs on through b lets b attend to a.
    leaky = pos.clone()
    leaky[0] = torch.arange(leaky.shape[1])
    with torch.no_grad():
        leaked = lm_only.logprobs(ids, leaky, torch.cat([features(full_model, a), features(full_model, b)]))
    assert (leaked - ref)[len(a.input_ids) + 1:].abs().max() > 1e-3


def test_wrong_positions_break_parity(full_model, lm_only, cases):
    inputs = cases["several_images"]
    ref = full_logprobs(full_model, inputs)
    L = len(inputs.input_ids)
    text_positions = torch.arange(L).expand(4, L)  # 1-D positions: what a text-only model would use
    swapped = positions(inputs)[[0, 1, 3, 2]]  # h and w exchanged
    for wrong in (text_positions, swapped):
        with torch.no_grad():
            ours = lm_only.logprobs(inputs.input_ids, wrong, features(full_model, inputs))
        assert (ours - ref).abs().max() > 1e-3


@pytest.mark.parametrize("name, billions", [("Qwen/Qwen2.5-VL-7B-Instruct", 8.29), ("Qwen/Qwen2.5-VL-3B-Instruct", 3.75)])
def test_hub_configs_give_the_published_sizes(name, billions):
    """The config dicts (written from memory) build, on the meta device, models of the sizes the
    model cards publish: 8.29B and 3.75B parameters."""
    from transformers import Qwen2_5_VLConfig

    config = Qwen2_5_VLConfig(**{k: v for k, v in family.HUB_CONFIGS[name].items() if k != "architectures"})
    with torch.device("meta"):
        model = family.full_model_class()(config)
    assert round(sum(p.numel() for p in model.parameters()) / 1e9, 2) == billions
    dims = family.memory_dims(family.HUB_CONFIGS[name])
    assert dims["text"]["head_dim"] == 128 and dims["vision"]["deepstack_levels"] == 0
    assert dims["text"]["tie_word_embeddings"] == config.tie_word_embeddings
