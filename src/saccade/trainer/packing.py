"""Pack TrainingSamples into micro-batches of at most `max_tokens`, like text.

Because image features are precomputed, an image is just a run of tokens whose
embeddings come from the cache: samples with images pack exactly like text samples.
Samples are never split (so an image span is never cut), and attention never
crosses from one sample to the next (docs/packing.md says how, per attention backend).
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from saccade.models.vision import EmbeddingCacheMiss, ImageEmbedding
from saccade.trainer.samples import MicroBatch, TrainingSample


def first_fit_decreasing(lengths: list[int], max_tokens: int, *, names: list[str] | None = None) -> list[list[int]]:
    """Bins of sample indices, longest first, each summing to <= max_tokens.

    Within a bin, indices keep the decreasing-length order. Deterministic: ties keep input order.
    """
    if max_tokens <= 0:
        raise ValueError("max_tokens must be positive")
    for i, n in enumerate(lengths):
        if n > max_tokens:
            name = names[i] if names else str(i)
            raise ValueError(
                f"sample {name!r} has {n} tokens, more than max_tokens={max_tokens}; samples are never split. "
                "Raise trainer.max_tokens or lower the prompt/completion lengths or max_pixels."
            )
    order = sorted(range(len(lengths)), key=lambda i: -lengths[i])
    bins: list[list[int]] = []
    space: list[int] = []
    for i in order:
        for b, free in enumerate(space):
            if lengths[i] <= free:
                bins[b].append(i)
                space[b] -= lengths[i]
                break
        else:
            bins.append([i])
            space.append(max_tokens - lengths[i])
    return bins


def collate(
    samples: list[TrainingSample],
    lookup: Callable[[str], ImageEmbedding | None],
    *,
    image_token_id: int,
    spatial_merge_size: int,
) -> MicroBatch:
    """Concatenate samples into one row and gather their image embeddings in token order."""
    assert samples, "cannot collate zero samples"
    lengths = [s.num_tokens for s in samples]
    cu = torch.zeros(len(samples) + 1, dtype=torch.int32)
    cu[1:] = torch.tensor(lengths).cumsum(0)
    embeds, deepstack, grids = [], [], []
    for s in samples:
        n_pads = int((s.input_ids == image_token_id).sum())
        need = 0
        for i, (key, grid) in enumerate(zip(s.image_keys, s.image_grid_thw, strict=True)):
            emb = lookup(key)
            if emb is None:
                raise EmbeddingCacheMiss(
                    f"sample {s.sample_id!r}: the embedding of its image {i} (cache key {key}) is not in the "
                    "image-embedding cache. A step's images stay pinned from its rollout until its train step "
                    "ends, so it was never encoded, or was evicted by an earlier budget: raise "
                    "images.cache_bytes, or set images.cache_dir for a disk layer under it"
                )
            if not torch.equal(emb.grid_thw.long(), grid.long()):
                raise ValueError(
                    f"sample {s.sample_id}: image {key} was encoded with grid {emb.grid_thw.tolist()} but the sample "
                    f"expects {grid.tolist()}; the engine and trainer used different min/max pixels"
                )
            embeds.append(emb.embeds)
            deepstack.append(emb.deepstack)
            grids.append(grid)
            need += emb.num_tokens
        if need != n_pads:
            raise ValueError(f"sample {s.sample_id}: {n_pads} image-pad tokens but its images give {need} embeddings")
        assert need == int((s.image_grid_thw.prod(-1) // spatial_merge_size**2).sum()) if s.num_images else need == 0
    return MicroBatch(
        input_ids=torch.cat([s.input_ids for s in samples]).unsqueeze(0),
        position_ids=torch.cat([s.position_ids for s in samples], dim=1).unsqueeze(1),
        loss_mask=torch.cat([s.loss_mask for s in samples]),
        inference_logprobs=torch.cat([s.inference_logprobs for s in samples]),
        advantages=torch.cat([torch.full((n,), s.advantage, dtype=torch.float32) for s, n in zip(samples, lengths)]),
        cu_seqlens=cu,
        image_embeds=torch.cat(embeds) if embeds else None,
        deepstack=torch.cat(deepstack, dim=1) if deepstack else None,
        image_grid_thw=torch.stack(grids) if grids else torch.zeros(0, 3, dtype=torch.long),
        sample_ids=[s.sample_id for s in samples],
    )


def pack(
    samples: list[TrainingSample],
    lookup: Callable[[str], ImageEmbedding | None],
    *,
    max_tokens: int,
    image_token_id: int,
    spatial_merge_size: int,
) -> list[MicroBatch]:
    """First-fit-decreasing into micro-batches of at most max_tokens tokens each."""
    bins = first_fit_decreasing([s.num_tokens for s in samples], max_tokens, names=[s.sample_id for s in samples])
    return [
        collate([samples[i] for i in b], lookup, image_token_id=image_token_id, spatial_merge_size=spatial_merge_size)
        for b in bins
    ]
