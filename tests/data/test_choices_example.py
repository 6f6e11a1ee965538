"""The example multiple-choice data set (`saccade.data.choices_example`): its own column names,
four options a row, the answer as a letter, and the answer in the picture."""

from __future__ import annotations

import io

import pyarrow.parquet as pq
from PIL import Image

from saccade.data.choices_example import COLOR_OPTIONS, main, write_color_choices
from saccade.data.shapes import COLORS


def test_the_data_set_has_its_own_columns_four_options_and_the_answer_in_the_picture(tmp_path):
    write_color_choices(tmp_path, train_rows=8, test_rows=4)
    train = pq.read_table(tmp_path / "data" / "train-00000-of-00001.parquet").to_pylist()
    test = pq.read_table(tmp_path / "data" / "test-00000-of-00001.parquet").to_pylist()
    assert (len(train), len(test)) == (8, 4)
    assert set(train[0]) == {"qid", "picture", "query", "options", "gold"}
    # Each block of four rows holds every colour once: the letters alone say nothing.
    assert sorted(row["gold"] for row in train[:4]) == ["A", "B", "C", "D"]
    for row in train + test:
        assert row["options"] == list(COLOR_OPTIONS) and len(row["options"]) >= 4
        colour = row["options"]["ABCD".index(row["gold"])]
        image = Image.open(io.BytesIO(row["picture"]["bytes"])).convert("RGB")
        assert image.size == (64, 64)
        # The big shape covers much of the picture: its colour is the most common non-gray one.
        counts = sorted((n, c) for n, c in image.getcolors(64 * 64) if len(set(c)) > 1)
        assert counts[-1][1] == COLORS[colour], row["qid"]
    assert train[0]["picture"] != test[0]["picture"]  # the splits are different pictures


def test_the_script_says_how_to_run_the_demo_on_it(tmp_path, capsys):
    main([str(tmp_path / "d"), "--train-rows", "4", "--test-rows", "4"])
    out = capsys.readouterr().out
    assert "saccade demo --task.kind dataset --task.dataset" in out and '"choices": "options"' in out
    assert (tmp_path / "d" / "data" / "test-00000-of-00001.parquet").is_file()
