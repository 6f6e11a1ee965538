"""The rollout path: prompts in, scored training samples with group-relative advantages out.
`sample_step` is an RL step's sampling, composed once: `saccade rl`, `saccade bench step` and
the tests all run it.

One path for every task. Each prompt is sampled G times (a group); each sample is an answer
(single-turn tasks) or a whole episode (multi-turn), scored by its own environment and turned
into one `TrainingSample` from the engine's own token ids. Then, the same for both:
group-relative advantages, the zero-variance filter, and the step's rollout metrics.

How the G samples are drawn is the one thing that depends on the task, through its
`max_turns`: a single-turn prompt goes to the engine once with n = G (the G answers share the
prompt's prefill); a multi-turn task runs G environments reset with the prompt, turn by turn,
token-in/token-out (`saccade.envs.rollout.run_episodes`).
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from dataclasses import dataclass, field, replace
from typing import Any, TypeVar

import numpy as np
import torch

from saccade.config import EnvConfig, RolloutConfig, RunConfig
from saccade.data.rows import StepRows
from saccade.distributed import SINGLE, World, all_gather
from saccade.envs.base import StepResult
from saccade.inference.engine import ChatRequest, Completion, Engine, SamplingParams, stream_seed
from saccade.inference.servers import NoServerError
from saccade.models.families import Positions
from saccade.models.vision import Pins
from saccade.orchestrator.advantages import group_advantages, zero_variance_groups
from saccade.orchestrator.samples import completion_to_sample
from saccade.run.setup import Setup
from saccade.run.tasks import Prompt, Task
from saccade.timing import timed
from saccade.trainer.samples import TrainingSample


# A task's prompt: what its environments are reset with.
S = TypeVar("S", bound=Prompt)


@dataclass
class Rollout:
    """One scored answer or episode, before its advantage is known."""

    sample: TrainingSample  # the whole sequence as the engine ran it; advantage set later
    reward: float  # the episode's return (single-turn: the answer's reward)
    info: dict[str, Any]  # what the environment reported at the last step
    completion_tokens: int  # tokens the engine sampled, over all turns
    finish_reasons: list[str]  # one per turn: "stop" or "length"
    texts: list[str]  # each assistant turn's text, decoded from the sampled ids
    policy_version: int  # the oldest weights any of its turns was sampled under
    # What the environment said before each assistant turn: [0] the opening messages, [k] its
    # reply to turn k-1 (images as it sent them). Read by the samples log (saccade.loops.sample_log).
    env_messages: list[list[dict[str, Any]]] = field(default_factory=list, repr=False)

    def __getstate__(self) -> dict[str, Any]:
        # Under torchrun the step's groups are gathered to every rank (pickled): the images stay
        # on the rank that sampled them. Only rank 0 writes samples, from its own prompts.
        return {**self.__dict__, "env_messages": []}

    @property
    def turns(self) -> int:
        return len(self.texts)

    @property
    def correct(self) -> float:
        """1.0 when the environment scored the last turn fully correct."""
        return float(float(self.info.get("correct", 0.0)) >= 1.0)

    @property
    def final_cut(self) -> bool:
        """Its final reply (the answer) was cut at sampling.max_tokens."""
        return self.finish_reasons[-1:] == ["length"]

    @property
    def cut_frac(self) -> float:
        """The share of its replies cut at sampling.max_tokens (single-turn: 0 or 1)."""
        return sum(reason == "length" for reason in self.finish_reasons) / max(len(self.finish_reasons), 1)


@dataclass
class RolloutBatch:
    """A step's rollouts: the training samples of the groups kept, and the metrics of all."""

    samples: list[TrainingSample]
    metrics: dict[str, float]
    groups: list[list[Rollout]] = field(default_factory=list)
    # The step's groups dropped for having no reward spread (rollout.filter_zero_variance): their
    # loss tokens and samples, for a normalisation that counts them (loss.denominator 'sampled').
    filtered_loss_tokens: int = 0
    filtered_samples: int = 0


@dataclass
class StepRollouts:
    """One step's rollouts, as sampled and scored for it (`sample_step`): what the sampling
    hands the trainer (`saccade.orchestrator.source.RolloutSource`)."""

    step: int
    groups: list[list[Rollout]]  # this rank's groups, in prompt order (they still hold the environments' images)
    pins: Pins  # the cache pins that keep their image embeddings until the step has trained
    sample_s: float  # wall seconds the sampling took
    rows: StepRows[Any]  # the data rows read for the step: prompts, positions, skips
    all_groups: list[list[Rollout]]  # every rank's groups, in prompt order, advantages set
    batch: RolloutBatch  # the scored step: the samples to train on, the rollout metrics


def sample_answers(engine: Engine, task: Task[S], prompts: list[S], params: SamplingParams, *,
                   positions: Positions, seeds: list[int | None] | None = None) -> list[list[Rollout]]:
    """Single-turn: one request per prompt with n = params.n; each answer scored by its own
    environment (reset with the prompt, stepped with the answer). `seeds`: each prompt's
    sampling stream (answer j draws from stream_seed(seed, j)); None: the engine's."""
    from saccade.envs.rollout import reset_all, step_all

    G = params.n
    envs = [task.make_env() for _ in prompts for _ in range(G)]
    with timed("env"):
        openings = asyncio.run(reset_all(envs, [p for p in prompts for _ in range(G)]))
    seeds = seeds if seeds is not None else [None] * len(prompts)
    requests = [ChatRequest(p.sample_id, openings[g * G], seed=seeds[g]) for g, p in enumerate(prompts)]
    groups = engine.generate(requests, params)
    replies = [{"role": "assistant", "content": c.text} for group in groups for c in group]
    with timed("rewards"):
        results = asyncio.run(step_all(envs, replies))
    with timed("samples"):
        return _scored_groups(groups, prompts, results, positions, openings)


def _scored_groups(groups: list[list[Completion]], prompts: list[S], results: list[StepResult],
                   positions: Positions, openings: list) -> list[list[Rollout]]:
    """Each completion with its environment's result, as a Rollout holding its training sample."""
    G = len(groups[0]) if groups else 0
    out = []
    for g, (group, prompt) in enumerate(zip(groups, prompts, strict=True)):
        rollouts = []
        for i, completion in enumerate(group):
            result = results[g * G + i]
            sample = completion_to_sample(completion, sample_id=f"{prompt.sample_id}/{i}", advantage=0.0,
                                          reward=result.reward, positions=positions)
            rollouts.append(Rollout(sample, result.reward, result.info, completion.completion_ids.numel(),
                                    [completion.finish_reason], [completion.text], completion.policy_version,
                                    env_messages=[openings[g * G]]))
        out.append(rollouts)
    return out


def sample_episodes(engine: Engine, task: Task[S], prompts: list[S], params: SamplingParams, *,
                    positions: Positions, continuation, env: EnvConfig, tokenizer, check: bool,
                    seeds: list[int | None] | None = None) -> list[list[Rollout]]:
    """Multi-turn: params.n environments per prompt, each episode one training sample. With
    `check`, every turn's generation-time inputs must equal the training sample's."""
    from saccade.envs.rollout import run_episodes
    from saccade.envs.trajectory import check_consistency, to_training_sample

    G = params.n
    episodes = [p for p in prompts for _ in range(G)]
    ids = [f"{p.sample_id}/{i}" for p in prompts for i in range(G)]
    # Episode i of a prompt draws from stream_seed(prompt's seed, i), as answer i would.
    episode_seeds = [None if seed is None else stream_seed(seed, i)
                     for seed in (seeds if seeds is not None else [None] * len(prompts)) for i in range(G)]
    trajectories = run_episodes(engine, [task.make_env() for _ in episodes], episodes, ids, replace(params, n=1),
                                continuation=continuation, max_total_tokens=env.max_total_tokens,
                                seeds=episode_seeds)
    markers = tuple(env.loss_markers) if env.loss_on == "markers" else None
    rollouts = []
    for t in trajectories:
        sample = to_training_sample(t, positions=positions, tokenizer=tokenizer, markers=markers)
        if check:  # fails loudly: a run whose trainer sees other inputs than the engine must not go on
            check_consistency(sample, t.turns, positions=positions)
        rollouts.append(Rollout(
            sample, t.total_reward, t.infos[-1] if t.infos else {},
            sum(turn.completion_ids.numel() for turn in t.turns), list(t.finish_reasons), list(t.texts),
            t.policy_version, env_messages=list(t.env_messages),
        ))
    return [rollouts[g * G:(g + 1) * G] for g in range(len(prompts))]


def sample_groups(engine: Engine, task: Task[S], prompts: list[S], params: SamplingParams, *,
                  positions: Positions, continuation=None, env: EnvConfig | None = None, tokenizer=None,
                  check: bool = False, seeds: list[int | None] | None = None) -> list[list[Rollout]]:
    """params.n scored rollouts per prompt, answers or episodes as the task's max_turns says.
    `seeds`: one sampling stream per prompt (`prompt_seeds`), or None for the engine's own.
    `positions`: the model's M-RoPE rule (`Setup.positions`), for the training samples."""
    if task.max_turns == 1:
        return sample_answers(engine, task, prompts, params, positions=positions, seeds=seeds)
    return sample_episodes(engine, task, prompts, params, positions=positions, continuation=continuation,
                           env=env or EnvConfig(), tokenizer=tokenizer, check=check, seeds=seeds)


def prompt_seeds(seed: int, step: int, prompt_indices) -> list[int]:
    """Each prompt's sampling stream: a function of (run seed, step, prompt index) only, so the
    same prompts sample the same completions in one process or spread over many."""
    return [stream_seed(seed, step, i) for i in prompt_indices]


def sample_step(step: int, rows: StepRows[S], *, setup: Setup, task: Task[S], cfg: RunConfig, sampling: SamplingParams,
                world: World = SINGLE, max_lag: int = 0, sampling_weights=contextlib.nullcontext) -> StepRollouts:
    """One RL step's rollouts, scored. This rank samples its share of the step's prompts (`rows`),
    `sampling.n` answers or episodes each, every sampling stream a function of (seed, step,
    prompt's stream position) only, so any number of ranks samples the same completions. Then
    every rank holds the whole step's groups, in prompt order, with their group-relative
    advantages, the samples worth training on and the step's rollout metrics (`score_groups`).
    Their image embeddings stay pinned (`StepRollouts.pins`) until the step has trained.

    `max_lag`: the oldest weights, in versions behind `step`, a group may come from and still be
    trained on. `sampling_weights`: the context the engine samples in (the embedded engine
    sampling from a sharded model: its weights gathered whole)."""
    mine = world.share(len(rows.prompts))
    check = cfg.env.check_consistency == "always" or (cfg.env.check_consistency == "first" and step == 0)
    pins = setup.cache.pins(f"step {step + 1}")
    start = time.perf_counter()
    own, error = [], None
    with pins, sampling_weights():
        try:
            own = sample_groups(
                setup.engine, task, [rows.prompts[i] for i in mine], sampling, positions=setup.positions,
                continuation=setup.continuation, env=cfg.env, tokenizer=setup.processor.tokenizer, check=check,
                seeds=prompt_seeds(cfg.trainer.seed, step, [rows.positions[i] for i in mine]),
            )
        except Exception as err:  # noqa: BLE001 - under torchrun every rank must hear of it (below)
            if world.size == 1:
                raise
            error = err
    sample_s = time.perf_counter() - start
    with timed("samples"):
        try:
            groups = every_ranks_groups(own, error, world, step)
        except Exception:
            pins.release()
            raise
        # Never trained on: a group from weights staler than the bound (none, by construction;
        # counted, so a change that breaks it shows).
        fresh = [g for g in groups if step - min(r.policy_version for r in g) <= max_lag]
        batch = score_groups(fresh or groups, cfg.rollout)
        if not fresh:
            batch.samples = []
        batch.metrics.update(lag_metrics(groups, step, max_lag), stale_groups_dropped=float(len(groups) - len(fresh)))
    return StepRollouts(step, own, pins, sample_s, rows, groups, batch)


def every_ranks_groups(own: list[list[Rollout]], error: Exception | None, world: World,
                       step: int) -> list[list[Rollout]]:
    """Every rank's groups, in rank (so prompt) order; or, when sampling failed on any rank, an
    error raised on every rank alike, so that all stop at the same step: NoServerError if any
    rank's servers were all gone (then every rank checkpoints, as one process does), else
    this rank's own error or one naming the rank that failed. Without this, the other ranks
    would wait in the next collective until the process group's timeout."""
    failure = None if error is None else (type(error).__name__, str(error), isinstance(error, NoServerError))
    parts = all_gather((own, failure), world)
    failures = [(rank, f) for rank, (_, f) in enumerate(parts) if f is not None]
    if not failures:
        return [g for part, _ in parts for g in part]
    gone = next(((rank, f) for rank, f in failures if f[2]), None)
    if gone is not None:
        raise NoServerError(gone[1][1] if gone[0] == world.rank else f"rank {gone[0]}: {gone[1][1]}")
    if error is not None:
        raise error
    rank, (kind, text, _) = failures[0]
    raise RuntimeError(f"rank {rank} failed while sampling step {step + 1}: {kind}: {text}")


def lag_metrics(groups: list[list[Rollout]], step: int, max_lag: int) -> dict[str, float]:
    """How far behind the trainer's weights (step) each rollout's were: the mean, the largest,
    and the fraction at each lag 0..max_lag (a histogram with fixed keys)."""
    lags = [step - r.policy_version for group in groups for r in group]
    out = {"policy_lag": float(max(lags)), "policy_lag_mean": sum(lags) / len(lags)}
    for k in range(max_lag + 1):
        out[f"policy_lag_{k}_frac"] = sum(lag == k for lag in lags) / len(lags)
    return out


def shaped_rewards(groups: list[list[Rollout]], overlong_penalty: float) -> torch.Tensor:
    """The rewards advantages are computed from: each episode's return minus overlong_penalty
    times the share of its replies cut at sampling.max_tokens (DAPO's overlong shaping, its
    hard part). When every reply of a group scores 0, those that ended now beat those cut."""
    return torch.tensor([[r.reward - overlong_penalty * r.cut_frac for r in group] for group in groups],
                        dtype=torch.float32)


def score_groups(groups: list[list[Rollout]], rollout: RolloutConfig) -> RolloutBatch:
    """Group-relative advantages set on the samples; the kept groups' samples and the metrics.
    With rollout.mask_overlong, a sample whose final reply was cut stays in its group's
    statistics but out of the loss (DAPO's overlong filtering)."""
    rewards_PG = torch.tensor([[r.reward for r in group] for group in groups], dtype=torch.float32)
    shaped_PG = shaped_rewards(groups, rollout.overlong_penalty) if rollout.overlong_penalty else rewards_PG
    advantages_PG = group_advantages(shaped_PG, baseline=rollout.advantage_baseline,
                                     scaling=rollout.advantage_scaling)
    signal_P = ~zero_variance_groups(shaped_PG)  # a group whose rewards are all equal teaches nothing
    keep_P = signal_P if rollout.filter_zero_variance else torch.ones(len(groups), dtype=torch.bool)
    samples, filtered = [], []
    for g, group in enumerate(groups):
        for i, r in enumerate(group):
            r.sample.advantage = float(advantages_PG[g, i])
            if rollout.mask_overlong and r.final_cut:
                continue
            (samples if keep_P[g] else filtered).append(r.sample)
    metrics = rollout_metrics(groups, rewards_PG, keep_P, signal_P)
    if rollout.overlong_penalty:
        metrics["reward_shaped_mean"] = float(shaped_PG.mean())
    return RolloutBatch(samples, metrics, groups, filtered_loss_tokens=sum(int(s.loss_mask.sum()) for s in filtered),
                        filtered_samples=len(filtered))


def rollout_metrics(groups: list[list[Rollout]], rewards_PG: torch.Tensor, keep_P: torch.Tensor,
                    signal_P: torch.Tensor) -> dict[str, float]:
    """Rewards, accuracy, lengths, turns, images, how many groups carry a signal (reward
    variance) and how many were kept, how the replies ended; plus the mean of every number the
    environments reported at their last step, as env_<key>, and the reward functions' values,
    parts and failures (reward_<name>, reward_errors, ...). `stopped_frac` and `truncated_frac`
    are shares of the replies (every turn of an episode): ended by the model, and cut at
    sampling.max_tokens (finish reason "length"). `final_truncated_frac` counts each answer or
    episode once, by its final reply (single-turn: the same as truncated_frac): the stall watch's
    sign of a policy whose replies no longer end (saccade.loops.stall): a multi-turn run whose groups
    still vary can have half its replies cut (the views demo's look turns), not its final ones."""
    flat = [r for group in groups for r in group]
    lengths = torch.tensor([r.completion_tokens for r in flat], dtype=torch.float32)
    reasons = [reason for r in flat for reason in r.finish_reasons]
    return {
        "reward_mean": float(rewards_PG.mean()),
        "reward_std": float(rewards_PG.std()) if rewards_PG.numel() > 1 else 0.0,
        "accuracy": float(np.mean([r.correct for r in flat])),
        "completion_len_mean": float(lengths.mean()),
        "completion_len_max": float(lengths.max()),
        "stopped_frac": float(np.mean([reason == "stop" for reason in reasons])),
        "truncated_frac": float(np.mean([reason == "length" for reason in reasons])),
        "final_truncated_frac": float(np.mean([r.final_cut for r in flat])),
        "groups_with_signal_frac": float(signal_P.float().mean()),
        "groups_kept_frac": float(keep_P.float().mean()),
        "completion_tokens": float(lengths.sum()),
        "sampled_policy_version": float(min(r.policy_version for r in flat)),
        "turns_mean": float(np.mean([r.turns for r in flat])),
        "images_mean": float(np.mean([r.sample.num_images for r in flat])),
        "episode_tokens_mean": float(np.mean([r.sample.num_tokens for r in flat])),
        **final_info_means([r.info for r in flat]),
        **reward_metrics([r.info for r in flat]),
    }


def final_info_means(infos: list[dict[str, Any]]) -> dict[str, float]:
    """The mean of every numeric or boolean value in the episodes' last `info`, as "env_<key>":
    what an environment reports about its episodes (answered, seen, ...) becomes a metric."""
    values: dict[str, list[float]] = {}
    for info in infos:
        for key, value in info.items():
            if isinstance(value, (bool, int, float)):
                values.setdefault(f"env_{key}", []).append(float(value))
    return {key: float(np.mean(v)) for key, v in sorted(values.items())}


# Counts, summed over the step's answers; every other reward_* value is a mean.
REWARD_COUNTS = ("reward_errors", "reward_timeouts")


def reward_metrics(infos: list[dict[str, Any]]) -> dict[str, float]:
    """What the reward functions said about the answers (`saccade.rewards.weighted.Rewards`, in each
    info's "rewards"): reward_<name> and reward_<name>_<part>, means over the answers that
    report them (a function that failed on an answer reports no parts there);
    reward_errors and reward_timeouts, the step's failed calls. Empty for tasks scored
    otherwise (views, verifiers: their scores are env_<key>)."""
    values: dict[str, list[float]] = {}
    for info in infos:
        for key, value in (info.get("rewards") or {}).items():
            values.setdefault(key, []).append(float(value))
    return {key: float(np.sum(v) if key in REWARD_COUNTS else np.mean(v)) for key, v in sorted(values.items())}
