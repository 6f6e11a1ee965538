"""GRPO-family RL on a VLM, as one visible loop (`train_rl`).

Each step: take the next prompts from the task's stream (`saccade.data.rows.PromptStream`:
a broken data set row is skipped, listed in skipped.jsonl and counted); sample G answers or
episodes per prompt with the engine, score them, turn rewards into group-relative advantages
and keep the groups that carry a signal (`saccade.orchestrator.rollout.sample_step`); pack the
samples, built from the engine's own token ids, into this rank's micro-batches
(`saccade.trainer.packing.rank_micro_batches`); take `num_iterations` optimizer steps on the
clipped objective against the engine's logprobs (`saccade.trainer.step.train_step`). Then the
engine gets the new weights: free with the embedded engine (it shares the module); vLLM
servers load an exported folder, after every step or every `engine.sync_every_steps`.
What those calls share is built once per run (`RLStep`); `saccade bench step` builds and times
the very same step.

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
- vLLM servers get the weights as an exported folder, not over NCCL.
"""

from __future__ import annotations

import logging
import time
from contextlib import closing
from pathlib import Path
from typing import Any

from saccade.config import RunConfig, config_changes, describe
from saccade.distributed import SINGLE, World
from saccade.inference.servers import NoServerError
from saccade.loops.checkpointer import (Checkpointer, check_fresh_start, disk_full, stopped_by_full_disk,
                                        stopped_unsaved_by_full_disk)
from saccade.loops.evaluator import Evaluator
from saccade.loops.rl_step import RLStep
from saccade.loops.stall import StallError
from saccade.loops.stall_watch import StallWatch
from saccade.loops.step_log import EngineCounters, NoLogger, SampleLog, step_metrics
from saccade.loops.weight_sync import WeightSync, push_start_weights
from saccade.metrics import MetricsLogger, format_step
from saccade.model_match import ModelMatchGuard
from saccade.orchestrator.source import RolloutSource
from saccade.progress import ProgressBar
from saccade.run.setup import Setup, build_setup
from saccade.stopping import RunStopped, StopRequest
from saccade.run.tasks import Task, closing_task, task_from_config


def say_config_changes(saved: Path, now: str, *, resume: bool) -> None:
    """A resume with a config other than the run's (config.toml) goes on (more steps, a lower lr
    are what resumes are for), but says each change, since config.toml is about to be rewritten."""
    if not resume or not saved.is_file():
        return
    changes = config_changes(saved.read_text(), now)
    if changes:
        logging.getLogger(__name__).warning("--resume with a config other than the run's (%s):\n  %s", saved,
                                            "\n  ".join(changes))


def nonfinite_streak(streak: int, train_metrics: dict[str, Any], num_iterations: int) -> int:
    """Steps in a row whose every optimizer step was skipped (NaN/inf loss or gradients), this
    step's included: such a step leaves the weights as they were, so a run of them trains nothing."""
    return streak + 1 if train_metrics.get("skipped_steps", 0.0) >= num_iterations else 0


def train_rl(cfg: RunConfig, *, run_dir: Path, resume: bool = False, setup: Setup | None = None,
             task: Task | None = None, stop_after: int | None = None, progress: bool = True,
             world: World = SINGLE, stop: StopRequest | None = None, fresh: bool = False) -> dict[str, Any]:
    """The RL loop; returns the last step's figures. The objective is the clipped policy
    gradient on group-relative advantages, `saccade.trainer.loss.policy_loss`, which phase 2 takes
    `num_iterations` optimizer steps on. `stop_after` ends early (tests); `stop`: a STOP file or a
    caught signal, after which the run saves and raises `RunStopped`. `world`: this rank (torchrun);
    rank 0 writes the metrics, every rank takes part in checkpoints and weight pushes. `fresh`: a
    new run in a folder holding another run's checkpoints moves them aside (else it is refused)."""
    run_dir.mkdir(parents=True, exist_ok=True)
    if not resume:  # before config.toml is written over: the folder may be another run's
        check_fresh_start(run_dir, fresh=fresh, world=world)
    stop = stop or StopRequest(run_dir)
    if world.is_main:
        say_config_changes(run_dir / "config.toml", describe(cfg), resume=resume)
        (run_dir / "config.toml").write_text(describe(cfg))  # what this run ran with, resolved
    setup = setup or build_setup(cfg, run_dir, world)
    built = None if task is not None else task_from_config(cfg)  # closed when the run ends (its reward workers)
    rl = RLStep.build(cfg, setup, task or built, world)
    evaluator = Evaluator(cfg, rl, world)
    checkpoints = Checkpointer(cfg, rl, run_dir, world)
    state = checkpoints.start(resume)
    push_start_weights(setup.engine, state, world)
    stall = StallWatch(cfg, checkpoints, state, world)
    stall.start(state, resume=resume)
    logger = MetricsLogger(run_dir, wandb=cfg.log.wandb, wandb_project=cfg.log.wandb_project,
                           tensorboard=cfg.log.tensorboard, config=cfg.model_dump(), resume=resume,
                           ) if world.is_main else NoLogger()
    if resume:
        logger.truncate_after(state.step)
    end = cfg.trainer.steps if stop_after is None else min(cfg.trainer.steps, state.step + stop_after)
    stream = rl.prompt_stream(run_dir, position=state.data_position, done_steps=state.step, resume=resume)
    source = RolloutSource(  # each step's rollouts; on the rollout thread when sampling ahead
        lambda step: rl.sample(step, stream.take(cfg.rollout.prompts_per_step, step=step + 1)),
        first_step=state.step, end=end, max_async_level=cfg.rollout.max_async_level,
        # After a periodic checkpoint, from its weights: what a resume from it can sample (source.py).
        on_policy=lambda step: checkpoints.due(step, rolled_back=False))
    weights, samples = WeightSync(cfg, setup.engine, source, world, end=end), SampleLog(rl, logger, run_dir)
    counters, model_match, metrics = EngineCounters(setup.engine), ModelMatchGuard.of(cfg), {}
    nonfinite, most_nonfinite = 0, cfg.trainer.max_nonfinite_steps
    progress_bar = ProgressBar(progress and world.is_main, end - state.step, "rl")
    with closing_task(built), closing(evaluator), logger, stream, progress_bar as bar, source:
        try:
            for step in range(state.step, end):
                start = time.perf_counter()
                # 1. Rollouts: G per prompt, scored, advantages, the groups worth training on; their
                # image embeddings stay pinned in the cache until step 2 ends.
                rollouts, waited_s, queue_depth = source.get(step)
                state.data_position, rollout_s = rollouts.rows.end, time.perf_counter() - start
                # 2. Train: this rank's micro-batches, `num_iterations` optimizer steps. At the first
                # step the trainer must score the sampled tokens as the engine did.
                train_metrics = rl.train(step, rollouts)
                model_match.after_train(step, train_metrics)
                nonfinite = nonfinite_streak(nonfinite, train_metrics, cfg.trainer.num_iterations)
                train_s = time.perf_counter() - start - rollout_s
                # 3. The stall watch: warn, roll back now (before the weights go out), or stop below.
                verdict = stall.after_train(step, rollouts.batch.metrics, state)
                # 4. Weights to the engine, when due or when the run evaluates or checkpoints now.
                state.step = step + 1
                forced = evaluator.due(state.step) or checkpoints.due(state.step, rolled_back=verdict.rolled_back)
                sync_s, gone = weights.after_step(state, forced=forced)
                # 5. Metrics and evaluation, logged; then stop for a lost server or a stall, or checkpoint.
                metrics = step_metrics(
                    rollouts, train_metrics, setup, counters.step(), rollout_s=rollout_s, train_s=train_s,
                    weight_sync_s=sync_s, step_s=time.perf_counter() - start, trainer_idle_s=waited_s,
                    rollout_queue_depth=float(queue_depth), dataset=rl.fits is not None)
                metrics.update(verdict.figures, **(evaluator.after_step(state.step, logger) if gone is None else {}))
                logger.log(state.step, metrics)
                bar(format_step(metrics), note=samples.after_step(state.step, rollouts))
                if gone is not None:
                    raise gone
                if verdict.stop:  # the stalled weights are not saved: the last checkpoint is the one to go on from
                    raise stall.stopped(state.step, metrics, rl_command(run_dir, world))
                if most_nonfinite and nonfinite >= most_nonfinite:  # the weights are unchanged by them: save
                    state.policy_version = state.step
                    raise StallError(
                        f"{nonfinite} steps in a row had every optimizer step skipped for a non-finite loss or "
                        f"gradient (trainer.max_nonfinite_steps = {most_nonfinite}), up to step {state.step}: the run "
                        f"trains nothing. Saved {checkpoints.save(state)}, the weights from before them. Look for "
                        "the cause (a lower trainer.lr, model.dtype float32, the data rows of those steps), then go "
                        f"on with: {rl_command(run_dir, world)} --resume")
                saved = checkpoints.after_step(state, rolled_back=verdict.rolled_back)
                # 6. Asked to stop (STOP file, Ctrl-C): every rank alike, after a checkpoint.
                if state.step < end and stop.agreed(world, setup.device):
                    raise stopped_on_request(checkpoints, state, saved, stop, world)
        except OSError as err:
            if not disk_full(err):
                raise
            if world.size > 1:  # ranks apart: a save now would wait for the others; torchrun ends them
                raise stopped_unsaved_by_full_disk(err, run_dir, world, rl_command(run_dir, world)) from err
            state.policy_version = state.step
            raise stopped_by_full_disk(err, checkpoints, state) from err
        except NoServerError as err:  # every rank at the same step: the finished steps are saved
            state.policy_version = state.step
            raise NoServerError(
                f"{err}. The run stopped after step {state.step} and saved {checkpoints.save(state, guarded=False)}; "
                f"once a server answers again, go on with: {rl_command(run_dir, world)} --resume") from None
    return {"step": state.step, "last": metrics, "setup": setup}


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


def rl_command(run_dir: Path, world: World) -> str:
    """The command that runs this run's config again: under torchrun, with as many ranks."""
    config = run_dir / "config.toml"
    if world.size > 1:
        return f"torchrun --nproc-per-node {world.size} -m saccade rl {config}"
    return f"saccade rl {config}"
