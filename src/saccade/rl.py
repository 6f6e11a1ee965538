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
a schedule, not a race, so the same at any world size), and TIS corrects for the lag (`loss.tis`). With every server gone every
rank saves the finished steps in one checkpoint and stops, saying what to restart.
Every `log.samples_every` steps rank 0 also writes the step's first prompts with their
completions to samples.jsonl (`saccade.sample_log`), for a person to read, each reply's
logprob with and without its images beside it (`saccade.visual`; one process only).

Every step the stall watch (`saccade.stall`, docs/stalls.md) reads the rollouts' figures: no
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

import contextlib
import shutil
import time
import warnings
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from saccade.config import LossConfig, RunConfig, StallRollbackConfig, describe, effective_loss
from saccade.data.rows import (
    PromptStream,
    StepRows,
    max_skip_fraction,
    open_prompt_stream,
    recheck,
    row_check,
    skip_counts,
)
from saccade.distributed import SINGLE, World, barrier, first_error, unsharded
from saccade.evaluation import evaluate
from saccade.inference.engine import SamplingParams
from saccade.inference.servers import NoServerError
from saccade.metrics import METRICS_FILE, MetricsLogger, format_step
from saccade.model_match import ModelMatchGuard
from saccade.models.lm import shares_prompts
from saccade.orchestrator.rollout import sample_step
from saccade.orchestrator.source import RolloutSource, StepRollouts
from saccade.process_stats import memory_metrics, process_metrics
from saccade.progress import ProgressBar
from saccade.sample_log import SAMPLES_DIR, finite, sample_line, step_samples
from saccade.setup import Setup, build_setup
from saccade.stopping import RunStopped, StopRequest
from saccade.stall import (
    StallError,
    StallState,
    StepSignal,
    after_rollback,
    describe_stall,
    observe,
    stall_action,
    stall_warning,
)
from saccade.tasks import Task, task_from_config
from saccade.timing import timed
from saccade.trainer.checkpoint import TrainState, load_checkpoint, save_checkpoint
from saccade.trainer.checkpoint_folder import (
    STALLED_DIR,
    checkpoint_before,
    latest_checkpoint,
    set_aside_checkpoints,
)
from saccade.trainer.packing import rank_micro_batches
from saccade.trainer.reference import Reference, adapter_free_reference, frozen_copy, frozen_reference
from saccade.trainer.step import build_optimizer, lr_schedule, set_peak_lr, staged, train_step
from saccade.visual import reply_logprobs

# TrainState.extra's key for the product of the stall rollbacks' lr factors (1.0: none): the
# peak lr is trainer.lr times it, after a resume too.
LR_SCALE = "lr_scale"

# TrainState.extra's key for the stall watch's state (`StallState.saved`): its streaks and rollbacks.
STALL = "stall"


def kl_reference(cfg: RunConfig, setup: Setup, sampling: SamplingParams, world: World = SINGLE) -> Reference:
    """The KL term's reference policy (`saccade.trainer.reference`), scoring what the engine samples
    from: with LoRA the base with the adapters off; with full fine-tuning a frozen copy of the
    policy's weights as they are now. `RLStep.build` calls it before `--resume` loads a
    checkpoint, so a resumed run's reference is the weights the run started from, not the
    checkpoint's."""
    banned = setup.engine.banned_token_ids
    if cfg.lora is not None:
        return adapter_free_reference(setup.model, distribution=sampling.distribution, banned_token_ids=banned)
    copy = frozen_copy(setup.model, setup.model_path, compute_dtype=getattr(torch, cfg.model.dtype), world=world)
    return frozen_reference(copy, distribution=sampling.distribution, banned_token_ids=banned)


@dataclass
class RLStep:
    """An RL step's parts, built once per run from the config and the setup (`RLStep.build`):
    `sample` a step's prompts, then `train` on what they scored. `train_rl` runs it every step;
    `saccade bench step` builds and times the same, so the benchmark measures the loop's step."""

    cfg: RunConfig
    setup: Setup
    task: Task
    world: World
    optimizer: torch.optim.Optimizer
    scheduler: Any
    loss: LossConfig  # effective_loss: TIS on whenever rollouts may come from older weights
    # What the engine samples from, so what the trainer, its old logprobs and the reference score.
    sampling: SamplingParams
    reference: Reference | None  # the KL term's: LoRA's base with adapters off, or a frozen copy (full FT)
    share_prompts: bool  # a group's prompt forwarded once
    max_lag: int  # the oldest weights a trained batch may come from, in versions behind the trainer's
    fits: Callable[[Any], None] | None  # a data set's rows must fit the token budget (an image span is never cut)
    # The ranks as the rollouts see them: `world` itself, or, when a thread samples ahead under
    # torchrun, the same ranks over a process group of the thread's own.
    rollout_world: World = SINGLE

    @classmethod
    def build(cls, cfg: RunConfig, setup: Setup, task: Task, world: World = SINGLE) -> RLStep:
        t, e = cfg.trainer, cfg.engine
        optimizer, scheduler = build_optimizer(setup.model, lr=t.lr, weight_decay=t.weight_decay,
                                               schedule=lr_schedule(t))
        sampling = SamplingParams.sampled(cfg.sampling, n=cfg.rollout.group_size)
        reference = None
        if cfg.loss.kl_coef > 0:
            reference = kl_reference(cfg, setup, sampling, world)
        share_prompts = t.share_prompts and shares_prompts(setup.model)
        if t.share_prompts and not share_prompts and world.is_main:
            warnings.warn(
                f"trainer.share_prompts is on, but model.attn_implementation {cfg.model.attn_implementation!r} cannot "
                "share a prompt: each of a group's G samples forwards its prompt, images included, again (G x the "
                "prompt tokens per group; forward_tokens in metrics.jsonl shows it). Use 'auto' (packed_sdpa) to share "
                "them, or set trainer.share_prompts = false to silence this", RuntimeWarning, stacklevel=3)
        samples_ahead = cfg.rollout.max_async_level > 0
        return cls(cfg, setup, task, world, optimizer, scheduler, effective_loss(cfg), sampling, reference,
                   share_prompts, max_lag=cfg.rollout.max_async_level + e.sync_every_steps - 1,
                   fits=row_check(cfg, setup.processor),
                   rollout_world=world.with_own_group(t.dist_timeout_s) if samples_ahead else world)

    def sampling_weights(self):
        """The context the engine samples in. The embedded engine samples from the sharded module
        itself: whole weights on every rank (one all-gather), so ranks decode without collectives."""
        return unsharded(self.setup.model) if self.setup.engine.shares_weights else contextlib.nullcontext()

    def prompt_stream(self, run_dir: Path, *, position: int = 0, done_steps: int = 0,
                      resume: bool = False) -> PromptStream:
        """The prompts, read in step order from `position`; broken data set rows skipped, listed in
        skipped.jsonl (by rank 0), counted, and the step refilled from the rows after them. Every
        rank reads (and checks) all the step's rows, so all skip the same broken ones."""
        return open_prompt_stream(
            lambda at: self.task.train_sample(at, seed=self.cfg.trainer.seed), run_dir=run_dir, position=position,
            done_steps=done_steps, resume=resume, max_skip_fraction=max_skip_fraction(self.cfg),
            check=self.fits, writes=self.world.is_main)

    def sample(self, step: int, rows: StepRows) -> StepRollouts:
        """This rank's rollouts of the step's prompts; every rank's groups, scored (`sample_step`)."""
        return sample_step(step, rows, setup=self.setup, task=self.task, cfg=self.cfg, sampling=self.sampling,
                           world=self.rollout_world, max_lag=self.max_lag, sampling_weights=self.sampling_weights)

    def train(self, step: int, rollouts: StepRollouts) -> dict[str, float]:
        """`train_step` on the step's samples, packed like text (never splitting a sample) into this
        rank's micro-batches. They stay in host memory (page-locked on a GPU); each pass of the
        train step sends them to the device one ahead of the one it computes. The rollouts' image
        embeddings are unpinned after. No samples (no group with a signal): nothing trains."""
        s, t = self.setup, self.cfg.trainer
        metrics: dict[str, float] = {}
        if rollouts.batch.samples:
            with timed("pack"), rollouts.pins:
                micro_batches = staged(rank_micro_batches(
                    rollouts.batch.samples, s.cache, max_tokens=t.max_tokens, image_token_id=s.image_token_id,
                    spatial_merge_size=s.merge, share_prompts=self.share_prompts, world=self.world), s.device)
            metrics = self.train_micro_batches(step, micro_batches)
        rollouts.pins.release()
        return metrics

    def train_micro_batches(self, step: int, micro_batches: list) -> dict[str, float]:
        """`train_step` with the run's settings on this rank's micro-batches of `step` (in host memory)."""
        t = self.cfg.trainer
        return train_step(
            self.setup.model, self.optimizer, self.scheduler, micro_batches, loss=self.loss,
            num_iterations=t.num_iterations, grad_clip=t.grad_clip, distribution=self.sampling.distribution,
            banned_token_ids=self.setup.engine.banned_token_ids, reference=self.reference, world=self.world,
            current_version=step,
        )

    def evaluate(self, samples: list) -> dict[str, float]:
        """Greedy success on the held-out `samples` (with eval.visual_gain, also with every image
        blank), evaluated by rank 0 ({} on the others, which wait; with the embedded engine every
        rank holds the whole weights meanwhile)."""
        with self.sampling_weights():
            ev = evaluate(self.setup, self.task, samples, max_tokens=self.cfg.sampling.max_tokens,
                          env=self.cfg.env, visual_gain=self.cfg.eval.visual_gain) if self.world.is_main else {}
            barrier(self.world)
        return ev

    def resume(self, run_dir: Path) -> TrainState:
        """The run's latest complete checkpoint loaded into the model and optimizer, the engine's
        sampling RNG restored: the state to go on from. The peak lr is this config's trainer.lr
        (times the factors of the run's stall rollbacks, if any), not the one saved with the
        optimizer: going on at a lower lr is what a resume from a stall is for."""
        path = latest_checkpoint(run_dir)
        if path is None:
            raise ValueError(f"--resume: no complete checkpoint under {run_dir}; start without --resume")
        state = load_checkpoint(path, model=self.setup.model, optimizer=self.optimizer, scheduler=self.scheduler)
        set_peak_lr(self.optimizer, self.scheduler, self.cfg.trainer.lr * state.extra.get(LR_SCALE, 1.0))
        self.setup.engine.set_rng_state(state.extra.get("engine_rng"))
        return state

    def roll_back(self, run_dir: Path, state: TrainState, *, since: int) -> dict[str, float]:
        """A stalled run back to the newest checkpoint saved before policy version `since` (the
        weights the stall's first step sampled): its weights, optimizer state and place in the lr
        schedule reloaded, the peak lr multiplied by stall.lr_factor (kept in
        `state.extra`, so a resume keeps it), the checkpoints from the stall on set aside. The
        checkpoint's own TrainState is not used: the step count, the data position and the
        policy versions go on forward, so metrics.jsonl stays append-only. Every rank takes part.
        Returns the figures the step logs, or {} when no checkpoint from before the stall is
        left (the run then stops)."""
        found = checkpoint_before(run_dir, since)
        if found is None:
            return {}
        step, path = found
        load_checkpoint(path, model=self.setup.model, optimizer=self.optimizer, scheduler=self.scheduler)
        assert isinstance(self.cfg.stall, StallRollbackConfig), self.cfg.stall.action
        state.extra[LR_SCALE] = state.extra.get(LR_SCALE, 1.0) * self.cfg.stall.lr_factor
        lr = set_peak_lr(self.optimizer, self.scheduler, self.cfg.trainer.lr * state.extra[LR_SCALE])
        if self.world.is_main:  # the stalled weights: never the latest checkpoint a resume would load
            set_aside_checkpoints(run_dir, since)
        barrier(self.world)
        return {"rollback_to_step": float(step), "rollback_lr": lr}

    def save(self, run_dir: Path, state: TrainState) -> Path:
        """A checkpoint of the run as it stands (every rank takes part), the engine's sampling RNG with it."""
        state.extra["engine_rng"] = self.setup.engine.rng_state()
        return save_checkpoint(run_dir, model=self.setup.model, optimizer=self.optimizer, scheduler=self.scheduler,
                               state=state, keep_last=self.cfg.checkpoint.keep_last,
                               base_model_path=self.setup.model_path)


def train_rl(cfg: RunConfig, *, run_dir: Path, resume: bool = False, setup: Setup | None = None,
             task: Task | None = None, stop_after: int | None = None, progress: bool = True,
             world: World = SINGLE, stop: StopRequest | None = None) -> dict[str, Any]:
    """The RL loop. Returns final figures. `stop_after` ends early after that many steps (tests).
    `stop`: asked to stop (a STOP file in the run folder, or a signal `saccade rl` caught), the
    run saves a checkpoint after the step under way and raises `RunStopped`.

    `world`: this process's place among the trainer's ranks (`saccade.distributed`; torchrun
    started it). Each rank samples its share of the prompts; every rank then holds the whole
    step's scored batch and trains its share of the micro-batches of the sharded model. Rank 0
    writes the metrics; every rank takes part in checkpoints and weight exports."""
    run_dir.mkdir(parents=True, exist_ok=True)
    stop = stop or StopRequest(run_dir)
    if world.is_main:
        (run_dir / "config.toml").write_text(describe(cfg))  # what this run ran with, resolved
    setup = setup or build_setup(cfg, run_dir, world)
    task = task or task_from_config(cfg)
    run = RLStep.build(cfg, setup, task, world)
    engine, t = setup.engine, cfg.trainer
    # Only built when the run evaluates: a data set's eval split is then opened (downloaded) too.
    eval_samples = task.eval_samples(cfg.eval.prompts) if cfg.eval.every_steps else []
    if run.fits is not None and eval_samples:
        eval_samples = recheck(eval_samples, run.fits)

    state = run.resume(run_dir) if resume else TrainState(step=0, data_position=0, policy_version=0, extra={})
    # From the first step on, the engine samples from exactly the trainer's weights: a vLLM
    # server may still hold the base model, or another run's (the embedded engine shares them).
    engine.update_weights(version=state.policy_version)
    barrier(world)
    if cfg.stall.action == "rollback" and not resume:  # a stall before the first checkpoint goes back here
        with stop_if_unwritable(run_dir, state.step):
            run.save(run_dir, state)
    stall = StallState.restored(state.extra.get(STALL))
    logger = MetricsLogger(
        run_dir, wandb=cfg.log.wandb, wandb_project=cfg.log.wandb_project, tensorboard=cfg.log.tensorboard,
        config=cfg.model_dump(), resume=resume,
    ) if world.is_main else NoLogger()
    if resume:
        logger.truncate_after(state.step)
    last: dict[str, float] = {}
    end = t.steps if stop_after is None else min(t.steps, state.step + stop_after)
    stream = run.prompt_stream(run_dir, position=state.data_position, done_steps=state.step, resume=resume)
    source = RolloutSource(  # each step's rollouts; on the rollout thread when sampling ahead
        lambda step: run.sample(step, stream.take(cfg.rollout.prompts_per_step, step=step + 1)),
        first_step=state.step, end=end, max_async_level=cfg.rollout.max_async_level)
    engine_before = engine.stats()
    model_match = ModelMatchGuard(cfg.engine.model_mismatch_limit, cfg.model.path, cfg.engine.kind)
    with logger, stream, ProgressBar(progress and world.is_main, end - state.step, "rl") as bar, source:
        try:
            for step in range(state.step, end):
                start = time.perf_counter()
                # 1. Rollouts: G per prompt, scored, advantages, the groups worth training on. Every
                # image embedding they put in or read from the cache stays pinned until step 2 ends.
                rollouts, waited_s, queue_depth = source.get(step)
                state.data_position = rollouts.rows.end
                rollout_s = time.perf_counter() - start

                # 2. Train: this rank's micro-batches of the samples, `num_iterations` optimizer steps.
                # At the first step, the trainer and the engine must have scored those tokens alike.
                train_metrics = run.train(step, rollouts)
                model_match.after_train(step, train_metrics)
                train_s = time.perf_counter() - start - rollout_s

                # 3. The stall watch: no group with reward variance, or most replies cut at max_tokens,
                # for stall.steps steps in a row. Every rank holds the same figures, so all
                # decide alike: warn (rank 0 says it), stop (below, once the step is logged), or roll
                # back now, before the weights go to the engine.
                stall = observe(stall, StepSignal.of(rollouts.batch.metrics), cfg.stall)
                action = stall_action(stall, cfg.stall)
                stall_figures = stall.metrics(cfg.stall.steps)  # before a rollback restarts the streaks
                if action == "warn" and world.is_main:
                    warnings.warn(stall_warning(stall, rollouts.batch.metrics, cfg.stall, run_dir / METRICS_FILE),
                                  RuntimeWarning, stacklevel=2)
                rolled_back: dict[str, float] = {}
                if action == "rollback":
                    rolled_back = run.roll_back(run_dir, state, since=stall.since(cfg.stall.steps))
                    if rolled_back:  # rollouts from here on sample the restored weights, version step + 1
                        stall = after_rollback(stall, version=step + 1)
                        rolled_back["rollbacks"] = float(stall.rollbacks)
                    else:  # no checkpoint from before the stall is left
                        action = "stop"
                state.extra[STALL] = stall.saved()  # a resume goes on with the same streaks

                # 4. Weights to the engine: every k-th step, and whenever the run evaluates,
                # checkpoints, rolls back or ends, so those see (and a resume restarts from) the
                # current weights. Rollouts sampled ahead go on meanwhile, on the weights the servers hold.
                state.step = step + 1
                evaluating = bool(cfg.eval.every_steps) and state.step % cfg.eval.every_steps == 0
                # A rollback saves at once: a resume must not go back to the stalled weights.
                checkpointing = bool(rolled_back) or (
                    bool(cfg.checkpoint.every_steps) and state.step % cfg.checkpoint.every_steps == 0)
                sync_s, gone = 0.0, None
                if state.step % cfg.engine.sync_every_steps == 0 or evaluating or checkpointing or state.step == end:
                    source.wait_to_push(state.step)  # first, the steps due to sample older weights
                    try:
                        sync_s = engine.update_weights(version=state.step)
                    except NoServerError as err:  # the step is logged, then the run checkpoints and stops
                        gone = err
                    # Rank 0 pushes: every rank learns how it went, and none samples again before
                    # the servers hold the new weights.
                    gone = first_error(gone, world)
                state.policy_version = engine.policy_version
                if gone is None:
                    source.trained(step)
                step_s = time.perf_counter() - start

                # 5. Metrics, evaluation, checkpoint.
                engine_now = engine.stats()
                metrics = step_metrics(
                    rollouts, train_metrics, setup, engine_counters(engine_now, engine_before),
                    rollout_s=rollout_s, train_s=train_s, weight_sync_s=sync_s, step_s=step_s,
                    trainer_idle_s=waited_s, rollout_queue_depth=float(queue_depth), dataset=run.fits is not None)
                metrics.update(stall_figures, **rolled_back)
                engine_before = engine_now
                if evaluating and gone is None:
                    ev = run.evaluate(eval_samples)
                    if world.is_main:
                        logger.log(state.step, {k: v for k, v in ev.items() if k != "n"}, phase="eval")
                        metrics["eval_accuracy"] = ev["accuracy"]
                        if "visual_gain" in ev:  # eval.visual_gain: the same prompts, images blank
                            metrics.update(eval_accuracy_blank=ev["accuracy_blank"], visual_gain=ev["visual_gain"])
                logger.log(state.step, metrics)
                last = metrics
                note = None
                if world.is_main and cfg.log.samples_every and state.step % cfg.log.samples_every == 0:
                    note = log_samples(logger, state.step, rollouts, run, run_dir)
                bar(format_step(metrics), note=note)
                if gone is not None:
                    raise gone
                if action == "stop":  # the stalled weights are not saved: the last checkpoint is the one to go on from
                    raise stalled_stop(cfg, run_dir, state.step, stall, metrics, world)
                saved = None
                if checkpointing or state.step == t.steps:  # and always at the end of the run
                    with stop_if_unwritable(run_dir, state.step):
                        saved = run.save(run_dir, state)
                # 6. Asked to stop (STOP file, Ctrl-C): every rank alike, after a checkpoint.
                if state.step < end and stop.agreed(world, setup.device):
                    if saved is None:
                        state.policy_version = state.step  # the weights saved: a resume pushes them as this version
                        with stop_if_unwritable(run_dir, state.step):
                            saved = run.save(run_dir, state)
                    message = (f"stopped on request after step {state.step}; saved {saved}; go on with: "
                               f"{rl_command(run_dir, world)} --resume")
                    stop.done(message, world)
                    raise RunStopped(message)
        except NoServerError as err:
            # Nothing trained is lost: the weights of every finished step go into a checkpoint. Every
            # rank gets here at the same step (sampling and pushing agree on failures across ranks).
            state.policy_version = state.step
            saved = run.save(run_dir, state)
            raise NoServerError(
                f"{err}. The run stopped after step {state.step} and saved {saved}; once a server answers again, "
                f"go on with: {rl_command(run_dir, world)} --resume"
            ) from None
    return {"step": state.step, "last": last, "setup": setup}


def rl_command(run_dir: Path, world: World) -> str:
    """The command that runs this run's config again: under torchrun, with as many ranks."""
    config = run_dir / "config.toml"
    if world.size > 1:
        return f"torchrun --nproc-per-node {world.size} -m saccade rl {config}"
    return f"saccade rl {config}"


def stalled_stop(cfg: RunConfig, run_dir: Path, step: int, stall: StallState, metrics: dict[str, float],
                 world: World) -> StallError:
    """The error that ends a stalled run (stall.action "stop", or "rollback" with no rollback left):
    the checkpoints from the stall on set aside, so that `--resume` loads the last one from
    before it, and the command to go on with at a lower lr. A collapsed policy's weights are not
    worth a checkpoint. `--resume` cuts metrics.jsonl back to the checkpoint's step, so the
    stalled run's metrics are kept aside too."""
    watch = cfg.stall
    since = stall.since(watch.steps)  # the stall's first step sampled these weights: they and later ones stalled
    found = checkpoint_before(run_dir, since)
    aside, moved = run_dir / STALLED_DIR, []
    if world.is_main:
        moved = set_aside_checkpoints(run_dir, since)
        if found is not None and (run_dir / METRICS_FILE).exists():
            aside.mkdir(exist_ok=True)
            shutil.copyfile(run_dir / METRICS_FILE, aside / f"metrics-to-step_{step:06d}.jsonl")
    barrier(world)
    text = f"the run stalled: {describe_stall(stall, metrics, watch)}. It stopped after step {step}"
    if isinstance(watch, StallRollbackConfig) and stall.rollbacks >= watch.max_rollbacks:
        text += f", its stall.max_rollbacks ({watch.max_rollbacks}) rollbacks spent,"
    text += " without saving its weights (a stalled policy is not worth a checkpoint)"
    if moved:
        text += f"; the checkpoints written since the stall began are set aside in {aside}"
    # The lower lr to go on at: the rollback's factor (its default, half, for 'stop').
    factor = (watch if isinstance(watch, StallRollbackConfig) else StallRollbackConfig()).lr_factor
    command, lower = rl_command(run_dir, world), f"{cfg.trainer.lr * factor:g}"
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


def log_samples(logger: MetricsLogger, step: int, rollouts: StepRollouts, run: RLStep, run_dir: Path) -> str:
    """A few prompts with their completions for a person to read (samples.jsonl, `saccade
    report`): the step's first, which rank 0 sampled itself and so still holds their images.
    Each completion also gets its reply's logprob with and without its images under the
    weights just trained (`saccade.visual.reply_logprobs`). Returns the console's line about
    the first."""
    cfg = run.cfg
    records = step_samples(step, rollouts.rows.prompts, rollouts.all_groups, rollouts.groups,
                           count=cfg.log.samples_prompts, folder=run_dir / SAMPLES_DIR, side=cfg.log.samples_image_side)
    # Under torchrun the model is sharded: a forward on rank 0 alone would wait for the others.
    if run.world.size == 1:
        logged = [r for group in rollouts.groups[:len(records)] for r in group]
        figures = iter(reply_logprobs(run.setup, logged, distribution=run.sampling.distribution,
                                      banned_token_ids=run.setup.engine.banned_token_ids,
                                      max_tokens=cfg.trainer.max_tokens))
        for record in records:
            for completion in record["completions"]:
                completion.update({k: None if v is None else finite(v) for k, v in next(figures).items()})
    logger.log_samples(step, records)
    return sample_line(records)


def step_metrics(rollouts: StepRollouts, train_metrics: dict[str, float], setup: Setup,
                 engine_counters: dict[str, float], *, dataset: bool, **seconds: float) -> dict[str, float]:
    """What a train step logs: the rollouts' figures (rewards, lengths, lag: `rollout_metrics`),
    the train step's (loss, grad norm, ...), a data set's rows skipped by reason, where the
    step's seconds went (`seconds`), the embedding cache, the engine's counters over the step,
    memory and the process."""
    batch, cache = rollouts.batch, setup.cache
    metrics = {**batch.metrics, **train_metrics}
    if dataset:  # a data set: its broken rows met this step, by reason
        metrics.update(skip_counts(rollouts.rows.skipped))
    metrics.update(
        seconds,
        tokens_per_s=(train_metrics.get("train_tokens", 0.0) + batch.metrics["completion_tokens"]) / seconds["step_s"],
        cache_hit_rate=cache.stats.hit_rate, cache_evictions=float(cache.stats.evictions),
        cache_mb=cache.nbytes / 2**20, cache_entries=float(len(cache)),
        # How the overlap went: seconds the trainer waited for rollouts (trainer_idle_s), rollouts
        # that were ready behind this step's (rollout_queue_depth), each server's idle seconds.
        sample_s=rollouts.sample_s, **engine_counters, **memory_metrics(setup.device), **process_metrics(),
    )
    return metrics


class CheckpointWriteError(RuntimeError):
    """A checkpoint could not be written (disk full, folder unwritable): the run stops."""


@contextlib.contextmanager
def stop_if_unwritable(run_dir: Path, step: int):
    """Turn a failed checkpoint write into an error that says what is safe and what to do. The
    run stops rather than train on without checkpoints: days of steps that no checkpoint
    holds would be lost to the next crash. The save itself is atomic, so the previous
    checkpoint is intact (a half-written one is only ever a `.tmp-*` folder)."""
    try:
        yield
    except Exception as err:  # noqa: BLE001 - a full disk fails as OSError, torch.save's writer as RuntimeError
        previous = latest_checkpoint(run_dir)
        kept = f"the previous one, {previous}, is intact" if previous else "there is no earlier checkpoint"
        raise CheckpointWriteError(
            f"the checkpoint of step {step} could not be written under {run_dir / 'checkpoints'} "
            f"({type(err).__name__}: {err}); {kept}. The run stopped rather than train on without checkpoints. "
            f"Fix the cause (a full disk: free space; an unwritable folder: its permissions), then go on "
            f"with: saccade rl {run_dir / 'config.toml'} --resume"
        ) from err


# The engine's counters whose per-step differences are logged (servers of a vLLM engine).
STEP_COUNTERS = ("requests_retried", "requests_rerouted", "servers_taken_out", "servers_rejoined", "engine_idle_s")


def engine_counters(now: dict[str, float], before: dict[str, float]) -> dict[str, float]:
    """The step's share of the engine's counters (`STEP_COUNTERS`), and how many servers answer."""
    out = {k: now[k] - before.get(k, 0.0) for k in STEP_COUNTERS if k in now}
    if "servers_alive" in now:
        out["servers_alive"] = now["servers_alive"]
    return out


class NoLogger:
    """What ranks other than 0 log to: nothing (rank 0 writes the run's metrics)."""

    def __enter__(self):
        return self

    def __exit__(self, *exc) -> None:
        pass

    def log(self, *args, **kwargs) -> None:
        pass

    def log_samples(self, *args, **kwargs) -> None:
        pass

    def truncate_after(self, step: int) -> None:
        pass
