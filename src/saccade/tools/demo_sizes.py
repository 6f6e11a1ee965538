"""The picture sizes the data-set demo's probe tries, and the one it takes (pure functions).

A random tiny tower sees a 64-px picture as 16 patches of 16 px merged into 4 tokens: a shape
a few pixels wide fills a corner of one patch, and its colour is lost (docs/demo.md, "The
shape-size finding"). Upscaled, the same picture spans more patches: issue 63's data set of
small shapes went from 0.109 (chance 0.125) to 0.891 when the processor resized its 64-px
pictures to 224 px (`images.min_pixels = 50176`). So when the probe finds nothing at the data
set's own size, it tries larger ones before it says "not grounded":

* `sides_to_try`: the data set's own side (its held-out pictures as the processor sizes them,
  the median), then that side doubled while its square fits the model's bound (its processor's
  `max_pixels`), then the bound's own side when the last doubling fell short of it; at most
  `MAX_SIZES` sizes in all (each costs a probe).
* `search_sizes`: the probe at each size in turn, stopping at the first at which it reads the
  answers (0.9 of them, the demo's accuracy bar: a larger size has nothing more to give the
  bar), so the smallest such size is taken (each size costs more tokens, so more minutes, at
  every later stage). A size that grounds only in part (the tower keeps some of the answers,
  the verdict's "grounded") does not stop the search: a larger one may keep them all. When
  none reads 0.9, the size whose probe read the most among those that ground is taken.
* `size_limits`: the run's `[images]` bounds for a side: `min_pixels` its square (the processor
  upscales every smaller picture to it), `max_pixels` raised to it if lower. Set once for the
  whole demo, so the warm start, GRPO, the control, the engine and the trainer all see the
  same pictures. The data set's own side keeps the config's bounds as they are.
* `picture_tokens`: what a side costs: the image tokens of a picture at those bounds (the
  processor's `smart_resize` to a multiple of patch x merge, one token per merged patch), the
  held-out pictures' mean.
"""

from __future__ import annotations

import math
import statistics
from dataclasses import dataclass
from typing import Callable, Sequence

from saccade.config import ImagesConfig

# The probe's sizes at most: the data set's own and three larger (a side 8 times the own, 64
# times the tokens); each is a probe's SFT fit.
MAX_SIZES = 4


@dataclass(frozen=True)
class SizeTried:
    """One size the probe tried: the pictures' side (px), its image tokens a picture, and the
    probe's held-out accuracy with the pictures at that size."""

    side: int
    tokens: float
    accuracy: float


def resized(height: int, width: int, limits: ImagesConfig, factor: int) -> tuple[int, int]:
    """A picture's (height, width) as the processor resizes it within `limits` (`factor`: the
    tower's patch size x its merge size)."""
    from transformers.models.qwen2_vl.image_processing_qwen2_vl import smart_resize

    return smart_resize(height, width, factor=factor, min_pixels=limits.min_pixels, max_pixels=limits.max_pixels)


def picture_tokens(sizes: Sequence[tuple[int, int]], limits: ImagesConfig, factor: int) -> float:
    """The mean image tokens of pictures of these (height, width) within `limits`: one token per
    merged patch, `factor` x `factor` pixels."""
    if not sizes:
        raise ValueError("no pictures to size: the held-out rows have no images")
    return statistics.fmean(h * w // factor**2 for h, w in (resized(*s, limits, factor) for s in sizes))


def own_side(sizes: Sequence[tuple[int, int]], limits: ImagesConfig, factor: int) -> int:
    """The data set's side as the model sees it: the median over its pictures of the side of a
    square of their resized area."""
    if not sizes:
        raise ValueError("no pictures to size: the held-out rows have no images")
    return int(statistics.median(math.isqrt(h * w) for h, w in (resized(*s, limits, factor) for s in sizes)))


def sides_to_try(side: int, max_pixels: int, factor: int, *, most: int = MAX_SIZES) -> list[int]:
    """The sides the probe tries, smallest first: `side` (the data set's own), then doubled while
    its square fits `max_pixels` (the model's bound), then the bound's side (a multiple of
    `factor`) when the last doubling fell short of it; at most `most` sides."""
    if side < 1 or max_pixels < 1 or factor < 1:
        raise ValueError(f"side, max_pixels and factor must be positive; got {side}, {max_pixels}, {factor}")
    bound = math.isqrt(max_pixels) // factor * factor
    sides = [side]
    while len(sides) < most and 2 * sides[-1] <= bound:
        sides.append(2 * sides[-1])
    if len(sides) < most and sides[-1] + factor <= bound:
        sides.append(bound)
    return sides


def size_limits(limits: ImagesConfig, side: int, own: int) -> ImagesConfig:
    """The run's image bounds for pictures of `side` px: the config's own at the data set's own
    side; else `min_pixels` = side², and `max_pixels` raised to it if lower."""
    if side == own:
        return limits
    area = side * side
    return limits.model_copy(update={"min_pixels": area, "max_pixels": max(limits.max_pixels, area)})


def search_sizes(sides: Sequence[int], probe_at: Callable[[int], float], tokens: Callable[[int], float], *,
                 grounded: Callable[[float], bool], enough: Callable[[float], bool]) -> tuple[list[SizeTried], int | None]:
    """The probe at each side in turn (`probe_at(side)`: its held-out accuracy with the pictures),
    stopping at the first that reads `enough` of them; when none does, the side among those that
    `grounded` accepts whose probe read the most (the smallest of equals), or None. Returns (every
    size tried, the side taken)."""
    tried: list[SizeTried] = []
    for side in sides:
        tried.append(SizeTried(side, tokens(side), probe_at(side)))
        if enough(tried[-1].accuracy):
            return tried, side
    partial = [t for t in tried if grounded(t.accuracy)]
    return tried, (max(partial, key=lambda t: t.accuracy).side if partial else None)


@dataclass(frozen=True)
class SizePlan:
    """The sizes a data set's probe may try: its own side, the sides to try (own first), each
    one's image tokens a picture, and the bounds they come from."""

    own: int
    sides: list[int]
    tokens: dict[int, float]
    factor: int  # the tower's patch size x merge size: one image token per factor x factor pixels
    bound: int  # the model's max_pixels (its processor's)
    limits: ImagesConfig  # the config's image bounds (the own side's)

    def limits_at(self, side: int) -> ImagesConfig:
        return size_limits(self.limits, side, self.own)


def plan_sizes(cfg, held_out: list, processor) -> SizePlan:
    """The size plan of a data set's held-out rows (their pictures' sizes) for the model whose
    `processor` it is, from the config's image bounds."""
    ip = processor.image_processor
    factor, bound = int(ip.patch_size * ip.merge_size), int(ip.size["longest_edge"])
    pictures = [(image.height, image.width) for sample in held_out for image in (sample.images or [])]
    own = own_side(pictures, cfg.images, factor)
    sides = sides_to_try(own, bound, factor)
    tokens = {side: picture_tokens(pictures, size_limits(cfg.images, side, own), factor) for side in sides}
    return SizePlan(own=own, sides=sides, tokens=tokens, factor=factor, bound=bound, limits=cfg.images)


def size_reason(tried: Sequence[SizeTried], chosen: int | None, *, blank: float, chance: float,
                enough: float) -> str:
    """Which size the probe took and why, in words, from what it read at each size tried
    (`enough`: the accuracy at which the search stops)."""
    def at(t: SizeTried) -> str:
        return f"{t.side} px ({t.tokens:g} image tokens a picture): {t.accuracy:.3f}"

    against = f"blank {blank:.3f}, chance {chance:.2f}"
    if chosen is None:
        return (f"not grounded at any size tried ({'; '.join(at(t) for t in tried)}; {against}): "
                f"{tried[-1].side} px is as large as this model takes or the probe's last size")
    first = tried[0]
    taken = next(t for t in tried if t.side == chosen)
    cost = (f"; {taken.tokens / first.tokens:.3g} x the image tokens of the pictures' own size"
            if taken is not first else "")
    if taken.accuracy < enough:
        return (f"no size tried read {enough:g} of the answers ({'; '.join(at(t) for t in tried)}; {against}): "
                f"{taken.side} px read the most{cost}")
    if len(tried) == 1:
        return f"the pictures' own size, {at(first)} with the pictures ({against})"
    smaller = "; ".join(at(t) for t in tried[:-1])
    return (f"the smallest size at which the probe read {enough:g} of the answers: {at(taken)} ({against}); "
            f"smaller ones read less ({smaller}){cost}")
