"""Tests for saccade.trainer.samples: TrainingSample, make_sample and the binary wire format."""

from __future__ import annotations

import json

import pytest
import torch

from saccade.data.messages import messages_to_inputs
from saccade.data.synthetic import synthetic_image
from saccade.trainer.samples import TrainingSample, make_sample, samples_from_bytes, samples_to_bytes

MERGE = 2
TENSORS = ("input_ids", "loss_mask", "inference_logprobs", "position_ids", "image_grid_thw")
SCALARS = ("sample_id", "image_keys", "advantage", "reward", "policy_version")


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


def _sample(name, inp, *, seed: int, advantage: float, reward: float, version: int) -> TrainingSample:
    g = torch.Generator().manual_seed(seed)
    L = inp.input_ids.shape[0]
    mask = torch.zeros(L, dtype=torch.bool)
    mask[L // 2 :] = True
    # Arbitrary float32 values (not round numbers): a lossy text round-trip would show.
    logprobs = torch.where(mask, -torch.rand(L, generator=g) * 7.0, torch.zeros(L))
    keys = [f"{h}-1024-65536" for h in inp.image_hashes]
    return make_sample(
        name,
        inp.input_ids,
        inp.mm_token_type_ids,
        inp.image_grid_thw,
        keys,
        spatial_merge_size=MERGE,
        loss_mask=mask,
        inference_logprobs=logprobs,
        advantage=advantage,
        reward=reward,
        policy_version=version,
    )


@pytest.fixture(scope="module")
def samples(inputs):
    return [
        _sample("one_image/0", inputs["one_image"], seed=0, advantage=0.1, reward=1.0, version=3),
        _sample("two_sizes/1", inputs["two_sizes"], seed=1, advantage=-1.2345678901234567, reward=0.0, version=4),
        _sample("text_only/ü", inputs["text_only"], seed=2, advantage=1e-12, reward=0.5, version=0),
    ]


def _assert_same(a: TrainingSample, b: TrainingSample) -> None:
    for name in TENSORS:
        x, y = getattr(a, name), getattr(b, name)
        assert x.dtype == y.dtype, name
        assert x.shape == y.shape, name
        assert torch.equal(x, y), name
    for name in SCALARS:
        assert getattr(a, name) == getattr(b, name), name
        assert type(getattr(a, name)) is type(getattr(b, name)), name


# ----------------------------------------------------------------------- round trip


def test_round_trip_is_exact(samples):
    assert {s.num_images for s in samples} == {0, 1, 2}
    assert len({s.num_tokens for s in samples}) == 3
    back = samples_from_bytes(samples_to_bytes(samples))
    assert len(back) == len(samples)
    for a, b in zip(samples, back, strict=True):
        _assert_same(a, b)
    assert back[2].image_grid_thw.shape == (0, 3)


def test_round_trip_single_and_empty(samples):
    (one,) = samples_from_bytes(samples_to_bytes([samples[1]]))
    _assert_same(one, samples[1])
    assert samples_from_bytes(samples_to_bytes([])) == []


def _header(blob: bytes) -> dict:
    n = int.from_bytes(blob[:8], "little")
    return json.loads(blob[8 : 8 + n])


def _floats_in(obj) -> list[float]:
    if isinstance(obj, float):
        return [obj]
    if isinstance(obj, dict):
        return [f for v in obj.values() for f in _floats_in(v)]
    if isinstance(obj, list):
        return [f for v in obj for f in _floats_in(v)]
    return []


def test_blob_is_binary_not_json_lists(inputs):
    # Long completions, as in real rollouts: 2000 tokens each.
    long = []
    for i, name in enumerate(("one_image", "text_only")):
        inp = inputs[name]
        pad = torch.full((2000 - inp.input_ids.shape[0],), 300)
        ids = torch.cat([inp.input_ids, pad])
        types = torch.cat([inp.mm_token_type_ids, torch.zeros_like(pad)])
        g = torch.Generator().manual_seed(i)
        long.append(
            make_sample(
                f"long{i}", ids, types, inp.image_grid_thw, [f"k{j}" for j in range(inp.num_images)],
                spatial_merge_size=MERGE, loss_mask=torch.ones(2000, dtype=torch.bool),
                inference_logprobs=-torch.rand(2000, generator=g), advantage=0.25, reward=1.0,
            )
        )
    blob = samples_to_bytes(long)
    header = _header(blob)
    meta = json.loads(header["__metadata__"]["saccade.samples"])
    assert len(meta) == 2
    for entry in meta:
        assert set(entry) == set(SCALARS)  # no tensor field went into the JSON
    # The only floats in the JSON are the per-sample scalars (advantage, reward).
    assert sorted(_floats_in(meta)) == [0.25, 0.25, 1.0, 1.0]
    assert not any(isinstance(v, list) and len(v) > 10 for e in meta for v in e.values())
    tensor_bytes = sum(getattr(s, n).nbytes for s in long for n in TENSORS)
    assert tensor_bytes > 2 * 2000 * (8 + 1 + 4 + 4 * 8)
    # Size ~= tensors' raw bytes plus a small header (a JSON float list would be ~5x larger).
    assert tensor_bytes <= len(blob) <= tensor_bytes + 4096
    header_len = int.from_bytes(blob[:8], "little")
    assert len(blob) == 8 + header_len + tensor_bytes
    # Stored with their own dtypes, not widened.
    assert header["0.inference_logprobs"]["dtype"] == "F32"
    assert header["0.input_ids"]["dtype"] == "I64"
    assert header["0.loss_mask"]["dtype"] == "BOOL"


def test_blob_is_readable_by_plain_safetensors(samples):
    from safetensors.torch import load

    tensors = load(samples_to_bytes(samples))
    assert torch.equal(tensors["1.inference_logprobs"], samples[1].inference_logprobs)
    assert torch.equal(tensors["0.position_ids"], samples[0].position_ids)


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
    s = make_sample(name, inp.input_ids, inp.mm_token_type_ids, inp.image_grid_thw, keys, spatial_merge_size=MERGE)
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
        spatial_merge_size=MERGE, loss_mask=torch.ones(L, dtype=torch.uint8),
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
        make_sample("x", inp.input_ids, inp.mm_token_type_ids, inp.image_grid_thw, ["only-one"], spatial_merge_size=MERGE)
    with pytest.raises(ValueError):
        make_sample("x", inp.input_ids, inp.mm_token_type_ids, inp.image_grid_thw[:1], ["k"], spatial_merge_size=MERGE)
