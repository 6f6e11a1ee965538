"""New weights to the engine, when due: every `engine.sync_every_steps` steps, whenever the run
evaluates, checkpoints, rolls back or ends (so those see, and a resume restarts from, the
current weights), and once at the start (a vLLM server may still hold the base model, or another
run's; the embedded engine shares the trainer's module and is always current). Rank 0 pushes;
every rank learns how it went, and none samples again before the servers hold the new weights;
then every rank's engine refuses a server still answering under older ones (one rank 0 took out
while another rank still sends it requests: `ServerClient.confirm`).
Rollouts sampled ahead go on meanwhile, on the weights the servers hold.
"""

from __future__ import annotations

from saccade.config import RunConfig
from saccade.distributed import World, barrier, first_error
from saccade.inference.engine import Engine
from saccade.inference.servers import NoServerError
from saccade.orchestrator.source import RolloutSource
from saccade.trainer.checkpoint.saving import TrainState


class WeightSync:
    def __init__(self, cfg: RunConfig, engine: Engine, source: RolloutSource, world: World, *, end: int):
        self.every, self.engine, self.source, self.world, self.end = cfg.engine.sync_every_steps, engine, source, world, end

    def due(self, step: int, *, forced: bool) -> bool:
        return step % self.every == 0 or forced or step == self.end

    def after_step(self, state: TrainState, *, forced: bool) -> tuple[float, NoServerError | None]:
        """Push the weights after `state.step` steps when due (`forced`: the run evaluates or
        checkpoints now). Returns the seconds it took and, with every server gone, the error (the
        step is logged, then the run checkpoints and stops)."""
        sync_s, gone = 0.0, None
        if self.due(state.step, forced=forced):
            self.source.wait_to_push(state.step)  # first, the steps due to sample older weights
            try:
                sync_s = self.engine.update_weights(version=state.step)
            except NoServerError as err:
                gone = err
            gone = first_error(gone, self.world)
            if gone is None:
                self.engine.confirm_weights(state.step)
        state.policy_version = self.engine.policy_version
        if gone is None:
            self.source.trained(state.step - 1)
        return sync_s, gone


def push_start_weights(engine: Engine, state: TrainState, world: World) -> None:
    """From the first step on, the engine samples from exactly the trainer's weights."""
    engine.update_weights(version=state.policy_version)
    barrier(world)  # rank 0's push has returned
    engine.confirm_weights(state.policy_version)
