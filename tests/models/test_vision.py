"""Tests for saccade.models.vision: frozen-tower encoding equal to the full model, and its cache."""

from __future__ import annotations

from contextlib import contextmanager

import pytest
import torch

from saccade.config import ImagesConfig
from saccade.data.images import image_hash
from saccade.data.messages import messages_to_inputs
from saccade.models.vision import EmbeddingCache, ImageEmbedding, VisionEncoder
from saccade.data.synthetic import synthetic_image

TOL = 1e-6  # fp32, same tower weights, same batched call


@contextmanager
def count_tower_calls(tower):
    """Record each tower forward: how many images (grid rows) it was run on."""
    calls: list[int] = []

    def hook(module, args, kwargs, output):
        grid = kwargs.get("grid_thw", args[1] if len(args) > 1 else None)
        calls.append(int(grid.shape[0]))

    handle = tower.register_forward_hook(hook, with_kwargs=True)
    try:
        yield calls
    finally:
        handle.remove()


@pytest.fixture(scope="module")
def images():
    # Three sizes (square, wide, tall) so the per-image split and the grids are exercised.
    return [synthetic_image(64, 64, 11), synthetic_image(96, 48, 12), synthetic_image(48, 160, 13)]


# ----------------------------------------------------------------- parity with full model


def test_encode_equals_full_model_image_features(full_model, processor, limits, encoder, images):
    # The reference goes through the message path (messages_to_inputs), the encoder
    # through its own preprocessing: equal results also mean equal grids and pixels.
    messages = [{"role": "user", "content": [{"type": "image", "image": im} for im in images]}]
    inputs = messages_to_inputs(messages, processor, limits=limits)
    with torch.no_grad():
        ref = full_model.model.get_image_features(inputs.pixel_values, inputs.image_grid_thw)
    levels = len(full_model.config.vision_config.deepstack_visual_indexes)
    assert len(ref.deepstack_features) == levels >= 2

    with count_tower_calls(encoder.tower) as calls:
        out = encoder.encode(images)
    assert calls == [3]  # one batched call for all three misses
    assert len(out) == 3
    H = full_model.config.text_config.hidden_size
    for i, emb in enumerate(out):
        assert torch.equal(emb.grid_thw, inputs.image_grid_thw[i])
        n = int(inputs.image_grid_thw[i].prod()) // 4
        assert emb.num_tokens == n
        assert emb.embeds.shape == (n, H) and emb.embeds.dtype == torch.float32
        assert emb.deepstack.shape == (levels, n, H)
        assert (emb.embeds - ref.pooler_output[i]).abs().max().item() <= TOL
        for k in range(levels):
            assert (emb.deepstack[k] - ref.deepstack_features[k][i]).abs().max().item() <= TOL
    # Sizes really differ, and so do the features (a swapped split would be caught above).
    assert len({tuple(e.grid_thw.tolist()) for e in out}) == 3
    assert len({e.num_tokens for e in out}) == 3
    assert not torch.allclose(out[0].deepstack[0], out[0].deepstack[1])


def test_encode_preprocess_matches_message_path(processor, limits, encoder, images):
    messages = [{"role": "user", "content": [{"type": "image", "image": im} for im in images]}]
    inputs = messages_to_inputs(messages, processor, limits=limits)
    pixels, grid = encoder.preprocess(images)
    assert torch.equal(grid, inputs.image_grid_thw)
    assert torch.equal(pixels, inputs.pixel_values)


def test_encode_reuses_the_processors_pixels_for_the_misses(processor, limits, tower, images, monkeypatch):
    """The engine hands the tower the pixels its prompt's processor call already made: the same
    embeddings as preprocessing again, without the second resize (only the misses are taken)."""
    messages = [{"role": "user", "content": [{"type": "image", "image": im} for im in images]}]
    inputs = messages_to_inputs(messages, processor, limits=limits)
    fresh = VisionEncoder(tower, processor, limits=limits, cache=EmbeddingCache()).encode(images)
    encoder = VisionEncoder(tower, processor, limits=limits, cache=EmbeddingCache())
    encoder.encode(images[1:2])  # a hit: images 0 and 2 are the misses, their rows picked out
    monkeypatch.setattr(encoder, "preprocess", lambda *_: pytest.fail("preprocessed again"))
    reused = encoder.encode(images, pixels=(inputs.pixel_values, inputs.image_grid_thw))
    for a, b in zip(fresh, reused, strict=True):
        assert torch.equal(a.grid_thw, b.grid_thw)
        assert (a.embeds - b.embeds).abs().max() <= TOL and (a.deepstack - b.deepstack).abs().max() <= TOL


# ------------------------------------------------------------------------- caching


def test_tower_runs_once_per_distinct_image(encoder, images):
    a, b, _ = images
    with count_tower_calls(encoder.tower) as calls:
        first = encoder.encode([a, b, a])
        assert calls == [2]
        second = encoder.encode([a, b])
        assert calls == [2], "the second call must be served from the cache"
    assert first[0] is first[2]
    assert torch.equal(second[0].embeds, first[0].embeds)
    assert torch.equal(second[1].deepstack, first[1].deepstack)
    stats = encoder.cache.stats
    # [a, b, a]: two misses (the repeated a is deduplicated before the lookup); [a, b]: two hits.
    assert (stats.hits, stats.misses, stats.disk_hits) == (2, 2, 0)
    assert stats.hit_rate == pytest.approx(0.5)
    assert len(encoder.cache) == 2


def test_cache_key_is_content_and_limits(encoder, images):
    a = images[0]
    key = encoder.cache_key(a)
    assert key.startswith(image_hash(a))
    assert encoder.cache_key(a.copy()) == key  # same pixels, another object
    assert encoder.cache_key(images[1]) != key


def test_different_limits_give_different_keys_and_grids(tower, processor):
    big = synthetic_image(512, 384, 21)
    shared = EmbeddingCache()
    fine = VisionEncoder(tower, processor, limits=ImagesConfig(min_pixels=32 * 32, max_pixels=256 * 256), cache=shared)
    coarse = VisionEncoder(tower, processor, limits=ImagesConfig(min_pixels=32 * 32, max_pixels=96 * 96), cache=shared)
    assert fine.cache_key(big) != coarse.cache_key(big)
    with count_tower_calls(tower) as calls:
        (e_fine,) = fine.encode([big])
        (e_coarse,) = coarse.encode([big])
    assert calls == [1, 1], "a cached entry for other limits must not be reused"
    assert not torch.equal(e_fine.grid_thw, e_coarse.grid_thw)
    assert int(e_fine.grid_thw.prod()) * 16**2 <= 256 * 256
    assert int(e_coarse.grid_thw.prod()) * 16**2 <= 96 * 96
    assert e_fine.num_tokens > e_coarse.num_tokens
    assert len(shared) == 2


def _entry(n: int, levels: int = 3, H: int = 8, fill: float = 0.0) -> ImageEmbedding:
    return ImageEmbedding(
        embeds=torch.full((n, H), fill),
        deepstack=torch.full((levels, n, H), fill),
        grid_thw=torch.tensor([1, 2, 2 * n], dtype=torch.long),
    )


def test_lru_evicts_least_recently_used_under_byte_budget():
    one = _entry(4).nbytes
    assert one == 4 * 8 * 4 + 3 * 4 * 8 * 4 + 3 * 8
    cache = EmbeddingCache(max_bytes=2 * one + one // 2)  # room for two entries, not three
    cache.put("k1", _entry(4, fill=1.0))
    cache.put("k2", _entry(4, fill=2.0))
    assert cache.get("k1") is not None  # k1 is now the most recently used
    cache.put("k3", _entry(4, fill=3.0))
    assert "k2" not in cache
    assert "k1" in cache and "k3" in cache
    assert cache.stats.evictions == 1
    assert len(cache) == 2
    assert cache.nbytes == 2 * one <= cache.max_bytes
    assert cache.get("k2") is None
    assert float(cache.get("k1").embeds[0, 0]) == 1.0
    # k3 is now the least recently used: the next insertion evicts it.
    cache.put("k4", _entry(4, fill=4.0))
    assert "k3" not in cache and "k1" in cache and "k4" in cache
    assert cache.stats.evictions == 2
    assert cache.nbytes <= cache.max_bytes


def test_replacing_a_key_does_not_double_count():
    cache = EmbeddingCache(max_bytes=10_000)
    cache.put("k", _entry(4))
    cache.put("k", _entry(2))
    assert len(cache) == 1
    assert cache.nbytes == _entry(2).nbytes


def test_entry_larger_than_budget_is_not_kept():
    small = _entry(1)
    cache = EmbeddingCache(max_bytes=small.nbytes * 3)
    cache.put("small", small)
    cache.put("huge", _entry(16))
    assert "huge" not in cache
    assert "small" in cache, "an oversized entry must not flush the cache"
    assert cache.nbytes == small.nbytes
    assert cache.stats.evictions == 0


def test_encoder_returns_entries_too_big_to_cache(tower, processor, limits, images):
    encoder = VisionEncoder(tower, processor, limits=limits, cache=EmbeddingCache(max_bytes=1024))
    with count_tower_calls(tower) as calls:
        (first,) = encoder.encode([images[0]])
        (again,) = encoder.encode([images[0]])
    assert first.nbytes > 1024
    assert calls == [1, 1]  # not kept, so encoded again
    assert len(encoder.cache) == 0 and encoder.cache.nbytes == 0
    assert torch.equal(first.embeds, again.embeds)


def test_invalid_budget():
    with pytest.raises(ValueError):
        EmbeddingCache(max_bytes=0)


def test_disk_cache_is_shared_across_instances(tower, processor, limits, images, tmp_path):
    writer = VisionEncoder(tower, processor, limits=limits, cache=EmbeddingCache(disk_dir=tmp_path))
    written = writer.encode(images[:2])
    keys = [writer.cache_key(im) for im in images[:2]]
    for key in keys:
        assert (tmp_path / key[:2] / f"{key}.safetensors").is_file()
    assert not list(tmp_path.rglob("*.tmp*")), "temp files must be renamed into place"

    reader = VisionEncoder(tower, processor, limits=limits, cache=EmbeddingCache(disk_dir=tmp_path))
    assert all(key in reader.cache for key in keys)
    with count_tower_calls(tower) as calls:
        read = reader.encode(images[:2])
        assert calls == []
        assert (reader.cache.stats.disk_hits, reader.cache.stats.misses, reader.cache.stats.hits) == (2, 0, 0)
        reader.encode(images[:2])  # now from memory
        assert calls == []
    assert reader.cache.stats.hits == 2
    assert reader.cache.stats.hit_rate == pytest.approx(1.0)
    for w, r in zip(written, read, strict=True):
        assert torch.equal(w.embeds, r.embeds)
        assert torch.equal(w.deepstack, r.deepstack)
        assert torch.equal(w.grid_thw, r.grid_thw) and r.grid_thw.dtype == torch.int64
    # An image never written is a miss on disk as well.
    with count_tower_calls(tower) as calls:
        reader.encode([images[2]])
    assert calls == [1]
    assert reader.cache.stats.misses == 1


# ------------------------------------------------------------------------- pins


def test_pinned_entries_outlive_the_budget_until_released():
    one = _entry(4).nbytes
    cache = EmbeddingCache(max_bytes=2 * one)
    pins = cache.pins("step 1")
    with pins:  # a rollout: everything put or read is pinned
        for k in range(5):
            cache.put(f"k{k}", _entry(4, fill=float(k)))
    assert len(cache) == 5 and cache.nbytes == 5 * one > cache.max_bytes
    assert cache.stats.evictions == 0 and cache.pinned_bytes == 5 * one
    cache.put("later", _entry(4))  # outside the scope: not pinned, so the one to go
    assert "later" not in cache and cache.stats.evictions == 1
    pins.release()  # the train step is over: back under the budget, least recently used first
    assert cache.nbytes <= cache.max_bytes and cache.pinned_bytes == 0
    assert [k for k in ("k3", "k4") if k in cache] == ["k3", "k4"] and "k0" not in cache
    assert cache.stats.evictions == 1 + 3


def test_a_read_pins_an_entry_and_two_scopes_count_separately():
    one = _entry(4).nbytes
    cache = EmbeddingCache(max_bytes=2 * one)
    cache.put("old", _entry(4))
    first, second = cache.pins("step 1"), cache.pins("step 2")
    with first:
        assert cache.get("old") is not None  # read during the rollout: pinned too
    with second:
        cache.get("old")
        cache.put("new", _entry(4))
    cache.put("x", _entry(4))
    cache.put("y", _entry(4))
    assert "old" in cache and "new" in cache  # both pinned; x and y had to go
    first.release()
    assert "old" in cache  # still held by the second step
    second.release()
    cache.put("z", _entry(4))
    assert cache.nbytes <= cache.max_bytes


def test_an_oversized_entry_is_kept_while_pinned():
    cache = EmbeddingCache(max_bytes=_entry(1).nbytes)
    pins = cache.pins()
    with pins:
        cache.put("huge", _entry(16))
    assert "huge" in cache
    pins.release()
    assert "huge" not in cache


def test_entries_are_stored_in_the_cache_dtype():
    cache = EmbeddingCache(dtype=torch.bfloat16)
    stored = cache.put("k", _entry(4))
    assert stored.embeds.dtype == stored.deepstack.dtype == torch.bfloat16
    assert cache.get("k").embeds.dtype == torch.bfloat16 and stored.grid_thw.dtype == torch.long


def test_a_miss_when_packing_names_the_sample_the_image_and_the_setting(encoder, images, policy):
    from saccade.models.vision import EmbeddingCacheMiss
    from saccade.trainer.packing import collate
    from saccade.trainer.samples import make_sample

    [emb] = encoder.encode([images[0]])
    n = emb.num_tokens
    ids = torch.tensor([1] + [policy.image_token_id] * n + [2])
    types = torch.tensor([0] + [1] * n + [0])
    sample = make_sample("prompt-7/3", ids, types, emb.grid_thw[None], ["no-such-key"],
                         positions=encoder.positions)
    with pytest.raises(EmbeddingCacheMiss, match=r"sample 'prompt-7/3'.*image 0 \(cache key no-such-key\).*"
                       r"raise image_cache.budget_bytes"):
        collate([sample], encoder.cache.get, image_token_id=policy.image_token_id, spatial_merge_size=encoder.merge)
