"""The stall watch's rule (`saccade.stall`) over crafted step figures: both kinds of stall,
each response, the streaks that break, the rollouts of undone weights, and the limit on
rollbacks. Every step here is on-policy (sampled from the weights of the step before)
unless a test says otherwise."""

from __future__ import annotations

import pytest

from saccade.config import RolloutConfig
from saccade.stall import (
    StallState,
    StepSignal,
    Streak,
    after_rollback,
    describe_stall,
    observe,
    stall_action,
)

HEALTHY = dict(groups_with_signal_frac=0.75, truncated_frac=0.1, accuracy=0.4)
NO_SIGNAL = dict(groups_with_signal_frac=0.0, truncated_frac=0.0, accuracy=0.0)  # every reply wrong, all end
CUT = dict(groups_with_signal_frac=0.25, truncated_frac=0.9, accuracy=0.0)  # some variance left, replies cut
COLLAPSED = dict(groups_with_signal_frac=0.0, truncated_frac=1.0, accuracy=0.0)  # both at once
SOLVED = dict(groups_with_signal_frac=0.0, truncated_frac=0.0, accuracy=1.0)  # every reply right


def watch(kinds: list[dict], **rollout) -> tuple[list[str], StallState]:
    """The action after each step of `kinds` (step k sampled from version k), and the last state;
    a "rollback" is carried out as train_rl does (the next step samples the restored weights)."""
    cfg = RolloutConfig(stall_steps=3, **rollout)
    state, actions = StallState(), []
    for version, kind in enumerate(kinds):
        state = observe(state, StepSignal(**kind, sampled_version=version), cfg)
        action = stall_action(state, cfg)
        if action == "rollback":
            state = after_rollback(state, version + 1)
        actions.append(action)
    return actions, state


@pytest.mark.parametrize("kind", [NO_SIGNAL, CUT, COLLAPSED])
def test_either_kind_warns_once_when_its_streak_reaches_stall_steps(kind):
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
    half = dict(HEALTHY, truncated_frac=0.5)
    assert watch([half] * 5)[0] == ["go_on"] * 5  # "more than" the threshold
    assert watch([dict(COLLAPSED, groups_with_signal_frac=0.1)] * 4, stall_truncated_frac=1.0)[0] == ["go_on"] * 4


@pytest.mark.parametrize("kind", [NO_SIGNAL, CUT])
def test_stop_acts_on_the_step_the_stall_is_seen(kind):
    actions, state = watch([HEALTHY, HEALTHY, kind, kind, kind], on_stall="stop")
    assert actions == ["go_on"] * 4 + ["stop"]
    assert state.since(3) == 2


@pytest.mark.parametrize("kind", [NO_SIGNAL, CUT])
def test_rollback_restarts_the_streaks_and_counts(kind):
    actions, state = watch([HEALTHY, kind, kind, kind, HEALTHY, kind], on_stall="rollback")
    assert actions == ["go_on", "go_on", "go_on", "rollback", "go_on", "go_on"]
    assert state.rollbacks == 1 and state.counts_from == 4
    assert state.metrics(3) == {"no_signal_steps": float(kind is NO_SIGNAL), "truncated_steps": float(kind is CUT),
                                "stalled": 0.0, "rollbacks": 1.0}


def test_rollbacks_stop_at_max_rollbacks_then_the_run_stops():
    actions, state = watch([COLLAPSED] * 9, on_stall="rollback", max_rollbacks=2)
    assert actions == ["go_on", "go_on", "rollback", "go_on", "go_on", "rollback", "go_on", "go_on", "stop"]
    assert state.rollbacks == 2


def test_rollouts_sampled_before_a_rollback_do_not_count():
    """Sampled ahead (rollout.max_async_level 2): the two steps after the rollback still come
    from the weights it undid; they neither extend nor break a streak."""
    cfg = RolloutConfig(stall_steps=2, on_stall="rollback")
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


def test_the_description_names_each_kind_and_the_figures():
    cfg = RolloutConfig(stall_steps=3)
    _, state = watch([COLLAPSED] * 3)
    text = describe_stall(state, {"reward_mean": 0.0, "truncated_frac": 1.0, "completion_len_mean": 128.0}, cfg)
    assert text.startswith("no group has had reward variance for 3 steps")
    assert "more than 50% of the replies have been cut at sampling.max_tokens for 3 steps" in text
    assert text.endswith("reward_mean 0, truncated_frac 1, completion_len_mean 128")
