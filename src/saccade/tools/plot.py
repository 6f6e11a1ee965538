"""Training curves from a run's metrics.jsonl (written by `saccade.metrics.MetricsLogger`).

`plot_run(run_dir)` writes one PNG per group of metrics that the run has (reward, accuracy,
completion length, KL, train/inference mismatch, loss, entropy, gradient norm, episode outcomes,
step time, memory) and an `overview.png` with all of them in a grid, into `run_dir/plots/` by default. Groups the run
has no metric for are skipped. Rendering uses matplotlib's Agg canvas directly (no pyplot, no display, no
global backend change), so it is safe to call from a training process or a headless machine.

Series are keyed by (phase, metric): `accuracy` logged with phase "eval" shows as `eval/accuracy`,
next to the train `accuracy`. A `*_mean` metric with a matching `*_std` gets a ±1 std band. Long,
noisy train series are drawn faint with an EMA-smoothed line over them. A step logged twice (a
resumed run that was not truncated) keeps its last value.
"""

from __future__ import annotations

import math
import re
import sys
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from saccade.metrics import METRICS_FILE, RESERVED_KEYS, read_metrics

__all__ = ["GROUPS", "draw_group", "plot_command", "plot_run", "plotted_groups"]

PLOTS_DIR = "plots"
SMOOTH_MIN_POINTS = 40  # train series at least this long get an EMA line over the raw one


@dataclass(frozen=True)
class Group:
    name: str  # file stem
    title: str
    ylabel: str
    match: Callable[[str], bool]  # on the metric's base name (after the last "/")
    log_scale: bool = False  # switch to a log y axis when all values > 0 and they span > 30x


def _is_len(b: str) -> bool:
    return bool(re.search(r"(^|_)(len|length)(_|$)", b)) or b.startswith(("completion_len", "response_len"))


def _is_kl(b: str) -> bool:
    return (b == "kl" or b.startswith("kl_") or b.endswith("_kl")) and "coef" not in b and not b.startswith("mismatch")


def _is_loss(b: str) -> bool:
    return (b == "loss" or b.endswith("_loss") or b.startswith("loss_")) and "token" not in b


GROUPS: tuple[Group, ...] = (
    Group("reward", "Reward", "reward", lambda b: "reward" in b),
    # visual_gain (eval accuracy with the images minus with them blank) is on the accuracy's scale.
    Group("accuracy", "Accuracy", "accuracy",
          lambda b: "accuracy" in b or b == "acc" or b.endswith("_acc") or b == "visual_gain"),
    Group("completion_len", "Completion length", "tokens", _is_len),
    Group("kl", "KL to the reference policy", "KL", _is_kl, log_scale=True),
    Group("mismatch", "Train / inference mismatch", "mismatch", lambda b: b.startswith("mismatch"), log_scale=True),
    Group("loss", "Loss", "loss", _is_loss),
    Group("entropy", "Entropy", "nats / token", lambda b: "entropy" in b),
    Group("grad_norm", "Gradient norm", "‖g‖", lambda b: "grad_norm" in b, log_scale=True),
    # Episode outcomes an environment reports in its last info (rl.final_info_means): seen, correct...
    Group("env", "Episodes (what the environment reports)", "mean over episodes", lambda b: b.startswith("env_")),
    # Where a step's time goes: sampling, training, getting the weights to the engine.
    Group("step_time", "Step time", "seconds",
          lambda b: b in ("rollout_s", "train_s", "weight_sync_s", "step_s", "trainer_idle_s")),
    # What a long run must keep flat (`saccade bench soak`): the process's and the image cache's memory.
    Group("memory", "Memory", "MB", lambda b: b in ("rss_mb", "peak_rss_mb", "cuda_peak_mb", "cache_mb")),
)

SeriesKey = tuple[str, str]  # (phase, metric key)


def _base(key: str) -> str:
    return key.rsplit("/", 1)[-1]


def _display(phase: str, key: str) -> str:
    if phase == "train" or key.startswith(phase + "/"):
        return key
    return f"{phase}/{key}"


def _collect(records: list[dict]) -> dict[SeriesKey, dict[float, float]]:
    """{(phase, key): {step: value}}; None -> nan; a repeated step keeps its last value."""
    series: dict[SeriesKey, dict[float, float]] = {}
    for rec in records:
        step = rec.get("step")
        if not isinstance(step, (int, float)) or isinstance(step, bool):
            continue
        phase = str(rec.get("phase", "train"))
        for k, v in rec.items():
            if k in RESERVED_KEYS:
                continue
            if v is None:
                v = math.nan
            elif isinstance(v, bool) or not isinstance(v, (int, float)):
                continue
            series.setdefault((phase, k), {})[step] = float(v)
    return series


def _std_sibling(key: str) -> str:
    return key[: -len("_mean")] + "_std" if key.endswith("_mean") else key + "_std"


def _ema(y, alpha: float):
    """Debiased EMA that steps over NaNs (as TensorBoard's smoothing does)."""
    import numpy as np

    out = np.full_like(y, np.nan)
    acc = weight = 0.0
    for i, v in enumerate(y):
        if np.isfinite(v):
            acc = (1 - alpha) * acc + alpha * v
            weight = (1 - alpha) * weight + alpha
        if weight > 0:
            out[i] = acc / weight
    return out


def _fmt(v: float) -> str:
    if not math.isfinite(v):
        return "nan"
    if v != 0 and (abs(v) >= 1e5 or abs(v) < 1e-3):
        return f"{v:.2e}"
    return f"{v:.4g}"


def _group_series(group: Group, series: dict[SeriesKey, dict[float, float]]) -> list[SeriesKey]:
    """The series a group draws (std series become bands, not lines), train phase first."""
    keys = []
    for (phase, key), points in series.items():
        b = _base(key)
        if not group.match(b) or b.endswith("_std"):
            continue
        if not any(math.isfinite(v) for v in points.values()):
            continue
        keys.append((phase, key))
    return sorted(keys, key=lambda pk: (pk[0] != "train", pk[0], pk[1]))


def draw_group(
    ax, group: Group, keys: list[SeriesKey], series: dict[SeriesKey, dict[float, float]], *, compact: bool
) -> None:
    import numpy as np

    colors = [f"C{i}" for i in range(10)]
    finite_all: list[float] = []
    for i, (phase, key) in enumerate(keys):
        color = colors[i % len(colors)]
        pts = sorted(series[(phase, key)].items())
        x = np.array([p[0] for p in pts], dtype=float)
        y = np.array([p[1] for p in pts], dtype=float)
        finite = y[np.isfinite(y)]
        finite_all.extend(finite.tolist())
        b = _base(key)
        minor = b.endswith(("_min", "_max"))
        label = f"{_display(phase, key)}  (last {_fmt(finite[-1])})"
        std_pts = series.get((phase, _std_sibling(key)))
        std = np.array([std_pts.get(s, np.nan) for s in x], dtype=float) if std_pts else None

        smooth = phase == "train" and len(x) >= SMOOTH_MIN_POINTS and not minor
        sparse = len(x) < 30 or phase != "train"
        style = dict(color=color, linewidth=0.9 if minor else 1.6, linestyle=":" if minor else "-")
        if sparse:
            style.update(marker="o", markersize=3 if compact else 4)
        if smooth:
            alpha = 2.0 / (max(5, len(x) // 15) + 1)
            ax.plot(x, y, color=color, linewidth=0.8, alpha=0.3)
            y_line = _ema(y, alpha)
            if std is not None:
                std = _ema(std, alpha)
            ax.plot(x, y_line, label=label + "  [EMA]", **style)
        else:
            y_line = y
            ax.plot(x, y, label=label, **style)
        bad = x[~np.isfinite(y)]
        if bad.size:  # NaN/inf steps (null in the JSONL): a mark on the bottom edge, in the line's color
            ax.plot(bad, np.zeros_like(bad), linestyle="none", marker="x", color="red", markersize=7, markeredgewidth=2,
                    clip_on=False, transform=ax.get_xaxis_transform(),
                    label=f"{_display(phase, key)} non-finite ({bad.size})")
        if std is not None and np.isfinite(std).any():
            ax.fill_between(x, y_line - std, y_line + std, color=color, alpha=0.15, linewidth=0,
                            label=None if compact else f"± {_display(phase, _std_sibling(key))}")
            band = np.concatenate([y_line - std, y_line + std])
            finite_all.extend(band[np.isfinite(band)].tolist())

    if group.log_scale and finite_all:
        lo, hi = min(finite_all), max(finite_all)
        if lo > 0 and hi / lo > 30:
            ax.set_yscale("log")
    ax.set_title(group.title, fontsize=11 if compact else 13)
    ax.set_xlabel("step")
    ax.set_ylabel(group.ylabel)
    ax.grid(True, alpha=0.3)
    ax.legend(fontsize=7 if compact else 9, loc="best", framealpha=0.8)


def plotted_groups(records: list[dict]) -> tuple[dict[SeriesKey, dict[float, float]], list[tuple[Group, list[SeriesKey]]]]:
    """The records' series, and each group the run has a metric for with the series it draws
    (`draw_group(ax, group, keys, series, compact=...)` draws one; `saccade report` draws them as SVG)."""
    series = _collect(records)
    return series, [(g, ks) for g in GROUPS if (ks := _group_series(g, series))]


def _save(fig, path: Path) -> None:
    from matplotlib.backends.backend_agg import FigureCanvasAgg

    FigureCanvasAgg(fig)
    fig.savefig(path, dpi=110)


def run_records(run_dir: Path) -> list[dict]:
    """The records of the run's metrics.jsonl; ValueError when there is none or it is empty."""
    path = run_dir / METRICS_FILE
    if not path.is_file():
        raise ValueError(f"no {METRICS_FILE} in {run_dir}: run `saccade rl` (or sft) with this run directory first")
    records = read_metrics(path)
    if not records:
        raise ValueError(f"{path} has no records yet: run `saccade rl` (or sft) with this run directory first")
    return records


def plot_run(run_dir: str | Path, out_dir: str | Path | None = None) -> list[Path]:
    """Write the run's curves as PNGs into `out_dir` (default `run_dir/plots`); return their paths
    (one per group the run has, then `overview.png`). Raises ValueError if the run has no metrics
    (missing or empty metrics.jsonl) or none that belongs to a group."""
    run_dir = Path(run_dir)
    records = run_records(run_dir)
    try:
        from matplotlib.figure import Figure
    except ImportError as e:
        raise ImportError("plotting needs matplotlib: pip install 'matplotlib>=3.8'") from e

    series, present = plotted_groups(records)
    if not present:
        names = sorted({_display(p, k) for p, k in series})
        raise ValueError(f"{run_dir / METRICS_FILE}: no plottable metrics (found: {', '.join(names) or 'none'})")

    out = Path(out_dir) if out_dir is not None else run_dir / PLOTS_DIR
    out.mkdir(parents=True, exist_ok=True)
    last_step = max(r["step"] for r in records if isinstance(r.get("step"), (int, float)))
    written: list[Path] = []
    for group, keys in present:
        fig = Figure(figsize=(8, 4.8), layout="constrained")
        ax = fig.add_subplot()
        draw_group(ax, group, keys, series, compact=False)
        fig.suptitle(f"{run_dir.name}", fontsize=9, color="0.4", x=0.99, ha="right")
        p = out / f"{group.name}.png"
        _save(fig, p)
        written.append(p)

    n = len(present)
    ncols = min(3, n)
    nrows = math.ceil(n / ncols)
    fig = Figure(figsize=(5.6 * ncols, 3.9 * nrows), layout="constrained")
    for i, (group, keys) in enumerate(present):
        draw_group(fig.add_subplot(nrows, ncols, i + 1), group, keys, series, compact=True)
    fig.suptitle(f"{run_dir.name}: {len(records)} records, last step {last_step}", fontsize=13)
    p = out / "overview.png"
    _save(fig, p)
    written.append(p)
    return written


def plot_command(run_dir: str, out_dir: str | None = None) -> int:
    """`saccade plot RUN_DIR`: write the PNGs, print their paths; 1 with a message if no metrics."""
    try:
        paths = plot_run(Path(run_dir), Path(out_dir) if out_dir else None)
    except (ValueError, ImportError) as e:
        print(f"saccade plot: {e}", file=sys.stderr)
        return 1
    for p in paths:
        print(p)
    return 0
