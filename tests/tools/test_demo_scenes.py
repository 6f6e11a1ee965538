"""`saccade demo scenes`: its config ships and validates, and a 2-step RL run with
task.kind = "scenes" runs on the embedded engine (episodes, consistency check, metrics)."""

from __future__ import annotations

import pytest

from saccade.tools.demo_scenes import load_scenes_config, scenes_verdict
from saccade.metrics import read_metrics

FAST = [
    "--trainer.steps", "2", "--rollout.prompts_per_step", "2", "--rollout.group_size", "2",
    "--rollout.filter_zero_variance", "false", "--eval.prompts", "2", "--eval.every_steps", "2",
    "--trainer.torch_threads", "1",
]


def test_the_scenes_config_ships_inside_the_package():
    cfg = load_scenes_config(["--task.max_turns", "3"])
    assert cfg.task.kind == "scenes" and cfg.task.max_turns == 3 and cfg.task.start_turn == 180
    assert cfg.task.render_size == 64 and not cfg.task.describe_actions


def test_scenes_verdict():
    assert scenes_verdict({"success_before": 0.0, "success_after": 0.3, "minutes": 9.0}) == []
    assert len(scenes_verdict({"success_before": 0.1, "success_after": 0.35, "minutes": 16.0})) == 2


@pytest.mark.slow
def test_two_rl_steps_on_scenes_run_on_the_embedded_engine(tmp_path):
    from saccade.loops.rl import train_rl

    cfg = load_scenes_config([*FAST, "--log.dir", str(tmp_path / "run"), "--env.check_consistency", "always"])
    train_rl(cfg, run_dir=cfg.run_dir, progress=False)
    rows = read_metrics(cfg.run_dir)
    train = [r for r in rows if r["phase"] == "train"]
    assert len(train) == 2 and [r for r in rows if r["phase"] == "eval"]
    for r in train:  # what the environment reports about its episodes is logged
        assert 0 <= r["env_seen"] <= 1 and r["env_refusals"] >= 0 and 0 <= r["env_render_cache_hit_rate"] <= 1
        assert r["mismatch_abs"] <= 1e-4
