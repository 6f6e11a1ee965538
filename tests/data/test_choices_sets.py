"""The demo's test data sets (`saccade.data.choices_sets`): the example's layout, balanced answers,
pictures that differ by answer, and a kind whose pictures say nothing of the answer."""

from __future__ import annotations

import io
from collections import Counter

import numpy as np
import pyarrow.parquet as pq
import pytest
from PIL import Image

from saccade.data.choices_sets import COLORS10, ChoiceSet, choice_rows, main, write_choice_set


def picture(row) -> np.ndarray:
    return np.asarray(Image.open(io.BytesIO(row["picture"]["bytes"])).convert("RGB"))


def dominant_colour(image: np.ndarray) -> tuple[int, ...]:
    """The most common colour that is not a gray."""
    pixels = [tuple(p) for p in image.reshape(-1, 3) if len(set(p)) > 1]
    return Counter(pixels).most_common(1)[0][0]


@pytest.mark.parametrize("spec", [ChoiceSet("color", 8), ChoiceSet("color", 2, 96), ChoiceSet("position", 2),
                                  ChoiceSet("count", 4), ChoiceSet("color_left", 6), ChoiceSet("noise", 4)])
def test_every_block_of_k_rows_holds_every_answer_once(spec):
    rows = choice_rows(spec, 3 * spec.options, seed=3, split="train")
    for b in range(3):
        block = rows[b * spec.options:(b + 1) * spec.options]
        assert sorted(r["gold"] for r in block) == [chr(ord("A") + i) for i in range(spec.options)]
    assert all(r["options"] == spec.option_words() for r in rows)
    assert picture(rows[0]).shape == (spec.image_size, spec.image_size, 3)


def test_the_colour_of_the_shape_is_the_answer_and_noise_pictures_ignore_it():
    colours = list(COLORS10.values())
    rows = choice_rows(ChoiceSet("color", 8), 16, seed=0, split="train")
    assert all(dominant_colour(picture(r)) == colours["ABCDEFGH".index(r["gold"])] for r in rows)
    noise = choice_rows(ChoiceSet("noise", 8), 64, seed=0, split="train")
    agree = sum(dominant_colour(picture(r)) == colours["ABCDEFGH".index(r["gold"])] for r in noise)
    assert agree < 64 / 8 * 3  # about 1 in 8 by chance; the colour set's every row


def test_position_and_colour_left_pictures_differ_by_answer():
    for r in choice_rows(ChoiceSet("position", 2), 8, seed=1, split="train"):
        ink = np.argwhere((picture(r) < 200).any(axis=2))[:, 1]  # columns of non-background pixels
        assert (ink.mean() < 32) == (r["gold"] == "A")
    colours = list(COLORS10.values())
    for r in choice_rows(ChoiceSet("color_left", 6), 8, seed=1, split="train"):
        assert dominant_colour(picture(r)[:, :32]) == colours["ABCDEF".index(r["gold"])]
    for r in choice_rows(ChoiceSet("count", 4), 8, seed=1, split="train"):
        assert picture(r).std() > 0


def test_the_script_writes_both_splits_in_the_hub_layout(tmp_path, capsys):
    main([str(tmp_path), "--kind", "color", "--options", "3", "--train-rows", "6", "--test-rows", "3"])
    assert "saccade demo --task.kind dataset" in capsys.readouterr().out
    test = pq.read_table(tmp_path / "data" / "test-00000-of-00001.parquet").to_pylist()
    assert len(test) == 3 and set(test[0]) == {"qid", "picture", "query", "options", "gold"}
    with pytest.raises(ValueError, match="2 to 2 options"):
        ChoiceSet("position", 3)
    with pytest.raises(ValueError, match="at least 1"):
        write_choice_set(tmp_path, ChoiceSet(), train_rows=0)


def test_tinted_backgrounds_vary_and_stay_light_and_the_shape_keeps_its_colour():
    spec = ChoiceSet("color", 8, radius=(0.12, 0.22), background="tinted")
    rows = choice_rows(spec, 16, seed=0, split="train")
    corners = {tuple(picture(r)[0, 0]) for r in rows}  # a shape never reaches a corner
    assert len(corners) == 16 and all(190 <= c <= 255 for rgb in corners for c in rgb)
    assert any(len(set(rgb)) > 1 for rgb in corners)  # tinted, not gray
    colours = list(COLORS10.values())
    for r in rows:
        image = picture(r)
        shape = Counter(tuple(p) for p in image.reshape(-1, 3) if tuple(p) != tuple(image[0, 0]))
        assert shape.most_common(1)[0][0] == colours["ABCDEFGH".index(r["gold"])]
        assert sum(shape.values()) < 0.25 * 64 * 64  # a small shape: under a quarter of the picture
    with pytest.raises(ValueError, match="background"):
        ChoiceSet(background="plaid")


def test_the_named_sets_are_written_by_name_and_a_flag_beside_the_name_wins(tmp_path):
    from saccade.data.choices_sets import SETS

    assert SETS["colors8"] == (ChoiceSet("color", 8), 4000)
    assert SETS["colors8-small"][0].background == "tinted" and SETS["noise8-small"][0].kind == "noise"
    main([str(tmp_path / "a"), "--set", "colors3-96", "--train-rows", "6", "--test-rows", "3"])
    rows = pq.read_table(tmp_path / "a" / "data" / "train-00000-of-00001.parquet").to_pylist()
    assert len(rows) == 6 and rows[0]["options"] == ["red", "green", "blue"] and picture(rows[0]).shape == (96, 96, 3)
    assert rows == choice_rows(SETS["colors3-96"][0], 6, seed=0, split="train")
