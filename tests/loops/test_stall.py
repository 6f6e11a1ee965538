"""The stall watch (`saccade.loops.stall`): its rule over crafted step figures (both kinds of stall,
each response, the streaks that break, the rollouts of undone weights, the limit on
rollbacks), then real runs that collapse on the tiny model and are stopped or rolled back.

The runs: the demo's warm start (`tiny-warm`, which answers one of three colors and stops)
rewarded for the first color of the options, as tests/loops/test_rl_learns.py, where lr 7e-4 takes
the reward from chance to about 0.9 in 20 steps. At lr 1e-2 the policy collapses instead: by
step 3 (seed 0) every reply is the end token alone, every reward 0, no group has any variance,
and nothing trains again (measured here for seeds 0-2 at 1 and 2 threads alike; seed 5 collapses
the other way, into replies that never end)."""

from __future__ import annotations

import pytest
from pydantic import TypeAdapter
from stub_tasks import scored_task

from saccade.config import RunConfig, StallConfig, load_config, split_overrides
from saccade.metrics import read_metrics
from saccade.loops.stall import (
    StallState,
    StepSignal,
    Streak,
    after_rollback,
    describe_stall,
    observe,
    stall_action,
)

HEALTHY = dict(groups_with_signal_frac=0.75, final_truncated_frac=0.1, accuracy=0.4)
NO_SIGNAL = dict(groups_with_signal_frac=0.0, final_truncated_frac=0.0, accuracy=0.0)  # every reply wrong, all end
CUT = dict(groups_with_signal_frac=0.25, final_truncated_frac=0.9, accuracy=0.0)  # some variance left, replies cut
COLLAPSED = dict(groups_with_signal_frac=0.0, final_truncated_frac=1.0, accuracy=0.0)  # both at once
SOLVED = dict(groups_with_signal_frac=0.0, final_truncated_frac=0.0, accuracy=1.0)  # every reply right


def stall_config(**fields) -> StallConfig:
    """A [stall] section as a config file gives it (`action` picks the variant; 'warn' unless told)."""
    return TypeAdapter(StallConfig).validate_python({"action": "warn", **fields})


def watch(kinds: list[dict], **stall) -> tuple[list[str], StallState]:
    """The action after each step of `kinds` (step k sampled from version k), and the last state;
    a "rollback" is carried out as train_rl does (the next step samples the restored weights)."""
    cfg = stall_config(steps=3, **stall)
    state, actions = StallState(), []
    for version, kind in enumerate(kinds):
        state = observe(state, StepSignal(**kind, sampled_version=version), cfg)
        action = stall_action(state, cfg)
        if action == "rollback":
            state = after_rollback(state, version + 1)
        actions.append(action)
    return actions, state


@pytest.mark.parametrize("kind", [NO_SIGNAL, CUT, COLLAPSED])
def test_either_kind_warns_once_when_its_streak_reaches_its_steps(kind):
    actions, state = watch([HEALTHY, kind, kind, kind, kind, kind])
    assert actions == ["go_on", "go_on", "go_on", "warn", "go_on", "go_on"]
    assert state.stalled(3) and state.since(3) == 1  # the first stalled step sampled version 1


def test_both_kinds_warn_each_once_and_a_broken_streak_starts_over():
    actions, _ = watch([NO_SIGNAL, NO_SIGNAL, CUT, CUT, CUT, HEALTHY, NO_SIGNAL, NO_SIGNAL, NO_SIGNAL])
    # no signal 2 steps, then cut 3 (the no-signal streak broke: CUT has variance), healthy, no signal 3
    assert actions == ["go_on"] * 4 + ["warn", "go_on", "go_on", "go_on", "warn"]


def test_a_collapse_that_starts_as_cut_replies_is_dated_from_them():
    actions, state = watch([HEALTHY, CUT, CUT, COLLAPSED, COLLAPSED, COLLAPSED])
    assert actions == ["go_on", "go_on", "go_on", "warn", "go_on", "warn"]
    assert state.truncated == Streak(5, 1) and state.no_signal == Streak(3, 3) and state.since(3) == 1


def test_a_solved_run_or_a_cut_share_at_the_threshold_is_no_stall():
    assert watch([SOLVED] * 5)[0] == ["go_on"] * 5
    half = dict(HEALTHY, final_truncated_frac=0.5)
    assert watch([half] * 5)[0] == ["go_on"] * 5  # "more than" the threshold
    assert watch([dict(COLLAPSED, groups_with_signal_frac=0.1)] * 4, truncated_frac=1.0)[0] == ["go_on"] * 4


@pytest.mark.parametrize("kind", [NO_SIGNAL, CUT])
def test_stop_acts_on_the_step_the_stall_is_seen(kind):
    actions, state = watch([HEALTHY, HEALTHY, kind, kind, kind], action="stop")
    assert actions == ["go_on"] * 4 + ["stop"]
    assert state.since(3) == 2


@pytest.mark.parametrize("kind", [NO_SIGNAL, CUT])
def test_rollback_restarts_the_streaks_and_counts(kind):
    actions, state = watch([HEALTHY, kind, kind, kind, HEALTHY, kind], action="rollback")
    assert actions == ["go_on", "go_on", "go_on", "rollback", "go_on", "go_on"]
    assert state.rollbacks == 1 and state.counts_from == 4
    assert state.metrics(3) == {"no_signal_steps": float(kind is NO_SIGNAL), "truncated_steps": float(kind is CUT),
                                "stalled": 0.0, "rollbacks": 1.0}


def test_rollbacks_stop_at_max_rollbacks_then_the_run_stops():
    actions, state = watch([COLLAPSED] * 9, action="rollback", max_rollbacks=2)
    assert actions == ["go_on", "go_on", "rollback", "go_on", "go_on", "rollback", "go_on", "go_on", "stop"]
    assert state.rollbacks == 2


def test_rollouts_sampled_before_a_rollback_do_not_count():
    """Sampled ahead (rollout.max_async_level 2): the two steps after the rollback still come
    from the weights it undid; they neither extend nor break a streak."""
    cfg = stall_config(steps=2, action="rollback")
    state = StallState()
    for version in (0, 1):
        state = observe(state, StepSignal(**NO_SIGNAL, sampled_version=version), cfg)
    assert stall_action(state, cfg) == "rollback"
    state = after_rollback(state, version=4)  # the step numbered 4 put the restored weights out as version 4
    for version in (2, 3):  # queued before the rollback
        state = observe(state, StepSignal(**NO_SIGNAL, sampled_version=version), cfg)
        assert stall_action(state, cfg) == "go_on" and state.no_signal == Streak()
    state = observe(state, StepSignal(**NO_SIGNAL, sampled_version=4), cfg)
    assert state.no_signal == Streak(1, 4)


def test_the_state_goes_into_a_checkpoint_and_back():
    import json

    _, state = watch([COLLAPSED] * 4, action="rollback", max_rollbacks=1)
    assert state != StallState()
    assert StallState.restored(json.loads(json.dumps(state.saved()))) == state
    assert StallState.restored(None) == StallState()  # a checkpoint from before the watch


def test_the_description_names_each_kind_and_the_figures():
    cfg = stall_config(steps=3)
    _, state = watch([COLLAPSED] * 3)
    figures = {"reward_mean": 0.0, "final_truncated_frac": 1.0, "completion_len_mean": 128.0}
    text = describe_stall(state, figures, cfg)
    assert text.startswith("no group has had reward variance for 3 steps")
    assert "more than 50% of the final replies have been cut at sampling.max_tokens for 3 steps" in text
    assert text.endswith("reward_mean 0, final_truncated_frac 1, completion_len_mean 128")


# --------------------------------------------------------------------------- real runs


def first_choice(text: str, sample) -> float:
    return float(text.strip().strip(".").lower() == sample.choices[0])


def collapsing_run(tmp_path, name: str, *extra: str) -> RunConfig:
    """The warm start at lr 1e-2, seed 0: collapsed from step 3 on; a stall after 3 steps of it."""
    from saccade.tools.demo import resolve_warm_start

    return resolve_warm_start(load_config(RunConfig, "configs/demo.toml", [
        "--model.path", "tiny-warm", "--trainer.seed", "0", "--trainer.lr", "1e-2",
        "--rollout.prompts_per_step", "8", "--rollout.group_size", "8",
        "--sampling.max_tokens", "4", "--loss.max_completion_tokens", "4",
        "--eval.every_steps", "0", "--stall.steps", "3", "--log.dir", str(tmp_path / name), *extra]))


def _train(cfg: RunConfig, **kwargs):
    from saccade.loops.rl import train_rl

    return train_rl(cfg, run_dir=cfg.run_dir, task=scored_task(cfg, first_choice), progress=False, **kwargs)


def _train_records(run_dir) -> list[dict]:
    return [r for r in read_metrics(run_dir) if r["phase"] == "train"]


@pytest.mark.slow
def test_a_collapsed_run_stops_and_the_command_it_prints_goes_on_from_before_the_stall(tmp_path):
    """stall.action = "stop": steps 3-5 sampled the collapsed weights of steps 2-4, so the run stops
    after step 5, saves nothing, sets aside the checkpoints of steps 2-4 and names step 1. The
    printed command, run as it is, goes on from step 1 at half the lr."""
    from saccade.loops.stall import StallError

    cfg = collapsing_run(tmp_path, "stop", "--trainer.steps", "10", "--stall.action", "stop",
                         "--checkpoint.every_steps", "1", "--checkpoint.keep_last", "10")
    with pytest.raises(StallError, match="no group has had reward variance for 3 steps") as stopped:
        _train(cfg)
    message = str(stopped.value)
    assert "It stopped after step 5 without saving its weights" in message
    assert "Go on from step 1, the last checkpoint from before the stall" in message
    command = message.splitlines()[-1].split()
    assert command == ["saccade", "rl", str(cfg.run_dir / "config.toml"), "--resume", "--trainer.lr", "0.005"]
    assert [(r["step"], r["stalled"]) for r in _train_records(cfg.run_dir)][-3:] == [(3, 0), (4, 0), (5, 1)]
    assert sorted(p.name for p in (cfg.run_dir / "checkpoints").iterdir()) == ["step_000001"]
    aside = cfg.run_dir / "checkpoints-stalled"
    assert sorted(p.name for p in aside.iterdir()) == [
        "metrics-to-step_000005.jsonl", "step_000002", "step_000003", "step_000004"]

    # The command, as `saccade rl` parses it (its first step).
    known, overrides = split_overrides(command[2:])
    resumed = load_config(RunConfig, known[0], overrides)
    _train(resumed, resume=known[1:] == ["--resume"], stop_after=1)
    records = _train_records(cfg.run_dir)
    assert [r["step"] for r in records] == [1, 2]  # metrics.jsonl cut back to step 1, as --resume does
    assert [r["lr"] for r in records] == [0.01, 0.005]
    assert [r["step"] for r in read_metrics(aside / "metrics-to-step_000005.jsonl")] == [1, 2, 3, 4, 5]


@pytest.mark.slow
def test_a_collapsed_run_rolls_back_to_its_start_at_a_lower_lr_and_learns(tmp_path):
    """stall.action = "rollback", a checkpoint every 4 steps: the run saves its start weights as step 0,
    collapses (steps 3-5 sampled the weights of steps 2-4), and after step 5 rolls back past the
    stalled checkpoint of step 4 (set aside) to step 0, at lr 1e-2 x 0.07 = 7e-4, saving the
    reloaded weights at once as step 5. It learns from there: the last steps' reward is far above
    the stalled level (0). The step count goes on forward: one metrics line per step, 1 to 22."""
    from safetensors.torch import load_file

    cfg = collapsing_run(tmp_path, "rollback", "--trainer.steps", "22", "--stall.action", "rollback",
                         "--stall.lr_factor", "0.07", "--checkpoint.every_steps", "4",
                         "--checkpoint.keep_last", "10")
    _train(cfg)
    records = _train_records(cfg.run_dir)
    assert [r["step"] for r in records] == list(range(1, 23))
    stalled = [r["step"] for r in records if r["stalled"]]
    assert stalled == [5] and records[4]["rollback_to_step"] == 0 and records[4]["rollback_lr"] == pytest.approx(7e-4)
    assert [r["rollbacks"] for r in records] == [0] * 4 + [1] * 18
    assert all(r["reward_mean"] == 0 for r in records[2:5])  # the collapse
    trained = [r["lr"] for r in records[5:] if "lr" in r]  # a step with no signal trains nothing, logs no lr
    assert len(trained) > 10 and trained == pytest.approx([7e-4] * len(trained))
    last = sorted(r["reward_mean"] for r in records[-5:])
    assert last[2] > 0.6, [r["reward_mean"] for r in records]  # the median: learning again
    checkpoints = cfg.run_dir / "checkpoints"
    assert sorted(p.name for p in checkpoints.iterdir()) == [
        f"step_{k:06d}" for k in (0, 5, 8, 12, 16, 20, 22)]
    assert [p.name for p in (cfg.run_dir / "checkpoints-stalled").iterdir()] == ["step_000004"]
    start, rolled = (load_file(checkpoints / f"step_00000{k}" / "model.safetensors") for k in (0, 5))
    assert all(rolled[name].equal(start[name]) for name in start)  # the start weights, exactly
    assert "lr_scale" in (checkpoints / "step_000005" / "state.json").read_text()


def test_the_cli_reports_a_stall_without_a_traceback(tmp_path, monkeypatch, capsys):
    """`saccade rl` prints a StallError's message (the command to go on with) and exits 3."""
    import saccade.loops.rl
    from saccade.cli import main
    from saccade.loops.stall import StallError

    def stalls(cfg, **kwargs):
        raise StallError("the run stalled: ...\n  saccade rl run/config.toml --resume --trainer.lr 0.005")

    monkeypatch.setattr(saccade.loops.rl, "train_rl", stalls)
    assert main(["rl", "--log.dir", str(tmp_path), "--trainer.device", "cpu"]) == 3
    err = capsys.readouterr().err
    assert err.startswith("saccade: stopped: the run stalled") and "Traceback" not in err
    assert err.rstrip().endswith("saccade rl run/config.toml --resume --trainer.lr 0.005")
