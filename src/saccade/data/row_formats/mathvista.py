"""Format ``mathvista``: MathVista's fields (AI4Math/MathVista).

``query`` is the ready prompt (the image goes first: it has no placeholder), ``decoded_image``
the image; ``question_type`` multi_choice takes its gold from ``choices`` by text, else
``answer_type`` (integer, float with ``precision``, list, text) says how the answer is compared.
A row goes by its own ``pid``: '<task>-<pid>', the ids MathVista's results use.
"""

from __future__ import annotations

from typing import Any

from saccade.data.questions import VQASample
from saccade.data.row_formats import parts
from saccade.data.row_formats.base import RowContext, RowFormat
from saccade.data.rows import RowSkipped


class MathVista(RowFormat):
    name = "mathvista"
    columns = ("pid", "question", "decoded_image", "choices", "precision", "answer", "question_type", "answer_type",
               "metadata", "query")
    layout = ("pid, question, decoded_image (image), choices (list or null), unit, precision, answer, "
              "question_type, answer_type, metadata (struct), query")

    def sample_id(self, row: dict[str, Any], at: RowContext) -> str:
        return f"{at.task}-{row.get('pid')}"  # MathVista's own ids, the ones its results use

    def read(self, row: dict[str, Any], at: RowContext) -> VQASample:
        """The ready ``query`` after the image; gold is a choice's text for multiple choice,
        else typed (integer / float with precision / list / text)."""
        answer = parts.answer(row["answer"], column="answer")
        if row["decoded_image"] is None:  # every MathVista question is about its image
            raise RowSkipped("missing_image", "decoded_image is None")
        multi_choice = row["question_type"] == "multi_choice"
        precision = row.get("precision")
        float_answer = row["answer_type"] == "float" and precision is not None and precision == precision  # not NaN
        meta = dict(row["metadata"] or {})
        return VQASample(
            sample_id=at.sample_id,
            images=at.images(row["decoded_image"], "decoded_image"),
            question=row["question"],
            answer=answer,
            choices=list(row["choices"]) if multi_choice and row["choices"] else None,
            answer_type="multi_choice" if multi_choice else str(row["answer_type"]),
            # MathVista's own category fields (task, skills, grade, ...) keep their names.
            metadata={"dataset": at.dataset, "pid": str(row["pid"]), "question_type": row["question_type"],
                      "unit": row.get("unit"), **meta},
            precision=int(precision) if float_answer else None,
            prompt=[{"role": "user", "content": row["query"]}],
        )
