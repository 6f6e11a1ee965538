"""Video-R1-260k's clip rows as JSONL that `task.format = "columns"` reads, for the recipe
configs/recipes/video-r1-qwen2.5vl-7b-8gpu.toml.

Video-R1-260k.json (the hub data set Video-R1/Video-R1-data, its RL rows) is one JSON array whose
`path` is an image or a clip by `data_type`, whose gold `solution` is wrapped in
<answer>...</answer>, and whose prompt tulerfeng/Video-R1's src/r1-v/src/open_r1/grpo.py builds at
load time (`make_conversation_image_and_video`: the problem, its options for a multiple-choice row,
its question template and the answer-format sentence of the row's problem type). This writes each
clip row as that prompt text (`question`), the gold without its tags (`answer`), the clip's path
as it is, relative to the data set's folder (`video`), no images (`image`: []), its problem type
(`category`) and id. Image rows are left out: saccade's columns format reads a clip from every
row when `task.columns.videos` is named. Video-R1-260k has no held-out split: the last
`HELD_OUT` clip rows go to a second file instead of the first (the recipe's task.eval_dataset).

    python scripts/video_r1_rows.py Video-R1-data/Video-R1-260k.json

writes video-r1-clips.jsonl and video-r1-clips-eval.jsonl beside the JSON, in the data set's
folder: the clips' paths are relative to it.
"""

from __future__ import annotations

import json
import re
import sys
from pathlib import Path

# grpo.py's QUESTION_TEMPLATE and TYPE_TEMPLATE, word for word.
QUESTION_TEMPLATE = (
    "{Question}\n"
    "Please think about this question as if you were a human pondering deeply. "
    "Engage in an internal dialogue using expressions such as 'let me think', 'wait', 'Hmm', 'oh, I see', "
    "'let's break it down', etc, or other natural language thought expressions "
    "It's encouraged to include self-reflection or verification in the reasoning process. "
    "Provide your detailed reasoning between the <think> </think> tags, and then give your final answer between "
    "the <answer> </answer> tags."
)
TYPE_TEMPLATE = {
    "multiple choice": " Please provide only the single option letter (e.g., A, B, C, D, etc.) within the "
    "<answer> </answer> tags.",
    "numerical": " Please provide the numerical value (e.g., 42 or 3.14) within the <answer> </answer> tags.",
    "OCR": " Please transcribe text from the image/video clearly and provide your text answer within the "
    "<answer> </answer> tags.",
    "free-form": " Please provide your text answer within the <answer> </answer> tags.",
    "regression": " Please provide the numerical value (e.g., 42 or 3.14) within the <answer> </answer> tags.",
}
HELD_OUT = 256
_ANSWER = re.compile(r"<answer>\s*(.*?)\s*</answer>", re.DOTALL)


def clip_row(example: dict) -> dict | None:
    """One Video-R1 row as a `columns` row, or None for an image row."""
    if example["data_type"] != "video":
        return None
    question = example["problem"]
    if example["problem_type"] == "multiple choice":
        question += "Options:\n" + "".join(option + "\n" for option in example["options"])
    gold = _ANSWER.search(example["solution"])
    return {
        "id": str(example["problem_id"]),
        "question": QUESTION_TEMPLATE.format(Question=question) + TYPE_TEMPLATE[example["problem_type"]],
        "answer": gold.group(1) if gold else example["solution"].strip(),
        "video": example["path"],
        "image": [],
        "category": example["problem_type"],
    }


def convert(source: Path, held_out: int = HELD_OUT) -> tuple[Path, Path, int, int]:
    """Write the clip rows of `source` (Video-R1-260k.json) beside it: video-r1-clips.jsonl (training)
    and video-r1-clips-eval.jsonl (the last `held_out`). Returns both paths and their row counts."""
    rows = [row for row in map(clip_row, json.loads(source.read_text())) if row is not None]
    if len(rows) <= held_out:
        raise ValueError(f"{source}: {len(rows)} clip rows, not more than the {held_out} to hold out")
    train, held = rows[:-held_out], rows[-held_out:]
    paths = source.parent / "video-r1-clips.jsonl", source.parent / "video-r1-clips-eval.jsonl"
    for path, part in zip(paths, (train, held), strict=True):
        path.write_text("".join(json.dumps(row) + "\n" for row in part))
    return *paths, len(train), len(held)


if __name__ == "__main__":
    if len(sys.argv) != 2:
        raise SystemExit("usage: python scripts/video_r1_rows.py Video-R1-data/Video-R1-260k.json")
    train, held, n_train, n_held = convert(Path(sys.argv[1]))
    print(f"{n_train:,} clip rows to {train}, {n_held:,} held out to {held}")
