"""Format ``video_r1``: Video-R1-260k's rows as published (the hub data set Video-R1/Video-R1-data,
its RL file; tulerfeng/Video-R1): ``problem_id``, ``problem``, ``data_type`` ("image" or "video":
what ``path`` holds, relative to the data set's folder), ``problem_type``, ``options``,
``solution`` (the gold inside ``<answer>...</answer>``), ``path``.

Image rows and clip rows are read alike, as Video-R1 trains on both: the picture or the clip
goes first in the user turn, and the text is the prompt its training code builds at load time
(src/r1-v/src/open_r1/grpo.py, `make_conversation_image_and_video`): the problem, its options
on a multiple-choice row, the question template and the answer sentence of the row's problem
type, word for word. The gold is the solution without its tags; the problem type is the row's
category (`saccade eval` reports accuracy per type). A row whose data_type is neither is skipped
as `missing_image`; a problem type Video-R1 does not have stops the run (the file is in another
layout).
"""

from __future__ import annotations

import re
from typing import Any

from saccade.data.questions import VQASample
from saccade.data.row_formats import parts
from saccade.data.row_formats.base import RowContext, RowFormat
from saccade.data.rows import RowSkipped

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
_ANSWER = re.compile(r"<answer>\s*(.*?)\s*</answer>", re.DOTALL)


def prompt_text(problem: str, problem_type: str, options: list[str] | None) -> str:
    """grpo.py's prompt text for one row."""
    question = problem
    if problem_type == "multiple choice":
        question += "Options:\n" + "".join(option + "\n" for option in options or [])
    return QUESTION_TEMPLATE.format(Question=question) + TYPE_TEMPLATE[problem_type]


def gold(solution: str) -> str:
    """The solution's answer without its tags (the whole solution, stripped, when it has none)."""
    found = _ANSWER.search(solution)
    return found.group(1) if found else solution.strip()


class VideoR1(RowFormat):
    name = "video_r1"
    columns = ("problem_id", "problem", "data_type", "problem_type", "options", "solution", "path")
    layout = ("problem_id, problem, data_type ('image' or 'video'), problem_type, options, solution "
              "(<answer>...</answer>), path (the picture or clip, relative to the data set's folder)")
    writes_prompt = True

    def sample_id(self, row: dict[str, Any], at: RowContext) -> str:
        return at.sample_id if row["problem_id"] is None else str(row["problem_id"])

    def read(self, row: dict[str, Any], at: RowContext) -> VQASample:
        """grpo.py's prompt; the row's picture or clip first; the gold without its tags."""
        kind, problem_type = row["data_type"], row["problem_type"]
        if kind not in ("image", "video"):  # then `path` is neither a picture nor a clip of the row's
            raise RowSkipped("missing_image", f"data_type {str(kind)[:20]!r} is neither 'image' nor 'video'")
        if problem_type not in TYPE_TEMPLATE:  # not Video-R1's layout: a wrong format, not a broken row
            raise ValueError(f"row {at.sample_id}: problem_type {str(problem_type)[:30]!r} is none of Video-R1's "
                             f"({', '.join(TYPE_TEMPLATE)}); is task.format = 'video_r1' the layout of this data set?")
        if row["path"] is None:
            raise RowSkipped("missing_image", "path (the row's picture or clip) is None")
        text = prompt_text(str(row["problem"] or ""), problem_type, row["options"])
        messages = [{"role": "user", "content": text}]
        if at.layout is not None and at.layout.system_prompt:  # Video-R1 has none; one's own is kept
            messages.insert(0, {"role": "system", "content": at.layout.system_prompt})
        images, videos = [], []
        if kind == "image":
            images = at.images([parts.with_base(row["path"], at.base)], "path")
        else:
            videos = parts.videos(row["path"], sample_id=at.sample_id, column="path", base=at.base, root=at.root)
        return VQASample(
            sample_id=at.sample_id,
            images=images,
            question=parts.user_text(messages),
            answer=gold(str(row["solution"] or "")),
            choices=None,
            answer_type="free_form",
            metadata={"dataset": at.dataset, "id": str(row["problem_id"]), "category": problem_type},
            prompt=messages,
            videos=videos,
        )
