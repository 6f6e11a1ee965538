"""Video-R1-260k's RL rows split for configs/recipes/video-r1-qwen2.5vl-7b-8gpu.toml: rows as
published, image rows and clip rows alike (`task.format = "video_r1"` reads them:
saccade.data.row_formats.video_r1, which builds the prompt tulerfeng/Video-R1's grpo.py builds).

Video-R1-260k.json (the hub data set Video-R1/Video-R1-data) is one JSON array and has no
held-out split: this writes its rows, unchanged, as JSONL beside it, the last `HELD_OUT` clip rows
to video-r1-eval.jsonl (the recipe's task.eval_dataset: evaluated on clips, as Video-R1 is) and
every other row, pictures and clips in their order, to video-r1-train.jsonl.

    python scripts/video_r1_rows.py Video-R1-data/Video-R1-260k.json

The rows' paths stay relative to the data set's folder, where both files are written.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

HELD_OUT = 256


def convert(source: Path, held_out: int = HELD_OUT) -> tuple[Path, Path, int, int]:
    """Write the rows of `source` (Video-R1-260k.json) beside it as they are: video-r1-eval.jsonl (its
    last `held_out` clip rows) and video-r1-train.jsonl (every other row). Returns both paths and
    their row counts."""
    rows = json.loads(source.read_text())
    clips = [i for i, row in enumerate(rows) if row.get("data_type") == "video"]
    if len(clips) <= held_out:
        raise ValueError(f"{source}: {len(clips)} clip rows, not more than the {held_out} to hold out")
    held_set = set(clips[-held_out:])
    train = [row for i, row in enumerate(rows) if i not in held_set]
    held = [rows[i] for i in sorted(held_set)]
    paths = source.parent / "video-r1-train.jsonl", source.parent / "video-r1-eval.jsonl"
    for path, part in zip(paths, (train, held), strict=True):
        path.write_text("".join(json.dumps(row) + "\n" for row in part))
    return *paths, len(train), len(held)


if __name__ == "__main__":
    if len(sys.argv) != 2:
        raise SystemExit("usage: python scripts/video_r1_rows.py Video-R1-data/Video-R1-260k.json")
    train, held, n_train, n_held = convert(Path(sys.argv[1]))
    print(f"{n_train:,} rows (pictures and clips) to {train}, {n_held:,} clip rows held out to {held}")
