"""GRPO-family RL on a VLM, as one visible loop (`train_rl`).

Each step: take the next prompts from the task's stream (`saccade.data.rows.PromptStream`:
a broken data set row is skipped, listed in skipped.jsonl and counted); sample G answers or
episodes per prompt with the engine, score them, turn rewards into group-relative advantages
and keep the groups that carry a signal (`saccade.orchestrator.rollout.sample_step`); pack the
samples, built from the engine's own token ids, into this rank's micro-batches
(`saccade.trainer.packing.rank_micro_batches`); take `num_iterations` optimizer steps on the
clipped objective against the engine's logprobs (`saccade.trainer.step.train_step`). Then the
engine gets the new weights: free with the embedded engine (it shares the module); vLLM
servers get them from the run's transport, after every step or every `engine.sync_every_steps`.
What those calls share is built once per run (`RLStep`); `saccade bench step` builds and times
the very same step. The rest of the run's parts are built in one place (`saccade.loops.parts`),
and the checks after a step give one verdict (`saccade.loops.guards`).

Every image embedding a step reads is pinned in the cache from its rollout until its train
step has ended (`EmbeddingCache.pins`), so no budget can evict it in between.

Under torchrun the same loop runs on every rank (`saccade.distributed`, docs/distributed.md):
each samples its share of the prompts, all hold the whole step's scored batch, and each trains
its share of the micro-batches of the FSDP2-sharded model. One process is the same loop with
`World()`, every collective a no-op.

Rollouts come from a `RolloutSource` (saccade.orchestrator.source): at
`rollout.max_async_level` 0 each step samples after the previous step's weights reached the
engine; at k > 0 (vLLM servers) a thread samples up to k steps ahead while the trainer
trains, from the newest weights pushed by step s - k (k versions old when every step pushes;
a schedule, not a race, so the same at any world size and on a resume: the step after a periodic
checkpoint samples that checkpoint's weights), and TIS corrects for the lag (`loss.tis`). With every server gone every
rank saves the finished steps in one checkpoint and stops, saying what to restart.
Every `log.samples_every` steps rank 0 also writes the step's first prompts with their
completions to samples.jsonl (`saccade.loops.sample_log`), for a person to read, each reply's
logprob with and without its images beside it (`saccade.orchestrator.visual`; one process only).

Every step the stall watch (`saccade.loops.stall`, docs/stalls.md) reads the rollouts' figures: no
group with reward variance, or most replies cut at max_tokens, for `stall.steps` steps in a
row is a stalled (often collapsed) run. `stall.action` then warns, stops it naming the
command to go on with, or rolls it back to the last checkpoint from before the stall at a lower
lr (`RLStep.roll_back`) and trains on, the step count going forward.

Simplified on purpose:
- Sampling ahead is a thread in each trainer process, not an orchestrator process of its own:
  under torchrun every rank's thread samples its share of the step and gathers the groups
  over a gloo process group of its own (`World.with_own_group`), beside the trainer's.
- Rank 0 alone evaluates (greedy success on a held-out split, and with `eval.visual_gain` the
  same with every image blank: `eval_accuracy_blank`, `visual_gain`) while the other ranks
  wait, and rank 0 alone writes the metrics and the samples.
- Every rank reads and checks all of a step's rows (so all skip the same broken ones) and
  holds the whole step's scored groups, gathered to it.
- A step whose groups carry no signal trains on nothing; the run does not sample more to fill
  it (DAPO's dynamic sampling); the stall watch counts such steps.
- vLLM servers get the weights through the run's transport (`saccade.transports`: a folder, the
  LoRA adapter's folder, or a gloo process group), not over NCCL yet.
"""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

from saccade.config import RunConfig
from saccade.distributed import SINGLE, World
from saccade.loops.checkpointer import Checkpointer
from saccade.loops.parts import RunParts, rl_command
from saccade.loops.step_log import step_metrics
from saccade.metrics import format_step
from saccade.run.setup import Setup
from saccade.run.tasks import Task
from saccade.stopping import RunStopped, StopRequest

__all__ = ["rl_command", "stopped_on_request", "train_rl"]


def train_rl(cfg: RunConfig, *, run_dir: Path, resume: bool = False, setup: Setup | None = None,
             task: Task | None = None, stop_after: int | None = None, progress: bool = True,
             world: World = SINGLE, stop: StopRequest | None = None, fresh: bool = False) -> dict[str, Any]:
    """The RL loop; returns the last step's figures. The objective is the clipped policy
    gradient on group-relative advantages, `saccade.trainer.loss.policy_loss`, which phase 2 takes
    `num_iterations` optimizer steps on. `stop_after` ends early (tests); `stop`: a STOP file or a
    caught signal, after which the run saves and raises `RunStopped`. `world`: this rank (torchrun);
    rank 0 writes the metrics, every rank takes part in checkpoints and weight pushes. `fresh`: a
    new run in a folder holding another run's checkpoints moves them aside (else it is refused)."""
    run = RunParts.build(cfg, run_dir, resume=resume, setup=setup, task=task, stop_after=stop_after,
                         progress=progress, world=world, stop=stop, fresh=fresh)
    state, metrics = run.state, {}
    with run.open() as bar:
        for step in range(state.step, run.end):
            start = time.perf_counter()
            # 1. Rollouts: G per prompt, scored, advantages, the groups worth training on; their
            # image embeddings stay pinned in the cache until step 2 ends.
            rollouts, waited_s, queue_depth = run.source.get(step)
            state.data_position, rollout_s = rollouts.rows.end, time.perf_counter() - start
            # 2. Train: this rank's micro-batches, `num_iterations` optimizer steps.
            train_metrics = run.rl.train(step, rollouts)
            train_s = time.perf_counter() - start - rollout_s
            # 3. The guards (loops/guards.py): the model match, the stall watch (it may roll back now,
            # before the weights go out), the non-finite streak; one verdict, acted on in 5.
            verdict = run.guards.after_train(step, rollouts, train_metrics, state)
            # 4. Weights to the engine, when due or when the run evaluates or checkpoints now.
            state.step = step + 1
            forced = run.evaluator.due(state.step) or run.checkpoints.due(state.step, rolled_back=verdict.rolled_back)
            sync_s, gone = run.weights.after_step(state, forced=forced)
            # 5. Metrics and evaluation, logged; then stop for a lost server or a guard, or checkpoint.
            metrics = step_metrics(
                rollouts, train_metrics, run.setup, run.counters.step(), rollout_s=rollout_s, train_s=train_s,
                weight_sync_s=sync_s, step_s=time.perf_counter() - start, trainer_idle_s=waited_s,
                rollout_queue_depth=float(queue_depth), dataset=run.rl.fits is not None)
            metrics.update(verdict.figures, **run.weights.figures,
                           **(run.evaluator.after_step(state.step, run.logger) if gone is None else {}))
            run.logger.log(state.step, metrics)
            bar(format_step(metrics), note=run.samples.after_step(state.step, rollouts))
            if gone is not None:
                raise gone
            if verdict.stop is not None:
                raise verdict.stop(state, metrics)
            saved = run.checkpoints.after_step(state, rolled_back=verdict.rolled_back)
            # 6. Asked to stop (STOP file, Ctrl-C): every rank alike, after a checkpoint.
            if state.step < run.end and run.stop.agreed(world, run.setup.device):
                raise stopped_on_request(run.checkpoints, state, saved, run.stop, world)
    return {"step": state.step, "last": metrics, "setup": run.setup}


def stopped_on_request(checkpoints: Checkpointer, state, saved: Path | None, stop: StopRequest,
                       world: World) -> RunStopped:
    """A run asked to stop: its checkpoint (unless this step's was just written), the message every
    rank agrees on, STOPPED written (`StopRequest.done`)."""
    if saved is None:
        state.policy_version = state.step  # the weights saved: a resume pushes them as this version
        saved = checkpoints.save(state)
    message = (f"stopped on request after step {state.step}; saved {saved}; go on with: "
               f"{rl_command(checkpoints.run_dir, world)} --resume")
    stop.done(message, world)
    return RunStopped(message)
