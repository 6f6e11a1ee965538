"""`saccade bench soak`: the fit and the verdict on hand-made records, then a short real run
through the command line whose JSON must hold every figure."""

from __future__ import annotations

import json

import pytest

from saccade.bench.soak import format_soak_report, least_squares_slope, soak_figures
from saccade.metrics import read_metrics


def test_least_squares_slope_by_hand():
    # x̄ = 2, ȳ = 7/3: ((-1)(-4/3) + 0 + (1)(5/3)) / ((-1)² + 0 + 1²) = 3 / 2.
    assert least_squares_slope([1, 2, 3], [1, 2, 4]) == pytest.approx(1.5)
    assert least_squares_slope([10, 20, 30, 40], [5, 5, 5, 5]) == 0
    with pytest.raises(ValueError, match="at least 2 points"):
        least_squares_slope([1], [1])
    with pytest.raises(ValueError, match="different x"):
        least_squares_slope([3, 3], [1, 2])


def rows(n: int, *, rss=lambda s: 900.0, fds=lambda s: 7.0, threads=lambda s: 6.0) -> list[dict]:
    """Train records as `saccade rl` writes them, with the soak's figures as functions of the step."""
    return [{"step": s, "phase": "train", "rss_mb": rss(s), "peak_rss_mb": rss(s) + 10, "open_fds": fds(s),
             "threads": threads(s), "python_threads": 1.0, "cache_entries": min(32.0 * s, 243.0),
             "cache_mb": min(0.25 * s, 1.9), "cache_evictions": max(0.0, 32.0 * s - 243), "step_s": 0.5}
            for s in range(1, n + 1)]


def test_a_run_that_settles_after_the_warm_up_is_flat():
    # 100 MB taken in the first 10 steps, then a sawtooth of +-2 MB with no trend.
    f = soak_figures(rows(60, rss=lambda s: 800 + 10 * min(s, 10) + (2 if s % 2 else -2)), warmup=10)
    assert f["fitted_steps"] == [11, 60]
    assert abs(f["rss_slope_mb_per_100_steps"]) < 0.5
    assert f["rss_mb"] == {"start": 812, "settled": 898, "end": 898}
    assert f["cache_entries"]["end"] == 243 and f["cache_slope_mb_per_100_steps"] == 0
    assert len(f["cache_over_time"]) == 10 and f["cache_over_time"][-1]["step"] == 60
    assert f["ok"] and "soak OK" in format_soak_report(f)


def test_growth_after_the_warm_up_fails_the_soak():
    leaking = soak_figures(rows(60, rss=lambda s: 900 + 0.05 * s), warmup=10)  # 5 MB per 100 steps
    assert leaking["rss_slope_mb_per_100_steps"] == pytest.approx(5.0)
    assert not leaking["flat"]["rss"] and leaking["flat"]["open_fds"] and not leaking["ok"]
    assert "GROWS" in format_soak_report(leaking) and "SOAK FAILED" in format_soak_report(leaking)

    fds = soak_figures(rows(60, fds=lambda s: 7.0 + (s > 40)), warmup=10)  # a descriptor left open
    assert fds["flat"]["rss"] and not fds["flat"]["open_fds"] and not fds["ok"]
    threads = soak_figures(rows(60, threads=lambda s: 6.0 + s // 20), warmup=10)
    assert not threads["flat"]["threads"] and not threads["ok"]


def test_too_few_steps_or_old_records_are_refused():
    with pytest.raises(ValueError, match="--warmup"):
        soak_figures(rows(11), warmup=10)
    old = [{k: v for k, v in r.items() if k != "open_fds"} for r in rows(20)]
    with pytest.raises(ValueError, match="open_fds"):
        soak_figures(old, warmup=10)


@pytest.mark.slow
def test_a_short_soak_writes_every_figure(tmp_path):
    """6 small steps of the demo config from tiny-warm, through `saccade bench soak`."""
    from saccade.cli import main

    out, path = tmp_path / "soak", tmp_path / "soak.json"
    code = main(["bench", "soak", "--steps", "6", "--warmup", "2", "--out", str(out), "--json", str(path),
                 "--rollout.prompts_per_step", "4", "--rollout.group_size", "4"])
    f = json.loads(path.read_text())
    for key in ("rss_slope_mb_per_100_steps", "cache_slope_mb_per_100_steps", "step_s_median", "wall_s",
                "peak_rss_mb_end", "cache_budget_mb"):
        assert isinstance(f[key], float), key
    for key in ("rss_mb", "open_fds", "threads", "python_threads", "cache_entries", "cache_mb"):
        assert set(f[key]) == {"start", "settled", "end"} and all(v >= 0 for v in f[key].values()), key
    assert f["steps"] == f["trained_steps"] == 6 and f["fitted_steps"] == [3, 6] and f["cache_budget_mb"] == 8
    assert f["open_fds"]["start"] > 0 and f["threads"]["start"] >= f["python_threads"]["start"] >= 1
    assert f["cache_entries"]["end"] == 24 and f["cache_over_time"][-1]["step"] == 6  # 4 new images a step
    assert {"open_fds", "threads", "python_threads"} <= set(f["process_before"]) <= set(f["process_after"])
    assert f["process_after"]["open_fds"] <= f["process_before"]["open_fds"]  # the run closed what it opened
    assert code == (0 if f["ok"] else 1)
    # Every step logged the process's memory, descriptors and threads.
    train = [r for r in read_metrics(out / "run") if r["phase"] == "train"]
    assert len(train) == 6
    assert all(r["peak_rss_mb"] >= r["rss_mb"] > 100 and r["open_fds"] > 0 and r["threads"] >= 1 for r in train)
    assert (out / "run" / "plots" / "memory.png").stat().st_size > 5_000 and f["plot"].endswith("memory.png")
