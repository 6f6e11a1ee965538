"""The checks after each train step, as one verdict (`StepGuards.after_train`): the loop logs the
step, then stops if a guard asked it to. Each guard is a part that decides its own "when":

- `ModelMatch`: at the first step whose metrics hold tokens sampled under exactly the weights
  being trained, the trainer and the engine scored them alike (`saccade.model_match`); otherwise
  the run stops at once, before anything is saved;
- the stall watch (`saccade.loops.stall_watch`): warn, roll back now, or stop once logged, the
  stalled weights not saved;
- `NonfiniteStreak`: `trainer.max_nonfinite_steps` steps in a row whose every optimizer step was
  skipped for a non-finite loss or gradient train nothing: the run saves (the weights are those
  from before them) and stops, saying where to look;
- `ImageMismatch`: the images' own trainer-engine gap (the tokens after an image against the
  text-only ones, `mismatch_abs_image_lag{k}` / `mismatch_abs_text_lag{k}`) past
  `engine.image_mismatch_limit`: warned about, or the run stops once the step is logged, nothing saved.

A new guard is a class with `after_train(step, rollouts, train_metrics, state) -> Verdict` and a
line in `StepGuards.__init__`.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, Protocol

from saccade.config import RunConfig
from saccade.distributed import World
from saccade.loops.checkpointer import Checkpointer
from saccade.loops.stall import StallError
from saccade.loops.stall_watch import StallWatch
from saccade.model_match import ModelMatchGuard
from saccade.trainer.checkpoint.saving import TrainState

log = logging.getLogger(__name__)

# What stops a run once its step is logged: the state and the step's metrics -> the error to raise.
Stop = Callable[[TrainState, dict[str, float]], Exception]


@dataclass
class Verdict:
    """A step's checks: the figures they log, whether the weights were rolled back (then saved at
    once), and, when the run stops after logging the step, how (`stop`)."""

    figures: dict[str, float] = field(default_factory=dict)
    rolled_back: bool = False
    stop: Stop | None = None


class Guard(Protocol):
    def after_train(self, step: int, rollouts: Any, train_metrics: dict[str, float], state: TrainState) -> Verdict:
        ...


class ModelMatch:
    """`saccade.model_match.ModelMatchGuard` as a guard: it raises at once, nothing saved."""

    def __init__(self, cfg: RunConfig):
        self.guard = ModelMatchGuard.of(cfg)

    def after_train(self, step, rollouts, train_metrics, state) -> Verdict:
        self.guard.after_train(step, train_metrics)
        return Verdict()


def nonfinite_streak(streak: int, train_metrics: dict[str, Any], num_iterations: int) -> int:
    """Steps in a row whose every optimizer step was skipped (NaN/inf loss or gradients), this
    step's included: such a step leaves the weights as they were, so a run of them trains nothing."""
    return streak + 1 if train_metrics.get("skipped_steps", 0.0) >= num_iterations else 0


class NonfiniteStreak:
    def __init__(self, cfg: RunConfig, checkpoints: Checkpointer, command: str):
        self.most, self.iterations = cfg.trainer.max_nonfinite_steps, cfg.trainer.num_iterations
        self.checkpoints, self.command, self.streak = checkpoints, command, 0

    def after_train(self, step, rollouts, train_metrics, state) -> Verdict:
        self.streak = nonfinite_streak(self.streak, train_metrics, self.iterations)
        return Verdict(stop=self.stopped if self.most and self.streak >= self.most else None)

    def stopped(self, state: TrainState, metrics: dict[str, float]) -> StallError:
        state.policy_version = state.step  # the weights are unchanged by those steps: saved as they are
        return StallError(
            f"{self.streak} steps in a row had every optimizer step skipped for a non-finite loss or gradient "
            f"(trainer.max_nonfinite_steps = {self.most}), up to step {state.step}: the run trains nothing. Saved "
            f"{self.checkpoints.save(state)}, the weights from before them. Look for the cause (a lower trainer.lr, "
            f"model.dtype float32, the data rows of those steps), then go on with: {self.command} --resume")


class ImageMismatchError(RuntimeError):
    """The tokens after an image were scored further apart by the trainer and the engine than the budget."""


def image_excess(train_metrics: dict[str, float]) -> tuple[int, float] | None:
    """(lag, excess) at the lag where the tokens after an image differ most from the engine's beyond
    the text-only tokens' gap; None when no lag can be judged. At lag 0 the gap is the numerics alone
    (with no text-only token the excess is the image tokens' whole gap); at a lag > 0 it includes the
    policy's move, so a lag is judged only against text-only tokens of the same lag."""
    worst = None
    for name, gap in train_metrics.items():
        if not name.startswith("mismatch_abs_image_lag"):
            continue
        lag = int(name.removeprefix("mismatch_abs_image_lag"))
        text = train_metrics.get(f"mismatch_abs_text_lag{lag}")
        if text is None and lag > 0:
            continue
        excess = gap - (text or 0.0)
        if worst is None or excess > worst[1]:
            worst = (lag, excess)
    return worst


class ImageMismatch:
    """The images' own gap against `engine.image_mismatch_limit` (`image_excess`), every step."""

    def __init__(self, cfg: RunConfig, world: World):
        self.limit, self.action = cfg.engine.image_mismatch_limit, cfg.engine.image_mismatch_action
        self.engine, self.world = cfg.engine.kind, world

    def after_train(self, step, rollouts, train_metrics, state) -> Verdict:
        found = image_excess(train_metrics) if self.limit is not None else None
        if found is None:
            return Verdict()
        lag, excess = found
        figures = {"image_mismatch_excess": excess}
        if excess <= self.limit:
            return Verdict(figures)
        text = train_metrics.get(f"mismatch_abs_text_lag{lag}")
        message = (
            f"step {step + 1}: the trainer scores the tokens after an image {excess:.3g} further from the "
            f"{self.engine} engine's logprobs than the text-only tokens (lag {lag}: after an image "
            f"{train_metrics[f'mismatch_abs_image_lag{lag}']:.3g}, text-only "
            f"{'none' if text is None else format(text, '.3g')}), over engine.image_mismatch_limit {self.limit:g}: the "
            f"two sides place or encode the images differently. Likely causes: image positions (M-RoPE) computed "
            f"otherwise on one side; another vision tower or image processor on the engine; other image bounds")
        if self.action == "warn":
            if self.world.is_main:
                log.warning("%s (engine.image_mismatch_action = 'warn': the run goes on)", message)
            return Verdict(figures)
        return Verdict(figures, stop=lambda state, metrics: ImageMismatchError(
            f"{message}. The run stopped after logging the step, saving nothing (engine.image_mismatch_action = "
            "'stop')"))


class Stall:
    """The stall watch (`StallWatch`) as a guard."""

    def __init__(self, watch: StallWatch, command: str):
        self.watch, self.command = watch, command

    def after_train(self, step, rollouts, train_metrics, state) -> Verdict:
        stall = self.watch.after_train(step, rollouts.batch.metrics, state)
        stop = (lambda state, metrics: self.watch.stopped(state.step, metrics, self.command)) if stall.stop else None
        return Verdict(figures=stall.figures, rolled_back=stall.rolled_back, stop=stop)


class StepGuards:
    """Every guard, in order; their verdicts as one. The stall watch's streaks are restored from
    the run's state and saved in every checkpoint."""

    def __init__(self, cfg: RunConfig, checkpoints: Checkpointer, state: TrainState, world: World, *, command: str):
        self.stall_watch = StallWatch(cfg, checkpoints, state, world)
        # In this order: a stall's stop goes before the non-finite streak's (the stalled weights are not saved).
        self.guards: list[Guard] = [ModelMatch(cfg), Stall(self.stall_watch, command),
                                    NonfiniteStreak(cfg, checkpoints, command), ImageMismatch(cfg, world)]

    def start(self, state: TrainState, *, resume: bool) -> None:
        self.stall_watch.start(state, resume=resume)

    def after_train(self, step: int, rollouts, train_metrics: dict[str, float], state: TrainState) -> Verdict:
        """Every guard's check of step `step`; the first that asks to stop decides how."""
        out = Verdict()
        for guard in self.guards:
            verdict = guard.after_train(step, rollouts, train_metrics, state)
            out.figures.update(verdict.figures)
            out.rolled_back = out.rolled_back or verdict.rolled_back
            out.stop = out.stop or verdict.stop
        return out
