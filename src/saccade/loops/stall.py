"""The stall watch: the GRPO failure users hit most, caught, and what the run then does.

The policy collapses, often into replies that no longer end (each one cut at
sampling.max_tokens); every sample of a prompt then scores the same, no group has reward
variance, every advantage is 0 and learning stops. Nothing fails: the loop goes on, the
weights never move again. Two kinds of step count towards a stall, each in its own streak:
- no signal: no group had reward variance (`groups_with_signal_frac` 0), and not every
  reply was correct (a policy that answers everything right has nothing left to learn; that
  is no collapse, and going back from it would undo the run);
- truncated: more than `stall.truncated_frac` of the answers or episodes ended on a
  reply cut at sampling.max_tokens (`final_truncated_frac`; single-turn: the share of replies
  cut). Past half, most answers are cut before they end, and such a run can still have a
  little variance left (a reward for the format, a lucky short reply), so this kind sees the
  collapse that the first would only see once it is complete. Final replies, not all of them:
  a multi-turn run whose groups still vary can have half its replies cut (the views demo's
  look turns: 0.44 of all its replies over 300 steps, 0.06 of its final ones).
A run has stalled when either streak reaches `stall.steps` steps. Then `stall.action` says
what happens: "warn" (once per streak), "stop", or "rollback" (at most `stall.max_rollbacks`
times; a stall after the last stops the run).

`observe` (the state updated with a step's figures) and `stall_action` (state in, action out)
are the whole rule, pure functions tested on crafted sequences (tests/loops/test_stall.py); `train_rl`
does what they say. Where a stall began is known by the policy version its first step sampled
from (`Streak.since`): a rollback goes back to a checkpoint older than that.

No torch here: the CLI imports `StallError` to report it.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import asdict, dataclass, replace
from typing import Literal

from saccade.config import StallConfig, StallRollbackConfig

Action = Literal["go_on", "warn", "stop", "rollback"]


class StallError(RuntimeError):
    """A stalled run stopped (`stall.action` "stop", or "rollback" with nothing left to go
    back to); the message names what to run next. `saccade rl` prints it and exits with 3."""


@dataclass(frozen=True)
class Streak:
    """Steps in a row of one kind, and the policy version the first of them sampled from."""

    steps: int = 0
    since: int = 0

    def extend(self, hit: bool, version: int) -> Streak:
        if not hit:
            return Streak()
        return Streak(self.steps + 1, self.since if self.steps else version)


@dataclass(frozen=True)
class StepSignal:
    """What one step's rollouts say about a stall (`StepSignal.of` reads them from its metrics)."""

    groups_with_signal_frac: float  # groups with reward variance
    final_truncated_frac: float  # answers or episodes whose final reply was cut at sampling.max_tokens
    accuracy: float  # replies scored fully correct
    sampled_version: int  # the oldest weights the step's rollouts were sampled from

    @classmethod
    def of(cls, metrics: Mapping[str, float]) -> StepSignal:
        return cls(metrics["groups_with_signal_frac"], metrics["final_truncated_frac"], metrics["accuracy"],
                   int(metrics["sampled_policy_version"]))


@dataclass(frozen=True)
class StallState:
    """The watch's state between steps: the two streaks, the rollbacks made, and the first
    policy version whose rollouts count (rollouts sampled ahead from the weights a rollback
    undid do not: with rollout.max_async_level k, up to k steps of them are still queued)."""

    no_signal: Streak = Streak()
    truncated: Streak = Streak()
    rollbacks: int = 0
    counts_from: int = 0

    def reached(self, stall_steps: int) -> list[Streak]:
        """The streaks that reached `stall_steps` with this step: each acts once."""
        return [s for s in (self.no_signal, self.truncated) if s.steps == stall_steps]

    def stalled(self, stall_steps: int) -> bool:
        return max(self.no_signal.steps, self.truncated.steps) >= stall_steps

    def since(self, stall_steps: int) -> int:
        """The policy version the stall's first step sampled from (the earlier of the two streaks
        that have stalled): the weights from there on are the stalled ones."""
        stalled = [s.since for s in (self.no_signal, self.truncated) if s.steps >= stall_steps]
        assert stalled, "since() of a run that has not stalled"
        return min(stalled)

    def saved(self) -> dict:
        """The state as JSON values, for a checkpoint's TrainState.extra (a resumed run goes on
        with the same streaks, so its figures are the uninterrupted run's)."""
        return asdict(self)

    @classmethod
    def restored(cls, saved: Mapping | None) -> StallState:
        """The state `saved()` wrote; a fresh one for a checkpoint without it."""
        if not saved:
            return cls()
        return cls(Streak(**saved["no_signal"]), Streak(**saved["truncated"]), saved["rollbacks"],
                   saved["counts_from"])

    def metrics(self, stall_steps: int) -> dict[str, float]:
        """What every step logs: the streaks, whether the run has stalled, the rollbacks so far."""
        return {"no_signal_steps": float(self.no_signal.steps), "truncated_steps": float(self.truncated.steps),
                "stalled": float(self.stalled(stall_steps)), "rollbacks": float(self.rollbacks)}


def observe(state: StallState, seen: StepSignal, watch: StallConfig) -> StallState:
    """The state after a step whose rollouts showed `seen`."""
    if seen.sampled_version < state.counts_from:  # sampled before a rollback, from the weights it undid
        return state
    no_signal = seen.groups_with_signal_frac == 0 and seen.accuracy < 1.0
    truncated = seen.final_truncated_frac > watch.truncated_frac
    return replace(state, no_signal=state.no_signal.extend(no_signal, seen.sampled_version),
                   truncated=state.truncated.extend(truncated, seen.sampled_version))


def stall_action(state: StallState, watch: StallConfig) -> Action:
    """What the run does after the step `state` has observed: it acts the step a streak reaches
    stall.steps, so "warn" says it once per streak, however long the stall lasts."""
    if not state.reached(watch.steps):
        return "go_on"
    if watch.action == "warn":
        return "warn"
    if isinstance(watch, StallRollbackConfig) and state.rollbacks < watch.max_rollbacks:
        return "rollback"
    return "stop"


def after_rollback(state: StallState, version: int) -> StallState:
    """The state once the run went back: streaks restarted, the rollback counted, rollouts
    sampled from policy versions before `version` (the rolled-back weights') not counted."""
    return StallState(rollbacks=state.rollbacks + 1, counts_from=version)


def describe_stall(state: StallState, metrics: Mapping[str, float], watch: StallConfig) -> str:
    """What has stalled, in words, with the step's figures that show it."""
    n = watch.steps
    parts = []
    if state.no_signal.steps >= n:
        parts.append(f"no group has had reward variance for {state.no_signal.steps} steps (every episode of a prompt "
                     f"scores the same, so the weights have not changed since)")
    if state.truncated.steps >= n:
        parts.append(f"more than {watch.truncated_frac:.0%} of the final replies have been cut at "
                     f"sampling.max_tokens for {state.truncated.steps} steps (they no longer end)")
    figures = ", ".join(f"{k} {metrics[k]:.3g}" for k in ("reward_mean", "final_truncated_frac", "completion_len_mean")
                        if k in metrics)
    return " and ".join(parts) + f"; {figures}"


def stall_warning(state: StallState, metrics: Mapping[str, float], watch: StallConfig, metrics_path) -> str:
    """stall.action = "warn": the stall, where to look, and what to change."""
    return (f"{describe_stall(state, metrics, watch)}. See {metrics_path}; if the policy collapsed, resume from "
            "an earlier checkpoint with a lower trainer.lr (or set stall.action = 'rollback' to have the run "
            "do it), or raise rollout.group_size or sampling.temperature; if the replies are cut from the first "
            "step on, raise sampling.max_tokens")
