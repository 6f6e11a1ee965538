"""Tests for saccade.trainer.samples: TrainingSample and make_sample."""

from __future__ import annotations

import pytest
import torch

from saccade.data.messages import messages_to_inputs
from saccade.data.synthetic import synthetic_image
from saccade.models.families import family_of
from saccade.trainer.samples import TrainingSample, make_sample

MERGE = 2
POSITIONS = family_of({"model_type": "qwen3_vl"}).positions(MERGE)  # the tiny model's


def img(w: int, h: int, seed: int) -> dict:
    return {"type": "image", "image": synthetic_image(w, h, seed)}


CONVERSATIONS = {
    "one_image": [
        {"role": "user", "content": [img(64, 64, 1), {"type": "text", "text": "What color is the circle?"}]},
        {"role": "assistant", "content": "Red."},
    ],
    "two_sizes": [
        {"role": "user", "content": [img(96, 48, 2), {"type": "text", "text": "and"}, img(48, 160, 3)]},
        {"role": "assistant", "content": "The first is wide."},
    ],
    "text_only": [
        {"role": "user", "content": "How many sides does a triangle have?"},
        {"role": "assistant", "content": "Three."},
    ],
}


@pytest.fixture(scope="module")
def inputs(processor, limits):
    return {n: messages_to_inputs(m, processor, limits=limits, sample=n) for n, m in CONVERSATIONS.items()}


# ----------------------------------------------------------------------- validation


def _fields(L: int = 6, n_images: int = 0) -> dict:
    return dict(
        sample_id="s1",
        input_ids=torch.arange(L),
        loss_mask=torch.zeros(L, dtype=torch.bool),
        inference_logprobs=torch.zeros(L),
        position_ids=torch.arange(L).expand(4, -1).clone(),
        image_grid_thw=torch.ones(n_images, 3, dtype=torch.long),
        image_keys=[f"k{i}" for i in range(n_images)],
    )


def test_valid_fields_construct():
    s = TrainingSample(**_fields(6, 1))
    assert s.num_tokens == 6 and s.num_images == 1


@pytest.mark.parametrize(
    "field, value, match",
    [
        ("loss_mask", torch.zeros(5, dtype=torch.bool), "loss_mask"),
        ("loss_mask", torch.zeros(1, 6, dtype=torch.bool), "loss_mask"),
        ("inference_logprobs", torch.zeros(7), "inference_logprobs"),
        ("position_ids", torch.zeros(3, 6, dtype=torch.long), "position_ids"),
        ("position_ids", torch.zeros(4, 5, dtype=torch.long), "position_ids"),
        ("position_ids", torch.zeros(6, dtype=torch.long), "position_ids"),
        ("image_keys", ["k0", "k1"], "image keys"),
        ("image_grid_thw", torch.ones(2, 3, dtype=torch.long), "image keys"),
        ("routed_experts", torch.zeros(1, 4, 2, dtype=torch.uint8), "routed_experts"),  # no loss token
        ("routed_experts", torch.zeros(0, 4, dtype=torch.uint8), "routed_experts"),  # not (tokens, layers, k)
    ],
)
def test_validation_rejects_mismatched_shapes(field, value, match):
    fields = _fields(6, 1)
    fields[field] = value
    with pytest.raises(ValueError, match=match) as err:
        TrainingSample(**fields)
    assert "s1" in str(err.value)  # names the sample


# ----------------------------------------------------------------------- make_sample


@pytest.mark.parametrize("name", list(CONVERSATIONS))
def test_make_sample_positions_equal_get_rope_index(full_model, inputs, name):
    inp = inputs[name]
    keys = [f"key{i}" for i in range(inp.num_images)]
    s = make_sample(name, inp.input_ids, inp.mm_token_type_ids, inp.image_grid_thw, keys, positions=POSITIONS)
    L = inp.input_ids.shape[0]
    assert s.position_ids.shape == (4, L) and s.position_ids.dtype == torch.int64
    assert torch.equal(s.position_ids[0], torch.arange(L))
    with torch.no_grad():
        ref, _ = full_model.model.get_rope_index(
            inp.input_ids[None], inp.mm_token_type_ids[None], image_grid_thw=inp.image_grid_thw
        )
    assert torch.equal(s.position_ids[1:], ref[:, 0].long())
    # Defaults: nothing in the loss, zero logprobs, an empty (0, 3) grid for text only.
    assert s.loss_mask.dtype == torch.bool and not s.loss_mask.any()
    assert s.inference_logprobs.dtype == torch.float32 and not s.inference_logprobs.any()
    assert s.image_grid_thw.shape == (inp.num_images, 3) and s.image_grid_thw.dtype == torch.int64
    assert s.image_keys == keys


def test_make_sample_normalises_dtypes(inputs):
    inp = inputs["one_image"]
    L = inp.input_ids.shape[0]
    s = make_sample(
        "d", inp.input_ids.int(), inp.mm_token_type_ids, inp.image_grid_thw.int(), ["k"],
        positions=POSITIONS, loss_mask=torch.ones(L, dtype=torch.uint8),
        inference_logprobs=torch.full((L,), -0.5, dtype=torch.float64), advantage=1, reward=0, policy_version=7.0,
    )
    assert s.input_ids.dtype == torch.int64
    assert s.image_grid_thw.dtype == torch.int64
    assert s.loss_mask.dtype == torch.bool and bool(s.loss_mask.all())
    assert s.inference_logprobs.dtype == torch.float32
    assert type(s.advantage) is float and type(s.reward) is float and type(s.policy_version) is int


def test_make_sample_rejects_keys_that_disagree_with_images(inputs):
    inp = inputs["two_sizes"]
    with pytest.raises(ValueError, match="image keys"):
        make_sample("x", inp.input_ids, inp.mm_token_type_ids, inp.image_grid_thw, ["only-one"], positions=POSITIONS)
    with pytest.raises(ValueError):
        make_sample("x", inp.input_ids, inp.mm_token_type_ids, inp.image_grid_thw[:1], ["k"], positions=POSITIONS)
