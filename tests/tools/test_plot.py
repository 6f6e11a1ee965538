"""plot_run: PNG curves from a synthetic metrics.jsonl; missing groups skipped; clear errors."""

from __future__ import annotations

import json
import math

import pytest

pytest.importorskip("matplotlib")

from PIL import Image

from saccade.metrics import METRICS_FILE, MetricsLogger
from saccade.tools.plot import GROUPS, _collect, _group_series, plot_command, plot_run


def _write_run(run_dir, steps=60, *, full=True):
    with MetricsLogger(run_dir) as lg:
        for s in range(1, steps + 1):
            m = {"reward_mean": 0.2 + 0.5 * (1 - math.exp(-s / 20)) + 0.03 * math.sin(s), "reward_std": 0.25,
                 "loss": 0.1 * math.cos(s)}
            if full:
                m.update(accuracy=0.3 + s / 200, completion_len_mean=300 - s, completion_len_max=600 - s,
                         kl=1e-4 * s, mismatch_abs=0.02, mismatch_kl=2e-4, entropy=1.0, grad_norm=1.0,
                         env_seen=min(1.0, s / 50), rss_mb=900 + s / 100, cache_mb=s / 4,
                         rollout_s=2.0, train_s=1.0 + s / 100, weight_sync_s=0.1)
            if s == 30:
                m["loss"] = float("nan")
            lg.log(s, m)
            if full and s % 20 == 0:
                lg.log(s, {"eval/accuracy": 0.4 + s / 300}, phase="eval")


def _check_png(path, min_w=500, min_h=300):
    assert path.is_file() and path.stat().st_size > 5_000
    with Image.open(path) as im:
        assert im.format == "PNG"
        w, h = im.size
        im.load()
    assert w >= min_w and h >= min_h and w < 5000 and h < 5000
    return w, h


def test_plot_run_writes_every_group(tmp_path):
    _write_run(tmp_path)
    paths = plot_run(tmp_path)
    names = [p.name for p in paths]
    assert names == [f"{g.name}.png" for g in GROUPS] + ["overview.png"]
    assert all(p.parent == tmp_path / "plots" for p in paths)
    sizes = {p.name: _check_png(p) for p in paths}
    ow, oh = sizes["overview.png"]
    assert ow > sizes["reward.png"][0] and oh > sizes["reward.png"][1]


def test_missing_groups_are_skipped(tmp_path, capsys):
    _write_run(tmp_path, steps=8, full=False)  # only reward_mean/std and loss
    out = tmp_path / "elsewhere"
    paths = plot_run(tmp_path, out)
    assert [p.name for p in paths] == ["reward.png", "loss.png", "overview.png"]
    assert all(p.parent == out for p in paths)
    for p in paths:
        _check_png(p)
    assert not (out / "kl.png").exists()

    # The command (`saccade plot RUN_DIR`) prints the paths and answers 0.
    assert plot_command(str(tmp_path)) == 0
    printed = capsys.readouterr().out.split()
    assert printed == [str(tmp_path / "plots" / p.name) for p in paths]


def test_series_grouping_by_phase():
    records = [
        {"step": 1, "phase": "train", "accuracy": 0.5, "reward_mean": 1.0, "reward_std": 0.1, "kl_coef": 0.1,
         "loss_tokens": 10, "mismatch_kl": None},
        {"step": 1, "phase": "eval", "accuracy": 0.4, "eval/accuracy": 0.45},
        {"step": 1, "phase": "train", "accuracy": 0.6},  # step logged twice: the last value wins
    ]
    series = _collect(records)
    assert series[("train", "accuracy")] == {1: 0.6}
    by_name = {g.name: g for g in GROUPS}
    assert _group_series(by_name["accuracy"], series) == [
        ("train", "accuracy"), ("eval", "accuracy"), ("eval", "eval/accuracy")]
    assert _group_series(by_name["reward"], series) == [("train", "reward_mean")]  # std is a band
    assert _group_series(by_name["kl"], series) == []  # kl_coef is a setting, not a KL
    assert _group_series(by_name["loss"], series) == []  # loss_tokens is a count
    assert _group_series(by_name["mismatch"], series) == []  # all null


def test_errors_without_metrics(tmp_path, capsys):
    with pytest.raises(ValueError, match="saccade rl"):
        plot_run(tmp_path)
    assert plot_command(str(tmp_path)) == 1
    assert "saccade rl" in capsys.readouterr().err

    (tmp_path / METRICS_FILE).write_text("")
    with pytest.raises(ValueError, match="no records"):
        plot_run(tmp_path)

    (tmp_path / METRICS_FILE).write_text(json.dumps({"step": 1, "phase": "train", "foo": 1.0}) + "\n")
    with pytest.raises(ValueError, match="no plottable metrics.*foo"):
        plot_run(tmp_path)
    assert not (tmp_path / "plots").exists()
