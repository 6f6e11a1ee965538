"""The stall watch as the loop runs it: it reads each step's rollouts and returns what the run
does (`StallVerdict`), deciding itself when to warn, roll back (through the `Checkpointer`, before
the weights go to the engine) or stop. The rule itself is `saccade.loops.stall`'s pure functions
(docs/stalls.md); its state goes into every checkpoint, so a resume keeps the streaks.
"""

from __future__ import annotations

import shutil
import warnings
from dataclasses import dataclass, field
from pathlib import Path

from saccade.config import RunConfig, StallRollbackConfig
from saccade.distributed import World, barrier
from saccade.loops.checkpointer import Checkpointer
from saccade.metrics import METRICS_FILE
from saccade.loops.stall import (
    StallError, StallState, StepSignal, after_rollback, describe_stall, observe, stall_action, stall_warning,
)
from saccade.trainer.checkpoint.saving import TrainState
from saccade.trainer.checkpoint.folder import STALLED_DIR, checkpoint_before, set_aside_checkpoints

# TrainState.extra's key for the stall watch's state (`StallState.saved`): its streaks and rollbacks.
STALL = "stall"


@dataclass
class StallVerdict:
    """What a step's stall check decided: the figures it logs, whether it rolled the weights back
    (they are then saved at once), whether the run stops once the step is logged."""

    figures: dict[str, float] = field(default_factory=dict)
    rolled_back: bool = False
    stop: bool = False


class StallWatch:
    """No group with reward variance, or most replies cut at max_tokens, for stall.steps steps in a
    row. Every rank holds the same figures, so all decide alike."""

    def __init__(self, cfg: RunConfig, checkpoints: Checkpointer, state: TrainState, world: World):
        self.cfg, self.watch, self.checkpoints, self.world = cfg, cfg.stall, checkpoints, world
        self.run_dir = checkpoints.run_dir
        self.state = StallState.restored(state.extra.get(STALL))

    def start(self, state: TrainState, *, resume: bool) -> None:
        """A run that rolls back saves its start: a stall before the first checkpoint goes back here."""
        if self.watch.action == "rollback" and not resume:
            self.checkpoints.save(state)

    def after_train(self, step: int, metrics: dict[str, float], state: TrainState) -> StallVerdict:
        """Step `step`'s rollout figures observed: warn (rank 0 says it), roll back now, or stop."""
        watch = self.watch
        self.state = observe(self.state, StepSignal.of(metrics), watch)
        action = stall_action(self.state, watch)
        verdict = StallVerdict(figures=self.state.metrics(watch.steps))  # before a rollback restarts the streaks
        if action == "warn" and self.world.is_main:
            warnings.warn(stall_warning(self.state, metrics, watch, self.run_dir / METRICS_FILE),
                          RuntimeWarning, stacklevel=3)
        if action == "rollback":
            rolled_back = self.checkpoints.roll_back(state, since=self.state.since(watch.steps))
            if rolled_back:  # rollouts from here on sample the restored weights, version step + 1
                self.state = after_rollback(self.state, version=step + 1)
                verdict.figures.update(rolled_back, rollbacks=float(self.state.rollbacks))
                verdict.rolled_back = True
            else:  # no checkpoint from before the stall is left
                action = "stop"
        verdict.stop = action == "stop"
        state.extra[STALL] = self.state.saved()  # a resume goes on with the same streaks
        return verdict

    def stopped(self, step: int, metrics: dict[str, float], command: str) -> StallError:
        """The error that ends a stalled run (stall.action "stop", or "rollback" with no rollback left):
        the checkpoints from the stall on set aside, so that `--resume` loads the last one from
        before it, and the command to go on with at a lower lr. A collapsed policy's weights are not
        worth a checkpoint. `--resume` cuts metrics.jsonl back to the checkpoint's step, so the
        stalled run's metrics are kept aside too."""
        watch, run_dir, cfg = self.watch, self.run_dir, self.cfg
        since = self.state.since(watch.steps)  # the stall's first step sampled these weights: they and later ones stalled
        found = checkpoint_before(run_dir, since)
        aside, moved = run_dir / STALLED_DIR, []
        if self.world.is_main:
            moved = set_aside_checkpoints(run_dir, since)
            if found is not None and (run_dir / METRICS_FILE).exists():
                aside.mkdir(exist_ok=True)
                shutil.copyfile(run_dir / METRICS_FILE, aside / f"metrics-to-step_{step:06d}.jsonl")
        barrier(self.world)
        return stall_error(self.state, metrics, cfg, step=step, since=since, found=found, moved=bool(moved),
                           aside=aside, command=command)


def stall_error(stall: StallState, metrics: dict[str, float], cfg: RunConfig, *, step: int, since: int,
                found: tuple[int, Path] | None, moved: bool, aside: Path, command: str) -> StallError:
    """What a stalled run's stop says: what stalled, what was set aside, and what to run next."""
    watch = cfg.stall
    text = f"the run stalled: {describe_stall(stall, metrics, watch)}. It stopped after step {step}"
    if isinstance(watch, StallRollbackConfig) and stall.rollbacks >= watch.max_rollbacks:
        text += f", its stall.max_rollbacks ({watch.max_rollbacks}) rollbacks spent,"
    text += " without saving its weights (a stalled policy is not worth a checkpoint)"
    if moved:
        text += f"; the checkpoints written since the stall began are set aside in {aside}"
    # The lower lr to go on at: the rollback's factor (its default, half, for 'stop').
    factor = (watch if isinstance(watch, StallRollbackConfig) else StallRollbackConfig()).lr_factor
    lower = f"{cfg.trainer.lr * factor:g}"
    if found is not None:
        return StallError(
            f"{text}. Go on from step {found[0]}, the last checkpoint from before the stall, at a lower learning "
            f"rate (--resume cuts metrics.jsonl back to that step; the stalled run's is kept in {aside}):\n"
            f"  {command} --resume --trainer.lr {lower}")
    if since == 0:
        return StallError(
            f"{text}. It stalled from its first step, so the start weights did, not training: check that the "
            "rewards can tell a prompt's replies apart (docs/rewards.md); if the replies are cut from the start, "
            "raise sampling.max_tokens; else raise rollout.group_size or sampling.temperature")
    return StallError(
        f"{text}. No checkpoint from before the stall (its first step sampled the weights of step {since}) is "
        f"left (checkpoint.every_steps {cfg.checkpoint.every_steps}, keep_last {cfg.checkpoint.keep_last}); "
        f"start again at a lower learning rate:\n  {command} --trainer.lr {lower}")
