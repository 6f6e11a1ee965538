"""Metrics logging for the RL and SFT loops.

Every call to `MetricsLogger.log` appends one JSON line to `run_dir/metrics.jsonl`, then flushes
and fsyncs it (a `saccade.journal.Journal`), so a run killed at any moment loses at most the line
being written. Weights & Biases
and TensorBoard are optional mirrors: asked for but not installed, they cost one warning and the run
goes on with the JSONL file alone. The JSONL file is the record `saccade plot` reads.

One line::

    {"step": 12, "phase": "train", "time": 1767225600.1, "elapsed_s": 93.4, "reward_mean": 0.53, "kl": null}

JSON has no NaN or infinity: such values are written as null and counted (`nonfinite_counts`).

Resuming: `MetricsLogger(run_dir, resume=True)` appends to the existing file (first cutting off a
half-written last line, if the previous run was killed mid-write); `truncate_after(step)` (or
`resume_step=` at construction) drops the lines past the checkpoint being resumed, so the resumed
run's file has no duplicate or ghost steps. Without `resume`, an existing non-empty file is kept
aside as `metrics.jsonl.N` rather than overwritten.

samples.jsonl (`log_samples`, the records of `saccade.loops.sample_log`: a few prompts of a step with
their completions) is written, repaired, truncated on resume and set aside the same way, by the
same functions, and mirrored to the same backends (a W&B table, TensorBoard text and images).
"""

from __future__ import annotations

import json
import math
import numbers
import os
import time
import warnings
from collections import Counter
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from saccade.journal import Journal, read_jsonl

METRICS_FILE = "metrics.jsonl"
SAMPLES_FILE = "samples.jsonl"  # saccade.loops.sample_log writes its records through `MetricsLogger.log_samples`
TENSORBOARD_DIR = "tensorboard"
WANDB_ID_FILE = "wandb_run_id.txt"
RESERVED_KEYS = ("step", "phase", "time", "elapsed_s")

__all__ = ["METRICS_FILE", "MetricsLogger", "format_step", "read_metrics", "to_scalar"]


def to_scalar(value: Any, key: str = "?") -> float | int | None:
    """A metric value as a JSON-able Python number: 0-dim/1-element tensors and numpy scalars
    become float (or int, for integer dtypes); bools become 0/1; None stays None."""
    if value is None:
        return None
    if isinstance(value, bool):
        return int(value)
    if isinstance(value, numbers.Integral):
        return int(value)
    if isinstance(value, numbers.Real):  # float, numpy floating scalars
        return float(value)
    # torch.Tensor / numpy.ndarray, without importing either.
    numel = getattr(value, "numel", None)
    size = getattr(value, "size", None)
    n = numel() if callable(numel) else size if isinstance(size, int) else None
    if n is not None and hasattr(value, "item"):
        if n != 1:
            shape = tuple(getattr(value, "shape", ()))
            raise ValueError(f"metric {key!r} must be a scalar, got a tensor/array of shape {shape}")
        if hasattr(value, "detach"):
            value = value.detach()
        return to_scalar(value.item(), key)
    raise TypeError(f"metric {key!r} must be a number or a scalar tensor, got {type(value).__name__}")


def _is_nonfinite(v: float | int | None) -> bool:
    return isinstance(v, float) and not math.isfinite(v)


def read_metrics(path: str | os.PathLike, *, phase: str | None = None) -> list[dict]:
    """The records of a metrics.jsonl file (or of `run_dir/metrics.jsonl` if given a directory),
    in file order. A truncated last line (a kill mid-write) is skipped silently; an unreadable line
    elsewhere is skipped with a warning (`saccade.journal.read_jsonl`). `phase` keeps only that
    phase's records."""
    path = Path(path)
    if path.is_dir():
        path = path / METRICS_FILE
    return [rec for rec in read_jsonl(path) if phase is None or rec.get("phase", "train") == phase]


# Console summary: (key, short label), in display order.
_SUMMARY_KEYS: tuple[tuple[str, str], ...] = (
    ("reward_mean", "reward"),
    ("reward", "reward"),
    ("reward_std", "±"),
    ("accuracy", "acc"),
    ("eval/accuracy", "eval_acc"),
    ("eval_accuracy", "eval_acc"),
    ("visual_gain", "vis_gain"),
    ("loss", "loss"),
    ("kl", "kl"),
    ("entropy", "ent"),
    ("mismatch_kl", "mm_kl"),
    ("clip_frac", "clip"),
    ("grad_norm", "gnorm"),
    ("completion_len_mean", "len"),
    ("lr", "lr"),
    ("step_time_s", "s/step"),
    ("step_s", "s/step"),
)


def _fmt_number(v: Any) -> str:
    if v is None:
        return "nan"
    if isinstance(v, bool):
        return str(int(v))
    if isinstance(v, numbers.Integral):
        return str(int(v))
    v = float(v)
    if not math.isfinite(v):
        return str(v)
    if v != 0 and (abs(v) >= 1e5 or abs(v) < 1e-3):
        return f"{v:.3e}"
    return f"{v:.4g}"


def format_step(metrics: Mapping[str, Any], keys: list[str] | None = None, *, max_items: int = 10) -> str:
    """A compact one-line summary of a step's metrics (a `log` record or the raw dict), e.g.
    `step 12 | reward 0.531 ± 0.21 | acc 0.625 | loss -0.01234 | kl 1.234e-03 | len 143`.
    Given `keys`, shows those (under their own names); otherwise a fixed selection of the usual
    keys that are present, or the first `max_items` metrics if none of them is."""
    parts: list[str] = []
    if "step" in metrics:
        phase = metrics.get("phase", "train")
        parts.append(f"step {metrics['step']}" + ("" if phase == "train" else f" [{phase}]"))
    if keys is not None:
        chosen = [(k, k) for k in keys if k in metrics]
    else:
        chosen = [(k, label) for k, label in _SUMMARY_KEYS if k in metrics]
        if "reward_mean" in metrics:
            chosen = [(k, lab) for k, lab in chosen if k != "reward"]
        if not chosen:
            chosen = [(k, k) for k in metrics if k not in RESERVED_KEYS][:max_items]
    for k, label in chosen[:max_items]:
        try:
            v = to_scalar(metrics[k], k)
        except (TypeError, ValueError):
            continue
        if label == "±" and parts:
            parts[-1] += f" ± {_fmt_number(v)}"
        else:
            parts.append(f"{label} {_fmt_number(v)}")
    if keys is None:
        parts.extend(_stall_parts(metrics))
    return " | ".join(parts)


def _stall_parts(metrics: Mapping[str, Any]) -> list[str]:
    """The stall watch's state (saccade.loops.stall), shown only when there is something to see: a
    stalled run's streaks, and a rollback's step and new lr."""
    parts = []
    if metrics.get("stalled"):
        parts.append(f"STALLED: no signal {_fmt_number(metrics.get('no_signal_steps', 0))} steps, "
                     f"cut {_fmt_number(metrics.get('truncated_steps', 0))} steps")
    if metrics.get("rollback_to_step") is not None:
        parts.append(f"rolled back to step {_fmt_number(metrics['rollback_to_step'])}, "
                     f"lr {_fmt_number(metrics.get('rollback_lr'))}")
    return parts


def sample_markdown(record: dict) -> str:
    """A sample record (`saccade.loops.sample_log`) as Markdown: the prompt, then one table row per
    completion (TensorBoard renders its text plugin's strings as Markdown)."""
    def cell(text: str) -> str:
        return text.replace("|", "\\|").replace("\n", " ⏎ ") or "∅"

    lines = [f"**{record['prompt_id']}** (step {record['step']}): {cell(record['prompt']['text'])}", "",
             "| completion | reward | advantage | finish |", "|---|---:|---:|---|"]
    for c in record["completions"]:
        lines.append(f"| {cell(' ⇢ '.join(c['texts']))} | {_fmt_number(c['reward'])} | {_fmt_number(c['advantage'])} | "
                     f"{','.join(c['finish_reasons'])} |")
    return "\n".join(lines)


class MetricsLogger:
    """Appends one fsync'd JSON line per `log` to `run_dir/metrics.jsonl`; mirrors to W&B and
    TensorBoard when asked and installed. Use as a context manager, or call `close()`.

    W&B and TensorBoard see each finite metric under `phase/key` (`train/reward_mean`,
    `eval/accuracy`); keys that already contain a `/` are passed as they are. Non-finite values are
    not forwarded (they are null in the JSONL and counted in `nonfinite_counts`).
    """

    def __init__(
        self,
        run_dir: str | os.PathLike,
        *,
        wandb: bool = False,
        wandb_project: str | None = None,
        tensorboard: bool = False,
        config: dict | None = None,
        resume: bool = False,
        resume_step: int | None = None,
    ) -> None:
        self.run_dir = Path(run_dir)
        self.run_dir.mkdir(parents=True, exist_ok=True)
        self.journal = Journal(self.run_dir / METRICS_FILE)
        self.samples = Journal(self.run_dir / SAMPLES_FILE)  # opened on the first `log_samples`
        self.path, self.samples_path = self.journal.path, self.samples.path
        self.resume = resume
        self.config = dict(config) if config else {}
        self.nonfinite_counts: Counter[str] = Counter()
        self.backend_warnings: list[str] = []
        self._start = time.time()
        self._elapsed_offset = 0.0
        self._closed = False

        if resume:
            self.journal.repair()
            self.samples.repair()
            self._elapsed_offset = self._last_elapsed()
        else:
            for journal in (self.journal, self.samples):
                kept = journal.set_aside()
                if kept is not None:
                    warnings.warn(f"{journal.path} already existed (a previous run, not resumed): moved it to "
                                  f"{kept.name}", RuntimeWarning, stacklevel=2)
        self.journal.open()

        self._wandb = None
        self._wandb_run = None
        self._tb = None
        self._tb_kind: str | None = None
        if wandb:
            self._init_wandb(wandb_project)
        if tensorboard:
            self._init_tensorboard(purge_step=None)
        if resume and resume_step is not None:
            self.truncate_after(resume_step)

    # -- the JSONL file -------------------------------------------------------------------------

    def _last_elapsed(self) -> float:
        if not self.path.exists():
            return 0.0
        best = 0.0
        for rec in read_metrics(self.path):
            e = rec.get("elapsed_s")
            if isinstance(e, (int, float)) and math.isfinite(e):
                best = max(best, float(e))
        return best

    def truncate_after(self, step: int) -> int:
        """Drop every record with step > `step` (the checkpoint a resumed run restarts from), and a
        torn last line if any, from metrics.jsonl and samples.jsonl. Returns the number of metrics
        records dropped. Each file is rewritten atomically (temp file + fsync + rename).
        TensorBoard events past `step` are purged too."""
        self._check_open()
        kept, dropped = self.journal.truncate_after(step)
        self.samples.truncate_after(step)
        self._elapsed_offset = max((float(e) for rec in kept if isinstance(e := rec.get("elapsed_s"), (int, float))
                                    and math.isfinite(e)), default=0.0)
        if self._tb is not None:
            self._tb.close()
            self._init_tensorboard(purge_step=step + 1)
        return dropped

    # -- logging --------------------------------------------------------------------------------

    def log(self, step: int, metrics: Mapping[str, Any], *, phase: str = "train") -> dict:
        """Write one record (and mirror it). Tensor and numpy values become Python numbers; NaN and
        infinities are written as null and counted. Returns the record as written (non-finite
        values as None), e.g. for `format_step`."""
        self._check_open()
        values: dict[str, float | int | None] = {}
        for k, v in metrics.items():
            if k in RESERVED_KEYS:
                raise ValueError(f"metric name {k!r} is reserved (it is one of {RESERVED_KEYS})")
            values[str(k)] = to_scalar(v, k)
        now = time.time()
        record: dict[str, Any] = {
            "step": int(step),
            "phase": phase,
            "time": round(now, 3),
            "elapsed_s": round(self._elapsed_offset + now - self._start, 3),
        }
        for k, v in values.items():
            if _is_nonfinite(v):
                self.nonfinite_counts[k] += 1
                v = None
            record[k] = v
        self.journal.append(record)

        # Mirrors get finite values only (inf wrecks W&B/TensorBoard axes); the JSONL has the nulls.
        mirrored = {self._tag(k, phase): v for k, v in record.items() if k in values and v is not None}
        if self._wandb_run is not None and mirrored:
            try:
                self._wandb_run.log(mirrored, step=int(step))
            except Exception as e:  # a logging mirror must never stop training
                self._backend_failed("wandb", e)
        if self._tb is not None:
            try:
                for tag, v in mirrored.items():
                    self._tb.add_scalar(tag, v, int(step), walltime=now)
                self._tb.flush()
            except Exception as e:
                self._backend_failed("tensorboard", e)
        return record

    def log_samples(self, step: int, records: list[dict]) -> None:
        """Append a step's sample records (`saccade.loops.sample_log`: one per prompt, images already
        written under `run_dir`) to samples.jsonl, as metrics.jsonl's lines are written, and
        mirror them: a W&B table with the images, TensorBoard text and images."""
        self._check_open()
        self.samples.open()  # the file is there once asked for, records or none
        for record in records:
            self.samples.append(record)
        if self._wandb_run is not None and records:
            try:
                self._wandb_run.log({"samples": self._wandb_table(records)}, step=int(step))
            except Exception as e:  # a logging mirror must never stop training
                self._backend_failed("wandb", e)
        if self._tb is not None and records:
            try:
                self._tb_samples(step, records)
            except Exception as e:
                self._backend_failed("tensorboard", e)

    def _wandb_table(self, records: list[dict]):
        """One row per completion: the prompt's first image, its text, the answer and its scores."""
        columns = ["step", "prompt_id", "image", "prompt", "completion", "reward", "advantage", "finish_reasons"]
        table = self._wandb.Table(columns=columns)
        for rec in records:
            images = rec["prompt"]["images"]
            image = self._wandb.Image(str(self.run_dir / images[0])) if images else None
            for c in rec["completions"]:
                table.add_data(rec["step"], rec["prompt_id"], image, rec["prompt"]["text"], "\n".join(c["texts"]),
                               c["reward"], c["advantage"], ",".join(c["finish_reasons"]))
        return table

    def _tb_samples(self, step: int, records: list[dict]) -> None:
        """Per prompt: a Markdown table of its completions (`samples/<k>`) and its images
        (`samples/<k>/image<i>`); k is the prompt's place in the step, so the tags stay few."""
        import numpy as np
        from PIL import Image

        for k, rec in enumerate(records):
            self._tb.add_text(f"samples/{k}", sample_markdown(rec), int(step))
            for i, rel in enumerate(rec["prompt"]["images"]):
                with Image.open(self.run_dir / rel) as im:
                    pixels = np.asarray(im.convert("RGB"))
                self._tb.add_image(f"samples/{k}/image{i}", pixels, int(step), dataformats="HWC")
        self._tb.flush()

    @staticmethod
    def _tag(key: str, phase: str) -> str:
        return key if "/" in key else f"{phase}/{key}"

    @property
    def nonfinite_total(self) -> int:
        return sum(self.nonfinite_counts.values())

    # -- optional mirrors -----------------------------------------------------------------------

    def _warn(self, msg: str) -> None:
        self.backend_warnings.append(msg)
        warnings.warn(msg, RuntimeWarning, stacklevel=3)

    def _backend_failed(self, name: str, e: Exception) -> None:
        self._warn(f"{name} logging failed ({type(e).__name__}: {e}); it is off for the rest of this run, "
                   f"metrics go on to {self.path}")
        if name == "wandb":
            self._wandb_run = None
        else:
            self._tb = None

    def _init_wandb(self, project: str | None) -> None:
        try:
            import wandb as wandb_mod
        except ImportError:
            self._warn(f"wandb logging was asked for but wandb is not installed (pip install wandb); "
                       f"logging to {self.path} only")
            return
        id_file = self.run_dir / WANDB_ID_FILE
        run_id = id_file.read_text().strip() if self.resume and id_file.exists() else None
        try:
            run = wandb_mod.init(
                project=project,
                config=self.config or None,
                dir=str(self.run_dir),
                id=run_id,
                resume="allow" if run_id else None,
                name=self.run_dir.name,
            )
        except Exception as e:
            self._warn(f"wandb.init failed ({type(e).__name__}: {e}); logging to {self.path} only")
            return
        self._wandb = wandb_mod
        self._wandb_run = run if run is not None else wandb_mod
        rid = getattr(run, "id", None)
        if isinstance(rid, str) and rid:
            id_file.write_text(rid + "\n")

    def _init_tensorboard(self, purge_step: int | None) -> None:
        writer_cls = None
        try:
            from torch.utils.tensorboard import SummaryWriter as writer_cls  # needs `tensorboard`

            kind = "torch"
        except ImportError:
            try:
                from tensorboardX import SummaryWriter as writer_cls

                kind = "tensorboardX"
            except ImportError:
                pass
        if writer_cls is None:
            self._warn(f"tensorboard logging was asked for but neither tensorboard nor tensorboardX is installed "
                       f"(pip install tensorboard); logging to {self.path} only")
            return
        try:
            self._tb = writer_cls(log_dir=str(self.run_dir / TENSORBOARD_DIR), purge_step=purge_step)
        except Exception as e:
            self._warn(f"tensorboard SummaryWriter failed ({type(e).__name__}: {e}); logging to {self.path} only")
            return
        self._tb_kind = kind
        if self.config and purge_step is None:
            try:
                text = json.dumps(self.config, indent=2, default=str)
                self._tb.add_text("config", "```\n" + text + "\n```", 0)
            except Exception:
                pass

    @property
    def wandb_active(self) -> bool:
        return self._wandb_run is not None

    @property
    def tensorboard_active(self) -> bool:
        return self._tb is not None

    # -- lifetime -------------------------------------------------------------------------------

    def _check_open(self) -> None:
        if self._closed:
            raise RuntimeError(f"MetricsLogger for {self.run_dir} is closed")

    def close(self) -> None:
        """Close the file and the mirrors. Safe to call twice."""
        if self._closed:
            return
        self._closed = True
        self.journal.close()
        self.samples.close()
        if self._tb is not None:
            try:
                self._tb.close()
            except Exception:
                pass
            self._tb = None
        if self._wandb_run is not None:
            try:
                finish = getattr(self._wandb_run, "finish", None) or self._wandb.finish
                finish()
            except Exception:
                pass
            self._wandb_run = None

    def __enter__(self) -> MetricsLogger:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __del__(self) -> None:
        try:
            if not self._closed:
                self.journal.close()
                self.samples.close()
        except Exception:
            pass
