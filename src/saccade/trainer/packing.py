"""Pack TrainingSamples into micro-batches of at most `max_tokens`, like text.

Because image features are precomputed, an image is just a run of tokens whose
embeddings come from the cache: samples with images pack exactly like text samples, and so
do samples with clips (a clip's features are cached as an image's; `video_token_id` names its
pads). Samples are never split (so an image or clip span is never cut), and attention never
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
    shared prompt already in the row at `context`), its images from `skip_images` on and its
    clips from `skip_videos` on."""

    sample: TrainingSample
    skip: int = 0
    skip_images: int = 0
    context: tuple[int, int] = (0, 0)
    skip_videos: int = 0


def collate(
    samples: list[TrainingSample],
    lookup: Callable[[str], ImageEmbedding | None],
    *,
    image_token_id: int,
    spatial_merge_size: int,
    video_token_id: int | None = None,
) -> MicroBatch:
    """Concatenate samples into one row and gather their image (and clip) embeddings."""
    return collate_segments([Segment(s) for s in samples], lookup, image_token_id=image_token_id,
                            spatial_merge_size=spatial_merge_size, video_token_id=video_token_id)


def collate_segments(
    segments: list[Segment],
    lookup: Callable[[str], ImageEmbedding | None],
    *,
    image_token_id: int,
    spatial_merge_size: int,
    video_token_id: int | None = None,
) -> MicroBatch:
    """One row from segments (whole samples, or samples continuing a shared prompt). The row's
    visual rows are its images' in token order, then its clips' in token order: what
    `PolicyLM.visual_positions` lists (image pads, then video pads)."""
    assert segments, "cannot collate zero samples"
    lengths = [seg.sample.num_tokens - seg.skip for seg in segments]
    cu = torch.zeros(len(segments) + 1, dtype=torch.int32)
    cu[1:] = torch.tensor(lengths).cumsum(0)
    images: list[tuple[ImageEmbedding, torch.Tensor]] = []
    clips: list[tuple[ImageEmbedding, torch.Tensor]] = []
    for seg in segments:
        s = seg.sample
        embs = _embeddings(s, s.image_keys, s.image_grid_thw, lookup, pad_id=image_token_id,
                           merge=spatial_merge_size, what="image")
        images += list(zip(embs, s.image_grid_thw, strict=True))[seg.skip_images:]
        if s.num_videos:
            if video_token_id is None:
                raise ValueError(f"sample {s.sample_id!r} has clips, and the packer was given no video_token_id")
            embs = _embeddings(s, s.videos.keys, s.videos.grid_thw, lookup, pad_id=video_token_id,
                               merge=spatial_merge_size, what="video")
            clips += list(zip(embs, s.videos.grid_thw, strict=True))[seg.skip_videos:]
    visuals = [emb for emb, _ in images + clips]
    cut = [slice(seg.skip, None) for seg in segments]
    return MicroBatch(
        input_ids=torch.cat([seg.sample.input_ids[c] for seg, c in zip(segments, cut)]).unsqueeze(0),
        position_ids=torch.cat([seg.sample.position_ids[:, c] for seg, c in zip(segments, cut)], dim=1).unsqueeze(1),
        loss_mask=torch.cat([seg.sample.loss_mask[c] for seg, c in zip(segments, cut)]),
        inference_logprobs=torch.cat([seg.sample.inference_logprobs[c] for seg, c in zip(segments, cut)]),
        advantages=torch.cat([torch.full((n,), seg.sample.advantage, dtype=torch.float32)
                              for seg, n in zip(segments, lengths)]),
        cu_seqlens=cu,
        image_embeds=torch.cat([e.embeds for e in visuals]) if visuals else None,
        deepstack=torch.cat([e.deepstack for e in visuals], dim=1) if visuals else None,
        image_grid_thw=torch.stack([g for _, g in images]) if images else torch.zeros(0, 3, dtype=torch.long),
        sample_ids=[seg.sample.sample_id for seg in segments],
        context=[seg.context for seg in segments] if any(seg.skip for seg in segments) else None,
        policy_versions=torch.cat([torch.full((n,), seg.sample.policy_version, dtype=torch.long)
                                   for seg, n in zip(segments, lengths)]),
        after_image=torch.cat([after_image(seg.sample.input_ids, image_token_id)[c] for seg, c in zip(segments, cut)]),
        routed_experts=_routed_experts(segments),
        video_grid_thw=torch.stack([g for _, g in clips]) if clips else torch.zeros(0, 3, dtype=torch.long),
    )


def _routed_experts(segments: list[Segment]) -> torch.Tensor | None:
    """The row's loss tokens' engine experts, when every sample has them. A shared prompt skipped
    in a segment holds no loss token, so each sample's rows are all there, in row order."""
    experts = [seg.sample.routed_experts for seg in segments]
    return torch.cat(experts) if all(e is not None for e in experts) else None


def _embeddings(s: TrainingSample, keys: list[str], grids: torch.Tensor, lookup, *, pad_id: int, merge: int,
                what: str) -> list:
    """The sample's image (or clip) embeddings from the cache, in order, checked against its pads and grids."""
    n_pads = int((s.input_ids == pad_id).sum())
    out, need = [], 0
    for i, (key, grid) in enumerate(zip(keys, grids, strict=True)):
        emb = lookup(key)
        if emb is None:
            raise EmbeddingCacheMiss(
                f"sample {s.sample_id!r}: the embedding of its {what} {i} (cache key {key}) is not in the "
                "image-embedding cache. A step's images and clips stay pinned from its rollout until its train "
                "step ends, so it was never encoded, or was evicted by an earlier budget: raise "
                "image_cache.budget_bytes, or set image_cache.dir for a disk layer under it"
            )
        if not torch.equal(emb.grid_thw.long(), grid.long()):
            raise ValueError(
                f"sample {s.sample_id}: {what} {key} was encoded with grid {emb.grid_thw.tolist()} but the sample "
                f"expects {grid.tolist()}; the engine and trainer used different min/max pixels"
            )
        out.append(emb)
        need += emb.num_tokens
    if need != n_pads:
        raise ValueError(f"sample {s.sample_id}: {n_pads} {what}-pad tokens but its {what}s give {need} embeddings")
    assert need == int((grids.prod(-1) // merge**2).sum()) if len(keys) else need == 0
    return out


def prompt_length(s: TrainingSample) -> int:
    """Tokens before the first loss token: the prompt, which a group's samples share."""
    positions = s.loss_mask.nonzero()
    return int(positions[0]) if len(positions) else s.num_tokens


def _whole_in(pads: int, tokens: list[int]) -> int:
    """How many of the visuals (each `tokens[i]` pads, in order) the first `pads` pads hold: a span
    is never cut by a loss token, so the prompt holds whole ones."""
    count = 0
    while pads > 0:
        pads -= tokens[count]
        count += 1
    return count


def prompt_span(s: TrainingSample, image_token_id: int, spatial_merge_size: int,
                video_token_id: int | None = None) -> tuple[int, int, int] | None:
    """(tokens, images, clips) of the sample's prompt, or None when it has nothing to share (no
    prompt, or nothing after it). An image or clip span is never cut by a loss token, so the
    prompt holds whole images and clips: the first ones, up to its pad counts."""
    n = prompt_length(s)
    if n == 0 or n >= s.num_tokens:
        return None
    merged = spatial_merge_size**2
    images = _whole_in(int((s.input_ids[:n] == image_token_id).sum()), (s.image_grid_thw.prod(-1) // merged).tolist())
    clips = 0
    if s.num_videos:
        if video_token_id is None:
            raise ValueError(f"sample {s.sample_id!r} has clips, and the packer was given no video_token_id")
        clips = _whole_in(int((s.input_ids[:n] == video_token_id).sum()), (s.videos.grid_thw.prod(-1) // merged).tolist())
    return n, images, clips


def prompt_key(s: TrainingSample, image_token_id: int, spatial_merge_size: int,
               video_token_id: int | None = None) -> tuple | None:
    """Samples with equal keys have the same prompt: the same ids, images and clips (hence the same
    positions). None for a sample with nothing to share."""
    span = prompt_span(s, image_token_id, spatial_merge_size, video_token_id)
    if span is None:
        return None
    n, images, clips = span
    # A clip's seconds per temporal patch move its positions (Qwen2.5-VL) without showing in its ids.
    return (s.input_ids[:n].numpy().tobytes(), tuple(s.image_keys[:images]), tuple(s.videos.keys[:clips]),
            tuple(s.videos.second_per_grid[:clips].tolist()))


def prompt_groups(samples: list[TrainingSample], max_tokens: int, *, image_token_id: int,
                  spatial_merge_size: int, video_token_id: int | None = None) -> list[list[int]]:
    """Sample indices in units that share one copy of their prompt, each unit at most max_tokens
    (prompt once + every completion); a sample with no partner is a unit of its own."""
    families: dict[tuple, list[int]] = {}
    units: list[list[int]] = []
    for i, s in enumerate(samples):
        key = prompt_key(s, image_token_id, spatial_merge_size, video_token_id)
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
                   span: tuple[int, int, int]) -> list[Segment]:
    """The unit's first sample whole, the others after its prompt (`span`: tokens, images, clips),
    continuing the copy at `start`."""
    prompt, images, clips = span
    return [Segment(samples[unit[0]])] + [
        Segment(samples[i], prompt, images, (start, start + prompt), clips) for i in unit[1:]]


def pack_plan(
    samples: list[TrainingSample],
    *,
    max_tokens: int,
    image_token_id: int,
    spatial_merge_size: int,
    share_prompts: bool = False,
    video_token_id: int | None = None,
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
    units = prompt_groups(samples, max_tokens, image_token_id=image_token_id, spatial_merge_size=spatial_merge_size,
                          video_token_id=video_token_id)
    # Each unit's shared prompt (tokens, images, clips), found once; a lone sample shares nothing.
    spans = [prompt_span(samples[u[0]], image_token_id, spatial_merge_size, video_token_id) if len(u) > 1
             else (0, 0, 0) for u in units]
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
    video_token_id: int | None = None,
) -> list[MicroBatch]:
    """The micro-batches of `pack_plan`, collated with their image (and clip) embeddings from `lookup`."""
    plan = pack_plan(samples, max_tokens=max_tokens, image_token_id=image_token_id,
                     spatial_merge_size=spatial_merge_size, share_prompts=share_prompts, video_token_id=video_token_id)
    return [collate_segments(segments, lookup, image_token_id=image_token_id, spatial_merge_size=spatial_merge_size,
                             video_token_id=video_token_id) for segments in plan]


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
                       spatial_merge_size: int, share_prompts: bool = False, world: World = SINGLE,
                       video_token_id: int | None = None) -> list[MicroBatch]:
    """This rank's micro-batches of the step. Every rank plans the whole step's packing (the same
    plan as one process), takes its share by `balance` (about the same tokens, the same number
    of micro-batches: padding ones fill in), fetches from the other ranks the image and clip
    embeddings it lacks into `cache`, and collates its share from it."""
    plan = pack_plan(samples, max_tokens=max_tokens, image_token_id=image_token_id,
                     spatial_merge_size=spatial_merge_size, share_prompts=share_prompts, video_token_id=video_token_id)
    assignment = balance([planned_tokens(segments) for segments in plan], world.size)
    mine = [plan[i] for i in assignment[world.rank]]
    share_embeddings([k for segments in mine for seg in segments for k in [*seg.sample.image_keys,
                                                                              *seg.sample.videos.keys]], cache, world)
    micro_batches = [collate_segments(segments, cache.get, image_token_id=image_token_id,
                                      spatial_merge_size=spatial_merge_size, video_token_id=video_token_id)
                     for segments in mine]
    slots = max(len(a) for a in assignment)
    return micro_batches + [padding_micro_batch() for _ in range(slots - len(micro_batches))]
