"""Row formats: how a data set's rows become questions, one layout a file, by name.

| format | a row holds | read by (`task.kind`) |
|---|---|---|
| ``verl`` (verl.py) | a chat with ``<image>`` placeholders, images, reward_model.ground_truth | openmmreasoner |
| ``mathvista`` (mathvista.py) | MathVista's pid, query, decoded_image, choices, precision, answer_type | mathvista |
| ``problem_answer`` (problem_answer.py) | images, a problem with ``<image>``, a free-form answer | geometry3k |
| ``video_r1`` (video_r1.py) | Video-R1-260k's rows: a picture or a clip by data_type, its problem type's prompt | dataset (`task.format`) |
| ``columns`` (columns.py) | whatever `task.columns` names | dataset (the default `task.format`) |

A known data set names its format in `saccade.data.known_datasets.KNOWN_DATASETS`; one's own
names it in `task.format`. A new layout is one new file here (a `RowFormat` subclass: its
name, its columns, `read`) and its entry in `ROW_FORMATS`; `saccade.data.datasets` opens the
splits and asks the format for each row.
"""

from __future__ import annotations

from saccade.data.row_formats.base import RowContext, RowFormat, RowLayout
from saccade.data.row_formats.columns import Columns
from saccade.data.row_formats.mathvista import MathVista
from saccade.data.row_formats.problem_answer import ProblemAnswer
from saccade.data.row_formats.verl import Verl
from saccade.data.row_formats.video_r1 import VideoR1

__all__ = ["ROW_FORMATS", "RowContext", "RowFormat", "RowLayout", "row_format"]

ROW_FORMATS: dict[str, RowFormat] = {f.name: f for f in (Verl(), MathVista(), ProblemAnswer(), VideoR1(), Columns())}


def row_format(name: str) -> RowFormat:
    """The format called `name`; a ValueError naming the known ones otherwise."""
    found = ROW_FORMATS.get(name)
    if found is None:
        raise ValueError(f"unknown row format {name!r}; the known ones are {', '.join(ROW_FORMATS)} "
                         "(saccade.data.row_formats: a new layout is a new file there)")
    return found
