"""GRPO-family RL on a VLM, as one visible loop (`train_rl`).

Each step: take the next prompts from the task's stream (`saccade.data.rows.PromptStream`:
a broken data set row is skipped, listed in skipped.jsonl and counted); sample G answers or
episodes per prompt with the engine and score them; turn rewards into group-relative advantages and keep
the groups that carry a signal (`saccade.orchestrator.rollout`); pack the samples, built
from the engine's own token ids; take `num_iterations` optimizer steps on the clipped
objective against the engine's logprobs (`saccade.trainer.step.train_step`). Then the
engine gets the new weights: free with the embedded engine (it shares the module); vLLM
servers load an exported folder, after every step or every `engine.sync_every_steps`.

Every image embedding a step reads is pinned in the cache from its rollout until its train
step has ended (`EmbeddingCache.pins`), so no budget can evict it in between.

Under torchrun the same loop runs on every rank (`saccade.distributed`, docs/distributed.md):
each samples its share of the prompts, all hold the whole step's scored batch, and each trains
its share of the micro-batches of the FSDP2-sharded model. One process is the same loop with
`World()`, every collective a no-op.

Rollouts come from a `RolloutSource` (saccade.orchestrator.source): at
`rollout.max_async_level` 0 each step samples after the previous step's weights reached the
engine; at k > 0 (vLLM servers) a thread samples up to k steps ahead while the trainer
trains, from weights at most k versions old, and TIS corrects for the lag (`loss.tis`).
With every server gone the run saves a checkpoint and stops, saying what to restart.
Evaluation is greedy success on a held-out split, run by rank 0. Every `log.samples_every`
steps rank 0 also writes the step's first prompts with their completions to samples.jsonl
(`saccade.sample_log`), for a person to read.
"""

from __future__ import annotations

import contextlib
import time
import warnings
from pathlib import Path
from typing import Any

from saccade.config import RunConfig, effective_loss
from saccade.data.rows import PromptStream, max_skip_fraction, open_prompt_stream, recheck, row_check, skip_counts
from saccade.distributed import SINGLE, World, all_gather, balance, barrier, share_embeddings, unsharded
from saccade.setup import Setup, build_setup
from saccade.tasks import Task, task_from_config
from saccade.timing import timed

# Steps in a row with nothing to train on before the run says so. Zero-variance filtering
# can leave a collapsed policy (e.g. one whose replies no longer end) with no signal at
# all: the loop goes on, the weights never move again, and nothing else would tell.
STALL_STEPS = 20


def stall_message(steps_without_signal: int, metrics: dict[str, float], run_dir: Path) -> str | None:
    """The warning for a run that has had nothing to train on for STALL_STEPS steps, or None."""
    if steps_without_signal != STALL_STEPS:
        return None
    return (
        f"no group has had reward variance for {STALL_STEPS} steps (every episode of a prompt scores "
        f"the same; reward_mean {metrics.get('reward_mean', float('nan')):.3f}, completion_len_mean "
        f"{metrics.get('completion_len_mean', float('nan')):.1f}), so the weights have not changed since. "
        f"See {run_dir / 'metrics.jsonl'}; if the policy collapsed, resume from an earlier checkpoint with "
        "a lower trainer.lr, or raise rollout.group_size or sampling.temperature"
    )


def train_rl(cfg: RunConfig, *, run_dir: Path, resume: bool = False, setup: Setup | None = None,
             task: Task | None = None, stop_after: int | None = None, progress: bool = True,
             world: World = SINGLE) -> dict[str, Any]:
    """The RL loop. Returns final figures. `stop_after` ends early after that many steps (tests).

    `world`: this process's place among the trainer's ranks (`saccade.distributed`; torchrun
    started it). Each rank samples its share of the prompts; every rank then holds the whole
    step's scored batch and trains its share of the micro-batches of the sharded model. Rank 0
    writes the metrics; every rank takes part in checkpoints and weight exports."""
    from saccade.config import describe
    from saccade.evaluation import evaluate
    from saccade.inference.engine import SamplingParams
    from saccade.inference.servers import NoServerError
    from saccade.metrics import MetricsLogger, ProgressBar, format_step, memory_metrics, process_metrics
    from saccade.orchestrator.rollout import score_groups
    from saccade.orchestrator.source import RolloutSource
    from saccade.sample_log import SAMPLES_DIR, sample_line, step_samples
    from saccade.trainer.checkpoint import TrainState, latest_checkpoint, load_checkpoint, save_checkpoint
    from saccade.models.lm import shares_prompts
    from saccade.trainer.step import adapter_free_reference, build_optimizer, lr_schedule, staged, train_step

    run_dir.mkdir(parents=True, exist_ok=True)
    if world.is_main:
        (run_dir / "config.toml").write_text(describe(cfg))  # what this run ran with, resolved
    if cfg.rollout.max_async_level > 0 and world.size > 1:
        raise ValueError("rollout.max_async_level > 0 runs in one trainer process for now; under torchrun set "
                         "rollout.max_async_level = 0")
    setup = setup or build_setup(cfg, run_dir, world)
    task = task or task_from_config(cfg)
    model, engine, cache = setup.model, setup.engine, setup.cache
    t = cfg.trainer
    loss = effective_loss(cfg)  # TIS on whenever rollouts may come from older weights
    # The oldest weights a trained batch may come from, in versions behind the trainer's.
    max_lag = cfg.rollout.max_async_level + cfg.engine.sync_every_steps - 1
    optimizer, scheduler = build_optimizer(model, lr=t.lr, weight_decay=t.weight_decay, schedule=lr_schedule(t))
    sampling = SamplingParams.sampled(cfg.sampling, n=cfg.rollout.group_size)
    # What the engine samples from, so what the trainer, its old logprobs and the reference score.
    distribution, banned = sampling.distribution, engine.banned_token_ids
    reference = None
    if cfg.loss.kl_coef > 0:  # the KL term's reference: the base model, adapters off
        reference = adapter_free_reference(model, distribution=distribution, banned_token_ids=banned)
    share_prompts = t.share_prompts and shares_prompts(model)  # a group's prompt forwarded once
    if t.share_prompts and not share_prompts and world.is_main:
        warnings.warn(
            f"trainer.share_prompts is on, but model.attn_implementation {cfg.model.attn_implementation!r} cannot "
            "share a prompt: each of a group's G samples forwards its prompt, images included, again (G x the prompt "
            "tokens per group; forward_tokens in metrics.jsonl shows it). Use 'auto' (packed_sdpa) to share them, "
            "or set trainer.share_prompts = false to silence this", RuntimeWarning, stacklevel=2)
    # The embedded engine samples from the sharded module itself: whole weights on every rank
    # for the rollout (one all-gather), so ranks decode their own prompts without collectives.
    sampling_weights = (lambda: unsharded(model)) if engine.shares_weights else contextlib.nullcontext
    # A data set's rows must also fit the token budget: an image span is never cut (saccade.data.rows).
    fits = row_check(cfg, setup.processor)
    # Only built when the run evaluates: a data set's eval split is then opened (downloaded) too.
    eval_samples = task.eval_samples(cfg.eval.prompts) if cfg.eval.every_steps else []
    if fits is not None and eval_samples:
        eval_samples = recheck(eval_samples, fits)

    state = TrainState(step=0, data_position=0, policy_version=0, extra={})
    if resume:
        path = latest_checkpoint(run_dir)
        if path is None:
            raise ValueError(f"--resume: no complete checkpoint under {run_dir}; start without --resume")
        state = load_checkpoint(path, model=model, optimizer=optimizer, scheduler=scheduler)
        engine.set_rng_state(state.extra.get("engine_rng"))
    # From the first step on, the engine samples from exactly the trainer's weights: a vLLM
    # server may still hold the base model, or another run's (the embedded engine shares them).
    engine.update_weights(version=state.policy_version)
    barrier(world)
    logger = MetricsLogger(
        run_dir, wandb=cfg.log.wandb, wandb_project=cfg.log.wandb_project, tensorboard=cfg.log.tensorboard,
        config=cfg.model_dump(), resume=resume,
    ) if world.is_main else NoLogger()
    if resume:
        logger.truncate_after(state.step)
    last: dict[str, float] = {}
    steps_without_signal = 0
    end = t.steps if stop_after is None else min(t.steps, state.step + stop_after)

    # The prompts, read in step order; broken data set rows skipped, listed in skipped.jsonl
    # (by rank 0), counted, and the step refilled from the rows after them.
    stream = open_prompt_stream(
        lambda position: task.train_sample(position, seed=t.seed), run_dir=run_dir, position=state.data_position,
        done_steps=state.step, resume=resume, max_skip_fraction=max_skip_fraction(cfg), check=fits,
        writes=world.is_main)

    def sample(step: int):  # one step's rollouts; on the rollout thread when sampling ahead
        return sample_step(step, engine=engine, task=task, cfg=cfg, setup=setup, world=world, sampling=sampling,
                           stream=stream, sampling_weights=sampling_weights)

    source = RolloutSource(sample, first_step=state.step, end=end, max_async_level=cfg.rollout.max_async_level)
    engine_before = engine_stats(engine)
    with logger, stream, ProgressBar(progress and world.is_main, end - state.step, "rl") as bar, source:
        try:
            for step in range(state.step, end):
                start = time.perf_counter()
                # 1. Rollouts: G per prompt, scored, advantages, the groups worth training on. Every
                # image embedding they put in or read from the cache stays pinned until step 2 ends.
                rollouts, waited_s, queue_depth = source.get(step)
                state.data_position = rollouts.rows.end
                with timed("samples"):  # every rank: the whole step's groups, in prompt order
                    groups = [g for part in all_gather(rollouts.groups, world) for g in part]
                    # Never trained on: a group from weights staler than the bound (none, by
                    # construction; counted, so a change that breaks it shows).
                    fresh = [g for g in groups if step - min(r.policy_version for r in g) <= max_lag]
                    batch = score_groups(fresh or groups, cfg.rollout)
                    if not fresh:
                        batch.samples = []
                rollout_s = time.perf_counter() - start

                # 2. Train: pack like text (never splitting a sample), this rank's share of the
                # micro-batches, optimize. They stay in host memory (page-locked on a GPU); each pass
                # of the train step sends them to the device one ahead of the one it computes.
                pins = rollouts.pins
                train_metrics: dict[str, float] = {}
                if batch.samples:
                    with timed("pack"), pins:
                        micro_batches = staged(rank_micro_batches(
                            batch.samples, setup, max_tokens=t.max_tokens, share_prompts=share_prompts, world=world),
                            setup.device)
                    train_metrics = train_step(
                        model, optimizer, scheduler, micro_batches, loss=loss,
                        num_iterations=t.num_iterations, grad_clip=t.grad_clip, distribution=distribution,
                        banned_token_ids=banned, reference=reference, world=world, current_version=step,
                    )
                pins.release()
                train_s = time.perf_counter() - start - rollout_s
                steps_without_signal = 0 if batch.samples else steps_without_signal + 1
                stalled = stall_message(steps_without_signal, batch.metrics, run_dir)
                if stalled and world.is_main:  # every rank holds the same batch: say it once
                    warnings.warn(stalled, RuntimeWarning, stacklevel=2)

                # 3. Weights to the engine: every k-th step, and whenever the run evaluates,
                # checkpoints or ends, so those see (and a resume restarts from) the current weights.
                # Rollouts sampled ahead go on meanwhile, on the weights the servers hold.
                state.step = step + 1
                evaluating = bool(cfg.eval.every_steps) and state.step % cfg.eval.every_steps == 0
                checkpointing = bool(cfg.checkpoint.every_steps) and state.step % cfg.checkpoint.every_steps == 0
                sync_s, gone = 0.0, None
                if state.step % cfg.engine.sync_every_steps == 0 or evaluating or checkpointing or state.step == end:
                    try:
                        sync_s = engine.update_weights(version=state.step)
                    except NoServerError as err:  # the step is logged, then the run checkpoints and stops
                        gone = err
                    barrier(world)  # no rank samples again before the servers hold the new weights
                state.policy_version = engine.policy_version
                source.trained(step)
                step_s = time.perf_counter() - start

                # 4. Metrics, evaluation, checkpoint.
                engine_now = engine_stats(engine)
                metrics = {**batch.metrics, **train_metrics}
                if fits is not None:  # a data set: its broken rows met this step, by reason
                    metrics.update(skip_counts(rollouts.rows.skipped))
                metrics.update(
                    rollout_s=rollout_s, train_s=train_s, weight_sync_s=sync_s, step_s=step_s,
                    tokens_per_s=(train_metrics.get("train_tokens", 0.0) + batch.metrics["completion_tokens"]) / step_s,
                    cache_hit_rate=cache.stats.hit_rate, cache_evictions=float(cache.stats.evictions),
                    cache_mb=cache.nbytes / 2**20, cache_entries=float(len(cache)),
                    **lag_metrics(groups, step, max_lag),
                    stale_groups_dropped=float(len(groups) - len(fresh)),
                    # How the overlap went: seconds the trainer waited for rollouts, rollouts that
                    # were ready behind this step's, each server's seconds with nothing to do.
                    sample_s=rollouts.sample_s, trainer_idle_s=waited_s, rollout_queue_depth=float(queue_depth),
                    **{k: engine_now[k] - engine_before.get(k, 0.0) for k in STEP_COUNTERS if k in engine_now},
                    **memory_metrics(setup.device), **process_metrics(),
                )
                if "servers_alive" in engine_now:
                    metrics["servers_alive"] = engine_now["servers_alive"]
                engine_before = engine_now
                if evaluating and gone is None:  # rank 0 evaluates; with the embedded engine, every rank holds whole weights meanwhile
                    with sampling_weights():
                        ev = evaluate(setup, task, eval_samples, max_tokens=cfg.sampling.max_tokens, env=cfg.env) \
                            if world.is_main else {}
                        barrier(world)
                    if world.is_main:
                        logger.log(state.step, {k: v for k, v in ev.items() if k != "n"}, phase="eval")
                        metrics["eval_accuracy"] = ev["accuracy"]
                logger.log(state.step, metrics)
                last = metrics
                note = None
                if world.is_main and cfg.log.samples_every and state.step % cfg.log.samples_every == 0:
                    # A few prompts for a person to read (samples.jsonl, `saccade report`): the step's
                    # first, which rank 0 sampled itself and so still holds their images.
                    records = step_samples(state.step, rollouts.rows.prompts, groups, rollouts.groups,
                                           count=cfg.log.samples_prompts, folder=run_dir / SAMPLES_DIR,
                                           side=cfg.log.samples_image_side)
                    logger.log_samples(state.step, records)
                    note = sample_line(records)
                bar(format_step(metrics), note=note)
                if gone is not None:
                    raise gone
                if checkpointing or state.step == t.steps:  # and always at the end of the run
                    state.extra["engine_rng"] = engine.rng_state()
                    with stop_if_unwritable(run_dir, state.step):
                        save_checkpoint(
                            run_dir, model=model, optimizer=optimizer, scheduler=scheduler, state=state,
                            keep_last=cfg.checkpoint.keep_last, base_model_path=setup.model_path,
                        )
        except NoServerError as err:
            # Nothing trained is lost: the weights of every finished step go into a checkpoint.
            if world.size > 1:
                raise
            state.policy_version = state.step
            state.extra["engine_rng"] = engine.rng_state()
            saved = save_checkpoint(run_dir, model=model, optimizer=optimizer, scheduler=scheduler, state=state,
                                    keep_last=cfg.checkpoint.keep_last, base_model_path=setup.model_path)
            raise NoServerError(
                f"{err}. The run stopped after step {state.step} and saved {saved}; once a server answers again, "
                f"go on with: saccade rl {run_dir / 'config.toml'} --resume"
            ) from None
    return {"step": state.step, "last": last, "setup": setup}


class CheckpointWriteError(RuntimeError):
    """A checkpoint could not be written (disk full, folder unwritable): the run stops."""


@contextlib.contextmanager
def stop_if_unwritable(run_dir: Path, step: int):
    """Turn a failed checkpoint write into an error that says what is safe and what to do. The
    run stops rather than train on without checkpoints: days of steps that no checkpoint
    holds would be lost to the next crash. The save itself is atomic, so the previous
    checkpoint is intact (a half-written one is only ever a `.tmp-*` folder)."""
    from saccade.trainer.checkpoint import latest_checkpoint

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


def engine_stats(engine) -> dict[str, float]:
    """The engine's cumulative counters (`VLLMEngine.stats`); none for the embedded engine."""
    stats = getattr(engine, "stats", None)
    return stats() if stats is not None else {}


def lag_metrics(groups: list, step: int, max_lag: int) -> dict[str, float]:
    """How far behind the trainer's weights (step) each rollout's were: the mean, the largest,
    and the fraction at each lag 0..max_lag (a histogram with fixed keys)."""
    lags = [step - r.policy_version for group in groups for r in group]
    out = {"policy_lag": float(max(lags)), "policy_lag_mean": sum(lags) / len(lags)}
    for k in range(max_lag + 1):
        out[f"policy_lag_{k}_frac"] = sum(lag == k for lag in lags) / len(lags)
    return out


def sample_step(step: int, *, engine, task: Task, cfg: RunConfig, setup: Setup, world: World, sampling,
                stream: PromptStream, sampling_weights):
    """This rank's rollouts of one step: its share of the step's prompts, each sampling stream
    a function of (seed, step, prompt's stream position) only, so any number of ranks samples
    the same completions. Their image embeddings are pinned until the step has trained.

    Every rank reads (and checks) all the step's rows, so all skip the same broken ones."""
    from saccade.orchestrator.rollout import prompt_seeds, sample_groups
    from saccade.orchestrator.source import StepRollouts

    rows = stream.take(cfg.rollout.prompts_per_step, step=step + 1)  # numbered as metrics.jsonl numbers steps
    mine = world.share(len(rows.prompts))
    indices = [rows.positions[i] for i in mine]
    prompts = [rows.prompts[i] for i in mine]
    check = cfg.env.check_consistency == "always" or (cfg.env.check_consistency == "first" and step == 0)
    pins = setup.cache.pins(f"step {step + 1}")
    start = time.perf_counter()
    with pins, sampling_weights():
        groups = sample_groups(
            engine, task, prompts, sampling, merge=setup.merge, continuation=setup.continuation,
            env=cfg.env, tokenizer=setup.processor.tokenizer, check=check,
            seeds=prompt_seeds(cfg.trainer.seed, step, indices),
        )
    return StepRollouts(step, groups, pins, time.perf_counter() - start, rows=rows)


def rank_micro_batches(samples: list, setup: Setup, *, max_tokens: int, share_prompts: bool, world: World) -> list:
    """This rank's micro-batches of the step. Every rank plans the whole step's packing (the same
    plan as one process), takes its share by `balance` (about the same tokens, the same number
    of micro-batches: padding ones fill in), fetches from the other ranks the image embeddings
    it lacks, and collates its share."""
    from saccade.trainer.packing import collate_segments, pack_plan, padding_micro_batch, planned_tokens

    plan = pack_plan(samples, max_tokens=max_tokens, image_token_id=setup.image_token_id,
                     spatial_merge_size=setup.merge, share_prompts=share_prompts)
    assignment = balance([planned_tokens(segments) for segments in plan], world.size)
    mine = [plan[i] for i in assignment[world.rank]]
    share_embeddings([k for segments in mine for seg in segments for k in seg.sample.image_keys], setup.cache, world)
    micro_batches = [collate_segments(segments, setup.cache.get, image_token_id=setup.image_token_id,
                                      spatial_merge_size=setup.merge) for segments in mine]
    slots = max(len(a) for a in assignment)
    return micro_batches + [padding_micro_batch() for _ in range(slots - len(micro_batches))]


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
