"""New weights to the engine, when due: every `engine.sync_every_steps` steps, whenever the run
evaluates, checkpoints, rolls back or ends (so those see, and a resume restarts from, the
current weights), and once at the start (a vLLM server may still hold the base model, or another
run's; the embedded engine shares the trainer's module and is always current). Rank 0 pushes;
every rank learns how it went, and none samples again before the servers hold the new weights;
then every rank's engine refuses a server still answering under older ones (one rank 0 took out
while another rank still sends it requests: `ServerClient.confirm`).
Rollouts sampled ahead go on meanwhile, on the weights the servers hold.

On vLLM servers every push (every `engine.probe.every_syncs`-th) is checked on every server
(`saccade.loops.push_check`): each server answers a fixed probe after the push, the trainer scores
the answers, and one far from the trainer is taken out or stops the run.
"""

from __future__ import annotations

from saccade.config import RunConfig
from saccade.distributed import World, barrier, first_error
from saccade.inference.engine import Engine
from saccade.inference.servers import NoServerError
from saccade.loops.push_check import PushCheck
from saccade.orchestrator.source import RolloutSource
from saccade.trainer.checkpoint.saving import TrainState


class WeightSync:
    def __init__(self, cfg: RunConfig, engine: Engine, source: RolloutSource, world: World, *, end: int,
                 check: PushCheck | None = None):
        self.every, self.engine, self.source, self.world = cfg.engine.sync_every_steps, engine, source, world
        self.end, self.check = end, check
        self.figures: dict[str, float] = {}  # the last sync's push check figures (probe_s, probe_gap, ...)

    def due(self, step: int, *, forced: bool) -> bool:
        return step % self.every == 0 or forced or step == self.end

    def after_step(self, state: TrainState, *, forced: bool) -> tuple[float, NoServerError | None]:
        """Push the weights after `state.step` steps when due (`forced`: the run evaluates or
        checkpoints now). Returns the seconds it took and, with every server gone (or one refused
        by the push check with engine.probe.action 'stop'), the error (the step is logged, then the
        run checkpoints and stops). The push check's figures are left in `figures`."""
        sync_s, gone, self.figures = 0.0, None, {}
        if self.due(state.step, forced=forced):
            self.source.wait_to_push(state.step)  # first, the steps due to sample older weights
            sync_s, gone, self.figures = push_checked(self.engine, self.check, state.step, self.world)
        state.policy_version = self.engine.policy_version
        if gone is None:
            self.source.trained(state.step - 1)
        return sync_s, gone


def push_checked(engine: Engine, check: PushCheck | None, version: int,
                 world: World) -> tuple[float, NoServerError | None, dict[str, float]]:
    """Every rank: the weights to the engine as `version`, then the push check (when the run has one);
    (seconds of the push, the error that stops the run or None, the check's figures)."""
    sync_s, gone, figures = 0.0, None, {}
    try:
        sync_s = engine.update_weights(version=version)
    except NoServerError as err:
        gone = err
    gone = first_error(gone, world)
    if gone is None and check is not None:
        figures, gone = check.after_push(version)
    if gone is None:
        engine.confirm_weights(version)
    return sync_s, gone, figures


def push_start_weights(engine: Engine, state: TrainState, world: World, check: PushCheck | None = None) -> None:
    """From the first step on, the engine samples from exactly the trainer's weights; on vLLM servers
    the push check's first probe has found each of them to hold them (a server far off is taken out,
    or the run stops before its first step)."""
    _, gone, _ = push_checked(engine, check, state.policy_version, world)
    if gone is not None:
        raise gone
    barrier(world)  # rank 0's push has returned
