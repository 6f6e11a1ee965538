"""Test data sets for `saccade demo --task.kind dataset`, in the example's hub layout
(`saccade.data.choices_example`: ``data/{train,test}-00000-of-00001.parquet``, columns ``qid``,
``picture``, ``query``, ``options``, ``gold`` as a letter), of several shapes the demo's recipe
was not tuned on:

* ``color``: one shape in one of K colours (2 to 10) on a light background, "What color is the
  shape?". ``radius`` sets the shape's size as a share of the picture (the issue's real data set
  drew shapes of every size; the shapes task draws them large, 0.32-0.46); ``background`` a light
  gray, or (``tinted``) a light tint, each channel drawn apart (issue 63's real data set: small
  shapes on lightly tinted backgrounds).
* ``position``: one shape, left or right half of the picture (2 options), "Is the shape on the
  left or the right?": the answer is where, not what colour.
* ``count``: 1 to K small shapes (K up to 5), "How many shapes are there?", options one..five.
* ``color_left``: two shapes of different colours, one in each half, "What color is the shape on
  the left?": the answer needs colour and position.
* ``noise``: the ``color`` pictures with an answer drawn independently of them: the pictures
  carry nothing, and no model can beat chance on held-out rows.

Every kind's answers are balanced (each block of K rows holds every option once, in a seeded
order) and every option word is one token of the tiny model's tokenizer. Pure functions of
their arguments; train and test come from different seeds.

The data sets of docs/demo.md are named in `SETS` (their arguments, and train rows):

    python -m saccade.data.choices_sets runs/ds/colors8 --set colors8    # = --kind color --options 8 --train-rows 4000
    saccade demo --task.kind dataset --task.dataset runs/ds/colors8 --task.columns '{...}'   # COLUMNS_JSON
"""

from __future__ import annotations

import argparse
import math
from dataclasses import dataclass, replace
from pathlib import Path

import numpy as np
from PIL import Image, ImageDraw

from saccade.data.choices_example import COLUMNS_JSON, write_splits
from saccade.data.shapes import BACKGROUND_RANGE, SHAPES, _draw_shape

__all__ = ["COLORS10", "KINDS", "SETS", "ChoiceSet", "choice_rows", "write_choice_set"]

# Ten colours far from the light gray backgrounds; each name is one token of the tiny tokenizer.
COLORS10: dict[str, tuple[int, int, int]] = {
    "red": (220, 30, 30), "green": (30, 170, 50), "blue": (30, 70, 225), "yellow": (245, 215, 20),
    "purple": (140, 50, 185), "orange": (250, 130, 10), "pink": (250, 120, 200), "brown": (130, 80, 30),
    "black": (20, 20, 20), "cyan": (20, 210, 220),
}
COUNT_WORDS: tuple[str, ...] = ("one", "two", "three", "four", "five")
KINDS: tuple[str, ...] = ("color", "position", "count", "color_left", "noise")
BACKGROUNDS: tuple[str, ...] = ("gray", "tinted")
# A tinted background's channels: light, each drawn apart (pale pinks, blues, greens, creams).
TINT_RANGE: tuple[int, int] = (190, 255)
QUESTIONS = {
    "color": "What color is the shape?",
    "noise": "What color is the shape?",
    "position": "Is the shape on the left or the right?",
    "count": "How many shapes are there?",
    "color_left": "What color is the shape on the left?",
}


@dataclass(frozen=True)
class ChoiceSet:
    """One test data set: its kind, number of options, picture size and (for colour) shape size."""

    kind: str = "color"
    options: int = 8
    image_size: int = 64
    radius: tuple[float, float] = (0.32, 0.46)  # the shape's radius as a share of the picture
    background: str = "gray"  # "gray": a light gray; "tinted": each channel drawn apart, a light tint

    def __post_init__(self) -> None:
        if self.kind not in KINDS:
            raise ValueError(f"kind must be one of {', '.join(KINDS)}; got {self.kind!r}")
        most = {"position": 2, "count": len(COUNT_WORDS)}.get(self.kind, len(COLORS10))
        if not 2 <= self.options <= most:
            raise ValueError(f"a {self.kind!r} data set has 2 to {most} options; got {self.options}")
        if self.image_size < 32:
            raise ValueError(f"image_size must be at least 32 px (one tiny-model token); got {self.image_size}")
        lo, hi = self.radius
        if not 0.02 <= lo <= hi <= 0.5:
            raise ValueError(f"radius is (low, high) shares of the picture within 0.02..0.5; got {self.radius}")
        if self.background not in BACKGROUNDS:
            raise ValueError(f"background must be one of {', '.join(BACKGROUNDS)}; got {self.background!r}")

    def option_words(self) -> list[str]:
        if self.kind == "position":
            return ["left", "right"]
        if self.kind == "count":
            return list(COUNT_WORDS[: self.options])
        return list(COLORS10)[: self.options]


# docs/demo.md's test data sets by name: (what they draw, training rows); 128 held-out rows each.
SETS: dict[str, tuple[ChoiceSet, int]] = {
    "colors8": (ChoiceSet("color", 8), 4000),
    "colors8-any": (ChoiceSet("color", 8, radius=(0.15, 0.46)), 4000),
    "colors10-128": (ChoiceSet("color", 10, 128), 2000),
    "colors3-96": (ChoiceSet("color", 3, 96), 1000),
    "noise4": (ChoiceSet("noise", 4), 2000),
    "position2": (ChoiceSet("position", 2), 2000),
    "left6": (ChoiceSet("color_left", 6), 2000),
    "count4": (ChoiceSet("count", 4), 2000),
    # Issue 63's kind: 8 colours, small shapes on lightly tinted backgrounds, 64 px (grounded only upscaled).
    "colors8-small": (ChoiceSet("color", 8, radius=(0.12, 0.22), background="tinted"), 4000),
    # The same pictures, each answer drawn apart from its picture: nothing to read at any size.
    "noise8-small": (ChoiceSet("noise", 8, radius=(0.12, 0.22), background="tinted"), 4000),
}


def _background(kind: str, rng: np.random.Generator) -> tuple[int, int, int]:
    """A picture's background: one light gray, or (``tinted``) a light tint, each channel drawn apart."""
    low, high = BACKGROUND_RANGE
    if kind == "tinted":
        return tuple(int(v) for v in rng.integers(TINT_RANGE[0], TINT_RANGE[1] + 1, size=3))
    return (int(rng.integers(low, high + 1)),) * 3


def _picture(spec: ChoiceSet, answer: int, rng: np.random.Generator) -> Image.Image:
    """The picture of a row whose answer is option `answer` (for ``noise``, of a random colour)."""
    size = spec.image_size
    image = Image.new("RGB", (size, size), _background(spec.background, rng))
    draw = ImageDraw.Draw(image)
    colours = list(COLORS10.values())[: max(spec.options, 2)]
    shape = SHAPES[int(rng.integers(len(SHAPES)))]
    if spec.kind in ("color", "noise"):
        colour = colours[answer if spec.kind == "color" else int(rng.integers(len(colours)))]
        r = float(rng.uniform(*spec.radius)) * size
        cx, cy = (float(rng.uniform(r + 1, size - 1 - r)) for _ in range(2))
        _draw_shape(draw, shape, cx, cy, r, colour)
    elif spec.kind == "position":
        r = float(rng.uniform(0.12, 0.2)) * size  # fits in a half, its centre in that half
        cx = float(rng.uniform(r + 1, size / 2 - r - 1)) + (size / 2 if answer == 1 else 0.0)
        _draw_shape(draw, shape, cx, float(rng.uniform(r + 1, size - 1 - r)), r, colours[int(rng.integers(len(colours)))])
    elif spec.kind == "color_left":
        other = (answer + 1 + int(rng.integers(len(colours) - 1))) % len(colours)
        r = float(rng.uniform(0.16, 0.23)) * size
        for colour, half in ((colours[answer], 0.0), (colours[other], size / 2)):
            cx = half + float(rng.uniform(r + 1, size / 2 - r - 1))
            _draw_shape(draw, shape, cx, float(rng.uniform(r + 1, size - 1 - r)), r, colour)
    else:  # count: answer + 1 small shapes in distinct cells of a grid
        cells = math.ceil(math.sqrt(len(COUNT_WORDS)))
        step = size / cells
        r = step * float(rng.uniform(0.25, 0.38))
        colour = colours[int(rng.integers(len(colours)))]
        for cell in rng.permutation(cells * cells)[: answer + 1]:
            cx, cy = (cell % cells + 0.5) * step, (cell // cells + 0.5) * step
            _draw_shape(draw, shape, cx, cy, r, colour)
    return image


def choice_rows(spec: ChoiceSet, n: int, *, seed: int, split: str) -> list[dict]:
    """`n` rows of one split: {qid, picture (PNG bytes, a `datasets` Image struct), query,
    options, gold (a letter)}; a pure function of its arguments. Each block of `spec.options`
    rows holds every answer once; for ``noise`` the picture is drawn apart from it."""
    from saccade.data.images import image_to_png_bytes

    k = spec.options
    words = spec.option_words()
    rows = []
    for i in range(n):
        block, slot = divmod(i, k)
        answer = int(np.random.default_rng([seed, k, block, 0]).permutation(k)[slot])
        image = _picture(spec, answer, np.random.default_rng([seed, k, i, 1]))
        rows.append({
            "qid": f"{split}-{i:05d}",
            "picture": {"bytes": image_to_png_bytes(image), "path": None},
            "query": QUESTIONS[spec.kind],
            "options": words,
            "gold": chr(ord("A") + answer),
        })
    return rows


def write_choice_set(folder: str | Path, spec: ChoiceSet, *, train_rows: int = 2000, test_rows: int = 128,
                     seed: int = 0) -> Path:
    """Write the data set (both splits) under `folder`; returns `folder`."""
    def rows(n: int, *, seed: int, split: str) -> list[dict]:
        return choice_rows(spec, n, seed=seed, split=split)

    return write_splits(folder, rows, train_rows=train_rows, test_rows=test_rows, seed=seed)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m saccade.data.choices_sets",
                                     description="Write a multiple-choice test data set for `saccade demo --task.kind "
                                     "dataset` (docs/demo.md, 'Your own multiple-choice data set').")
    parser.add_argument("folder")
    parser.add_argument("--set", choices=sorted(SETS), help="one of docs/demo.md's data sets by name: its kind, "
                        "options, size, radius, background and train rows (a flag given beside it wins)")
    parser.add_argument("--kind", choices=KINDS)
    parser.add_argument("--options", type=int)
    parser.add_argument("--image-size", type=int)
    parser.add_argument("--radius", type=float, nargs=2, metavar=("LOW", "HIGH"))
    parser.add_argument("--background", choices=BACKGROUNDS)
    parser.add_argument("--train-rows", type=int)
    parser.add_argument("--test-rows", type=int, default=128)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)
    base, train_rows = SETS[args.set] if args.set else (ChoiceSet(), 2000)
    given = {"kind": args.kind, "options": args.options, "image_size": args.image_size,
             "radius": tuple(args.radius) if args.radius else None, "background": args.background}
    spec = replace(base, **{k: v for k, v in given.items() if v is not None})
    folder = write_choice_set(args.folder, spec, train_rows=args.train_rows or train_rows, test_rows=args.test_rows,
                              seed=args.seed)
    print(f"wrote {folder} ({spec}). Run the demo on it:\n"
          f"  saccade demo --task.kind dataset --task.dataset {folder} --task.columns '{COLUMNS_JSON}'")


if __name__ == "__main__":
    main()
