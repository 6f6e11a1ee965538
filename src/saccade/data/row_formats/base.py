"""What a row format is: one layout of data set rows, and how a row of it becomes a question.

A format knows a layout, not a data set: the columns every row has (checked when a split
opens, before a row is read), the id a row goes by, and how a row becomes a `VQASample`. Many
data sets share a layout, and each data set is read by one format: a known one by its entry in
`saccade.data.known_datasets`, one's own by `task.format` (default ``columns``: read through
`task.columns`). `saccade.data.row_formats.ROW_FORMATS` lists the formats by name.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, ClassVar

from PIL import Image

from saccade.config import ColumnsConfig, ImagesConfig
from saccade.data.questions import VQASample
from saccade.data.row_formats import parts

__all__ = ["RowContext", "RowFormat", "RowLayout"]


@dataclass(frozen=True)
class RowLayout:
    """How the rows of one's own data set are read (task 'dataset'): their format, which column
    holds what (`task.columns`, read by format 'columns'), the user turn's template and the
    system turn (`task.*`), and where image files may be read from."""

    columns: ColumnsConfig
    prompt_template: str | None = None  # task.prompt_template; None: the format's own (`RowFormat.prompt_template`)
    system_prompt: str | None = None
    image_root: str | None = None  # task.image_root: where image files may be read from besides the data's folder
    format: str = "columns"  # task.format: a name in ROW_FORMATS

    def read_columns(self) -> dict[str, str]:
        """{task.columns key: column name} of every column the rows are read from."""
        return {key: name for key, name in self.columns.model_dump().items() if name is not None}


@dataclass(frozen=True)
class RowContext:
    """What a format's reader knows of a row besides its values."""

    task: str  # the task's kind ('openmmreasoner', ..., 'dataset'): the start of the rows' default ids
    dataset: str  # the data set's name in each question's metadata
    sample_id: str  # the row's id, as the format's `sample_id` made it
    subset: str | None = None  # the config the row is from (None: the default config, or a file)
    limits: ImagesConfig = field(default_factory=ImagesConfig)
    base: Path | None = None  # where relative image paths are read from (None: the working folder)
    root: Path | None = None  # image files only from below here (None: no local file at all)
    layout: RowLayout | None = None  # task 'dataset': how its rows are read

    def images(self, values: Any, column: str) -> list[Image.Image]:
        """The row's images from `column`'s `values`, each checked and decoded (`parts.images`)."""
        return parts.images(values, sample_id=self.sample_id, column=column, limits=self.limits, root=self.root)


class RowFormat:
    """One layout of rows. A format sets `name`, `columns` and `layout` and writes `read`;
    `saccade.data.row_formats.ROW_FORMATS` holds one of each, by name."""

    name: ClassVar[str]
    columns: ClassVar[tuple[str, ...]] = ()  # every row's columns: a split without one is refused
    layout: ClassVar[str] = ""  # the row's columns in words, for that refusal
    # True: `read` writes the user turn from the task's template and system prompt itself;
    # False: the task puts them on the row's chat afterwards (`parts.with_prompt_parts`).
    writes_prompt: ClassVar[bool] = False
    # The user turn's template when task.prompt_template is unset.
    prompt_template: ClassVar[str] = "{prompt}"

    def check_columns(self, names: list[str], *, where: str, layout: RowLayout | None) -> None:
        """Refuse a split (`where`: '<task>: <source> (<config>/<split>)') whose `names` lack a column."""
        missing = [c for c in self.columns if c not in names]
        if missing:
            raise ValueError(f"{where} has no column {', '.join(missing)}; expected the layout {self.layout}")

    def sample_id(self, row: dict[str, Any], at: RowContext) -> str:
        """The id the row goes by, in its question and in a refusal; `at.sample_id` is the
        default, '<task>-[<config>-]<split>-<index>'."""
        return at.sample_id

    def read(self, row: dict[str, Any], at: RowContext) -> VQASample:
        """The row as a question. A row that cannot be used raises `RowSkipped` (no answer, a
        missing image, ...) or an `ImageError` (the caller names its reason and place)."""
        raise NotImplementedError
