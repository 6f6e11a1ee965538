"""The video demo's data set (saccade.data.clip_sets): only the clip's order holds the answer."""

from __future__ import annotations

import io

import numpy as np
from PIL import Image

from saccade.data.choices_sets import COLORS10
from saccade.data.clip_sets import clip_rows, reversed_rows


def colours_shown(row) -> list[str]:
    by_rgb = {rgb: name for name, rgb in COLORS10.items()}
    return [by_rgb[tuple(np.asarray(Image.open(io.BytesIO(f["bytes"])))[0, 0])] for f in row["clip"]]


def test_the_answer_is_the_colour_shown_first_and_no_frame_alone_tells_it():
    rows = clip_rows(200, seed=3, split="train")
    assert rows == clip_rows(200, seed=3, split="train")  # a pure function of its arguments
    golds = []
    for row in rows:
        shown = colours_shown(row)
        assert len(shown) == 4 and shown[0] == shown[1] != shown[2] == shown[3]  # each colour fills a temporal patch
        assert sorted(row["options"]) == sorted({shown[0], shown[2]})  # both options are seen in every clip
        golds.append(row["options"][ord(row["gold"]) - ord("A")] == shown[0])
        assert row["picture"] == []
    assert all(golds)
    # Which colour comes first is a coin: the options (the same two in every row) say nothing.
    assert 0.4 < np.mean([r["gold"] == "A" for r in rows]) < 0.6 and len({tuple(r["options"]) for r in rows}) == 1


def test_the_controls_twin_shows_the_answer_first_in_half_the_rows_only():
    rows, twins = clip_rows(400, seed=1, split="train"), reversed_rows(400, seed=1, split="train")
    first_is_gold = []
    for row, twin in zip(rows, twins, strict=True):
        assert (twin["qid"], twin["options"], twin["gold"]) == (row["qid"], row["options"], row["gold"])
        shown, real = colours_shown(twin), colours_shown(row)
        assert shown in (real, real[::-1])
        first_is_gold.append(shown[0] == row["options"][ord(row["gold"]) - ord("A")])
    assert 0.42 < np.mean(first_is_gold) < 0.58
