"""Data sets read through Hugging Face `datasets`: their splits opened, their rows read one at a
time, a shuffled training stream and a held-out split. How a row becomes a question is its
format's (`saccade.data.row_formats`); which format, hub id and default splits a known data set
has is `saccade.data.known_datasets`; one's own data set (task 'dataset') names its format in
`task.format`, by default ``columns``: its columns as `task.columns` names them
(`ColumnsConfig`: prompt, answer, images, and optionally choices, id, category).

A source is a hub id, a local folder laid out like the hub repository (a README.md whose
``configs`` name each config's files, or the default ``data/<split>-*.parquet`` / ``.jsonl``),
or one parquet or JSONL file or glob (then the whole file is the one split, and configs do
not apply). A local source has its own cache entry (`saccade.data.dataset_cache`). Image paths
in the rows are read relative to the data file's folder (a folder source: relative to the
folder), and only from below it, or below ``task.image_root`` when set (symlinks resolved): a
row naming any other file (``/etc/passwd``, ``../../secret.png``), or any file at all in a hub
data set, is skipped as ``image_outside_dataset`` and counted.

Nothing is decoded up front: `datasets` keeps the rows memory-mapped (Arrow), rows are
read one at a time in Arrow form and their images decoded only then, by
`saccade.data.images.load_image`. A row that cannot be used (a missing or undecodable image,
placeholders and images that differ in number, no answer) raises `RowSkipped` naming its
reason and place: the RL loop skips it and lists it (`saccade.data.rows`).
"""

from __future__ import annotations

import dataclasses
import functools
from bisect import bisect_right
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from saccade.config import ImagesConfig
from saccade.data.dataset_cache import cache_options
from saccade.data.images import ImageError, blank_like
from saccade.data.known_datasets import KNOWN_DATASETS
from saccade.data.questions import VQASample
from saccade.data.row_formats import RowContext, RowFormat, RowLayout, row_format
from saccade.data.row_formats.parts import with_prompt_parts
from saccade.data.rows import (
    DATASET_TASKS, EvalRows, RowSkipped, check_image_count, image_error_reason, usable_rows,
)
from saccade.data.videos import BlankedClip

__all__ = [
    "DatasetRows",
    "DatasetTask",
    "format_of",
    "held_out_split",
    "image_base",
    "load_split",
    "shuffled_index",
]


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


def load_split(source: str, *, subset: str | None, split: str, task: str):
    """One split of one config as a memory-mapped `datasets.Dataset` in Arrow form (nothing,
    images above all, is decoded before it is asked for), with clear errors."""
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
    return table.with_format("arrow")


def format_of(task: str, layout: RowLayout | None) -> RowFormat:
    """The row format of `task`'s rows: one's own data set's `task.format` (in its layout), a
    known data set's from its entry in `KNOWN_DATASETS`."""
    if (task == "dataset") != (layout is not None):
        raise ValueError("a RowLayout goes with task 'dataset', and only with it")
    return row_format(layout.format if layout is not None else KNOWN_DATASETS[task].format)


class DatasetRows:
    """Indexed, lazy access to the rows of one split across one or more configs, each row read
    by the task's row format (`format_of`)."""

    def __init__(self, task: str, source: str, *, subsets: tuple[str, ...] | None, split: str,
                 limits: ImagesConfig | None = None, layout: RowLayout | None = None) -> None:
        if task not in DATASET_TASKS:
            raise ValueError(f"unknown dataset task {task!r}; choose from {', '.join(DATASET_TASKS)}")
        self.format = format_of(task, layout)
        self.task, self.source, self.split = task, source, split
        self.limits = limits or ImagesConfig()
        self.layout = layout
        # The data set's name in each question's metadata: a known one's kind, one's own source.
        self.name = source if layout is not None else task
        names: list[str | None] = list(subsets) if subsets and not _is_file_source(source) else [None]
        self.parts = []
        for name in names:  # each split checked as it opens, before a row is read
            table = load_split(source, subset=name, split=split, task=task)
            self.format.check_columns(table.column_names, where=f"{task}: {source} ({name or 'default'}/{split})",
                                      layout=layout)
            self.parts.append((name, table))
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
        """Row `index` as a question, read by the format. A row that cannot be used raises
        `RowSkipped` saying why (saccade.data.rows: a missing or undecodable image, no answer,
        ...) and where."""
        subset, local, row = self.row(index)
        tag = f"{subset}-" if subset else ""
        at = RowContext(task=self.task, dataset=self.name, sample_id=f"{self.task}-{tag}{self.split}-{local}",
                        subset=subset, limits=self.limits, base=self.base, root=self.image_root, layout=self.layout)
        at = dataclasses.replace(at, sample_id=self.format.sample_id(row, at))
        place = {"split": self.split, "config": subset, "index": local}
        try:
            sample = self.format.read(row, at)
            check_image_count(sample)
        except RowSkipped as err:
            raise err.at(row_id=at.sample_id, **place) from None
        except ImageError as err:
            raise RowSkipped(image_error_reason(err), str(err)).at(row_id=at.sample_id, **place) from err
        sample.origin = place
        return sample


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
                             "another file (or task.eval_split to 'train' to evaluate on the training rows)")
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
    layout: RowLayout | None = None  # task 'dataset': its format, and how its rows become questions
    # The prompt parts a format that does not write its prompt gets on each row's chat
    # (task.prompt_template, None: the format's own; task.system_prompt), and every row's
    # scorer (task.scoring; None: saccade.rewards.score).
    prompt_template: str | None = None
    system_prompt: str | None = None
    scorer: Any = None
    format: RowFormat = field(init=False)  # how its rows become questions (`format_of`)

    @classmethod
    def defaults(cls, task: str, *, dataset: str | None = None, split: str | None = None,
                 subsets: list[str] | None = None, eval_dataset: str | None = None, eval_split: str | None = None,
                 eval_subsets: list[str] | None = None, **kwargs: Any) -> DatasetTask:
        """Unset fields from the task's defaults (`KNOWN_DATASETS`: hub id, training and held-out splits)."""
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
        known = KNOWN_DATASETS[task]
        source = dataset or known.hub_id
        return cls(
            task=task, dataset=source, split=split or known.train_split,
            subsets=tuple(subsets) if subsets else known.train_subsets,
            eval_dataset=eval_dataset or source, eval_split=eval_split or known.eval_split,
            eval_subsets=tuple(eval_subsets) if eval_subsets else known.eval_subsets, **kwargs,
        )

    def __post_init__(self) -> None:
        self.format = format_of(self.task, self.layout)  # an unknown format is refused here, before a split opens

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
        if not self.format.writes_prompt and sample.prompt is not None:
            template = self.prompt_template if self.prompt_template is not None else self.format.prompt_template
            sample.prompt = with_prompt_parts(sample.prompt, template, self.system_prompt, sample.choices)
        sample.scorer = self.scorer
        if self.blank_images:
            sample.images = [blank_like(im) for im in sample.images]
            sample.videos = [BlankedClip(v) for v in getattr(sample, "videos", [])]
        return sample
