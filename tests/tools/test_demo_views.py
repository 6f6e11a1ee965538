"""`saccade demo views`: its verdict, and the whole demo on a budget too small to learn."""

from __future__ import annotations

import json

import pytest

from saccade.tools.demo_views import SUCCESS_GAIN_MIN, correct_when_seen, load_views_config, views_verdict
from saccade.metrics import read_metrics

# Every stage runs; nothing can be learned in two steps.
FAST = [
    "--sft.steps", "2", "--sft.batch_size", "4",
    "--trainer.steps", "2", "--rollout.prompts_per_step", "2", "--rollout.group_size", "2",
    "--rollout.filter_zero_variance", "false",
    "--eval.prompts", "4", "--eval.every_steps", "1",
]


def test_the_views_config_ships_inside_the_package():
    cfg = load_views_config(["--task.max_turns", "3"])
    assert cfg.task.kind == "views" and cfg.task.max_turns == 3 and cfg.task.require_seen


def test_views_verdict():
    assert views_verdict({"success_before": 0.0, "success_after": SUCCESS_GAIN_MIN, "minutes": 9.0}) == []
    missed = views_verdict({"success_before": 0.1, "success_after": 0.35, "minutes": 16.0})
    assert [m.split()[0] for m in missed] == ["success_after", "minutes"]


def test_correct_when_seen_is_success_among_the_episodes_that_looked():
    assert correct_when_seen({"env_correct": 0.25, "env_seen": 0.5}) == 0.5
    assert correct_when_seen({"env_correct": 0.0, "env_seen": 0.0}) == 0.0


@pytest.mark.slow
def test_the_views_demo_runs_and_fails_loudly_when_it_does_not_learn(tmp_path):
    from saccade.cli import main

    out = tmp_path / "views.json"
    rc = main(["demo", "views", "--json", str(out), "--log.dir", str(tmp_path / "run"), *FAST])
    assert rc == 1  # two GRPO steps cannot add 0.3 success: the demo must say it missed its bar
    result = json.loads(out.read_text())
    for key in ("success_before", "success_after", "seen_before", "seen_after", "correct_when_seen_before",
                "correct_when_seen_after", "minutes"):
        assert isinstance(result[key], float) and 0 <= result[key], key
    assert result["color_chance"] == pytest.approx(1 / 3)
    for metrics_file in ("warm-start/metrics.jsonl", "grpo/metrics.jsonl"):
        assert (tmp_path / "run" / metrics_file).is_file(), metrics_file
    rows = read_metrics(tmp_path / "run" / "grpo" / "metrics.jsonl")
    train = [r for r in rows if r["phase"] == "train"]
    evals = [r for r in rows if r["phase"] == "eval"]
    assert len(train) == 2 and len(evals) == 2
    # What the environment reports about its episodes is logged, in training and in eval.
    assert all(0 <= r["env_seen"] <= 1 and 0 <= r["env_correct"] <= r["env_seen"] for r in train + evals)
    assert (tmp_path / "run" / "grpo" / "plots" / "overview.png").is_file()
