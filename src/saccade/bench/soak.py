"""`saccade bench soak`: a long run of the demo config, watched for whatever grows step after
step: resident memory, open file descriptors, threads, the image-embedding cache.

The run is `saccade rl` itself (embedded engine, from the demo's warm start `tiny-warm`, as
`bench async` runs it), with evaluation and intermediate checkpoints off so that every step
is alike. Every step already logs `rss_mb`, `open_fds`, `threads`, `python_threads`,
`cache_entries` and `cache_mb` to metrics.jsonl; the bench reads them back and fits.

What is fitted: the RSS slope, least squares over the steps after the warm-up (the first
`warmup` steps are left out: the allocator's arenas, torch's thread pools and the kernels'
workspaces settle there), in MB per 100 steps. The bar is below 1 MB per 100 steps, with the
descriptors and threads at the end no higher than at the end of the warm-up.

Zero-variance groups are kept (`rollout.filter_zero_variance = false` unless given): once the
demo has learned, the filter would drop every group and the steps would stop training, so the
soak would watch the rollouts alone.

The image cache is bounded (`image_cache.budget_bytes`, 1 GiB by default) and grows until it is full:
each shapes prompt is a new image, about 0.25 MB of embeddings per demo step on the tiny model,
so the default budget takes thousands of steps to fill and its growth would read as a slope.
The bench therefore gives the cache a small budget (`SOAK_CACHE_BYTES`, full within the
warm-up) unless `--image_cache.budget_bytes` is given, and reports the cache's own figures apart.
"""

from __future__ import annotations

import tempfile
import time
from pathlib import Path
from typing import Any

WARMUP_STEPS = 50
RSS_SLOPE_BAR_MB = 1.0  # per 100 steps, after the warm-up
SOAK_CACHE_BYTES = 8 << 20  # about 32 demo steps of images: full within the warm-up
CACHE_SAMPLES = 10  # points of the cache's size over time in the report


def least_squares_slope(xs: list[float], ys: list[float]) -> float:
    """The slope of the least-squares line through (xs, ys): sum((x - x̄)(y - ȳ)) / sum((x - x̄)²)."""
    if len(xs) != len(ys):
        raise ValueError(f"{len(xs)} x values against {len(ys)} y values")
    if len(xs) < 2:
        raise ValueError("a slope needs at least 2 points: run more steps than the warm-up (--warmup)")
    n = len(xs)
    mean_x, mean_y = sum(xs) / n, sum(ys) / n
    sxx = sum((x - mean_x) ** 2 for x in xs)
    if sxx == 0:
        raise ValueError("a slope needs at least 2 different x values")
    return sum((x - mean_x) * (y - mean_y) for x, y in zip(xs, ys)) / sxx


def per_100_steps(rows: list[dict], key: str, first_step: int) -> float:
    """Least-squares slope of `key` over the rows from `first_step` on, per 100 steps."""
    fitted = [r for r in rows if r["step"] >= first_step and r.get(key) is not None]
    return 100 * least_squares_slope([r["step"] for r in fitted], [r[key] for r in fitted])


def evenly_spaced(rows: list[dict], n: int) -> list[dict]:
    """About `n` rows spread over the run, the first and the last included."""
    if len(rows) <= n:
        return list(rows)
    picks = sorted({round(i * (len(rows) - 1) / (n - 1)) for i in range(n)})
    return [rows[i] for i in picks]


def soak_figures(rows: list[dict], warmup: int = WARMUP_STEPS) -> dict[str, Any]:
    """The soak's figures from a run's train records (metrics.jsonl, phase "train"), in step order.

    Start is the first step, settled the last step of the warm-up, end the last step; the
    slopes are fitted over the steps after the warm-up (step > warmup)."""
    if len(rows) < warmup + 2:
        raise ValueError(f"{len(rows)} steps leave fewer than 2 after a warm-up of {warmup}: run more steps "
                         f"(--steps) or shorten the warm-up (--warmup)")
    missing = sorted({"rss_mb", "open_fds", "threads", "python_threads", "cache_entries", "cache_mb"} - set(rows[-1]))
    if missing:
        raise ValueError(f"the run's metrics.jsonl lacks {missing}: it was written by an older saccade; run it again")
    start, settled, end = rows[0], rows[warmup - 1] if warmup else rows[0], rows[-1]
    first_fitted = rows[warmup]["step"]

    def at(key: str) -> dict[str, float]:
        return {"start": start[key], "settled": settled[key], "end": end[key]}

    figures: dict[str, Any] = {
        "steps": len(rows),
        "trained_steps": sum("loss" in r for r in rows),  # steps with something to train on
        "warmup_steps": warmup,
        "fitted_steps": [first_fitted, end["step"]],
        "rss_slope_mb_per_100_steps": per_100_steps(rows, "rss_mb", first_fitted),
        "cache_slope_mb_per_100_steps": per_100_steps(rows, "cache_mb", first_fitted),
        "rss_mb": at("rss_mb"),
        "peak_rss_mb_end": end.get("peak_rss_mb"),
        "open_fds": at("open_fds"),
        "threads": at("threads"),
        "python_threads": at("python_threads"),
        "cache_entries": at("cache_entries"),
        "cache_mb": at("cache_mb"),
        "cache_over_time": [{"step": r["step"], "entries": r["cache_entries"], "mb": r["cache_mb"],
                             "evictions": r.get("cache_evictions")} for r in evenly_spaced(rows, CACHE_SAMPLES)],
        "step_s_median": sorted(r["step_s"] for r in rows)[len(rows) // 2],
    }
    figures["flat"] = {
        "rss": figures["rss_slope_mb_per_100_steps"] < RSS_SLOPE_BAR_MB,
        "open_fds": end["open_fds"] <= settled["open_fds"],
        "threads": end["threads"] <= settled["threads"] and end["python_threads"] <= settled["python_threads"],
    }
    figures["ok"] = all(figures["flat"].values())
    return figures


def python_thread_names() -> list[str]:
    """The live Python threads by name: what to look at when their count grows."""
    import threading

    return sorted(t.name for t in threading.enumerate())


def run_soak_bench(config: str = "configs/demo.toml", overrides: list[str] | None = None, *, steps: int = 500,
                   warmup: int = WARMUP_STEPS, out_dir: str | None = None, progress: bool = True) -> dict[str, Any]:
    """Run `steps` RL steps of `config` from tiny-warm in this process and return `soak_figures`,
    with the process's descriptors and threads before the run and after it, and the plot."""
    from saccade.config import RunConfig, load_config
    from saccade.demo import resolve_model_name
    from saccade.metrics import read_metrics
    from saccade.process_stats import process_metrics
    from saccade.plot import plot_run
    from saccade.rl import train_rl

    if steps < warmup + 2:
        raise ValueError(f"--steps {steps} leaves fewer than 2 steps after the warm-up of {warmup}: "
                         f"use --steps {warmup + 2} or more, or a shorter --warmup")
    out = Path(out_dir or tempfile.mkdtemp(prefix="saccade-bench-soak-"))
    overrides = list(overrides or [])
    defaults = ["--model.path", resolve_model_name("tiny-warm"), "--eval.every_steps", "0", "--checkpoint.every_steps", "0",
                "--trainer.steps", str(steps), "--log.dir", str(out / "run")]
    if not any(o.startswith("--image_cache.budget_bytes") for o in overrides):
        defaults += ["--image_cache.budget_bytes", str(SOAK_CACHE_BYTES)]
    # Once the demo has learned, every group scores alike and the filter leaves nothing to train
    # on: with it off, every step runs the whole path (zero advantages still forward and backward).
    if not any(o.startswith("--rollout.filter_zero_variance") for o in overrides):
        defaults += ["--rollout.filter_zero_variance", "false"]
    cfg = load_config(RunConfig, config, [*defaults, *overrides])
    before = {**process_metrics(), "python_thread_names": python_thread_names()}
    start = time.perf_counter()
    result = train_rl(cfg, run_dir=cfg.run_dir, progress=progress)
    wall = time.perf_counter() - start
    close = getattr(result["setup"].engine, "close", None)  # a vLLM engine's client; the embedded one has none
    if close is not None:
        close()
    del result
    after = {**process_metrics(), "python_thread_names": python_thread_names()}
    rows = [r for r in read_metrics(cfg.run_dir) if r["phase"] == "train"]
    figures = soak_figures(rows, warmup)
    plots = plot_run(cfg.run_dir)
    figures.update(
        config=config, overrides=overrides, cache_budget_mb=cfg.image_cache.budget_bytes / 2**20, wall_s=wall,
        process_before=before, process_after=after, run_dir=str(cfg.run_dir),
        plot=str(next((p for p in plots if p.name == "memory.png"), plots[-1])),
    )
    return figures


def format_soak_report(f: dict[str, Any]) -> str:
    """The figures for a reader: slope, descriptors, threads, cache, and the verdict."""
    def trio(key: str, fmt: str = "{:.0f}") -> str:
        v = f[key]
        return f"{fmt.format(v['start'])} at step 1, {fmt.format(v['settled'])} after the warm-up, " \
               f"{fmt.format(v['end'])} at the end"

    first, last = f["fitted_steps"]
    mark = {True: "flat", False: "GROWS"}
    lines = [
        f"{f['steps']} steps ({f['warmup_steps']} of warm-up, {f['trained_steps']} trained), median "
        f"{f['step_s_median']:.2f} s/step",
        f"RSS slope, least squares over steps {first}-{last}: {f['rss_slope_mb_per_100_steps']:+.2f} MB per 100 steps "
        f"(bar < {RSS_SLOPE_BAR_MB:g}): {mark[f['flat']['rss']]}",
        f"  RSS MB: {trio('rss_mb')}; peak {f['peak_rss_mb_end']:.0f}",
        f"open file descriptors: {trio('open_fds')}: {mark[f['flat']['open_fds']]}",
        f"threads (OS): {trio('threads')}; Python threads: {trio('python_threads')}: {mark[f['flat']['threads']]}",
        f"image-embedding cache, entries: {trio('cache_entries')}",
        f"  MB: {trio('cache_mb', '{:.2f}')}; {f['cache_slope_mb_per_100_steps']:+.2f} MB per 100 steps after "
        f"the warm-up",
        "  over time (step: entries, MB, evictions): " + ", ".join(
            f"{c['step']}: {c['entries']:.0f}, {c['mb']:.2f}, {c['evictions'] or 0:.0f}" for c in f["cache_over_time"]),
    ]
    if "process_before" in f:
        b, a = f["process_before"], f["process_after"]
        lines.append(f"this process before the run / after it: {b.get('open_fds', 0):.0f} / {a.get('open_fds', 0):.0f} "
                     f"descriptors, {b.get('threads', 0):.0f} / {a.get('threads', 0):.0f} threads, "
                     f"{b['python_threads']:.0f} / {a['python_threads']:.0f} Python threads "
                     f"({', '.join(a['python_thread_names'])})")
    if "cache_budget_mb" in f:
        lines.append(f"cache budget {f['cache_budget_mb']:g} MB; run folder {f['run_dir']}; RSS plot {f['plot']}")
    lines.append("soak OK: memory, descriptors and threads flat" if f["ok"] else "SOAK FAILED: something grows")
    return "\n".join(lines)
