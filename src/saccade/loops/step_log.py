"""What each step of a run writes: its metrics row (`step_metrics`: the rollouts', the train
step's, where the seconds went, the cache, the engine's counters, memory), and every
`log.samples_every` steps a few prompts with their completions for a person to read
(`SampleLog`: samples.jsonl, `saccade report`). Rank 0 writes; the other ranks log to `NoLogger`.
"""

from __future__ import annotations

from pathlib import Path

from saccade.data.rows import skip_counts
from saccade.loops.rl_step import RLStep
from saccade.metrics import MetricsLogger
from saccade.orchestrator.rollout import StepRollouts
from saccade.process_stats import memory_metrics, process_metrics
from saccade.loops.sample_log import SAMPLES_DIR, finite, sample_line, step_samples
from saccade.run.setup import Setup
from saccade.orchestrator.visual import reply_logprobs


class SampleLog:
    """Every `log.samples_every` steps (rank 0), the step's first prompts and their completions."""

    def __init__(self, rl: RLStep, logger, run_dir: Path):
        self.rl, self.logger, self.run_dir = rl, logger, run_dir
        self.every = rl.cfg.log.samples_every

    def after_step(self, step: int, rollouts: StepRollouts) -> str | None:
        """The console's line about the first prompt when samples were written, else None."""
        if not (self.rl.world.is_main and self.every and step % self.every == 0):
            return None
        return log_samples(self.logger, step, rollouts, self.rl, self.run_dir)


def log_samples(logger: MetricsLogger, step: int, rollouts: StepRollouts, run: RLStep, run_dir: Path) -> str:
    """A few prompts with their completions for a person to read (samples.jsonl, `saccade
    report`): the step's first, which rank 0 sampled itself and so still holds their images.
    Each completion also gets its reply's logprob with and without its images under the
    weights just trained (`saccade.orchestrator.visual.reply_logprobs`). Returns the console's line about
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


class EngineCounters:
    """The engine's counters over each step (`engine_counters` of two readings of `Engine.stats`)."""

    def __init__(self, engine):
        self.engine, self.before = engine, engine.stats()

    def step(self) -> dict[str, float]:
        now = self.engine.stats()
        out, self.before = engine_counters(now, self.before), now
        return out
