"""Broken data set rows: refused with a reason, counted, listed, never fatal one by one.

Real data sets hold rows that cannot be used. Each one is refused with a `RowSkipped`
that names one of `SKIP_REASONS`:

* ``missing_image``: an image reference that is None, an image file that is not there, or
  ``<image>`` placeholders in a row that has no image at all;
* ``bad_image``: image bytes that do not decode (corrupt, truncated, not an image);
* ``image_count``: the prompt's ``<image>`` placeholders and the row's images differ in number;
* ``no_answer``: no ground truth (missing, None or blank);
* ``too_long``: the prompt's tokens, image tokens included, plus ``sampling.max_tokens`` exceed
  ``trainer.max_tokens``. An image span is never cut, so such a prompt is skipped, not truncated;
* ``too_many_pixels``: an image larger than ``images.max_source_pixels``;
* ``image_outside_dataset``: an image file outside the data set's folder (or ``task.image_root``),
  or any local file named by a hub data set's row (``/etc/passwd`` is not a picture to train on).

The RL loop reads its prompts through a `PromptStream`: a broken row is skipped, the step's
batch is refilled from the rows after it (a step still gets ``rollout.prompts_per_step``
prompts), each skip is one JSON line of ``skipped.jsonl`` in the run folder (`SkipLog`) and
the step's metrics count them as ``skipped_<reason>``. A broken row is no reason to stop, but
many are: when more than ``task.max_skip_fraction`` of the last `SKIP_WINDOW_ROWS` rows read
were skipped, the run stops (`TooManySkippedRows`) naming the commonest reason.

Kill safety: every line of ``skipped.jsonl`` holds the step it was read for and its position
in the stream. A resumed run restarts from the checkpoint's step and data position, so it drops
the lines of later steps (and a torn last line) and reads those rows again: no row is listed
twice, none is lost, and the window of recent rows is rebuilt from the file as it was.
"""

from __future__ import annotations

import os
from collections import Counter, deque
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Generic, TypeVar

from saccade.config import HubDatasetTaskConfig
from saccade.data.known_datasets import KNOWN_DATASETS
from saccade.journal import Journal, read_jsonl

# The tasks whose prompts are a data set's rows: the known data sets and one's own (the [task]
# kinds of saccade.config.task's HubDatasetTaskConfig and OwnDatasetTaskConfig; a test keeps them equal).
DATASET_TASKS = (*KNOWN_DATASETS, "dataset")
SKIP_REASONS = ("missing_image", "bad_image", "image_count", "no_answer", "too_long", "too_many_pixels",
                "image_outside_dataset")
SKIPPED_FILE = "skipped.jsonl"
# The window the skip fraction is judged over: the last this many rows read. Judged only once
# that many have been read, so that one broken row among the first few cannot stop a run (at a
# true rate of 1%, more than 5% of 200 rows happens about once in 10^5 windows); a data set
# smaller than the window is read round again until the window is full.
SKIP_WINDOW_ROWS = 200

# A task's prompt, as its `train_sample` gives it (a VQASample for the data sets).
S = TypeVar("S")


class RowSkipped(ValueError):
    """A row that cannot be used: `reason` (one of SKIP_REASONS), a `detail` saying what is
    wrong, and where the row is (its id, split, config and index within that config)."""

    def __init__(self, reason: str, detail: str, *, row_id: str | None = None, split: str | None = None,
                 config: str | None = None, index: int | None = None) -> None:
        assert reason in SKIP_REASONS, reason
        self.reason, self.detail = reason, detail
        self.row_id, self.split, self.config, self.index = row_id, split, config, index
        super().__init__(self._message())

    def _message(self) -> str:
        return f"row {self.row_id}: {self.reason}: {self.detail}"

    def __str__(self) -> str:
        return self._message()

    def at(self, *, row_id: str, split: str | None, config: str | None, index: int | None) -> RowSkipped:
        """The same refusal, placed at its row (the row builders do not know where they are)."""
        self.row_id, self.split, self.config, self.index = row_id, split, config, index
        self.args = (self._message(),)
        return self

    def record(self, **extra: Any) -> dict[str, Any]:
        """The JSON line of skipped.jsonl: `extra` (step, position) first, then the row and why."""
        return {**extra, "id": self.row_id, "split": self.split, "config": self.config, "index": self.index,
                "reason": self.reason, "detail": self.detail}


def image_error_reason(err: Exception) -> str:
    """The skip reason of an image that failed to load (`saccade.data.images.ImageError`)."""
    from saccade.data.images import MissingImageError, TooManyPixelsError

    if isinstance(err, TooManyPixelsError):
        return "too_many_pixels"
    if isinstance(err, MissingImageError):
        return "missing_image"
    return "bad_image"


def check_image_count(sample) -> None:
    """Refuse a sample whose prompt's <image> placeholders and images differ in number (and its
    <video> placeholders and clips).

    No placeholder at all is fine (the images go first, as `to_messages` places them), unless
    there are placeholders and no image at all: then the images are missing."""
    from saccade.data.questions import IMAGE_PLACEHOLDER, VIDEO_PLACEHOLDER

    if sample.prompt is None:
        return
    for mark, count, what in ((IMAGE_PLACEHOLDER, len(sample.images), "image"),
                              (VIDEO_PLACEHOLDER, len(getattr(sample, "videos", [])), "clip")):
        marks = sum(str(m.get("content", "")).count(mark) for m in sample.prompt)
        if marks and not count:
            raise RowSkipped("missing_image", f"the prompt has {marks} {mark} placeholders and the row no {what}")
        if marks not in (0, count):
            raise RowSkipped("image_count", f"the prompt has {marks} {mark} placeholders but the row has "
                                            f"{count} {what}s; they must match")


def prompt_tokens(sample, processor, limits) -> int:
    """The tokens of a question's prompt as the engine sees it: its chat rendered with the
    generation prompt, each image's one pad expanded to its image tokens.

    Counted without resizing a pixel: the image tokens follow from each image's size (the
    processor's `smart_resize` to a multiple of patch x merge within the pixel limits), the
    text from the tokenizer. `messages_to_inputs` gives the same count (a test holds them
    equal) but resizes and patchifies every image: about 130 ms for a 1024x768 one here. A
    question with a clip is counted by `messages_to_inputs` itself (its timestamps are text the
    processor writes): the clip is decoded once, here, and kept for the engine (the decode cache)."""
    from transformers.models.qwen2_vl.image_processing_qwen2_vl import smart_resize

    from saccade.data.messages import extract_images, messages_to_inputs, render_chat
    from saccade.data.questions import to_messages

    if getattr(sample, "videos", None):
        inputs = messages_to_inputs(to_messages(sample), processor, limits=limits, add_generation_prompt=True,
                                    sample=sample.sample_id)
        return int(inputs.input_ids.shape[0])

    normalized, images = extract_images(to_messages(sample), limits=limits, sample=sample.sample_id)
    text = render_chat(processor, normalized, add_generation_prompt=True)
    tokens = len(processor.tokenizer(text)["input_ids"])  # each image one pad here
    image_processor = processor.image_processor
    factor = image_processor.patch_size * image_processor.merge_size
    for image in images:
        height, width = smart_resize(image.height, image.width, factor=factor, min_pixels=limits.min_pixels,
                                     max_pixels=limits.max_pixels)
        tokens += height * width // factor**2 - 1
    return tokens


def token_budget(processor, limits, *, max_tokens: int, completion_tokens: int) -> Callable[[Any], None]:
    """A check refusing (``too_long``) a question whose prompt tokens plus `completion_tokens`
    exceed `max_tokens`: the trainer packs a sample whole, and never cuts an image span."""

    def check(sample) -> None:
        from saccade.data.images import ImageError

        try:
            n = prompt_tokens(sample, processor, limits)
        except ImageError as err:  # a clip decoded here for the first time: refused as a broken image is
            raise place_error(RowSkipped(image_error_reason(err), str(err)), sample) from err
        if n + completion_tokens > max_tokens:
            raise place_error(RowSkipped(
                "too_long",
                f"the prompt is {n} tokens (image tokens included); with sampling.max_tokens = {completion_tokens} "
                f"that is over trainer.max_tokens = {max_tokens}. Images are never cut: raise trainer.max_tokens "
                "or lower images.max_pixels to keep such rows",
            ), sample)

    return check


def row_check(cfg, processor) -> Callable[[Any], None] | None:
    """For a data set task, the run's `token_budget` check (trainer.max_tokens against each
    prompt plus sampling.max_tokens); None for the generated tasks, whose prompts are short."""
    if cfg.task.kind not in DATASET_TASKS:
        return None
    return token_budget(processor, cfg.images, max_tokens=cfg.trainer.max_tokens,
                        completion_tokens=cfg.sampling.max_tokens)


def max_skip_fraction(cfg) -> float:
    """The share of broken rows that stops the run: a data set task's `task.max_skip_fraction`;
    for any other task (a user's may skip prompts too) the data sets' default."""
    return getattr(cfg.task, "max_skip_fraction", HubDatasetTaskConfig.model_fields["max_skip_fraction"].default)


def skip_counts(records: Iterable[dict[str, Any]], prefix: str = "skipped_") -> dict[str, float]:
    """{skipped_<reason>: rows} for every reason (0 when none): fixed keys, so plots line up."""
    counts = Counter(r["reason"] for r in records)
    return {f"{prefix}{reason}": float(counts[reason]) for reason in SKIP_REASONS}


def place_error(err: RowSkipped, sample) -> RowSkipped:
    """Fill in where a refused question's row is, from the sample (`VQASample.origin`)."""
    origin = getattr(sample, "origin", None) or {}
    return err.at(row_id=sample.sample_id, split=origin.get("split"), config=origin.get("config"),
                  index=origin.get("index"))


# --------------------------------------------------------------------- skipped.jsonl


def read_skipped(path: str | os.PathLike) -> list[dict[str, Any]]:
    """The records of a skipped.jsonl (or of a run folder's); a torn last line is left out."""
    path = Path(path)
    if path.is_dir():
        path = path / SKIPPED_FILE
    return read_jsonl(path) if path.exists() else []


class SkipLog:
    """Appends one fsync'd JSON line per skipped row to `run_dir/skipped.jsonl` (a
    `saccade.journal.Journal`, opened at the first skip: a run without broken rows has no file).

    `resume`: keep the lines of steps up to `keep_through_step` (the checkpoint the run
    restarts from) and drop the rest, a torn last line included, by an atomic rewrite: the
    resumed run reads those rows again and lists them once more. Not resuming: a file from an
    earlier run is set aside as skipped.jsonl.1 (.2, ...), as metrics.jsonl is."""

    def __init__(self, run_dir: str | os.PathLike, *, resume: bool, keep_through_step: int = 0) -> None:
        Path(run_dir).mkdir(parents=True, exist_ok=True)
        self.journal = Journal(Path(run_dir) / SKIPPED_FILE, ensure_ascii=False)
        self.path = self.journal.path
        if resume:
            self.journal.truncate_after(keep_through_step)
        else:
            self.journal.set_aside()

    def write(self, record: dict[str, Any]) -> None:
        self.journal.append(record)

    def close(self) -> None:
        self.journal.close()


# --------------------------------------------------------------------- the stream


class TooManySkippedRows(ValueError):
    """More than task.max_skip_fraction of the last rows read were broken: the data set needs fixing."""


class SkipWindow:
    """The skipped rows among the last `rows` rows read, judged against `max_fraction`."""

    def __init__(self, *, max_fraction: float, rows: int = SKIP_WINDOW_ROWS, listed_in: str | os.PathLike = SKIPPED_FILE):
        self.rows, self.max_fraction, self.listed_in = rows, max_fraction, listed_in
        self.skips: deque[tuple[int, str]] = deque()  # (position, reason), oldest first

    def add(self, position: int, reason: str) -> None:
        self.skips.append((position, reason))

    def judge(self, end: int) -> None:
        """Raise `TooManySkippedRows` when the rows [end - rows, end) are read and too many were skipped."""
        while self.skips and self.skips[0][0] < end - self.rows:
            self.skips.popleft()
        if end < self.rows or len(self.skips) <= self.max_fraction * self.rows:
            return
        reason, count = Counter(r for _, r in self.skips).most_common(1)[0]
        raise TooManySkippedRows(
            f"{len(self.skips)} of the last {self.rows} data set rows read were skipped as broken "
            f"({len(self.skips) / self.rows:.1%}), more than task.max_skip_fraction = {self.max_fraction}; the "
            f"commonest reason is {reason} ({count} rows). Each skipped row is listed with its reason in "
            f"{self.listed_in}: fix or filter the data set, or raise task.max_skip_fraction"
        )


@dataclass
class StepRows(Generic[S]):
    """What one step read from the training stream."""

    prompts: list[S]  # the usable prompts, in stream order
    positions: list[int]  # each one's position in the stream
    end: int  # the position after the last row read: where the next step starts
    skipped: list[dict[str, Any]]  # the records of the rows skipped on the way


class PromptStream(Generic[S]):
    """The training stream read one step at a time from `position`: rows that `read` or
    `check` refuse (`RowSkipped`) are skipped, listed in `log` and counted in `window`, and
    the step reads on until it holds the prompts it asked for.

    `read(position)` is the task's `train_sample`; `check(sample)` may refuse a readable row
    (the token budget). Reading is sequential: one step after the other, in step order."""

    def __init__(self, read: Callable[[int], S], *, position: int, window: SkipWindow,
                 check: Callable[[S], None] | None = None, log: SkipLog | None = None) -> None:
        self.read, self.check, self.window, self.log = read, check, window, log
        self.position = position

    def __enter__(self) -> PromptStream[S]:
        return self

    def __exit__(self, *exc) -> None:
        if self.log is not None:
            self.log.close()

    def take(self, n: int, *, step: int) -> StepRows[S]:
        """The next `n` usable prompts, read for `step` (numbered as metrics.jsonl numbers it)."""
        prompts: list[S] = []
        positions: list[int] = []
        skipped: list[dict[str, Any]] = []
        while len(prompts) < n:
            position = self.position
            self.position += 1
            try:
                sample = self.read(position)
                if self.check is not None:
                    self.check(sample)
            except RowSkipped as err:
                record = err.record(step=step, position=position)
                skipped.append(record)
                if self.log is not None:
                    self.log.write(record)
                self.window.add(position, err.reason)
            else:
                prompts.append(sample)
                positions.append(position)
            self.window.judge(self.position)
        return StepRows(prompts, positions, self.position, skipped)


def resumed_window(run_dir: str | os.PathLike, *, through_step: int, end: int, max_fraction: float) -> SkipWindow:
    """The skip window of a run resumed after `through_step` at stream position `end`, rebuilt
    from its skipped.jsonl (lines of later steps do not count: those rows are read again)."""
    window = SkipWindow(max_fraction=max_fraction, listed_in=Path(run_dir) / SKIPPED_FILE)
    for r in read_skipped(run_dir):
        if r.get("step", 0) <= through_step and end - window.rows <= r["position"] < end:
            window.add(r["position"], r["reason"])
    window.skips = deque(sorted(window.skips))
    return window


def open_prompt_stream(read: Callable[[int], S], *, run_dir: str | os.PathLike, position: int, done_steps: int,
                       resume: bool, max_skip_fraction: float, check: Callable[[S], None] | None = None,
                       writes: bool = True) -> PromptStream[S]:
    """The stream of a run that has trained `done_steps` steps and read up to `position`:
    resumed, its skipped.jsonl keeps the lines of those steps and its window is rebuilt from
    them. `writes`: this process lists the skips (rank 0; every rank reads the same rows)."""
    log = SkipLog(run_dir, resume=resume, keep_through_step=done_steps) if writes else None
    if resume:
        window = resumed_window(run_dir, through_step=done_steps, end=position, max_fraction=max_skip_fraction)
    else:
        window = SkipWindow(max_fraction=max_skip_fraction, listed_in=Path(run_dir) / SKIPPED_FILE)
    return PromptStream(read, position=position, window=window, check=check, log=log)


# ------------------------------------------------------------------------ evaluation


class EvalRows(list[S], Generic[S]):
    """Held-out questions that could be read, with the records of those that could not
    (`skipped`): an evaluation scores the first and reports the second apart."""

    def __init__(self, samples: Iterable[S] = (), skipped: Iterable[dict[str, Any]] = ()) -> None:
        super().__init__(samples)
        self.skipped: list[dict[str, Any]] = list(skipped)


def usable_rows(read: Callable[[int], S], indices: Iterable[int], *, check: Callable[[S], None] | None = None,
                skipped: Iterable[dict[str, Any]] = ()) -> EvalRows[S]:
    """The rows at `indices` that `read` and `check` accept; the others' records after `skipped`."""
    out: EvalRows[S] = EvalRows(skipped=skipped)
    for i in indices:
        try:
            sample = read(i)
            if check is not None:
                check(sample)
        except RowSkipped as err:
            out.skipped.append(err.record())
            continue
        out.append(sample)
    return out


def recheck(samples: list[S], check: Callable[[S], None]) -> EvalRows[S]:
    """`samples` less those `check` refuses, which join the skipped ones (the token budget
    can only be checked once the processor is loaded)."""
    skipped = getattr(samples, "skipped", [])
    out = usable_rows(lambda i: samples[i], range(len(samples)), check=check)
    return EvalRows(out, [*skipped, *out.skipped])
