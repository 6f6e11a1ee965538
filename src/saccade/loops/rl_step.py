"""The RL step's two halves, built once per run (`RLStep.build`): `sample` a step's prompts with
the engine (G replies or episodes each, scored, group-relative advantages, the groups with a
signal: `saccade.orchestrator.rollout.sample_step`), and `train` on them (packed like text into
this rank's micro-batches, `num_iterations` optimizer steps of `saccade.trainer.step.train_step`,
whose loss is `saccade.trainer.loss.policy_loss`). `train_rl` runs it every step; `saccade bench
step` builds and times the very same step.
"""

from __future__ import annotations

import contextlib
import warnings
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from saccade.config import LossConfig, RunConfig, effective_loss
from saccade.data.rows import PromptStream, StepRows, max_skip_fraction, open_prompt_stream, row_check
from saccade.distributed import SINGLE, World, unsharded
from saccade.inference.engine import SamplingParams
from saccade.models.lm import shares_prompts
from saccade.orchestrator.rollout import StepRollouts, sample_step
from saccade.run.setup import Setup
from saccade.run.tasks import Task
from saccade.timing import timed
from saccade.trainer.packing import rank_micro_batches
from saccade.trainer.reference import Reference, adapter_free_reference, frozen_copy, frozen_reference
from saccade.trainer.spike import GradSpikeGuard
from saccade.trainer.step import build_optimizer, lr_schedule, staged, train_step


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
    loss: LossConfig  # effective_loss: TIS on for older rollouts trained on several times
    # What the engine samples from, so what the trainer, its old logprobs and the reference score.
    sampling: SamplingParams
    reference: Reference | None  # the KL term's: LoRA's base with adapters off, or a frozen copy (full FT)
    share_prompts: bool  # a group's prompt forwarded once
    max_lag: int  # the oldest weights a trained batch may come from, in versions behind the trainer's
    fits: Callable[[Any], None] | None  # a data set's rows must fit the token budget (an image span is never cut)
    # The ranks as the rollouts see them: `world` itself, or, when a thread samples ahead under
    # torchrun, the same ranks over a process group of the thread's own.
    rollout_world: World = SINGLE
    # Skips a step whose gradient norm spikes (trainer.grad_spike); its window goes with each checkpoint.
    spike_guard: GradSpikeGuard | None = None

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
                   rollout_world=world.with_own_group(t.dist_timeout_s) if samples_ahead else world,
                   spike_guard=GradSpikeGuard.of(t.grad_spike))

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
                    spatial_merge_size=s.merge, share_prompts=self.share_prompts, world=self.world,
                    video_token_id=s.video_token_id), s.device)
            filtered = (rollouts.batch.filtered_loss_tokens, rollouts.batch.filtered_samples)
            metrics = self.train_micro_batches(step, micro_batches, filtered=filtered)
        rollouts.pins.release()
        return metrics

    def train_micro_batches(self, step: int, micro_batches: list, *,
                            filtered: tuple[int, int] = (0, 0)) -> dict[str, float]:
        """`train_step` with the run's settings on this rank's micro-batches of `step` (in host memory);
        `filtered`: the step's loss tokens and samples the zero-variance filter dropped."""
        t = self.cfg.trainer
        return train_step(
            self.setup.model, self.optimizer, self.scheduler, micro_batches, loss=self.loss,
            num_iterations=t.num_iterations, grad_clip=t.grad_clip, distribution=self.sampling.distribution,
            banned_token_ids=self.setup.engine.banned_token_ids, reference=self.reference, world=self.world,
            current_version=step, spike_guard=self.spike_guard, filtered=filtered, max_lag=self.max_lag,
        )
