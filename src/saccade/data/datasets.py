"""Real VQA data sets, read through Hugging Face `datasets` and mapped onto `VQASample`.

Three layouts are known, each from a hub id or a local copy:

* ``openmmreasoner``: OpenMMReasoner-RL-74K, the RL training set. One config per source
  (algopuzzle, mmk12, thinklite_vl_hard, tqa_train, virl39k, wemath_pro, wemath_standard:
  72,971 rows in ``train`` splits) and a ``validation`` config whose split is ``val``
  (1,724 rows). The common RL parquet layout: ``prompt`` (chat messages whose string
  contents hold ``<image>`` placeholders), ``images``, ``data_source``,
  ``reward_model.ground_truth``, ``avg_reward`` (train only), ``extra_info``.
  Multiple-choice ground truths are letters; the options are only in the prompt text, so
  they are parsed out of it (:func:`parse_options`) for the reward to read option text.
* ``mathvista``: AI4Math/MathVista ``testmini`` (1,000 rows): ``query`` is the ready prompt,
  ``decoded_image`` the image, ``choices``/``precision``/``answer_type`` drive the scoring.
* ``geometry3k``: hiyouga/geometry3k (train 2,101 / validation 300 / test 601):
  ``images``, ``problem`` with an ``<image>`` placeholder, ``answer``.

And any other: ``dataset``, whose columns `task.columns` names (`ColumnsConfig`: prompt,
answer, images, and optionally choices, id, category), its user turn written by
``task.prompt_template`` after an optional ``task.system_prompt`` (:func:`any_sample`).

A source is a hub id, a local folder laid out like the hub repository (a README.md whose
``configs`` name each config's files, or the default ``data/<split>-*.parquet`` / ``.jsonl``),
or one parquet or JSONL file or glob (then the whole file is the one split, and configs do
not apply). Image paths in the rows are read relative to the data file's folder (a folder
source: relative to the folder), and only from below it, or below ``task.image_root`` when set
(symlinks resolved): a row naming any other file (``/etc/passwd``, ``../../secret.png``), or
any file at all in a hub data set, is skipped as ``image_outside_dataset`` and counted.

Nothing is decoded up front: `datasets` keeps the rows memory-mapped (Arrow), rows are
read one at a time in Arrow form and their images decoded only then, by
`saccade.data.images.load_image`. A row that cannot be used (a missing or undecodable image,
placeholders and images that differ in number, no answer) raises `RowSkipped` naming its
reason and place: the RL loop skips it and lists it (`saccade.data.rows`).
"""

from __future__ import annotations

import functools
import re
from bisect import bisect_right
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
from PIL import Image

from saccade.config import DEFAULT_PROMPT_TEMPLATE, ColumnsConfig, ImagesConfig
from saccade.data.dataset_cache import cache_options
from saccade.data.image_paths import check_image_location
from saccade.data.images import ImageError, MissingImageError, blank_like, load_image
from saccade.data.rows import (
    DATASET_TASKS, EvalRows, RowSkipped, check_image_count, image_error_reason, usable_rows,
)
from saccade.data.questions import IMAGE_PLACEHOLDER, VQASample

__all__ = [
    "DatasetRows",
    "DatasetTask",
    "EVAL_DEFAULTS",
    "HUB_IDS",
    "OPENMMREASONER_TRAIN_SUBSETS",
    "REQUIRED_COLUMNS",
    "RowLayout",
    "any_sample",
    "format_choices",
    "geometry3k_sample",
    "held_out_split",
    "image_base",
    "load_split",
    "mathvista_sample",
    "openmmreasoner_sample",
    "parse_options",
    "shuffled_index",
    "with_prompt_parts",
]

HUB_IDS = {
    "openmmreasoner": "OpenMMReasoner/OpenMMReasoner-RL-74K",
    "mathvista": "AI4Math/MathVista",
    "geometry3k": "hiyouga/geometry3k",
}
OPENMMREASONER_TRAIN_SUBSETS = (
    "algopuzzle", "mmk12", "thinklite_vl_hard", "tqa_train", "virl39k", "wemath_pro", "wemath_standard",
)
# Where each task trains and evaluates by default: (subsets, split); None subsets: the default config.
TRAIN_DEFAULTS: dict[str, tuple[tuple[str, ...] | None, str]] = {
    "openmmreasoner": (OPENMMREASONER_TRAIN_SUBSETS, "train"),
    "mathvista": (None, "testmini"),
    "geometry3k": (None, "train"),
}
EVAL_DEFAULTS: dict[str, tuple[tuple[str, ...] | None, str]] = {
    "openmmreasoner": (("validation",), "val"),
    "mathvista": (None, "testmini"),
    "geometry3k": (None, "test"),
}
REQUIRED_COLUMNS: dict[str, tuple[str, ...]] = {
    "openmmreasoner": ("prompt", "images", "reward_model"),
    "mathvista": ("pid", "question", "decoded_image", "choices", "precision", "answer", "question_type",
                  "answer_type", "metadata", "query"),
    "geometry3k": ("images", "problem", "answer"),
}
LAYOUTS = {
    "openmmreasoner": "prompt (list of {role, content} with <image> placeholders), images (list of images), "
                      "data_source, reward_model ({ground_truth, style}), extra_info",
    "mathvista": "pid, question, decoded_image (image), choices (list or null), unit, precision, answer, "
                 "question_type, answer_type, metadata (struct), query",
    "geometry3k": "images (list of images), problem (text with <image>), answer",
}


# ------------------------------------------------------------------------ loading


FILE_BUILDERS = {".parquet": "parquet", ".jsonl": "json", ".json": "json"}  # each bare file's `datasets` builder


def _file_builder(source: str) -> str | None:
    """The builder of a bare data file or glob (parquet, JSONL); None for a hub id or folder."""
    for suffix, builder in FILE_BUILDERS.items():
        if source.endswith(suffix) and (Path(source).is_file() or "*" in source):
            return builder
    return None


def _is_file_source(source: str) -> bool:
    """A bare data file or glob: no configs, no split names of its own."""
    return _file_builder(source) is not None


def load_split(source: str, *, subset: str | None, split: str, task: str,
               columns: dict[str, str] | None = None):
    """One split of one config as a memory-mapped `datasets.Dataset`, with clear errors.

    `columns`: for task 'dataset', {task.columns key: column name} of the columns it reads;
    one the split lacks is refused here, when the split opens, before a row is read."""
    import datasets

    builder, cache = _file_builder(source), cache_options(source)  # a local source: its own cache entry
    if builder is not None:  # a bare file has no configs or split names of its own: it is the split asked for
        table = datasets.load_dataset(builder, data_files={split: source}, split=split, **cache)
    else:
        if not Path(source).exists() and source.startswith((".", "/", "~")):
            raise ValueError(f"{task}: dataset path {source} does not exist; set task.dataset to a hub id or a path")
        configs = datasets.get_dataset_config_names(source)
        if subset is not None and subset not in configs:
            raise ValueError(
                f"{task}: {source} has no config {subset!r}; it has {', '.join(configs)}. "
                "Set task.subsets (or task.eval_subsets) to some of those"
            )
        splits = datasets.get_dataset_split_names(source, config_name=subset, **cache)
        if split not in splits:
            where = f"config {subset!r} of {source}" if subset else source
            raise ValueError(
                f"{task}: {where} has no split {split!r}; it has {', '.join(splits)}. "
                "Set task.split (or task.eval_split) to one of those"
            )
        table = datasets.load_dataset(source, name=subset, split=split, **cache)
    if columns is not None:
        missing_keys = [key for key, name in columns.items() if name not in table.column_names]
        if missing_keys:
            named = ", ".join(f"task.columns.{key} = {columns[key]!r}" for key in missing_keys)
            raise ValueError(
                f"{task}: {source} ({subset or 'default'}/{split}) has no column for {named}; its columns are "
                f"{', '.join(table.column_names)}. Set task.columns.{missing_keys[0]} (and the others named) "
                "to one of those"
            )
        return table.with_format("arrow")
    missing = [c for c in REQUIRED_COLUMNS[task] if c not in table.column_names]
    if missing:
        raise ValueError(
            f"{task}: {source} ({subset or 'default'}/{split}) has no column {', '.join(missing)}; "
            f"expected the layout {LAYOUTS[task]}"
        )
    # Rows come back as Arrow: nothing (images above all) is decoded before it is asked for.
    return table.with_format("arrow")


class DatasetRows:
    """Indexed, lazy access to the rows of one split across one or more configs."""

    def __init__(self, task: str, source: str, *, subsets: tuple[str, ...] | None, split: str,
                 limits: ImagesConfig | None = None, layout: RowLayout | None = None) -> None:
        if task not in DATASET_TASKS:
            raise ValueError(f"unknown dataset task {task!r}; choose from {', '.join(DATASET_TASKS)}")
        if (task == "dataset") != (layout is not None):
            raise ValueError("a RowLayout goes with task 'dataset', and only with it")
        self.task, self.source, self.split = task, source, split
        self.limits = limits or ImagesConfig()
        self.layout = layout
        columns = layout.read_columns() if layout is not None else None
        names: list[str | None] = list(subsets) if subsets and not _is_file_source(source) else [None]
        self.parts = [(name, load_split(source, subset=name, split=split, task=task, columns=columns))
                      for name in names]
        self.starts = np.cumsum([0] + [len(t) for _, t in self.parts]).tolist()
        self.base = image_base(source)
        # Where the rows' image files may be: task.image_root, else the data's own folder (a hub
        # id has none: its rows may name no local file).
        configured = layout.image_root if layout is not None else None
        self.image_root = Path(configured).expanduser() if configured else self.base

    def __len__(self) -> int:
        return self.starts[-1]

    def row(self, index: int) -> tuple[str | None, int, dict[str, Any]]:
        """(config, index within it, the row as plain Python values; images still encoded)."""
        if not 0 <= index < len(self):
            raise IndexError(f"row {index} out of range for {len(self)} rows")
        part = bisect_right(self.starts, index) - 1
        name, table = self.parts[part]
        local = index - self.starts[part]
        return name, local, table[local].to_pylist()[0]

    def sample(self, index: int) -> VQASample:
        """Row `index` as a question. A row that cannot be used raises `RowSkipped` saying
        why (saccade.data.rows: a missing or undecodable image, no answer, ...) and where."""
        subset, local, row = self.row(index)
        tag = f"{subset}-" if subset else ""
        sample_id = f"{self.task}-{tag}{self.split}-{local}"
        if self.layout is not None and self.layout.columns.id is not None and row[self.layout.columns.id] is not None:
            sample_id = str(row[self.layout.columns.id])  # the data set's own ids, the ones its owner knows
        place = {"split": self.split, "config": subset, "index": local}
        try:
            if self.layout is not None:
                sample = any_sample(row, sample_id=sample_id, layout=self.layout, dataset=self.source,
                                    base=self.base, limits=self.limits, root=self.image_root)
            elif self.task == "openmmreasoner":
                sample = openmmreasoner_sample(row, sample_id=sample_id, subset=subset, limits=self.limits,
                                               root=self.image_root)
            elif self.task == "mathvista":
                sample = mathvista_sample(row, sample_id=sample_id, limits=self.limits, root=self.image_root)
            else:
                sample = geometry3k_sample(row, sample_id=sample_id, limits=self.limits, root=self.image_root)
            check_image_count(sample)
        except RowSkipped as err:
            raise err.at(row_id=_row_id(self.task, row, sample_id), **place) from None
        except ImageError as err:
            raise RowSkipped(image_error_reason(err), str(err)).at(
                row_id=_row_id(self.task, row, sample_id), **place) from err
        sample.origin = place
        return sample


def _row_id(task: str, row: dict[str, Any], sample_id: str) -> str:
    # MathVista's rows go by their own ids (mathvista_sample names them so).
    return f"mathvista-{row.get('pid')}" if task == "mathvista" else sample_id


# ------------------------------------------------------------------ rows -> samples


def _images(values: Any, *, sample_id: str, column: str, limits: ImagesConfig,
            root: Path | None = None) -> list[Image.Image]:
    """The row's images; a file outside `root` (any file when None) is refused first
    (`check_image_location`)."""
    if values is None:
        return []
    if not isinstance(values, list):
        values = [values]
    out = []
    for i, value in enumerate(values):
        if value is None:
            raise MissingImageError(f"{column}[{i}] is None", sample=f"{sample_id} ({column}[{i}])")
        check_image_location(value, root, f"{column}[{i}]")
        # load_image's errors say what is wrong; this names the row and the column.
        out.append(load_image(value, limits=limits, sample=f"{sample_id} ({column}[{i}])"))
    return out


def _chat(prompt: Any, *, sample_id: str) -> list[dict[str, str]]:
    if isinstance(prompt, str):
        return [{"role": "user", "content": prompt}]
    if not isinstance(prompt, list) or not all(isinstance(m, dict) and "role" in m for m in prompt):
        raise ValueError(f"row {sample_id}: prompt must be a list of {{role, content}} messages, got {prompt!r:.200}")
    for m in prompt:
        if not isinstance(m.get("content"), str):
            raise ValueError(f"row {sample_id}: prompt message contents must be strings with {IMAGE_PLACEHOLDER} "
                             f"placeholders, got {type(m.get('content')).__name__}")
    return [{"role": str(m["role"]), "content": m["content"]} for m in prompt]


def _user_text(chat: list[dict[str, str]]) -> str:
    text = "\n".join(m["content"] for m in chat if m["role"] == "user")
    return text.replace(IMAGE_PLACEHOLDER, " ").strip()


# "A. text", "(A) text", "A) text", "A: text", one option per line.
_OPTION_LINE = re.compile(r"^\s*\(?([A-Z])[.):：]\s*(.+?)\s*$", re.MULTILINE)
# "(A) text (B) text" inline, as in "Choices: (A) 3 (B) 4".
_OPTION_INLINE = re.compile(r"\(([A-Z])\)\s*(.+?)(?=\s*\([A-Z]\)|\s*$|\n)")


def parse_options(text: str) -> list[str] | None:
    """The option texts of a multiple-choice prompt, in order from A; None when there are
    not at least two options lettered A, B, ... without a gap."""
    for pattern in (_OPTION_LINE, _OPTION_INLINE):
        found = pattern.findall(text)
        options: list[str] = []
        for letter, option in found:
            if ord(letter) - ord("A") == len(options):
                options.append(option.strip())
            elif letter == "A":  # a second list starts: keep the later one (the options follow the question)
                options = [option.strip()]
        if len(options) >= 2:
            return options
    return None


def _answer(value: Any, *, column: str) -> str:
    """The ground truth as text; a row without one (None, blank) cannot be scored."""
    text = "" if value is None else str(value).strip()
    if not text:
        raise RowSkipped("no_answer", f"{column} is {'None' if value is None else 'blank'}")
    return text


def _is_letter(answer: str) -> bool:
    return len(answer) == 1 and "A" <= answer <= "Z"


def _scalars(values: Any) -> dict[str, Any]:
    """The JSON-friendly scalar entries of a dict column (extra_info carries anything)."""
    if not isinstance(values, dict):
        return {}
    return {k: v for k, v in values.items() if isinstance(v, str | int | float | bool) and not isinstance(v, bytes)}


def openmmreasoner_sample(row: dict[str, Any], *, sample_id: str, subset: str | None,
                          limits: ImagesConfig | None = None, root: Path | None = None) -> VQASample:
    """One OpenMMReasoner-RL row: its own chat (images at the placeholders), a letter or
    free-form ground truth, options parsed from the prompt for letter answers."""
    chat = _chat(row["prompt"], sample_id=sample_id)
    reward_model = row["reward_model"] or {}
    answer = _answer(reward_model.get("ground_truth"), column="reward_model.ground_truth")
    question = _user_text(chat)
    choices = parse_options(question) if _is_letter(answer) else None
    metadata = {
        "dataset": "openmmreasoner",
        "subset": subset or row.get("data_source"),
        "data_source": row.get("data_source"),
        "style": reward_model.get("style"),
        **({"avg_reward": row["avg_reward"]} if row.get("avg_reward") is not None else {}),
        **{f"extra_{k}": v for k, v in _scalars(row.get("extra_info")).items()},
    }
    return VQASample(
        sample_id=sample_id,
        images=_images(row["images"], sample_id=sample_id, column="images", limits=limits or ImagesConfig(),
                       root=root),
        question=question,
        answer=answer,
        choices=choices,
        answer_type="multi_choice" if _is_letter(answer) else "free_form",
        metadata=metadata,
        prompt=chat,
    )


def mathvista_sample(row: dict[str, Any], *, sample_id: str, limits: ImagesConfig | None = None,
                     root: Path | None = None) -> VQASample:
    """One MathVista row: the ready ``query`` after the image; gold is a choice's text for
    multiple choice, else typed (integer / float with precision / list / text)."""
    sample_id = f"mathvista-{row['pid']}"  # MathVista's own ids, the ones its results use
    answer = _answer(row["answer"], column="answer")
    if row["decoded_image"] is None:  # every MathVista question is about its image
        raise RowSkipped("missing_image", "decoded_image is None")
    multi_choice = row["question_type"] == "multi_choice"
    precision = row.get("precision")
    float_answer = row["answer_type"] == "float" and precision is not None and precision == precision  # not NaN
    meta = dict(row["metadata"] or {})
    return VQASample(
        sample_id=sample_id,
        images=_images(row["decoded_image"], sample_id=sample_id, column="decoded_image",
                       limits=limits or ImagesConfig(), root=root),
        question=row["question"],
        answer=answer,
        choices=list(row["choices"]) if multi_choice and row["choices"] else None,
        answer_type="multi_choice" if multi_choice else str(row["answer_type"]),
        # MathVista's own category fields (task, skills, grade, ...) keep their names.
        metadata={"dataset": "mathvista", "pid": str(row["pid"]), "question_type": row["question_type"],
                  "unit": row.get("unit"), **meta},
        precision=int(precision) if float_answer else None,
        prompt=[{"role": "user", "content": row["query"]}],
    )


def geometry3k_sample(row: dict[str, Any], *, sample_id: str, limits: ImagesConfig | None = None,
                      root: Path | None = None) -> VQASample:
    """One Geometry3K row: the problem with its figure at the ``<image>`` placeholder."""
    chat = [{"role": "user", "content": str(row["problem"])}]
    answer = _answer(row["answer"], column="answer")
    return VQASample(
        sample_id=sample_id,
        images=_images(row["images"], sample_id=sample_id, column="images", limits=limits or ImagesConfig(),
                       root=root),
        question=_user_text(chat),
        answer=answer,
        choices=None,
        answer_type="free_form",
        metadata={"dataset": "geometry3k"},
        prompt=chat,
    )


# ---------------------------------------------------------------- any data set


@dataclass(frozen=True)
class RowLayout:
    """How a row of one's own data set becomes a question (task 'dataset'): which column holds
    what (`task.columns`), the user turn's template and the system turn (`task.*`)."""

    columns: ColumnsConfig
    prompt_template: str = DEFAULT_PROMPT_TEMPLATE
    system_prompt: str | None = None
    image_root: str | None = None  # task.image_root: where image files may be read from besides the data's folder

    def read_columns(self) -> dict[str, str]:
        """{task.columns key: column name} of every column the rows are read from."""
        return {key: name for key, name in self.columns.model_dump().items() if name is not None}


def image_base(source: str) -> Path | None:
    """The folder relative image paths of `source` are read from: a local folder itself, a
    data file's (or glob's) folder; None for a hub id (paths then go from the working folder)."""
    if "*" in source:
        head = Path(source.split("*", 1)[0])
        return head if head.is_dir() else head.parent
    path = Path(source)
    if not path.exists():
        return None
    return path if path.is_dir() else path.parent


def _with_base(value: Any, base: Path | None) -> Any:
    """An image reference with a relative file path made relative to `base`; others as they are."""
    if base is None:
        return value
    if isinstance(value, dict) and value.get("bytes") is None and isinstance(value.get("path"), str):
        return {**value, "path": _with_base(value["path"], base)}
    if isinstance(value, str) and "://" not in value and not value.startswith("data:") and not Path(value).is_absolute():
        return str(base / value)
    return value


def format_choices(choices: list[str] | None) -> str:
    """Options as the prompt shows them: one a line, lettered ("A. red\nB. green"); "" for none."""
    if not choices:
        return ""
    return "\n".join(f"{chr(ord('A') + i)}. {choice}" for i, choice in enumerate(choices))


def _choices(value: Any, *, column: str) -> list[str] | None:
    if value is None or (isinstance(value, list) and not value):
        return None  # a row without options: a free-form answer
    if not isinstance(value, list):
        raise ValueError(f"task.columns.choices = {column!r} must name a list column of options; a row holds "
                         f"{type(value).__name__} {value!r:.80}")
    return [str(v) for v in value]


def any_sample(row: dict[str, Any], *, sample_id: str, layout: RowLayout, dataset: str,
               base: Path | None = None, limits: ImagesConfig | None = None, root: Path | None = None) -> VQASample:
    """One row of one's own data set as a question: the prompt column written into
    ``layout.prompt_template``, its images at its ``<image>`` placeholders (none: first),
    multiple choice when the row has options, else a free-form answer.

    A row whose image is None is refused (``missing_image``); an empty list is a row without
    images. The metadata holds the data set, the row's id and category when they are mapped."""
    c = layout.columns
    answer = _answer(row[c.answer], column=c.answer)
    value = row[c.images]
    if value is None:
        raise RowSkipped("missing_image", f"{c.images} is None")
    values = [_with_base(v, base) for v in (value if isinstance(value, list) else [value])]
    choices = _choices(row[c.choices], column=c.choices) if c.choices else None
    text = layout.prompt_template.format(prompt=str(row[c.prompt] or ""), choices=format_choices(choices)).strip()
    chat = [{"role": "user", "content": text}]
    if layout.system_prompt:
        chat.insert(0, {"role": "system", "content": layout.system_prompt})
    metadata: dict[str, Any] = {"dataset": dataset}
    if c.id is not None:
        metadata["id"] = None if row[c.id] is None else str(row[c.id])
    if c.category is not None:
        category = row[c.category]
        metadata["category"] = [str(v) for v in category] if isinstance(category, list) else category
    return VQASample(
        sample_id=sample_id,
        images=_images(values, sample_id=sample_id, column=c.images, limits=limits or ImagesConfig(), root=root),
        question=_user_text([chat[-1]]),
        answer=answer,
        choices=choices,
        answer_type="multi_choice" if choices else "free_form",
        metadata=metadata,
        prompt=chat,
    )


# ------------------------------------------------------------------- the task


@functools.lru_cache(maxsize=4)
def _epoch_order(n: int, seed: int, epoch: int) -> np.ndarray:
    return np.random.default_rng([seed, epoch]).permutation(n)


def shuffled_index(position: int, n: int, *, seed: int) -> int:
    """The row at ``position`` of an endless stream over ``n`` rows: every epoch visits each
    row once, in its own seeded order. A pure function of (position, n, seed)."""
    if n <= 0:
        raise ValueError("the dataset has no rows to train on")
    epoch, offset = divmod(position, n)
    return int(_epoch_order(n, seed, epoch)[offset])


HELD_OUT_SPLITS = ("test", "validation")


def held_out_split(source: str, subsets: tuple[str, ...] | None, *, train: str) -> str:
    """Task 'dataset' without task.eval_split: 'test' when the held-out source has it, else
    'validation', else a clear refusal. A single file has no splits: another file is its
    held-out split (any name does); the training file itself is refused."""
    import datasets

    if _is_file_source(source):
        if source == train:
            raise ValueError(f"dataset: {source} is one file, with no held-out split: set task.eval_dataset to "
                             "another file (or to the same one to evaluate on the training rows)")
        return HELD_OUT_SPLITS[0]
    config = subsets[0] if subsets else None
    splits = datasets.get_dataset_split_names(source, config_name=config, **cache_options(source))
    for split in HELD_OUT_SPLITS:
        if split in splits:
            return split
    raise ValueError(f"dataset: {source} has no split {' or '.join(map(repr, HELD_OUT_SPLITS))} to evaluate on; "
                     f"it has {', '.join(splits)}. Set task.eval_split to one of those (or task.eval_dataset)")


@dataclass
class DatasetTask:
    """A data set as the run sees it: a shuffled training stream and a held-out split.

    Splits are opened on first use: `saccade eval` never opens the training split."""

    task: str
    dataset: str
    split: str
    subsets: tuple[str, ...] | None
    eval_dataset: str
    eval_split: str | None  # None: task 'dataset' picks 'test', else 'validation', when the split opens
    eval_subsets: tuple[str, ...] | None
    blank_images: bool = False  # the control: every image replaced by a uniform gray one
    limits: ImagesConfig | None = None
    layout: RowLayout | None = None  # task 'dataset': how its rows become questions
    # The known data sets' prompt parts (task.prompt_template, task.system_prompt; task 'dataset'
    # has them in its layout) and every row's scorer (task.scoring; None: saccade.rewards.score).
    prompt_template: str = "{prompt}"
    system_prompt: str | None = None
    scorer: Any = None

    @classmethod
    def defaults(cls, task: str, *, dataset: str | None = None, split: str | None = None,
                 subsets: list[str] | None = None, eval_dataset: str | None = None, eval_split: str | None = None,
                 eval_subsets: list[str] | None = None, **kwargs: Any) -> DatasetTask:
        """Unset fields from the task's defaults (hub id, training and held-out splits)."""
        if task not in DATASET_TASKS:
            raise ValueError(f"unknown dataset task {task!r}; choose from {', '.join(DATASET_TASKS)}")
        if task == "dataset":
            # One's own data set: no hub id to fall back on, the default config, and a held-out
            # split found when it opens (`held_out_split`).
            if dataset is None:
                raise ValueError("task 'dataset' needs task.dataset: a hub id, a folder, or parquet / JSONL files")
            return cls(
                task=task, dataset=dataset, split=split or "train", subsets=tuple(subsets) if subsets else None,
                eval_dataset=eval_dataset or dataset, eval_split=eval_split,
                eval_subsets=tuple(eval_subsets) if eval_subsets else None, **kwargs,
            )
        train_subsets, train_split = TRAIN_DEFAULTS[task]
        held_subsets, held_split = EVAL_DEFAULTS[task]
        source = dataset or HUB_IDS[task]
        return cls(
            task=task, dataset=source, split=split or train_split,
            subsets=tuple(subsets) if subsets else train_subsets,
            eval_dataset=eval_dataset or source, eval_split=eval_split or held_split,
            eval_subsets=tuple(eval_subsets) if eval_subsets else held_subsets, **kwargs,
        )

    @functools.cached_property
    def train_rows(self) -> DatasetRows:
        return DatasetRows(self.task, self.dataset, subsets=self.subsets, split=self.split, limits=self.limits,
                           layout=self.layout)

    @functools.cached_property
    def eval_rows(self) -> DatasetRows:
        split = self.eval_split or held_out_split(self.eval_dataset, self.eval_subsets, train=self.dataset)
        return DatasetRows(self.task, self.eval_dataset, subsets=self.eval_subsets, split=split,
                           limits=self.limits, layout=self.layout)

    def train_sample(self, position: int, *, seed: int) -> VQASample:
        """Sample ``position`` of the training stream: rows shuffled by seed, epoch after epoch.
        A broken row raises `RowSkipped` (the RL loop's `PromptStream` skips it)."""
        rows = self.train_rows
        return self._finish(rows.sample(shuffled_index(position, len(rows), seed=seed)))

    def eval_samples(self, n: int) -> EvalRows[VQASample]:
        """The usable rows among the first ``n`` of the held-out split, in order (all of them
        when it has fewer); the broken ones' records in `.skipped`."""
        rows = self.eval_rows
        return usable_rows(lambda i: self._finish(rows.sample(i)), range(min(n, len(rows))))

    def _finish(self, sample: VQASample) -> VQASample:
        """The task's own parts on a row: its prompt parts, its scorer, blank images for the control."""
        if self.layout is None and sample.prompt is not None:
            sample.prompt = with_prompt_parts(sample.prompt, self.prompt_template, self.system_prompt,
                                              sample.choices)
        sample.scorer = self.scorer
        if self.blank_images:
            sample.images = [blank_like(im) for im in sample.images]
        return sample


def with_prompt_parts(chat: list[dict[str, str]], template: str, system_prompt: str | None,
                      choices: list[str] | None = None) -> list[dict[str, str]]:
    """A row's chat with `template` applied to its last user turn (the turn's text trimmed, as
    {prompt}; `<image>` placeholders stay where they are) and `system_prompt` first when the chat
    has no system turn (OpenMMReasoner's rows mostly carry their own instructions in the user turn)."""
    chat = [dict(m) for m in chat]
    if template != "{prompt}":
        last = max(i for i, m in enumerate(chat) if m["role"] == "user")
        chat[last]["content"] = template.format(prompt=chat[last]["content"].strip(),
                                                choices=format_choices(choices)).strip()
    if system_prompt and not any(m["role"] == "system" for m in chat):
        chat.insert(0, {"role": "system", "content": system_prompt})
    return chat
