"""The RL loop end to end on the tiny model: it runs, logs, checkpoints and resumes exactly."""

from __future__ import annotations

import pytest
import torch

from saccade.config import RunConfig, load_config
from saccade.metrics import read_metrics
from saccade.rl import train_rl

FAST = [
    "--trainer.steps", "4",
    "--trainer.seed", "3",
    "--rollout.prompts_per_step", "2",
    "--rollout.group_size", "4",
    "--rollout.filter_zero_variance", "false",
    "--engine.max_tokens", "4",
    "--loss.max_completion_tokens", "4",
    "--lora.rank", "4",
    "--data.eval_size", "4",
    "--eval.every_steps", "2",
    "--checkpoint.every_steps", "2",
    "--checkpoint.keep_last", "3",
]


def _config(tmp_path, name, *extra):
    return load_config(RunConfig, "configs/demo.toml", [*FAST, "--log.dir", str(tmp_path / name), *extra])


def _text_hash_reward(text, sample, weights):
    """A reward that depends on what was sampled, so a random model gets non-zero advantages."""
    import zlib

    value = (zlib.crc32(text.encode()) % 7) / 6.0
    return value, {"correct": float(value > 0.5)}


@pytest.mark.slow
def test_a_resumed_run_matches_an_uninterrupted_one(tmp_path, monkeypatch):
    import saccade.rl as rl

    monkeypatch.setattr(rl, "reward_of", _text_hash_reward)
    cfg = _config(tmp_path, "straight")
    train_rl(cfg, run_dir=cfg.run_dir, progress=False)
    straight = read_metrics(cfg.run_dir)

    cfg2 = _config(tmp_path, "killed")
    train_rl(cfg2, run_dir=cfg2.run_dir, progress=False, stop_after=2)  # "killed" after step 2
    assert (cfg2.run_dir / "checkpoints" / "step_000002" / "COMPLETE").exists()
    train_rl(cfg2, run_dir=cfg2.run_dir, resume=True, progress=False)
    resumed = read_metrics(cfg2.run_dir)

    assert [(r["step"], r["phase"]) for r in resumed] == [(r["step"], r["phase"]) for r in straight]
    compared = ("reward_mean", "accuracy", "completion_len_mean", "loss", "mismatch_abs", "grad_norm", "clip_frac")
    for a, b in zip(straight, resumed, strict=True):
        for key in compared:
            if key in a:
                assert a[key] == pytest.approx(b[key], rel=0, abs=1e-6), (a["step"], key)
    # Not vacuous: the run moved, and the logged mismatch is the fp32 float noise it should be.
    train = [r for r in straight if r["phase"] == "train"]
    assert all(r["mismatch_abs"] <= 1e-4 for r in train)
    assert len({round(r["loss"], 8) for r in train}) > 1


@pytest.mark.slow
def test_nan_gradients_skip_the_step_without_touching_weights(tmp_path, monkeypatch):
    import saccade.rl as rl

    cfg = _config(tmp_path, "nan", "--trainer.steps", "1", "--checkpoint.every_steps", "0", "--eval.every_steps", "0")
    setup = rl.build_setup(cfg, cfg.run_dir)
    before = {n: p.detach().clone() for n, p in setup.model.named_parameters() if p.requires_grad}
    monkeypatch.setattr(rl, "grad_norm_or_none", lambda params, max_norm: None)
    result = train_rl(cfg, run_dir=cfg.run_dir, setup=setup, progress=False)
    assert result["last"]["skipped_steps"] == 1.0
    for n, p in setup.model.named_parameters():
        if p.requires_grad:
            assert torch.equal(p, before[n]), n


def test_a_run_with_no_signal_left_says_so(tmp_path, monkeypatch):
    import saccade.rl as rl

    monkeypatch.setattr(rl, "reward_of", lambda text, sample, weights: (0.0, {"correct": 0.0}))
    monkeypatch.setattr(rl, "STALL_STEPS", 2)
    cfg = _config(tmp_path, "stalled", "--trainer.steps", "3", "--rollout.filter_zero_variance", "true",
                  "--checkpoint.every_steps", "0", "--eval.every_steps", "0")
    with pytest.warns(RuntimeWarning, match="no group has had reward variance for 2 steps") as caught:
        train_rl(cfg, run_dir=cfg.run_dir, progress=False)
    stalls = [str(w.message) for w in caught if "reward variance" in str(w.message)]
    assert len(stalls) == 1  # once, not every step
    assert str(cfg.run_dir / "metrics.jsonl") in stalls[0]


def test_final_info_means_turns_what_envs_report_into_metrics():
    from saccade.envs.trajectory import Trajectory
    from saccade.rl import final_info_means

    def episode(*infos):
        return Trajectory(sample_id="s", infos=list(infos))

    trajectories = [
        episode({"seen": False}, {"correct": 1.0, "seen": True, "action": None, "place": "left"}),
        episode({"correct": 0.0, "seen": False, "answered": True}),
        episode(),  # ended before any step: nothing to report
    ]
    assert final_info_means(trajectories) == {"env_answered": 1.0, "env_correct": 0.5, "env_seen": 0.5}
