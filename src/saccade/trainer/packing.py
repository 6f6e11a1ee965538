"""Pack TrainingSamples into micro-batches of at most `max_tokens`, like text.

Because image features are precomputed, an image is just a run of tokens whose
embeddings come from the cache: samples with images pack exactly like text samples.
Samples are never split (so an image span is never cut), and attention never
crosses from one sample to the next (docs/packing.md says how, per attention backend).
Under torchrun every rank plans the whole step and collates its own share of the
micro-batches (`rank_micro_batches`).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

from saccade.distributed import SINGLE, World, balance, share_embeddings
from saccade.models.vision import EmbeddingCache, EmbeddingCacheMiss, ImageEmbedding
from saccade.trainer.samples import MicroBatch, TrainingSample, after_image


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


@dataclass(frozen=True)
class Segment:
    """What of a sample goes in the row: its tokens from `skip` on (the first `skip` are a
    shared prompt already in the row at `context`), and its images from `skip_images` on."""

    sample: TrainingSample
    skip: int = 0
    skip_images: int = 0
    context: tuple[int, int] = (0, 0)


def collate(
    samples: list[TrainingSample],
    lookup: Callable[[str], ImageEmbedding | None],
    *,
    image_token_id: int,
    spatial_merge_size: int,
) -> MicroBatch:
    """Concatenate samples into one row and gather their image embeddings in token order."""
    return collate_segments([Segment(s) for s in samples], lookup, image_token_id=image_token_id,
                            spatial_merge_size=spatial_merge_size)


def collate_segments(
    segments: list[Segment],
    lookup: Callable[[str], ImageEmbedding | None],
    *,
    image_token_id: int,
    spatial_merge_size: int,
) -> MicroBatch:
    """One row from segments (whole samples, or samples continuing a shared prompt)."""
    assert segments, "cannot collate zero samples"
    lengths = [seg.sample.num_tokens - seg.skip for seg in segments]
    cu = torch.zeros(len(segments) + 1, dtype=torch.int32)
    cu[1:] = torch.tensor(lengths).cumsum(0)
    embeds, deepstack, grids = [], [], []
    for seg in segments:
        s = seg.sample
        embs = _image_embeddings(s, lookup, image_token_id=image_token_id, spatial_merge_size=spatial_merge_size)
        for emb, grid in list(zip(embs, s.image_grid_thw, strict=True))[seg.skip_images:]:
            embeds.append(emb.embeds)
            deepstack.append(emb.deepstack)
            grids.append(grid)
    cut = [slice(seg.skip, None) for seg in segments]
    return MicroBatch(
        input_ids=torch.cat([seg.sample.input_ids[c] for seg, c in zip(segments, cut)]).unsqueeze(0),
        position_ids=torch.cat([seg.sample.position_ids[:, c] for seg, c in zip(segments, cut)], dim=1).unsqueeze(1),
        loss_mask=torch.cat([seg.sample.loss_mask[c] for seg, c in zip(segments, cut)]),
        inference_logprobs=torch.cat([seg.sample.inference_logprobs[c] for seg, c in zip(segments, cut)]),
        advantages=torch.cat([torch.full((n,), seg.sample.advantage, dtype=torch.float32)
                              for seg, n in zip(segments, lengths)]),
        cu_seqlens=cu,
        image_embeds=torch.cat(embeds) if embeds else None,
        deepstack=torch.cat(deepstack, dim=1) if deepstack else None,
        image_grid_thw=torch.stack(grids) if grids else torch.zeros(0, 3, dtype=torch.long),
        sample_ids=[seg.sample.sample_id for seg in segments],
        context=[seg.context for seg in segments] if any(seg.skip for seg in segments) else None,
        policy_versions=torch.cat([torch.full((n,), seg.sample.policy_version, dtype=torch.long)
                                   for seg, n in zip(segments, lengths)]),
        after_image=torch.cat([after_image(seg.sample.input_ids, image_token_id)[c] for seg, c in zip(segments, cut)]),
        routed_experts=_routed_experts(segments),
    )


def _routed_experts(segments: list[Segment]) -> torch.Tensor | None:
    """The row's loss tokens' engine experts, when every sample has them. A shared prompt skipped
    in a segment holds no loss token, so each sample's rows are all there, in row order."""
    experts = [seg.sample.routed_experts for seg in segments]
    return torch.cat(experts) if all(e is not None for e in experts) else None


def _image_embeddings(s: TrainingSample, lookup, *, image_token_id: int, spatial_merge_size: int) -> list:
    """The sample's image embeddings from the cache, in order, checked against its pads and grids."""
    n_pads = int((s.input_ids == image_token_id).sum())
    out, need = [], 0
    for i, (key, grid) in enumerate(zip(s.image_keys, s.image_grid_thw, strict=True)):
        emb = lookup(key)
        if emb is None:
            raise EmbeddingCacheMiss(
                f"sample {s.sample_id!r}: the embedding of its image {i} (cache key {key}) is not in the "
                "image-embedding cache. A step's images stay pinned from its rollout until its train step "
                "ends, so it was never encoded, or was evicted by an earlier budget: raise "
                "image_cache.budget_bytes, or set image_cache.dir for a disk layer under it"
            )
        if not torch.equal(emb.grid_thw.long(), grid.long()):
            raise ValueError(
                f"sample {s.sample_id}: image {key} was encoded with grid {emb.grid_thw.tolist()} but the sample "
                f"expects {grid.tolist()}; the engine and trainer used different min/max pixels"
            )
        out.append(emb)
        need += emb.num_tokens
    if need != n_pads:
        raise ValueError(f"sample {s.sample_id}: {n_pads} image-pad tokens but its images give {need} embeddings")
    assert need == int((s.image_grid_thw.prod(-1) // spatial_merge_size**2).sum()) if s.num_images else need == 0
    return out


def prompt_length(s: TrainingSample) -> int:
    """Tokens before the first loss token: the prompt, which a group's samples share."""
    positions = s.loss_mask.nonzero()
    return int(positions[0]) if len(positions) else s.num_tokens


def prompt_span(s: TrainingSample, image_token_id: int, spatial_merge_size: int) -> tuple[int, int] | None:
    """(tokens, images) of the sample's prompt, or None when it has nothing to share (no prompt,
    or nothing after it). An image span is never cut by a loss token, so the prompt holds
    whole images: the first ones, up to its image-pad count."""
    n = prompt_length(s)
    if n == 0 or n >= s.num_tokens:
        return None
    pads = int((s.input_ids[:n] == image_token_id).sum())
    tokens = (s.image_grid_thw.prod(-1) // spatial_merge_size**2).tolist()
    images = 0
    while pads > 0:
        pads -= tokens[images]
        images += 1
    return n, images


def prompt_key(s: TrainingSample, image_token_id: int, spatial_merge_size: int) -> tuple | None:
    """Samples with equal keys have the same prompt: the same ids and the same images (hence the
    same positions). None for a sample with nothing to share."""
    span = prompt_span(s, image_token_id, spatial_merge_size)
    if span is None:
        return None
    n, images = span
    return (s.input_ids[:n].numpy().tobytes(), tuple(s.image_keys[:images]))


def prompt_groups(samples: list[TrainingSample], max_tokens: int, *, image_token_id: int,
                  spatial_merge_size: int) -> list[list[int]]:
    """Sample indices in units that share one copy of their prompt, each unit at most max_tokens
    (prompt once + every completion); a sample with no partner is a unit of its own."""
    families: dict[tuple, list[int]] = {}
    units: list[list[int]] = []
    for i, s in enumerate(samples):
        key = prompt_key(s, image_token_id, spatial_merge_size)
        if key is None:
            units.append([i])
        else:
            families.setdefault(key, []).append(i)
    for members in families.values():
        prompt = prompt_length(samples[members[0]])
        unit, size = [], prompt
        for i in members:
            extra = samples[i].num_tokens - prompt
            if unit and size + extra > max_tokens:
                units.append(unit)
                unit, size = [], prompt
            unit.append(i)
            size += extra
        units.append(unit)
    return sorted(units, key=min)


def _unit_segments(samples: list[TrainingSample], unit: list[int], start: int,
                   span: tuple[int, int]) -> list[Segment]:
    """The unit's first sample whole, the others after its prompt (`span`: tokens, images),
    continuing the copy at `start`."""
    prompt, images = span
    return [Segment(samples[unit[0]])] + [
        Segment(samples[i], prompt, images, (start, start + prompt)) for i in unit[1:]]


def pack_plan(
    samples: list[TrainingSample],
    *,
    max_tokens: int,
    image_token_id: int,
    spatial_merge_size: int,
    share_prompts: bool = False,
) -> list[list[Segment]]:
    """Which samples go in which micro-batch, and how (first-fit-decreasing, at most max_tokens
    tokens each): the segments of each micro-batch, before any embedding is looked up. A
    function of the samples alone, so every rank of a sharded trainer plans the same.

    `share_prompts` (needs the packed_sdpa kernel): samples with the same prompt (a GRPO group)
    keep one copy of it; each further completion attends to that copy. The forward then runs
    the prompt once per group instead of G times, and computes the same logprobs."""
    if not share_prompts:
        bins = first_fit_decreasing([s.num_tokens for s in samples], max_tokens,
                                    names=[s.sample_id for s in samples])
        return [[Segment(samples[i]) for i in b] for b in bins]
    units = prompt_groups(samples, max_tokens, image_token_id=image_token_id, spatial_merge_size=spatial_merge_size)
    # Each unit's shared prompt (tokens, images), found once; a lone sample shares nothing.
    spans = [prompt_span(samples[u[0]], image_token_id, spatial_merge_size) if len(u) > 1 else (0, 0)
             for u in units]
    sizes = [sum(samples[i].num_tokens for i in u) - span[0] * (len(u) - 1) for u, span in zip(units, spans)]
    bins = first_fit_decreasing(sizes, max_tokens, names=[samples[u[0]].sample_id for u in units])
    plan = []
    for b in bins:
        segments, start = [], 0
        for k in b:
            segments += _unit_segments(samples, units[k], start, spans[k])
            start += sizes[k]
        plan.append(segments)
    return plan


def planned_tokens(segments: list[Segment]) -> int:
    """The row length of a planned micro-batch (what its forward computes)."""
    return sum(seg.sample.num_tokens - seg.skip for seg in segments)


def pack(
    samples: list[TrainingSample],
    lookup: Callable[[str], ImageEmbedding | None],
    *,
    max_tokens: int,
    image_token_id: int,
    spatial_merge_size: int,
    share_prompts: bool = False,
) -> list[MicroBatch]:
    """The micro-batches of `pack_plan`, collated with their image embeddings from `lookup`."""
    plan = pack_plan(samples, max_tokens=max_tokens, image_token_id=image_token_id,
                     spatial_merge_size=spatial_merge_size, share_prompts=share_prompts)
    return [collate_segments(segments, lookup, image_token_id=image_token_id, spatial_merge_size=spatial_merge_size)
            for segments in plan]


def padding_micro_batch(token_id: int = 0) -> MicroBatch:
    """A one-token micro-batch with nothing in the loss: what a rank of a sharded trainer runs
    when it has fewer micro-batches than the others, so every rank makes the same number of
    forward/backward calls (FSDP's collectives hang otherwise). Its loss and gradient are 0."""
    return MicroBatch(
        input_ids=torch.tensor([[token_id]]),
        position_ids=torch.zeros(4, 1, 1, dtype=torch.long),
        loss_mask=torch.zeros(1, dtype=torch.bool),
        inference_logprobs=torch.zeros(1),
        advantages=torch.zeros(1),
        cu_seqlens=torch.tensor([0, 1], dtype=torch.int32),
        image_embeds=None,
        deepstack=None,
        image_grid_thw=torch.zeros(0, 3, dtype=torch.long),
        sample_ids=[],
    )


def rank_micro_batches(samples: list[TrainingSample], cache: EmbeddingCache, *, max_tokens: int, image_token_id: int,
                       spatial_merge_size: int, share_prompts: bool = False, world: World = SINGLE) -> list[MicroBatch]:
    """This rank's micro-batches of the step. Every rank plans the whole step's packing (the same
    plan as one process), takes its share by `balance` (about the same tokens, the same number
    of micro-batches: padding ones fill in), fetches from the other ranks the image embeddings
    it lacks into `cache`, and collates its share from it."""
    plan = pack_plan(samples, max_tokens=max_tokens, image_token_id=image_token_id,
                     spatial_merge_size=spatial_merge_size, share_prompts=share_prompts)
    assignment = balance([planned_tokens(segments) for segments in plan], world.size)
    mine = [plan[i] for i in assignment[world.rank]]
    share_embeddings([k for segments in mine for seg in segments for k in seg.sample.image_keys], cache, world)
    micro_batches = [collate_segments(segments, cache.get, image_token_id=image_token_id,
                                      spatial_merge_size=spatial_merge_size) for segments in mine]
    slots = max(len(a) for a in assignment)
    return micro_batches + [padding_micro_batch() for _ in range(slots - len(micro_batches))]
