"""What a clip costs a trainer, for `saccade memory`: its tokens to saccade's, and, beside it, what
a trainer that runs the vision tower (TRL's GRPOTrainer, verl, ms-swift: the peers' way) would
hold besides. Arithmetic over the model's dimensions (`saccade.tools.memory_dims`), no torch.

The clip is the largest a config's `[images.video]` allows (`config_clip`): `num_frames` (or
`max_frames`) frames at `max_pixels` (Qwen3-VL's video processor reads it over all the frames
together, Qwen2-VL's per frame), square frames rounded down to the patch grid as the processor's
`smart_resize` does. It is `ceil(frames / temporal_patch)` temporal patches of
`(side / patch)^2` patches each; the tower merges `merge^2` patches into one video token. Around
them the processor writes text: Qwen3-VL a `<t seconds>` timestamp and vision_start/end per
frame group (`TIMESTAMP_TOKENS` + 2, an estimate of Qwen's tokenizer), Qwen2.5-VL
vision_start/end once.

saccade's trainer holds the clip's tokens (its micro-batch, `trainer.max_tokens`, must hold
them) and their cached embedding rows (counted in `trainer_memory`'s image embeddings); never the
tower, never a pixel. A trainer that runs the tower holds, on top of the same language model's
(`tower_trainer_memory`, per micro-batch of one clip):
- the tower's weights in the compute dtype;
- the clip's pixel values: the processor's float32 `pixel_values_videos` (patches x
  channels x temporal patch x patch^2) and its copy in the compute dtype;
- the tower frozen: one block's working set at a time (`VisionDims.block_transient_bytes`: the
  residual stream, the block's output, the MLP's intermediates; an estimate), nothing saved;
- the tower trained: every block's saved activations (`VisionDims.tower_activation_bytes`,
  flash-attention's layout; the blocks exact against autograd on the tiny towers in the CPU's
  layout) and its float32 master weights, gradients and AdamW moments (16 bytes a parameter).
Not counted for either: the peers' own layouts (a prompt repeated G times with its pixels, their
attention kernels), nor activation checkpointing inside the tower.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from saccade.tools.memory import DTYPE_BYTES, Estimate, GiB, Item
from saccade.tools.memory_dims import ModelDims, VisionDims

TIMESTAMP_TOKENS = 6  # "<12.5 seconds>" in Qwen's tokenizer, about: '<', digits, '.', a digit, ' seconds', '>'
TOWER_STATE_BYTES = 16  # a trained tower's float32 master weights, gradients and AdamW's two moments


@dataclass(frozen=True)
class ClipShape:
    """A clip as the tower and the language model see it."""

    frames: int
    side: int  # px, each frame square after the resize
    temporal_patches: int
    patches: int  # the tower's input rows
    tokens: int  # video pads: patches / merge^2
    text_tokens: int  # timestamps and vision_start/end around them (an estimate)

    @property
    def prompt_tokens(self) -> int:
        return self.tokens + self.text_tokens


def clip_shape(vision: VisionDims, frames: int, frame_pixels: int) -> ClipShape:
    """A clip of `frames` square frames of at most `frame_pixels` pixels each."""
    factor = vision.patch_size * vision.spatial_merge_size
    side = max(factor, math.isqrt(frame_pixels) // factor * factor)
    temporal = math.ceil(frames / vision.temporal_patch_size)
    patches = temporal * (side // vision.patch_size) ** 2
    tokens = patches // vision.spatial_merge_size**2
    text = temporal * (TIMESTAMP_TOKENS + 2) if vision.video_pixels_per_clip else 2
    return ClipShape(frames, side, temporal, patches, tokens, text)


def config_clip(cfg, dims: ModelDims) -> ClipShape | None:
    """The largest clip the config's `[images.video]` allows, or None when it does not bound one
    (no `num_frames` nor `max_frames`, or no `max_pixels`: the processor's defaults, unknown here)."""
    video = cfg.images.video
    frames = video.num_frames or video.max_frames
    if frames is None or video.max_pixels is None:
        return None
    per_frame = video.max_pixels // frames if dims.vision.video_pixels_per_clip else video.max_pixels
    return clip_shape(dims.vision, frames, per_frame)


def tower_trainer_memory(dims: ModelDims, trainer: Estimate, clip: ClipShape, *, dtype: str = "bfloat16",
                         trained: bool = False) -> Estimate:
    """`trainer` (saccade's estimate of the same run) plus what running the tower on the clip adds
    (the module docstring); the tower frozen, or `trained`."""
    b = DTYPE_BYTES[dtype]
    v = dims.vision
    items = [i for i in trainer.items if i.name != "CUDA context"]
    if not any(i.name == "vision tower" for i in items):
        items.append(Item("vision tower", v.params * b / GiB, f"{v.params / 1e9:.2f}B params, {dtype}"))
    pixels = clip.patches * v.patch_values
    items.append(Item("pixel values", pixels * (4 + b) / GiB,
                      f"{clip.patches:,} patches x {v.patch_values} values, fp32 from the processor + a {dtype} copy"))
    if trained:
        items.append(Item("tower activations", clip.patches * v.tower_activation_bytes(b) / GiB,
                          f"{clip.patches:,} patches x {v.tower_activation_bytes(b) / 2**20:.2f} MiB, "
                          f"{v.depth} blocks saved for backward"))
        items.append(Item("tower masters+grads+AdamW", v.params * TOWER_STATE_BYTES / GiB, "fp32"))
    else:
        items.append(Item("tower working set", clip.patches * v.block_transient_bytes(b) / GiB,
                          f"one block at a time, {v.block_transient_bytes(b) / 2**10:.1f} KiB a patch, nothing saved"))
    items.append(Item("CUDA context", trainer.get("CUDA context"), "assumed"))
    return Estimate(tuple(items))
