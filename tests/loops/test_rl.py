"""The RL loop end to end on the tiny model: it runs, logs, checkpoints and resumes exactly;
a NaN/inf step is skipped without touching the weights; a run with no signal says so."""

from __future__ import annotations

import pytest
import torch
from stub_tasks import scored_task

from saccade.config import RunConfig, load_config
from saccade.metrics import read_metrics
from saccade.loops.rl import train_rl

FAST = [
    "--trainer.steps", "4",
    "--trainer.seed", "3",
    "--rollout.prompts_per_step", "2",
    "--rollout.group_size", "4",
    "--rollout.filter_zero_variance", "false",
    "--sampling.max_tokens", "4",
    "--loss.max_completion_tokens", "4",
    "--eval.prompts", "4",
    "--eval.every_steps", "2",
    "--checkpoint.every_steps", "2",
    "--checkpoint.keep_last", "3",
]
ONE_STEP = ["--trainer.steps", "1", "--checkpoint.every_steps", "0", "--eval.every_steps", "0"]


def _config(tmp_path, name, *extra):
    return load_config(RunConfig, "configs/demo.toml", [*FAST, "--log.dir", str(tmp_path / name), *extra])


# The KL term on, with full fine-tuning: its reference is a frozen copy of the start weights, which a
# resumed run must rebuild from model.path, not take from its checkpoint (saccade.trainer.reference).
KL = ["--loss.kl_coef", "0.05"]


@pytest.mark.slow
def test_a_resumed_run_matches_an_uninterrupted_one(tmp_path):
    cfg = _config(tmp_path, "straight", *KL)
    train_rl(cfg, run_dir=cfg.run_dir, task=scored_task(cfg), progress=False)
    straight = read_metrics(cfg.run_dir)

    cfg2 = _config(tmp_path, "killed", *KL)
    train_rl(cfg2, run_dir=cfg2.run_dir, task=scored_task(cfg2), progress=False, stop_after=2)  # "killed" after 2
    assert (cfg2.run_dir / "checkpoints" / "step_000002" / "COMPLETE").exists()
    train_rl(cfg2, run_dir=cfg2.run_dir, task=scored_task(cfg2), resume=True, progress=False)
    resumed = read_metrics(cfg2.run_dir)

    assert [(r["step"], r["phase"]) for r in resumed] == [(r["step"], r["phase"]) for r in straight]
    compared = ("reward_mean", "accuracy", "completion_len_mean", "loss", "mismatch_abs", "grad_norm", "clip_frac",
                "kl", "truncated_steps", "no_signal_steps", "stalled")  # the stall watch's streaks go on too
    for a, b in zip(straight, resumed, strict=True):
        for key in compared:
            if key in a:
                assert a[key] == pytest.approx(b[key], rel=0, abs=1e-6), (a["step"], key)
    # Not vacuous: the run moved, and the logged mismatch is the fp32 float noise it should be.
    train = [r for r in straight if r["phase"] == "train"]
    assert all(r["mismatch_abs"] <= 1e-4 for r in train)
    assert [r["truncated_steps"] for r in train] == [1, 2, 3, 4]  # a random model's replies never end in 4 tokens
    assert len({round(r["loss"], 8) for r in train}) > 1
    # The KL is 0 while the policy is its start, then the policy moves away from it: had the resumed
    # run taken its reference from the step-2 checkpoint, its step 3 would log a KL near 0.
    kl = [r["kl"] for r in train]
    assert kl[0] == 0.0 and all(k > 1e-4 for k in kl[2:]), kl


@pytest.mark.slow
def test_a_resumed_run_trains_at_its_own_trainer_lr(tmp_path):
    """The config's trainer.lr, not the checkpoint's, is the peak lr of a resumed run: what
    going on from a checkpoint with a lower learning rate needs (a stalled run's advice)."""
    cfg = _config(tmp_path, "lowered", "--eval.every_steps", "0")
    train_rl(cfg, run_dir=cfg.run_dir, task=scored_task(cfg), progress=False, stop_after=2)
    lowered = load_config(RunConfig, cfg.run_dir / "config.toml", ["--trainer.lr", "2e-4"])
    train_rl(lowered, run_dir=cfg.run_dir, task=scored_task(lowered), resume=True, progress=False)
    lrs = [(r["step"], r["lr"]) for r in read_metrics(cfg.run_dir) if r["phase"] == "train"]
    assert lrs == [(1, cfg.trainer.lr), (2, cfg.trainer.lr), (3, 2e-4), (4, 2e-4)]


def _trainable(setup) -> dict[str, torch.Tensor]:
    return {n: p.detach().clone() for n, p in setup.model.named_parameters() if p.requires_grad}


def _one_step(tmp_path, name, *, poison=None):
    """One RL step with rewards that vary (so the weights would move); `poison(setup)` may
    plant a NaN or inf first. Returns (the step's metrics, weights before, weights after)."""
    from saccade.run.setup import build_setup

    cfg = _config(tmp_path, name, *ONE_STEP)
    setup = build_setup(cfg, cfg.run_dir)
    if poison is not None:
        poison(setup)
    before = _trainable(setup)
    result = train_rl(cfg, run_dir=cfg.run_dir, setup=setup, task=scored_task(cfg), progress=False)
    return result["last"], before, _trainable(setup)


def _nan_gradient(setup):
    """A real NaN in one parameter's gradient, planted by a hook during backward."""
    param = next(p for n, p in setup.model.named_parameters() if p.requires_grad and "layers.0.mlp" in n)
    param.register_hook(lambda grad: torch.full_like(grad, float("nan")))


@pytest.mark.slow
def test_nan_gradients_skip_the_step_without_touching_weights(tmp_path):
    control, before, after = _one_step(tmp_path, "control")
    assert control["skipped_steps"] == 0.0 and control["grad_norm"] > 0
    assert any(not torch.equal(after[n], before[n]) for n in before), "control: the weights must move"

    poisoned, before, after = _one_step(tmp_path, "nan", poison=_nan_gradient)
    assert poisoned["skipped_steps"] == 1.0 and "grad_norm" not in poisoned
    assert all(torch.equal(after[n], before[n]) for n in before), "a NaN gradient reached the weights"


@pytest.mark.slow
def test_a_non_finite_loss_skips_the_step_without_touching_weights(tmp_path, monkeypatch):
    """A NaN behaviour logprob on one loss token makes the loss itself NaN, before any backward."""
    import saccade.orchestrator.rollout as rollout

    original = rollout.completion_to_sample

    def poisoned(completion, **kwargs):
        sample = original(completion, **kwargs)
        sample.inference_logprobs[-1] = float("nan")  # the ratio against it is NaN
        return sample

    monkeypatch.setattr(rollout, "completion_to_sample", poisoned)
    last, before, after = _one_step(tmp_path, "nan-loss")
    assert last["skipped_steps"] == 1.0 and "loss" not in last
    assert all(torch.equal(after[n], before[n]) for n in before)


@pytest.mark.slow
def test_sft_skips_a_step_with_a_nan_gradient(tmp_path):
    from saccade.run.setup import build_setup
    from saccade.loops.sft import train_sft

    cfg = load_config(RunConfig, "configs/demo.toml", ["--sft.steps", "1", "--sft.batch_size", "4",
                                                       "--log.dir", str(tmp_path / "sft")])
    setup = build_setup(cfg, cfg.run_dir)
    before = _trainable(setup)
    control = train_sft(cfg, run_dir=cfg.run_dir, setup=setup, progress=False)["last"]
    assert control["skipped_steps"] == 0.0
    moved = _trainable(setup)
    assert any(not torch.equal(moved[n], before[n]) for n in before), "control: SFT must move the weights"

    _nan_gradient(setup)
    skipped = train_sft(cfg, run_dir=tmp_path / "sft-nan", setup=setup, progress=False)["last"]
    assert skipped["skipped_steps"] == 1.0
    assert all(torch.equal(p, moved[n]) for n, p in _trainable(setup).items())


@pytest.mark.slow
def test_a_run_with_no_signal_left_says_so(tmp_path):
    """Weight 0: every answer scores 0, so no group ever has reward variance; and a random
    model's replies never end within 4 tokens: both kinds of stall, warned about once, in one
    message, the step they reach stall.steps; every step logs the watch's figures."""
    cfg = _config(tmp_path, "stalled", "--trainer.steps", "3", "--rollout.filter_zero_variance", "true",
                  "--checkpoint.every_steps", "0", "--eval.every_steps", "0", "--rollout.reward_weights",
                  '{"format": 0.0}', "--stall.steps", "2")
    with pytest.warns(RuntimeWarning, match="no group has had reward variance for 2 steps") as caught:
        train_rl(cfg, run_dir=cfg.run_dir, progress=False)
    stalls = [str(w.message) for w in caught if "reward variance" in str(w.message)]
    assert len(stalls) == 1  # once, not every step
    assert "more than 50% of the final replies have been cut at sampling.max_tokens for 2 steps" in stalls[0]
    assert str(cfg.run_dir / "metrics.jsonl") in stalls[0]
    train = [r for r in read_metrics(cfg.run_dir) if r["phase"] == "train"]
    assert [(r["no_signal_steps"], r["truncated_steps"], r["stalled"]) for r in train] == [
        (1, 1, 0), (2, 2, 1), (3, 3, 1)]
    assert all(r["truncated_frac"] == r["final_truncated_frac"] == 1.0 and r["groups_with_signal_frac"] == 0.0
               and r["rollbacks"] == 0
               for r in train)


@pytest.mark.slow
def test_a_cache_smaller_than_one_steps_images_trains_the_same(tmp_path):
    """`--image_cache.budget_bytes 200000` on the demo config: one step's 32 images (8 KB each) do not
    fit, yet every image stays until its train step ends, and the losses equal the unbounded
    run's; the cache evicts between steps."""
    common = ["--trainer.steps", "3", "--eval.every_steps", "0", "--checkpoint.every_steps", "0",
              "--rollout.group_size", "4"]

    def run(name: str, *extra: str) -> list[dict]:
        cfg = load_config(RunConfig, "configs/demo.toml", [*common, "--log.dir", str(tmp_path / name), *extra])
        train_rl(cfg, run_dir=cfg.run_dir, task=scored_task(cfg), progress=False)
        return [r for r in read_metrics(cfg.run_dir) if r["phase"] == "train"]

    unbounded = run("unbounded")
    small = run("small", "--image_cache.budget_bytes", "200000")
    assert all("loss" in r for r in unbounded)
    # Within fp32 noise (a wrong or missing embedding moves them by 1e-3 and more). Not bit for
    # bit: with shared prompts a 7e-9 difference (1.4e-6 of a loss of 0.005, a sum of terms that
    # cancel) was seen when this ran after other tests in one process, with identical
    # micro-batches; fp32 kernels vary with the allocator.
    assert [r["loss"] for r in small] == pytest.approx([r["loss"] for r in unbounded], rel=1e-5, abs=1e-8)
    assert [r["grad_norm"] for r in small] == pytest.approx([r["grad_norm"] for r in unbounded], rel=1e-6)
    evictions = [r["cache_evictions"] for r in small]
    assert 0 < evictions[0] < evictions[1] < evictions[2], evictions
    assert all(r["cache_evictions"] == 0 for r in unbounded)
    assert all(r["cache_mb"] * 2**20 <= 200000 for r in small)  # back under the budget after each step


@pytest.mark.slow
def test_bfloat16_on_the_cpu_trains_and_logs_its_mismatch(tmp_path):
    """`--model.dtype bfloat16` on the demo config: the engine and the trainer both compute in
    bf16 (full fine-tuning with float32 master weights); the per-step engine/trainer mismatch
    is in metrics.jsonl, below a real discrepancy."""
    cfg = _config(tmp_path, "bf16", "--model.dtype", "bfloat16", "--trainer.steps", "2",
                  "--checkpoint.every_steps", "0", "--eval.every_steps", "0")
    setup = train_rl(cfg, run_dir=cfg.run_dir, task=scored_task(cfg), progress=False)["setup"]
    assert {p.dtype for p in setup.model.parameters()} == {torch.bfloat16}
    rows = [r for r in read_metrics(cfg.run_dir) if r["phase"] == "train"]
    assert len(rows) == 2 and all(r["skipped_steps"] == 0 and r["grad_norm"] > 0 for r in rows)
    # packed_sdpa runs the same causal kernel as the engine: 2e-7 here (the masked sdpa path: 8e-4).
    assert all(0 <= r["mismatch_abs"] < 1e-2 for r in rows), [r["mismatch_abs"] for r in rows]
    assert all(r["peak_rss_mb"] >= r["rss_mb"] > 0 for r in rows)


USER_REWARDS = """
import asyncio


def shaped(completion, *, sample, messages):
    assert messages[0]["content"][0]["type"] == "image"  # the prompt, its image first
    return {"short": float(len(completion) < 12), "letters": sum(c.isalpha() for c in completion) / 16}


def broken(completion, sample):
    raise RuntimeError("the judge is down")


async def slow_judge(completion, *, sample):
    if len(completion) % 2 == 0:  # never answers on these: they time out
        await asyncio.sleep(3600)
    return 1.0
"""


@pytest.mark.slow
def test_user_rewards_named_in_the_config_train_and_are_logged_by_part(tmp_path, monkeypatch, caplog):
    """The task from the config alone: a user's module (a real file on sys.path) named by import
    path, a dict reward logged part by part, a raising reward counted but not fatal (its
    traceback logged once), an async one that times out on some answers."""
    import logging

    from reward_helpers import worker_pids

    (tmp_path / "rl_rewards.py").write_text(USER_REWARDS)
    monkeypatch.syspath_prepend(str(tmp_path))
    weights = '{"rl_rewards:shaped": 1.0, "rl_rewards:broken": 1.0, "rl_rewards:slow_judge": 0.5}'
    cfg = _config(tmp_path, "user", "--trainer.steps", "2", "--checkpoint.every_steps", "0", "--eval.every_steps",
                  "0", "--rollout.reward_weights", weights, "--rollout.reward_timeout_s", "0.2")
    with caplog.at_level(logging.WARNING, logger="saccade.scoring"):
        assert train_rl(cfg, run_dir=cfg.run_dir, progress=False)["step"] == 2  # the run goes on
    assert worker_pids() == set()  # the functions' worker processes ended with the run
    rows = [r for r in read_metrics(cfg.run_dir) if r["phase"] == "train"]
    answers = cfg.rollout.prompts_per_step * cfg.rollout.group_size
    assert len(rows) == 2
    for r in rows:
        assert r["reward_shaped"] == pytest.approx(r["reward_shaped_short"] + r["reward_shaped_letters"])
        assert r["reward_errors"] == answers and r["reward_broken"] == 0.0  # every answer, scored 0
        assert r["reward_timeouts"] == pytest.approx(answers * (1 - r["reward_slow_judge"]))
        assert r["reward_mean"] == pytest.approx(r["reward_shaped"] + 0.5 * r["reward_slow_judge"], abs=1e-6)
        assert "loss" in r
    assert sum(r["reward_timeouts"] for r in rows) > 0 and sum(r["reward_shaped_letters"] for r in rows) > 0
    failures = [rec for rec in caplog.records if "rl_rewards:broken" in rec.getMessage()]
    assert len(failures) == 1 and "the judge is down" in str(failures[0].exc_info[1])  # once, with its traceback
    assert len([rec for rec in caplog.records if "rl_rewards:slow_judge" in rec.getMessage()]) == 1


def test_lag_metrics_are_a_histogram_with_fixed_keys():
    from types import SimpleNamespace

    from saccade.orchestrator.rollout import lag_metrics

    groups = [[SimpleNamespace(policy_version=v) for v in (5, 5, 4, 4)], [SimpleNamespace(policy_version=5)] * 4]
    out = lag_metrics(groups, step=5, max_lag=2)
    assert out == {"policy_lag": 1.0, "policy_lag_mean": 0.25, "policy_lag_0_frac": 0.75,
                   "policy_lag_1_frac": 0.25, "policy_lag_2_frac": 0.0}


@pytest.mark.slow
def test_truncated_sampling_trains_on_policy(tmp_path):
    """sampling.top_k, top_p and min_p reach the engine, the trainer and the KL reference: the
    logged engine/trainer mismatch stays float noise, as without truncation."""
    cfg = _config(tmp_path, "truncated", "--sampling.top_k", "6", "--sampling.top_p", "0.9", "--sampling.min_p", "0.05",
                  "--sampling.temperature", "0.8", "--lora", "true", "--lora.rank", "4", "--loss.kl_coef", "0.01",
                  "--trainer.steps", "2", "--checkpoint.every_steps", "0", "--eval.every_steps", "0")
    train_rl(cfg, run_dir=cfg.run_dir, task=scored_task(cfg), progress=False)
    rows = [r for r in read_metrics(cfg.run_dir) if r["phase"] == "train"]
    assert len(rows) == 2 and all(r["skipped_steps"] == 0 for r in rows)
    assert all(r["mismatch_abs"] <= 1e-4 for r in rows), [r["mismatch_abs"] for r in rows]
    print("truncated RL mismatch_abs:", [r["mismatch_abs"] for r in rows])


def test_a_new_run_is_refused_in_a_folder_holding_another_runs_checkpoints(tmp_path):
    """Refused before anything is built or written: the other run's config.toml stays as it was."""
    cfg = _config(tmp_path, "run")
    other = cfg.run_dir / "checkpoints" / "step_000001"
    other.mkdir(parents=True)
    (other / "COMPLETE").write_text("{}")
    (cfg.run_dir / "config.toml").write_text("the other run's\n")
    with pytest.raises(ValueError, match=r"holds another run's checkpoints \(step_000001\): go on with that run"):
        train_rl(cfg, run_dir=cfg.run_dir, progress=False)
    assert (cfg.run_dir / "config.toml").read_text() == "the other run's\n"


def test_the_nonfinite_streak_counts_steps_whose_every_optimizer_step_was_skipped():
    from saccade.loops.guards import nonfinite_streak

    assert nonfinite_streak(0, {"skipped_steps": 1.0}, num_iterations=1) == 1
    assert nonfinite_streak(1, {"skipped_steps": 2.0}, num_iterations=2) == 2
    assert nonfinite_streak(2, {"skipped_steps": 1.0}, num_iterations=2) == 0  # one optimizer step applied
    assert nonfinite_streak(2, {"skipped_steps": 0.0}, num_iterations=1) == 0


def test_a_run_of_nonfinite_steps_stops_with_a_checkpoint_and_a_message(tmp_path):
    """Every gradient NaN (before: the run trained on forever, `skipped_steps` only logged)."""
    from saccade.loops.stall import StallError
    from saccade.run.setup import build_setup

    cfg = _config(tmp_path, "nan-run", "--trainer.steps", "5", "--checkpoint.every_steps", "0",
                  "--eval.every_steps", "0", "--trainer.max_nonfinite_steps", "2")
    setup = build_setup(cfg, cfg.run_dir)
    _nan_gradient(setup)
    with pytest.raises(StallError, match=r"2 steps in a row had every optimizer step skipped .*"
                       r"trainer.max_nonfinite_steps = 2\), up to step 2.*Saved .*step_000002.*--resume"):
        train_rl(cfg, run_dir=cfg.run_dir, setup=setup, task=scored_task(cfg), progress=False)
    assert (cfg.run_dir / "checkpoints" / "step_000002" / "COMPLETE").exists()
    assert [r["step"] for r in read_metrics(cfg.run_dir) if r["phase"] == "train"] == [1, 2]


def test_a_full_disk_under_the_metrics_stops_the_run_with_a_checkpoint_and_a_message(tmp_path, monkeypatch):
    """metrics.jsonl's write failing with ENOSPC at step 2 (before: a raw OSError, no checkpoint)."""
    import errno

    from saccade.loops.checkpointer import CheckpointWriteError
    from saccade.metrics import MetricsLogger

    real_log = MetricsLogger.log

    def log(self, step, metrics):
        if step == 2:
            raise OSError(errno.ENOSPC, "No space left on device")
        return real_log(self, step, metrics)

    monkeypatch.setattr(MetricsLogger, "log", log)
    cfg = _config(tmp_path, "full", "--trainer.steps", "3", "--checkpoint.every_steps", "0", "--eval.every_steps", "0")
    with pytest.raises(CheckpointWriteError, match=r"failed on a full disk .*No space left.*stopped after step 2 "
                       r"and saved .*step_000002.*--resume"):
        train_rl(cfg, run_dir=cfg.run_dir, task=scored_task(cfg), progress=False)
    assert (cfg.run_dir / "checkpoints" / "step_000002" / "COMPLETE").exists()
