"""TrainingSample (one rollout, as the trainer sees it) and MicroBatch (packed samples).

A TrainingSample holds the token ids exactly as the engine saw and sampled them, never
re-tokenized, plus everything the loss needs. Images and clips are referenced by cache key
(`image_keys`; `videos`, a `ClipRefs`: keys, grids, seconds per temporal patch); the embeddings
themselves live in the EmbeddingCache and are gathered when a micro-batch is built. The trainer
never holds a clip's pixels or runs the tower: a clip costs it its tokens.
"""

from __future__ import annotations

from dataclasses import dataclass, field, fields, replace
from typing import TYPE_CHECKING

import torch

from saccade.data.videos import ClipRefs

if TYPE_CHECKING:
    from saccade.models.families import Positions


@dataclass
class TrainingSample:
    sample_id: str
    input_ids: torch.Tensor  # (L,) int64: prompt + completion, exactly as the engine saw them
    loss_mask: torch.Tensor  # (L,) bool: True where the token's logprob enters the loss
    inference_logprobs: torch.Tensor  # (L,) float32: the engine's logprob of each sampled token, 0 elsewhere
    position_ids: torch.Tensor  # (4, L) int64: [text; t; h; w], text row 0..L-1
    image_grid_thw: torch.Tensor  # (n_images, 3) int64, in the order the images appear
    image_keys: list[str] = field(default_factory=list)  # EmbeddingCache keys, one per image, in order
    advantage: float = 0.0
    reward: float = 0.0
    policy_version: int = 0  # the weights version the engine sampled under
    # A mixture of experts: the engine's top_k experts per MoE layer for each loss token, in
    # order, (loss tokens, layers, top_k) (`Completion.routed_experts`); None when not known.
    routed_experts: torch.Tensor | None = None
    videos: ClipRefs = field(default_factory=ClipRefs)  # the clips, in the order they appear

    def __post_init__(self):
        L = self.input_ids.shape[0]
        if self.loss_mask.shape != (L,) or self.inference_logprobs.shape != (L,):
            raise ValueError(f"sample {self.sample_id}: loss_mask/inference_logprobs must have shape ({L},)")
        if self.routed_experts is not None and (
                self.routed_experts.dim() != 3 or self.routed_experts.shape[0] != int(self.loss_mask.sum())):
            raise ValueError(f"sample {self.sample_id}: routed_experts must be (loss tokens = "
                             f"{int(self.loss_mask.sum())}, layers, top_k), got {tuple(self.routed_experts.shape)}")
        if self.position_ids.shape != (4, L):
            raise ValueError(f"sample {self.sample_id}: position_ids must be (4, {L}), got {tuple(self.position_ids.shape)}")
        if len(self.image_keys) != self.image_grid_thw.shape[0]:
            raise ValueError(
                f"sample {self.sample_id}: {len(self.image_keys)} image keys but {self.image_grid_thw.shape[0]} grids"
            )

    @property
    def num_tokens(self) -> int:
        return int(self.input_ids.shape[0])

    @property
    def num_images(self) -> int:
        return len(self.image_keys)

    @property
    def num_videos(self) -> int:
        return len(self.videos)


def make_sample(
    sample_id: str,
    input_ids: torch.Tensor,
    mm_token_type_ids: torch.Tensor,
    image_grid_thw: torch.Tensor | None,
    image_keys: list[str],
    *,
    positions: Positions,
    loss_mask: torch.Tensor | None = None,
    inference_logprobs: torch.Tensor | None = None,
    advantage: float = 0.0,
    reward: float = 0.0,
    policy_version: int = 0,
    routed_experts: torch.Tensor | None = None,
    videos: ClipRefs | None = None,
) -> TrainingSample:
    """Build a sample, its M-RoPE positions computed from the token types, the images' grids and the
    clips' (`videos`) by `positions` (the model's: `PolicyLM.positions`, `Setup.positions`, the
    engine's encoder's)."""
    L = input_ids.shape[0]
    grid = image_grid_thw if image_grid_thw is not None else torch.zeros(0, 3, dtype=torch.long)
    videos = videos if videos is not None else ClipRefs()
    return TrainingSample(
        sample_id=sample_id,
        input_ids=input_ids.long(),
        loss_mask=loss_mask.bool() if loss_mask is not None else torch.zeros(L, dtype=torch.bool),
        inference_logprobs=inference_logprobs.float() if inference_logprobs is not None else torch.zeros(L),
        position_ids=positions.with_text_row(mm_token_type_ids, grid, videos),
        image_grid_thw=grid.long(),
        image_keys=list(image_keys),
        advantage=float(advantage),
        reward=float(reward),
        policy_version=int(policy_version),
        routed_experts=routed_experts,
        videos=videos,
    )


def after_image(input_ids_L: torch.Tensor, image_token_id: int) -> torch.Tensor:
    """(L,) bool: True where an image pad comes before the token in its sequence, so the token's
    logprob depends on how that image was encoded and placed (positions, the tower's features);
    False for the text-only tokens before any image (and in a sample without one)."""
    pads_L = (input_ids_L == image_token_id).long().cumsum(0)
    return torch.cat([torch.zeros(1, dtype=torch.bool), pads_L[:-1] > 0]) if len(pads_L) else pads_L.bool()


@dataclass
class MicroBatch:
    """Samples packed into one row of at most max_tokens; attention never crosses samples.

    Segment i (`cu_seqlens[i]:cu_seqlens[i+1]`) holds sample i. With shared prompts
    (`pack(..., share_prompts=True)`), the samples of a group keep their common prompt once:
    the group's first segment holds prompt + completion, each further segment only its
    completion, and `context[i]` is the row range of the prompt it continues ((0, 0): none).
    Sample i is then row[context[i]] + row[segment i], at its own positions."""

    input_ids: torch.Tensor  # (1, N) int64
    position_ids: torch.Tensor  # (4, 1, N) int64: text row restarts at 0 per sample
    loss_mask: torch.Tensor  # (N,) bool
    inference_logprobs: torch.Tensor  # (N,) float32
    advantages: torch.Tensor  # (N,) float32: each token carries its sample's advantage
    cu_seqlens: torch.Tensor  # (S + 1,) int32: sample boundaries (flash-attention varlen form)
    # (M, H): the images' features in token order, then the clips' in token order: the rows of
    # `PolicyLM.visual_positions` (image pads, then video pads), which scatters them there.
    image_embeds: torch.Tensor | None
    deepstack: torch.Tensor | None  # (Z, M, H): the DeepStack levels, rows as image_embeds'
    image_grid_thw: torch.Tensor  # (n_images, 3)
    sample_ids: list[str]
    context: list[tuple[int, int]] | None = None  # per segment: the row range it continues; None: no sharing
    policy_versions: torch.Tensor | None = None  # (N,) int64: each token's sample's sampling weights version
    # (N,) bool: the token has an image before it in its own sample (`after_image`); None: none has.
    after_image: torch.Tensor | None = None
    # A mixture of experts: the engine's experts for each loss token in row order, (loss tokens,
    # layers, top_k); None unless every sample in the row has them (`TrainingSample.routed_experts`).
    routed_experts: torch.Tensor | None = None
    # The same micro-batch in host memory, on a copy made by `to(device)`: what the host reads
    # (loss mask, ids, boundaries) is read there, so the trainer never waits on the device for it.
    host: MicroBatch | None = field(default=None, repr=False, compare=False)
    video_grid_thw: torch.Tensor = field(default_factory=lambda: torch.zeros(0, 3, dtype=torch.long))  # (n_clips, 3)

    @property
    def num_tokens(self) -> int:
        return int(self.input_ids.shape[1])

    @property
    def num_samples(self) -> int:
        return len(self.sample_ids)

    @property
    def num_sample_tokens(self) -> int:
        """Tokens of the samples it holds, a shared prompt counted once per sample (num_tokens
        counts what the forward computes)."""
        return self.num_tokens + sum(b - a for a, b in self.context or [])

    @property
    def on_host(self) -> MicroBatch:
        """This micro-batch in host memory (itself, unless it is a device copy)."""
        return self.host if self.host is not None else self

    def _tensor_fields(self) -> list[str]:
        return [f.name for f in fields(self) if isinstance(getattr(self, f.name), torch.Tensor)]

    def pinned(self) -> MicroBatch:
        """A copy in page-locked host memory, made once per step, so that every pass's copy to
        the GPU (`to`) is asynchronous and copies nothing more on the host. The blocks come from
        torch's caching host allocator: a later step reuses them."""
        return replace(self, **{name: getattr(self, name).pin_memory() for name in self._tensor_fields()})

    def to(self, device: torch.device | str) -> MicroBatch:
        """This micro-batch's tensors on `device`, with `host` pointing at the host copy. From
        pinned memory (`pinned`) the copies are asynchronous (non_blocking): the host never waits.
        The boundaries stay on the host: they are read there (attention layout, positions)."""
        device = torch.device(device)
        host = self.on_host
        moved = {name: getattr(host, name).to(device, non_blocking=True)
                 for name in host._tensor_fields() if name != "cu_seqlens"}
        return replace(host, **moved, host=host)

    def sample_slices(self) -> list[slice]:
        """Each segment's row slice (with shared prompts, a group's prompt is in its first segment only)."""
        b = self.cu_seqlens.tolist()
        return [slice(b[i], b[i + 1]) for i in range(len(b) - 1)]
