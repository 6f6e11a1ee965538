"""M-RoPE positions for images, computed from token types and image grids alone.

The trainer never holds the full model, so it cannot call transformers'
`get_rope_index`; this is the same rule as a pure function (tested equal to it): Qwen2-VL's
rule for images, which every family here keeps (`saccade.models.families`: a family's
`mrope_positions` is this function, or its own where its rule differs). Nothing outside
`saccade.models` calls it: every stage asks the model's `Positions`
(`saccade.models.families.interface`), which holds its family's rule. Every token gets three
rotary coordinates (t, h, w):
- a text token at running position p gets (p, p, p), and the next one p + 1;
- an image of llm grid (T, H', W') (H' = H / merge) starting at p gets
  (p + t, p + i, p + j) for each merged patch, and the text after it resumes at
  p + max(H', W') (images do not advance the position by their token count).

For packing, the language model also takes a fourth, leading row: the text position
0..L-1 of each token inside its own sample. transformers reads a drop in that row as
"a new sequence starts here" and stops attention from crossing it (see docs/packing.md).
"""

from __future__ import annotations

import torch

TEXT, IMAGE, VIDEO = 0, 1, 2


def mrope_positions(
    mm_token_type_ids_L: torch.Tensor,
    image_grid_thw_N3: torch.Tensor | None,
    spatial_merge_size: int,
) -> torch.Tensor:
    """(3, L) int64 M-RoPE positions for one sample. Images are taken in order. The signature is
    `ModelFamily.mrope_positions`' (the merge size positional), so a family takes it as is."""
    types = mm_token_type_ids_L.tolist()
    grids = [] if image_grid_thw_N3 is None else [tuple(int(x) for x in g) for g in image_grid_thw_N3]
    pieces: list[torch.Tensor] = []
    next_image = 0
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
        if kind != IMAGE:
            raise ValueError("video tokens are not supported yet; only images (mm_token_type 1)")
        # A run of image tokens may hold several images back to back: consume grid by grid.
        while i < j:
            if next_image >= len(grids):
                raise ValueError(
                    f"sample has more image tokens than image grids ({len(grids)} grids); "
                    "the prompt's image placeholders and the images disagree"
                )
            t, h, w = grids[next_image]
            next_image += 1
            gh, gw = h // spatial_merge_size, w // spatial_merge_size
            n = t * gh * gw
            if i + n > j:
                raise ValueError(
                    f"image {next_image - 1} needs {n} placeholder tokens but only {j - i} remain in its span"
                )
            pieces.append(_image_positions(pos, t, gh, gw))
            pos += max(gh, gw)
            i += n
    if next_image != len(grids):
        raise ValueError(f"{len(grids)} image grids given but the tokens hold only {next_image} images")
    if not pieces:
        return torch.zeros(3, 0, dtype=torch.long)
    return torch.cat(pieces, dim=1).long()


def _image_positions(start: int, t: int, gh: int, gw: int) -> torch.Tensor:
    tt = torch.arange(t).view(t, 1, 1).expand(t, gh, gw)
    hh = torch.arange(gh).view(1, gh, 1).expand(t, gh, gw)
    ww = torch.arange(gw).view(1, 1, gw).expand(t, gh, gw)
    return torch.stack([tt, hh, ww]).reshape(3, -1) + start


def with_text_row(mrope_3L: torch.Tensor) -> torch.Tensor:
    """(4, L): prepend the per-sample text position 0..L-1 that packing relies on."""
    L = mrope_3L.shape[1]
    return torch.cat([torch.arange(L, dtype=mrope_3L.dtype).unsqueeze(0), mrope_3L], dim=0)
