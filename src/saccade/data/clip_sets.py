"""The video demo's data set (`saccade demo video`): clips whose answer only their order holds.

Each clip shows one of two colours, then the other (`frames` frames, the first half of them in
the first colour, the rest in the second, each frame filled with its colour), and asks "Which
color came first?" with the two colours as its options. No single frame answers it: each shows
one of the two options, every clip shows both, and which came first is in the order of the
frames alone. The two colours are the same in every row (red and blue), so the options carry
nothing either and a model that does not read the order sits at 1/2: the warm start (a random
option a row) and a model on blank clips alike. (With a pair drawn from ten colours a row, the
warm start answered colours that were not among the row's options: 0.22 before GRPO.)
With every family's temporal patch of 2 frames, each colour fills whole temporal patches, so the
tower sees each colour as it sees a picture of it, and what is left to learn is time.

The control's twin (`reversed_rows`): the same rows, each clip reversed at random (a seeded coin
a row), the answer kept: the colour seen first is then the answer in half the rows and the other
option in the rest, so nothing a model can see tells the answer (its chance is 1/2, as the real
set's). Each set is written in the example's hub layout (`saccade.data.choices_example`:
``data/{train,test}-00000-of-00001.parquet``), a clip as its list of PNG frames (the columns
format reads a list of frames as a clip taken whole, `images.video.frame_list_fps` apart), and
no picture (an empty list).

    python -m saccade.data.clip_sets runs/demo-video/data    # writes order/ and order-reversed/ in it
"""

from __future__ import annotations

import argparse
from pathlib import Path

import numpy as np
from PIL import Image

from saccade.data.choices_example import write_splits
from saccade.data.choices_sets import COLORS10

__all__ = ["COLUMNS", "QUESTION", "clip_rows", "reversed_rows", "write_clip_sets"]

QUESTION = "Which color came first?"
# The columns format's mapping for these sets (task.columns).
COLUMNS = {"images": "picture", "videos": "clip", "prompt": "query", "answer": "gold", "choices": "options",
           "id": "qid"}
SETS = ("order", "order-reversed")
COLOURS = ("red", "blue")


def _frames(first: tuple[int, int, int], second: tuple[int, int, int], frames: int, size: int) -> list[dict]:
    """The clip as PNG frames (`datasets` Image structs): the first half `first`, the rest `second`."""
    from saccade.data.images import image_to_png_bytes

    out = []
    for i in range(frames):
        colour = first if i < frames // 2 else second
        out.append({"bytes": image_to_png_bytes(Image.new("RGB", (size, size), colour)), "path": None})
    return out


def clip_rows(n: int, *, seed: int, split: str, frames: int = 4, size: int = 64, reverse: bool = False) -> list[dict]:
    """`n` rows of one split, a pure function of its arguments: {qid, picture ([]), clip (PNG
    frames), query, options (the two colours), gold (the letter of the colour shown first)}.
    `reverse`: the control's twin (`reversed_rows`): each clip reversed by a seeded coin, the
    answer kept."""
    if frames < 2 or frames % 2:
        raise ValueError(f"a clip needs an even number of frames, at least 2 (half for each colour); got {frames}")
    options = list(COLOURS)
    rows = []
    for i in range(n):
        rng = np.random.default_rng([seed, i])
        first, second = COLOURS if rng.random() < 0.5 else COLOURS[::-1]
        shown = (second, first) if reverse and rng.random() < 0.5 else (first, second)
        rows.append({
            "qid": f"{split}-{i:05d}",
            "picture": [],
            "clip": _frames(COLORS10[shown[0]], COLORS10[shown[1]], frames, size),
            "query": QUESTION,
            "options": list(options),
            "gold": chr(ord("A") + options.index(first)),
        })
    return rows


def reversed_rows(n: int, *, seed: int, split: str, frames: int = 4, size: int = 64) -> list[dict]:
    """The control's rows: `clip_rows` with each clip reversed at random."""
    return clip_rows(n, seed=seed, split=split, frames=frames, size=size, reverse=True)


def write_clip_sets(folder: str | Path, *, train_rows: int = 2000, test_rows: int = 128, seed: int = 0,
                    frames: int = 4, size: int = 64) -> dict[str, Path]:
    """Write the set and its control's twin under `folder` (order/ and order-reversed/), the same
    rows each; returns their folders by name."""
    folder = Path(folder)
    out = {}
    for name, reverse in zip(SETS, (False, True), strict=True):
        def rows(n: int, *, seed: int, split: str, reverse=reverse) -> list[dict]:
            return clip_rows(n, seed=seed, split=split, frames=frames, size=size, reverse=reverse)

        out[name] = write_splits(folder / name, rows, train_rows=train_rows, test_rows=test_rows, seed=seed)
    return out


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m saccade.data.clip_sets",
                                     description="Write the video demo's data set and its control's twin.")
    parser.add_argument("folder")
    parser.add_argument("--train-rows", type=int, default=2000)
    parser.add_argument("--test-rows", type=int, default=128)
    parser.add_argument("--frames", type=int, default=4)
    parser.add_argument("--size", type=int, default=64)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)
    written = write_clip_sets(args.folder, train_rows=args.train_rows, test_rows=args.test_rows, seed=args.seed,
                              frames=args.frames, size=args.size)
    print("wrote " + ", ".join(str(p) for p in written.values()))


if __name__ == "__main__":
    main()
