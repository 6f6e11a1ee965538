"""Property tests: samples with any number of images per sample and per turn (zero included)
batch, pack and unpack without index errors, and every image stays in its order."""

from __future__ import annotations

import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from saccade.models.vision import ImageEmbedding
from saccade.trainer.packing import pack
from saccade.models.families import family_of
from saccade.trainer.samples import make_sample

PAD, START, END = 7, 5, 6  # image pad, vision start, vision end
HIDDEN, LEVELS, MERGE = 4, 2, 2
POSITIONS = family_of({"model_type": "qwen3_vl"}).positions(MERGE)

# A turn: (text tokens before, images as (h, w) patch grids, sampled tokens after).
grids = st.tuples(st.sampled_from([2, 4]), st.sampled_from([2, 4, 6]))
turn = st.tuples(st.integers(1, 4), st.lists(grids, max_size=3), st.integers(0, 4))
trajectory = st.lists(turn, min_size=1, max_size=3)


def build(sample_index: int, turns, registry: dict[str, ImageEmbedding]):
    ids, types, loss, keys, grid_rows = [], [], [], [], []
    for text_len, images, sampled in turns:
        ids += [20] * text_len
        types += [0] * text_len
        loss += [False] * text_len
        for h, w in images:
            key = f"s{sample_index}-img{len(keys)}"
            n = h * w // MERGE**2
            # Every row of this image's embedding holds its global number: order is checkable.
            number = float(len(registry))
            registry[key] = ImageEmbedding(torch.full((n, HIDDEN), number), torch.full((LEVELS, n, HIDDEN), number),
                                           torch.tensor([1, h, w]))
            ids += [START] + [PAD] * n + [END]
            types += [0] + [1] * n + [0]
            loss += [False] * (n + 2)
            keys.append(key)
            grid_rows.append([1, h, w])
        ids += [30] * sampled
        types += [0] * sampled
        loss += [True] * sampled
    grid = torch.tensor(grid_rows, dtype=torch.long) if grid_rows else None
    return make_sample(f"s{sample_index}", torch.tensor(ids), torch.tensor(types), grid, keys,
                       positions=POSITIONS, loss_mask=torch.tensor(loss),
                       inference_logprobs=-torch.arange(len(ids), dtype=torch.float32), advantage=float(sample_index))


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.lists(trajectory, min_size=1, max_size=6), st.integers(40, 400))
def test_pack_and_unpack_keep_every_token_and_image_in_order(batch, max_tokens):
    registry: dict[str, ImageEmbedding] = {}
    samples = [build(i, turns, registry) for i, turns in enumerate(batch)]
    max_tokens = max(max_tokens, max(s.num_tokens for s in samples))
    micro_batches = pack(samples, registry.__getitem__, max_tokens=max_tokens, image_token_id=PAD,
                         spatial_merge_size=MERGE)
    by_id = {s.sample_id: s for s in samples}
    seen = []
    for mb in micro_batches:
        assert mb.num_tokens <= max_tokens
        expected_numbers = []
        for sid, part in zip(mb.sample_ids, mb.sample_slices(), strict=True):
            s = by_id[sid]
            seen.append(sid)
            assert torch.equal(mb.input_ids[0, part], s.input_ids)  # unpack: the sample's own tokens
            assert torch.equal(mb.position_ids[:, 0, part], s.position_ids)
            assert torch.equal(mb.loss_mask[part], s.loss_mask)
            assert torch.equal(mb.inference_logprobs[part], s.inference_logprobs)
            assert bool((mb.advantages[part] == s.advantage).all())
            expected_numbers += [float(registry[k].embeds[0, 0]) for k in s.image_keys
                                 for _ in range(registry[k].num_tokens)]
        if expected_numbers:
            # Row r of the embeddings fills the r-th pad of the row: in sample order, then image order.
            assert mb.image_embeds[:, 0].tolist() == expected_numbers
            assert mb.deepstack[0, :, 0].tolist() == expected_numbers
            assert int((mb.input_ids == PAD).sum()) == len(expected_numbers)
        else:
            assert mb.image_embeds is None and mb.image_grid_thw.shape == (0, 3)
    assert sorted(seen) == sorted(by_id)  # every sample exactly once


@settings(max_examples=12, deadline=None, suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture])
@given(st.lists(st.lists(st.integers(0, 3), min_size=0, max_size=2), min_size=1, max_size=3))
def test_trajectories_accumulate_images_in_order(processor, limits, images_per_turn):
    """A real trajectory (chat template, processor): images given turn after turn, 0..2 per
    message, end up in order, and the ids equal one rendering of the whole conversation."""
    from saccade.data.messages import messages_to_inputs
    from saccade.envs.examples import image_part
    from saccade.envs.trajectory import ChatContinuation, add_forced_turn, add_messages, start_trajectory

    continuation = ChatContinuation(processor, limits=limits)
    seeds = iter(range(1000))
    first = [image_part(next(seeds)) for _ in images_per_turn[0]]
    messages = [{"role": "user", "content": [*first, {"type": "text", "text": "start"}]}]
    t = start_trajectory("p", messages, processor, limits=limits, key_for_hash=lambda h: h)
    for k, turn_images in enumerate(images_per_turn[1:]):
        add_forced_turn(t, f"turn {k}", processor.tokenizer, end_of_turn_id=continuation.end_of_turn_id)
        parts = [image_part(next(seeds), 32 + 32 * (s % 3), 64) for s in turn_images]
        reply = [{"role": "user", "content": [*parts, {"type": "text", "text": f"look {k}"}]}]
        add_messages(t, reply, continuation, key_for_hash=lambda h: h)
        messages += [{"role": "assistant", "content": f"turn {k}"}, *reply]
    whole = messages_to_inputs(messages, processor, limits=limits, add_generation_prompt=True)
    assert t.input_ids == whole.input_ids.tolist()
    assert t.image_keys == whole.image_hashes
    expected_grid = whole.image_grid_thw if whole.image_grid_thw is not None else torch.zeros(0, 3, dtype=torch.long)
    assert torch.equal(t.grid, expected_grid)
