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

A source is a hub id, a local folder laid out like the hub repository (a README.md whose
``configs`` name each config's files, or the default ``data/<split>-*.parquet``), or one
parquet file or glob (then the whole file is the one split, and configs do not apply).

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

from saccade.config import ImagesConfig
from saccade.data.images import ImageError, MissingImageError, load_image
from saccade.data.rows import EvalRows, RowSkipped, check_image_count, image_error_reason, usable_rows
from saccade.data.shapes import BLANK_GRAY, IMAGE_PLACEHOLDER, VQASample

__all__ = [
    "DATASET_TASKS",
    "DatasetRows",
    "DatasetTask",
    "EVAL_DEFAULTS",
    "HUB_IDS",
    "OPENMMREASONER_TRAIN_SUBSETS",
    "REQUIRED_COLUMNS",
    "geometry3k_sample",
    "load_split",
    "mathvista_sample",
    "openmmreasoner_sample",
    "parse_options",
    "shuffled_index",
]

DATASET_TASKS = ("openmmreasoner", "mathvista", "geometry3k")
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


def _is_parquet_source(source: str) -> bool:
    return source.endswith(".parquet") and (Path(source).is_file() or "*" in source)


def load_split(source: str, *, subset: str | None, split: str, task: str):
    """One split of one config as a memory-mapped `datasets.Dataset`, with clear errors."""
    import datasets

    if _is_parquet_source(source):
        # A bare file has no configs or split names of its own: it is the split asked for.
        table = datasets.load_dataset("parquet", data_files={split: source}, split=split)
    else:
        if not Path(source).exists() and source.startswith((".", "/", "~")):
            raise ValueError(f"{task}: dataset path {source} does not exist; set data.dataset to a hub id or a path")
        configs = datasets.get_dataset_config_names(source)
        if subset is not None and subset not in configs:
            raise ValueError(
                f"{task}: {source} has no config {subset!r}; it has {', '.join(configs)}. "
                "Set data.subsets (or data.eval_subsets) to some of those"
            )
        splits = datasets.get_dataset_split_names(source, config_name=subset)
        if split not in splits:
            where = f"config {subset!r} of {source}" if subset else source
            raise ValueError(
                f"{task}: {where} has no split {split!r}; it has {', '.join(splits)}. "
                "Set data.split (or data.eval_split) to one of those"
            )
        table = datasets.load_dataset(source, name=subset, split=split)
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
                 limits: ImagesConfig | None = None) -> None:
        if task not in DATASET_TASKS:
            raise ValueError(f"unknown dataset task {task!r}; choose from {', '.join(DATASET_TASKS)}")
        self.task, self.source, self.split = task, source, split
        self.limits = limits or ImagesConfig()
        names: list[str | None] = list(subsets) if subsets and not _is_parquet_source(source) else [None]
        self.parts = [(name, load_split(source, subset=name, split=split, task=task)) for name in names]
        self.starts = np.cumsum([0] + [len(t) for _, t in self.parts]).tolist()

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
        place = {"split": self.split, "config": subset, "index": local}
        try:
            if self.task == "openmmreasoner":
                sample = openmmreasoner_sample(row, sample_id=sample_id, subset=subset, limits=self.limits)
            elif self.task == "mathvista":
                sample = mathvista_sample(row, sample_id=sample_id, limits=self.limits)
            else:
                sample = geometry3k_sample(row, sample_id=sample_id, limits=self.limits)
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


def _images(values: Any, *, sample_id: str, column: str, limits: ImagesConfig) -> list[Image.Image]:
    if values is None:
        return []
    if not isinstance(values, list):
        values = [values]
    out = []
    for i, value in enumerate(values):
        if value is None:
            raise MissingImageError(f"{column}[{i}] is None", sample=f"{sample_id} ({column}[{i}])")
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
                          limits: ImagesConfig | None = None) -> VQASample:
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
        images=_images(row["images"], sample_id=sample_id, column="images", limits=limits or ImagesConfig()),
        question=question,
        answer=answer,
        choices=choices,
        answer_type="multi_choice" if _is_letter(answer) else "free_form",
        metadata=metadata,
        prompt=chat,
    )


def mathvista_sample(row: dict[str, Any], *, sample_id: str, limits: ImagesConfig | None = None) -> VQASample:
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
                       limits=limits or ImagesConfig()),
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


def geometry3k_sample(row: dict[str, Any], *, sample_id: str, limits: ImagesConfig | None = None) -> VQASample:
    """One Geometry3K row: the problem with its figure at the ``<image>`` placeholder."""
    chat = [{"role": "user", "content": str(row["problem"])}]
    answer = _answer(row["answer"], column="answer")
    return VQASample(
        sample_id=sample_id,
        images=_images(row["images"], sample_id=sample_id, column="images", limits=limits or ImagesConfig()),
        question=_user_text(chat),
        answer=answer,
        choices=None,
        answer_type="free_form",
        metadata={"dataset": "geometry3k"},
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


@dataclass
class DatasetTask:
    """A data set as the run sees it: a shuffled training stream and a held-out split.

    Splits are opened on first use: `saccade eval` never opens the training split."""

    task: str
    dataset: str
    split: str
    subsets: tuple[str, ...] | None
    eval_dataset: str
    eval_split: str
    eval_subsets: tuple[str, ...] | None
    blank_images: bool = False  # the control: every image replaced by a uniform gray one
    limits: ImagesConfig | None = None

    @classmethod
    def defaults(cls, task: str, *, dataset: str | None = None, split: str | None = None,
                 subsets: list[str] | None = None, eval_dataset: str | None = None, eval_split: str | None = None,
                 eval_subsets: list[str] | None = None, **kwargs: Any) -> DatasetTask:
        """Unset fields from the task's defaults (hub id, training and held-out splits)."""
        if task not in DATASET_TASKS:
            raise ValueError(f"unknown dataset task {task!r}; choose from {', '.join(DATASET_TASKS)}")
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
        return DatasetRows(self.task, self.dataset, subsets=self.subsets, split=self.split, limits=self.limits)

    @functools.cached_property
    def eval_rows(self) -> DatasetRows:
        return DatasetRows(self.task, self.eval_dataset, subsets=self.eval_subsets, split=self.eval_split,
                           limits=self.limits)

    def train_sample(self, position: int, *, seed: int) -> VQASample:
        """Sample ``position`` of the training stream: rows shuffled by seed, epoch after epoch.
        A broken row raises `RowSkipped` (the RL loop's `PromptStream` skips it)."""
        rows = self.train_rows
        return self._maybe_blank(rows.sample(shuffled_index(position, len(rows), seed=seed)))

    def eval_samples(self, n: int) -> EvalRows:
        """The usable rows among the first ``n`` of the held-out split, in order (all of them
        when it has fewer); the broken ones' records in `.skipped`."""
        rows = self.eval_rows
        return usable_rows(lambda i: self._maybe_blank(rows.sample(i)), range(min(n, len(rows))))

    def _maybe_blank(self, sample: VQASample) -> VQASample:
        if self.blank_images:
            sample.images = [Image.new("RGB", im.size, BLANK_GRAY) for im in sample.images]
        return sample
