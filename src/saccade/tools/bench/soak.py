"""`saccade bench soak`: a long run of the demo config, watched for whatever grows step after
step: resident memory, open file descriptors, threads, the image-embedding cache.

The run is `saccade rl` itself (embedded engine, from the demo's warm start `tiny-warm`, as
`bench async` runs it), with evaluation and intermediate checkpoints off so that every step
is alike. Every step already logs `rss_mb`, `open_fds`, `threads`, `python_threads`,
`cache_entries` and `cache_mb` to metrics.jsonl; the bench reads them back and fits.

What is judged: the RSS over the later half of the steps after the warm-up (the first `warmup`
steps are left out: the allocator's arenas, torch's thread pools and the kernels' workspaces
settle there, and a curve can still be settling for a while after). Its slope is Theil-Sen's,
the median of the slopes between every two steps, so the spikes of a few steps (RSS jumps by
10-20 MB and comes back) do not tilt it as they tilt a least-squares line. The bar is on the
growth that slope amounts to over the judged steps: below `RSS_GROWTH_BAR_MB`. A bar on growth
rather than on a slope makes a longer soak resolve a smaller leak (300 steps: about 8 MB per 100
steps; 2000 steps: about 1) and keeps a short one from reading noise as a trend. Descriptors and
threads at the end must be no higher than at the end of the warm-up.

Why not the old fit (least squares over every step after a 50-step warm-up, bar 1 MB per 100
steps): a 300-step run whose RSS sat within 1025-1037 MB from step 60 on failed it at +1.81 MB
per 100 steps, the curve still settling; and reshuffling the RSS noise of a flat 300-step run
gives least-squares slopes up to 1.7 MB per 100 steps: the bar sat inside the noise.

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

import statistics
import tempfile
import time
from pathlib import Path
from typing import Any

from saccade.config.bench import SoakBenchConfig

WARMUP_STEPS = SoakBenchConfig.model_fields["warmup"].default
RSS_GROWTH_BAR_MB = 10.0  # over the judged steps; a flat run's noise reads as up to about 5 MB
MAX_FITTED_POINTS = 1000  # Theil-Sen looks at every pair: thin a long run's judged steps to this many
SOAK_CACHE_BYTES = 8 << 20  # about 32 demo steps of images: full within the warm-up
CACHE_SAMPLES = 10  # points of the cache's size over time in the report


def theil_sen_slope(xs: list[float], ys: list[float]) -> float:
    """The median of the slopes between every two points with different x (Theil-Sen): a trend
    that a few outlying points cannot tilt, where a least-squares line follows them."""
    if len(xs) != len(ys):
        raise ValueError(f"{len(xs)} x values against {len(ys)} y values")
    slopes = []
    for i in range(len(xs)):
        for j in range(i + 1, len(xs)):
            if xs[j] != xs[i]:
                slopes.append((ys[j] - ys[i]) / (xs[j] - xs[i]))
    if not slopes:
        raise ValueError("a slope needs at least 2 points with different x: run more steps than the warm-up "
                         "(--steps, --warmup)")
    return statistics.median(slopes)


def judged_rows(rows: list[dict], warmup: int) -> list[dict]:
    """The later half of the rows after the warm-up (the last one always in): a curve that is
    still settling after the warm-up has mostly settled there, and a leak grows there as anywhere."""
    after = rows[warmup:]
    return after[len(after) // 2:]


def growth(rows: list[dict], key: str) -> tuple[float, float]:
    """(slope per 100 steps, growth in MB over the rows' steps) of `key`, by Theil-Sen."""
    fitted = evenly_spaced([r for r in rows if r.get(key) is not None], MAX_FITTED_POINTS)
    slope = theil_sen_slope([r["step"] for r in fitted], [r[key] for r in fitted])
    return 100 * slope, slope * (fitted[-1]["step"] - fitted[0]["step"])


def evenly_spaced(rows: list[dict], n: int) -> list[dict]:
    """About `n` rows spread over the run, the first and the last included."""
    if len(rows) <= n:
        return list(rows)
    picks = sorted({round(i * (len(rows) - 1) / (n - 1)) for i in range(n)})
    return [rows[i] for i in picks]


def soak_figures(rows: list[dict], warmup: int = WARMUP_STEPS) -> dict[str, Any]:
    """The soak's figures from a run's train records (metrics.jsonl, phase "train"), in step order.

    Start is the first step, settled the last step of the warm-up, end the last step; the
    slopes are fitted over the judged steps, the later half of those after the warm-up."""
    if len(rows) < warmup + 4:
        raise ValueError(f"{len(rows)} steps leave fewer than 4 after a warm-up of {warmup}: run more steps "
                         f"(--steps) or shorten the warm-up (--warmup)")
    missing = sorted({"rss_mb", "open_fds", "threads", "python_threads", "cache_entries", "cache_mb"} - set(rows[-1]))
    if missing:
        raise ValueError(f"the run's metrics.jsonl lacks {missing}: it was written by an older saccade; run it again")
    start, settled, end = rows[0], rows[warmup - 1] if warmup else rows[0], rows[-1]
    judged = judged_rows(rows, warmup)
    rss_slope, rss_growth = growth(judged, "rss_mb")

    def at(key: str) -> dict[str, float]:
        return {"start": start[key], "settled": settled[key], "end": end[key]}

    figures: dict[str, Any] = {
        "steps": len(rows),
        "trained_steps": sum("loss" in r for r in rows),  # steps with something to train on
        "warmup_steps": warmup,
        "judged_steps": [judged[0]["step"], end["step"]],
        "rss_slope_mb_per_100_steps": rss_slope,
        "rss_growth_mb": rss_growth,
        # The smallest steady leak that would miss the bar over this many judged steps.
        "resolves_mb_per_100_steps": 100 * RSS_GROWTH_BAR_MB / (end["step"] - judged[0]["step"]),
        "cache_slope_mb_per_100_steps": growth(judged, "cache_mb")[0],
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
        "rss": rss_growth < RSS_GROWTH_BAR_MB,
        "open_fds": end["open_fds"] <= settled["open_fds"],
        "threads": end["threads"] <= settled["threads"] and end["python_threads"] <= settled["python_threads"],
    }
    figures["ok"] = all(figures["flat"].values())
    return figures


def python_thread_names() -> list[str]:
    """The live Python threads by name: what to look at when their count grows."""
    import threading

    return sorted(t.name for t in threading.enumerate())


def run_soak_bench(cfg: SoakBenchConfig, *, progress: bool = True) -> dict[str, Any]:
    """Run `cfg.steps` RL steps of `cfg.config` (with `cfg.overrides`) from tiny-warm in this
    process and return `soak_figures`, with the process's descriptors and threads before the run
    and after it, and the plot."""
    from saccade.config import RunConfig, load_config
    from saccade.tools.demo import resolve_model_name
    from saccade.metrics import read_metrics
    from saccade.process_stats import process_metrics
    from saccade.tools.plot import plot_run
    from saccade.loops.rl import train_rl

    config, steps, warmup, out_dir = cfg.config, cfg.steps, cfg.warmup, cfg.out
    if steps < warmup + 4:
        raise ValueError(f"--steps {steps} leaves fewer than 4 steps after the warm-up of {warmup}: "
                         f"use --steps {warmup + 4} or more, or a shorter --warmup")
    out = Path(out_dir or tempfile.mkdtemp(prefix="saccade-bench-soak-"))
    overrides = list(cfg.overrides)
    defaults = ["--model.path", resolve_model_name("tiny-warm"), "--eval.every_steps", "0", "--checkpoint.every_steps", "0",
                "--trainer.steps", str(steps), "--log.dir", str(out / "run")]
    if not any(o.startswith("--image_cache.budget_bytes") for o in overrides):
        defaults += ["--image_cache.budget_bytes", str(SOAK_CACHE_BYTES)]
    # Once the demo has learned, every group scores alike and the filter leaves nothing to train
    # on: with it off, every step runs the whole path (zero advantages still forward and backward).
    if not any(o.startswith("--rollout.filter_zero_variance") for o in overrides):
        defaults += ["--rollout.filter_zero_variance", "false"]
    run = load_config(RunConfig, config, [*defaults, *overrides])
    before = {**process_metrics(), "python_thread_names": python_thread_names()}
    start = time.perf_counter()
    result = train_rl(run, run_dir=run.run_dir, progress=progress)
    wall = time.perf_counter() - start
    close = getattr(result["setup"].engine, "close", None)  # a vLLM engine's client; the embedded one has none
    if close is not None:
        close()
    del result
    after = {**process_metrics(), "python_thread_names": python_thread_names()}
    rows = [r for r in read_metrics(run.run_dir) if r["phase"] == "train"]
    figures = soak_figures(rows, warmup)
    plots = plot_run(run.run_dir)
    figures.update(
        config=config, overrides=overrides, cache_budget_mb=run.image_cache.budget_bytes / 2**20, wall_s=wall,
        process_before=before, process_after=after, run_dir=str(run.run_dir),
        plot=str(next((p for p in plots if p.name == "memory.png"), plots[-1])),
    )
    return figures


def format_soak_report(f: dict[str, Any]) -> str:
    """The figures for a reader: slope, descriptors, threads, cache, and the verdict."""
    def trio(key: str, fmt: str = "{:.0f}") -> str:
        v = f[key]
        return f"{fmt.format(v['start'])} at step 1, {fmt.format(v['settled'])} after the warm-up, " \
               f"{fmt.format(v['end'])} at the end"

    first, last = f["judged_steps"]
    mark = {True: "flat", False: "GROWS"}
    lines = [
        f"{f['steps']} steps ({f['warmup_steps']} of warm-up, {f['trained_steps']} trained), median "
        f"{f['step_s_median']:.2f} s/step",
        f"RSS over steps {first}-{last} (the later half after the warm-up): Theil-Sen slope "
        f"{f['rss_slope_mb_per_100_steps']:+.2f} MB per 100 steps, {f['rss_growth_mb']:+.1f} MB over those steps "
        f"(bar < {RSS_GROWTH_BAR_MB:g}): {mark[f['flat']['rss']]}; at this length a leak over "
        f"{f['resolves_mb_per_100_steps']:.1f} MB per 100 steps misses the bar",
        f"  RSS MB: {trio('rss_mb')}; peak {f['peak_rss_mb_end']:.0f}",
        f"open file descriptors: {trio('open_fds')}: {mark[f['flat']['open_fds']]}",
        f"threads (OS): {trio('threads')}; Python threads: {trio('python_threads')}: {mark[f['flat']['threads']]}",
        f"image-embedding cache, entries: {trio('cache_entries')}",
        f"  MB: {trio('cache_mb', '{:.2f}')}; {f['cache_slope_mb_per_100_steps']:+.2f} MB per 100 steps over "
        f"the judged steps",
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
