"""Format ``problem_answer``: a figure problem with a free-form answer, Geometry3K's layout
(hiyouga/geometry3k): ``images`` (a list), ``problem`` (text with an ``<image>`` placeholder
where the figure goes), ``answer``."""

from __future__ import annotations

from typing import Any

from saccade.data.questions import VQASample
from saccade.data.row_formats import parts
from saccade.data.row_formats.base import RowContext, RowFormat


class ProblemAnswer(RowFormat):
    name = "problem_answer"
    columns = ("images", "problem", "answer")
    layout = "images (list of images), problem (text with <image>), answer"

    def read(self, row: dict[str, Any], at: RowContext) -> VQASample:
        """The problem with its figure at the ``<image>`` placeholder; a free-form answer."""
        messages = [{"role": "user", "content": str(row["problem"])}]
        answer = parts.answer(row["answer"], column="answer")
        return VQASample(
            sample_id=at.sample_id,
            images=at.images(row["images"], "images"),
            question=parts.user_text(messages),
            answer=answer,
            choices=None,
            answer_type="free_form",
            metadata={"dataset": at.dataset},
            prompt=messages,
        )
