"""Format ``columns``: one's own data set, read through `task.columns` (docs/data.md).

`task.columns` (`ColumnsConfig`) names which column holds the prompt, the answer, the images,
and optionally the options, the rows' ids, a category and a clip (`videos`: a video file under
the data set's folder, or a list of frames; decoded when the prompt is tokenized, with the
model's video sampling, and refused then like a broken image). The user turn is
`task.prompt_template` over the prompt column and the options, after `task.system_prompt` when
set. A column the mapping names and the split lacks is refused when the split opens, naming
the `task.columns` key to change and the columns there are.
"""

from __future__ import annotations

from typing import Any

from saccade.config import DEFAULT_PROMPT_TEMPLATE
from saccade.data.questions import VQASample
from saccade.data.row_formats import parts
from saccade.data.row_formats.base import RowContext, RowFormat, RowLayout
from saccade.data.rows import RowSkipped


class Columns(RowFormat):
    name = "columns"
    layout = "the columns task.columns names"
    writes_prompt = True
    prompt_template = DEFAULT_PROMPT_TEMPLATE

    def check_columns(self, names: list[str], *, where: str, layout: RowLayout | None) -> None:
        columns = _layout(layout).read_columns()
        missing_keys = [key for key, name in columns.items() if name not in names]
        if missing_keys:
            named = ", ".join(f"task.columns.{key} = {columns[key]!r}" for key in missing_keys)
            raise ValueError(
                f"{where} has no column for {named}; its columns are {', '.join(names)}. Set "
                f"task.columns.{missing_keys[0]} (and the others named) to one of those"
            )

    def sample_id(self, row: dict[str, Any], at: RowContext) -> str:
        column = _layout(at.layout).columns.id
        if column is not None and row[column] is not None:
            return str(row[column])  # the data set's own ids, the ones its owner knows
        return at.sample_id

    def read(self, row: dict[str, Any], at: RowContext) -> VQASample:
        """The prompt column written into the layout's template, its images at its
        ``<image>`` placeholders (none: first), multiple choice when the row has options, else a
        free-form answer.

        A row whose image is None is refused (``missing_image``); an empty list is a row without
        images. The metadata holds the data set, the row's id and category when they are mapped."""
        layout = _layout(at.layout)
        c = layout.columns
        answer = parts.answer(row[c.answer], column=c.answer)
        value = row[c.images]
        if value is None:
            raise RowSkipped("missing_image", f"{c.images} is None")
        videos = parts.videos(row[c.videos], sample_id=at.sample_id, column=c.videos, base=at.base,
                              root=at.root) if c.videos else []
        values = [parts.with_base(v, at.base) for v in (value if isinstance(value, list) else [value])]
        choices = _choices(row[c.choices], column=c.choices) if c.choices else None
        template = layout.prompt_template if layout.prompt_template is not None else self.prompt_template
        text = template.format(prompt=str(row[c.prompt] or ""), choices=parts.format_choices(choices)).strip()
        messages = [{"role": "user", "content": text}]
        if layout.system_prompt:
            messages.insert(0, {"role": "system", "content": layout.system_prompt})
        metadata: dict[str, Any] = {"dataset": at.dataset}
        if c.id is not None:
            metadata["id"] = None if row[c.id] is None else str(row[c.id])
        if c.category is not None:
            category = row[c.category]
            metadata["category"] = [str(v) for v in category] if isinstance(category, list) else category
        return VQASample(
            sample_id=at.sample_id,
            images=at.images(values, c.images),
            question=parts.user_text([messages[-1]]),
            answer=answer,
            choices=choices,
            answer_type="multi_choice" if choices else "free_form",
            metadata=metadata,
            prompt=messages,
            videos=videos,
        )


def _layout(layout: RowLayout | None) -> RowLayout:
    if layout is None:
        raise ValueError("format 'columns' reads one's own data set through its task.columns: it needs a RowLayout")
    return layout


def _choices(value: Any, *, column: str) -> list[str] | None:
    if value is None or (isinstance(value, list) and not value):
        return None  # a row without options: a free-form answer
    if not isinstance(value, list):
        raise ValueError(f"task.columns.choices = {column!r} must name a list column of options; a row holds "
                         f"{type(value).__name__} {value!r:.80}")
    return [str(v) for v in value]
