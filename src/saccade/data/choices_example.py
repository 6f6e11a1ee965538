"""A multiple-choice data set of one's own making, to run `saccade demo` on a data set with.

`write_color_choices(folder)` writes a folder laid out like a hub repository,
``data/train-00000-of-00001.parquet`` and ``data/test-00000-of-00001.parquet``, whose columns
are named unlike saccade's (``qid``, ``picture``, ``query``, ``options``, ``gold``): each row a
picture of one large shape in one of four colours (the shapes task's pictures,
`saccade.data.shapes.make_sample`: the tiny model's random vision tower keeps colour only for
large shapes), the question "What color is the big shape?", the four colours as options and
the right one's letter as the gold answer. The answer is in the picture and nowhere else:
the options are the same, in the same order, on every row, and each block of four rows holds
every colour once.

    python -m saccade.data.choices_example runs/color-choices
    saccade demo --task.kind dataset --task.dataset runs/color-choices \\
        --task.columns '{"images": "picture", "prompt": "query", "answer": "gold", "choices": "options", "id": "qid"}'

(docs/demo.md, "Your own multiple-choice data set".)
"""

from __future__ import annotations

import argparse
from pathlib import Path

# Four colours of the shapes task (their names are words of the tiny model's tokenizer).
COLOR_OPTIONS: tuple[str, ...] = ("red", "green", "blue", "yellow")
QUESTION = "What color is the big shape?"
# `--task.columns` for this data set, as JSON.
COLUMNS_JSON = '{"images": "picture", "prompt": "query", "answer": "gold", "choices": "options", "id": "qid"}'
# Train and test rows come from different seeds' streams of pictures.
_TEST_SEED_OFFSET = 5_000


def color_choice_rows(n: int, *, seed: int, split: str, image_size: int = 64,
                      options: tuple[str, ...] = COLOR_OPTIONS) -> list[dict]:
    """`n` rows of one split: {qid, picture (PNG bytes, as a `datasets` Image struct), query,
    options, gold (a letter)}, a pure function of its arguments."""
    from saccade.data.images import image_to_png_bytes
    from saccade.data.shapes import ShapesTask, make_sample

    task = ShapesTask(kinds=("color",), num_choices=len(options), image_size=image_size)
    rows = []
    for i in range(n):
        sample = make_sample(task, i, seed=seed)
        assert sample.choices == list(options), f"options {options} must be the first colours of the shapes task"
        rows.append({
            "qid": f"{split}-{i:05d}",
            "picture": {"bytes": image_to_png_bytes(sample.images[0]), "path": None},
            "query": QUESTION,
            "options": list(options),
            "gold": chr(ord("A") + sample.choices.index(sample.answer)),
        })
    return rows


def write_splits(folder: str | Path, make_rows, *, train_rows: int, test_rows: int, seed: int) -> Path:
    """Both splits in the hub layout under `folder` (data/train-... and data/test-...parquet),
    `make_rows(n, seed=, split=)` giving each split's rows; the test split's seed is offset, so
    no picture repeats. Returns `folder`."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    if train_rows < 1 or test_rows < 1:
        raise ValueError(f"train_rows and test_rows must be at least 1; got {train_rows} and {test_rows}")
    folder = Path(folder)
    (folder / "data").mkdir(parents=True, exist_ok=True)
    for split, n, split_seed in (("train", train_rows, seed), ("test", test_rows, seed + _TEST_SEED_OFFSET)):
        table = pa.Table.from_pylist(make_rows(n, seed=split_seed, split=split))
        pq.write_table(table, folder / "data" / f"{split}-00000-of-00001.parquet")
    return folder


def write_color_choices(folder: str | Path, *, train_rows: int = 512, test_rows: int = 128, seed: int = 0,
                        image_size: int = 64) -> Path:
    """Write the data set (both splits) under `folder`; returns `folder`."""
    def rows(n: int, *, seed: int, split: str) -> list[dict]:
        return color_choice_rows(n, seed=seed, split=split, image_size=image_size)

    return write_splits(folder, rows, train_rows=train_rows, test_rows=test_rows, seed=seed)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(
        prog="python -m saccade.data.choices_example",
        description="Write a four-option multiple-choice data set (the colour of a big shape; columns qid, picture, "
        "query, options, gold) to run `saccade demo --task.kind dataset` on (docs/demo.md).")
    parser.add_argument("folder", help="where to write it (data/train-*.parquet, data/test-*.parquet)")
    parser.add_argument("--train-rows", type=int, default=512)
    parser.add_argument("--test-rows", type=int, default=128)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)
    folder = write_color_choices(args.folder, train_rows=args.train_rows, test_rows=args.test_rows, seed=args.seed)
    print(f"wrote {folder}/data/train-00000-of-00001.parquet ({args.train_rows} rows) and "
          f"test-00000-of-00001.parquet ({args.test_rows} rows). Run the demo on it:\n"
          f"  saccade demo --task.kind dataset --task.dataset {folder} --task.columns '{COLUMNS_JSON}'")


if __name__ == "__main__":
    main()
