"""GRPO-family RL on a VLM, as one visible loop (`train_rl`).

Each step: take the next prompts from the data stream, sample G completions each with
the engine, score them, turn rewards into group-relative advantages, build
TrainingSamples from the engine's own token ids, pack them, and take `num_iterations`
optimizer steps on the clipped objective against the engine's logprobs. Then the engine
gets the new weights: free with the embedded engine (it shares the module); vLLM servers
load an exported folder, after every step or every `engine.sync_every_steps`.

Simplified on purpose: rollouts and training alternate in one process (no async
off-policy buffer); evaluation is greedy accuracy on a held-out split.
"""

from __future__ import annotations

import math
import random
import time
import warnings
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch

from saccade.config import RunConfig


@dataclass
class Setup:
    """Everything a run holds: built once by `build_setup`, used by the loops."""

    cfg: RunConfig
    run_dir: Path
    model_path: str
    processor: Any
    model: torch.nn.Module  # PolicyLM, LoRA-wrapped or not
    engine: Any  # LocalEngine or VLLMEngine
    cache: Any  # EmbeddingCache: the images' embeddings, filled by the engine, read by the trainer
    limits: Any
    merge: int
    image_token_id: int
    continuation: Any = None  # ChatContinuation, built on the first multi-turn rollout


def set_seed(seed: int) -> None:
    random.seed(seed)
    np.random.seed(seed % 2**32)
    torch.manual_seed(seed)


def build_setup(cfg: RunConfig, run_dir: Path) -> Setup:
    """The trainer's model (LoRA or full) and the engine the config names.

    Embedded: the engine samples from the trainer's module and holds the frozen tower.
    vLLM: the servers hold the tower; image embeddings come from their /encode_images, so
    no tower is loaded in this process at all.
    """
    from saccade.models.lm import apply_lora, load_policy_lm, set_full_finetune
    from saccade.models.loading import load_processor
    from saccade.models.tiny import resolve_model
    from saccade.models.vision import EmbeddingCache

    if cfg.trainer.torch_threads:
        torch.set_num_threads(cfg.trainer.torch_threads)
    set_seed(cfg.trainer.seed)
    model_path = resolve_model(cfg.model.path)
    dtype = getattr(torch, cfg.model.dtype)
    processor = load_processor(model_path)
    limits = cfg.images.to_limits()
    policy = load_policy_lm(model_path, dtype=dtype, attn_implementation=cfg.model.attn_implementation)
    if cfg.lora.enabled:
        model = apply_lora(policy, cfg.lora.to_settings())
    else:
        model = set_full_finetune(policy)
    cache = EmbeddingCache(max_bytes=1 << 30)
    if cfg.engine.kind == "vllm":
        engine = build_vllm_engine(cfg, model, model_path, processor, limits, cache, run_dir)
    else:
        engine = build_local_engine(cfg, model, model_path, processor, limits, cache, dtype)
    merge = int(policy.config.vision_config.spatial_merge_size)  # the full model's config; no tower read
    return Setup(cfg, run_dir, model_path, processor, model, engine, cache, limits, merge, policy.image_token_id)


def build_local_engine(cfg: RunConfig, model, model_path: str, processor, limits, cache, dtype):
    from saccade.inference.local import LocalEngine
    from saccade.models.loading import load_vision_tower
    from saccade.models.vision import VisionEncoder

    # The engine side holds the frozen tower; the trainer's model never does.
    tower = load_vision_tower(model_path, dtype=dtype)
    encoder = VisionEncoder(tower, processor, limits=limits, cache=cache)
    return LocalEngine(model, processor, encoder, limits=limits, seed=cfg.trainer.seed)


def build_vllm_engine(cfg: RunConfig, model, model_path: str, processor, limits, cache, run_dir: Path):
    import os

    from saccade.inference.vllm import VLLMEngine

    lora = cfg.engine.sync_lora_adapter
    if lora and not cfg.lora.enabled:
        raise ValueError("engine.sync_lora_adapter needs lora.enabled = true (full fine-tuning pushes full weights)")
    weights_dir = Path(cfg.engine.weights_dir) if cfg.engine.weights_dir else run_dir / "engine-weights"
    return VLLMEngine.for_servers(
        cfg.engine.urls, processor, limits=limits, cache=cache, api_key=os.environ.get("VLLM_API_KEY"),
        max_concurrency=cfg.engine.max_concurrency, timeout_s=cfg.engine.timeout_s,
        exporter=engine_weights_exporter(model, model_path, weights_dir, lora=lora), lora=lora,
    )


def engine_weights_exporter(model: torch.nn.Module, base_model_path: str, folder: Path, *, lora: bool = False):
    """exporter(version) -> `folder/v{version}`: a full HF folder of the model's current weights
    (LoRA merged), or with `lora` only its PEFT adapter. Older versions are removed (the
    servers have loaded them already)."""
    import shutil

    from saccade.trainer.checkpoint import merge_full_weights_for_engine, save_adapter_for_engine

    def export(version: int) -> str:
        if lora:
            out = save_adapter_for_engine(model, base_model_path, folder / f"v{version}")
        else:
            out = merge_full_weights_for_engine(model, base_model_path, folder / f"v{version}")
        for old in folder.glob("v*"):
            if old != out and old.is_dir():
                shutil.rmtree(old, ignore_errors=True)
        return str(out)

    return export


def lr_lambda(cfg: RunConfig):
    """Linear warm-up, then constant, linear or cosine decay to min_lr_ratio, per optimizer step."""
    t = cfg.trainer
    total = max(1, t.steps * t.num_iterations)

    def factor(opt_step: int) -> float:
        if t.warmup_steps and opt_step < t.warmup_steps:
            return (opt_step + 1) / t.warmup_steps
        if t.lr_decay == "constant":
            return 1.0
        progress = min(1.0, (opt_step - t.warmup_steps) / max(1, total - t.warmup_steps))
        if t.lr_decay == "linear":
            shape = 1.0 - progress
        else:
            shape = 0.5 * (1.0 + math.cos(math.pi * progress))
        return t.min_lr_ratio + (1.0 - t.min_lr_ratio) * shape

    return factor


def build_optimizer(model: torch.nn.Module, cfg: RunConfig, *, lr: float | None = None, schedule=None):
    """AdamW over the trainable parameters and a LambdaLR (default: the trainer section's schedule)."""
    params = [p for p in model.parameters() if p.requires_grad]
    assert params, "nothing to train"
    optimizer = torch.optim.AdamW(params, lr=lr or cfg.trainer.lr, weight_decay=cfg.trainer.weight_decay)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, schedule or lr_lambda(cfg))
    return optimizer, scheduler


def grad_norm_or_none(params: list[torch.Tensor], max_norm: float) -> float | None:
    """Clip and return the pre-clip norm, or None if any gradient is NaN/inf (the step is then skipped)."""
    norm = torch.nn.utils.clip_grad_norm_(params, max_norm)
    return float(norm) if torch.isfinite(norm) else None


def reward_of(text: str, sample, weights: dict[str, float]) -> tuple[float, dict[str, float]]:
    from saccade.rewards import correct_reward, format_reward

    parts = {}
    for name in weights:
        if name == "correct":
            parts[name] = float(correct_reward(text, sample))
        elif name == "format":
            parts[name] = float(format_reward(text, sample.choices))
        else:
            raise ValueError(f"unknown reward function {name!r}; known: correct, format")
    return sum(weights[n] * v for n, v in parts.items()), parts


def task_from_config(cfg: RunConfig, *, blank: bool | None = None):
    """The run's task: a ShapesTask, or a DatasetTask (`saccade.data.datasets`, splits opened
    on first use) for data.task = openmmreasoner, mathvista or geometry3k."""
    from saccade.data.shapes import ShapesTask

    blank_images = cfg.data.blank_images if blank is None else blank
    if cfg.data.task == "views":
        from saccade.envs.views import ViewsTask

        e = cfg.env
        return ViewsTask(places=tuple(e.places), num_choices=cfg.data.num_choices, image_size=e.image_size,
                         max_turns=e.max_turns, turn_cost=e.turn_cost, eval_seed=cfg.trainer.seed + EVAL_SEED_OFFSET,
                         distractors=e.distractors, require_seen=e.require_seen,
                         look_reward=e.look_reward, colors=tuple(e.colors))
    if cfg.data.task != "shapes":
        from saccade.data.datasets import DatasetTask

        d = cfg.data
        return DatasetTask.defaults(
            d.task, dataset=d.dataset, split=d.split, subsets=d.subsets, eval_dataset=d.eval_dataset,
            eval_split=d.eval_split, eval_subsets=d.eval_subsets, blank_images=blank_images,
            limits=cfg.images.to_limits(),
        )
    return ShapesTask(
        kinds=tuple(cfg.data.question_kinds),
        num_choices=cfg.data.num_choices,
        image_size=cfg.data.image_size,
        blank_images=blank_images,
    )


def train_sample(task, position: int, *, seed: int):
    """Prompt ``position`` of the training stream: shapes generate it from (position, seed);
    a data set reads the row at that position of its seeded shuffle (a new order each epoch)."""
    from saccade.data.shapes import ShapesTask, make_sample

    if isinstance(task, ShapesTask):
        return make_sample(task, position, seed=seed)
    return task.train_sample(position, seed=seed)


def held_out_samples(task, n: int, *, seed: int) -> list:
    """The held-out prompts: shapes from another seed's stream; a data set's eval split in order."""
    from saccade.data.shapes import ShapesTask, make_split

    if isinstance(task, ShapesTask):
        return make_split(task, n, seed=seed)
    return task.eval_samples(n)


# Train prompts are indices 0, 1, 2, ... of the stream; held-out ones come from another seed.
EVAL_SEED_OFFSET = 10_000
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
        "a lower trainer.lr, or raise rollout.group_size or engine.temperature"
    )


def chat_requests(samples: list) -> list:
    """One chat request per VQA sample, named by its sample id."""
    from saccade.data.shapes import to_messages
    from saccade.inference.engine import ChatRequest

    return [ChatRequest(s.sample_id, to_messages(s)) for s in samples]


def greedy_texts(setup: Setup, samples: list, *, max_tokens: int) -> list[str]:
    """The engine's greedy completion text for each sample."""
    from saccade.inference.engine import SamplingParams

    groups = setup.engine.generate(chat_requests(samples), SamplingParams(temperature=0.0, max_tokens=max_tokens, n=1))
    return [g[0].text for g in groups]


def is_episodic(task) -> bool:
    """Tasks whose samples run as environment episodes (multi-turn), not single prompts."""
    return hasattr(task, "make_env")


def evaluate(setup: Setup, samples: list, *, max_tokens: int, task=None) -> dict[str, float]:
    """Greedy accuracy on held-out samples (episodes: the share answered correctly)."""
    from saccade.rewards import correct_reward

    if task is not None and is_episodic(task):
        from saccade.inference.engine import SamplingParams

        trajectories = run_task_episodes(setup, task, samples, [s.sample_id for s in samples],
                                         SamplingParams(temperature=0.0, max_tokens=max_tokens))
        return {"accuracy": float(np.mean([episode_success(t) for t in trajectories])), "n": len(samples),
                "turns": float(np.mean([len(t.turns) for t in trajectories])), **final_info_means(trajectories)}

    texts = greedy_texts(setup, samples, max_tokens=max_tokens)
    correct = [correct_reward(t, s) for t, s in zip(texts, samples, strict=True)]
    return {"accuracy": float(np.mean(correct)), "n": len(samples)}


def episode_success(trajectory) -> float:
    """1.0 when the episode's last turn was scored correct by its environment."""
    return float(bool(trajectory.infos) and trajectory.infos[-1].get("correct", 0.0) >= 1.0)


def final_info_means(trajectories: list) -> dict[str, float]:
    """The mean of every numeric or boolean value in the episodes' last `info`, as "env_<key>":
    what an environment reports about its episodes (answered, seen, ...) becomes a metric."""
    values: dict[str, list[float]] = {}
    for t in trajectories:
        for key, value in (t.infos[-1] if t.infos else {}).items():
            if isinstance(value, (bool, int, float)):
                values.setdefault(f"env_{key}", []).append(float(value))
    return {key: float(np.mean(v)) for key, v in sorted(values.items())}


def run_task_episodes(setup: Setup, task, samples: list, sample_ids: list[str], params) -> list:
    """One episode per sample, each in a fresh environment of the task."""
    from saccade.envs.rollout import run_episodes
    from saccade.envs.trajectory import ChatContinuation

    if setup.continuation is None:
        setup.continuation = ChatContinuation(setup.processor, limits=setup.limits)
    envs = [task.make_env() for _ in samples]
    return run_episodes(setup.engine, envs, samples, sample_ids, params, continuation=setup.continuation,
                        max_total_tokens=setup.cfg.env.max_total_tokens)


def group_advantages_and_keep(cfg: RunConfig, rewards_GN: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Group-relative advantages, and which groups to keep (zero-variance ones teach nothing)."""
    from saccade.orchestrator.advantages import group_advantages, zero_variance_groups

    advantages_GN = group_advantages(rewards_GN, scale_by_std=cfg.rollout.scale_advantages_by_std)
    keep = torch.ones(rewards_GN.shape[0], dtype=torch.bool)
    if cfg.rollout.filter_zero_variance:
        keep = ~zero_variance_groups(rewards_GN)
    return advantages_GN, keep


def episode_rollout_step(setup: Setup, task, samples: list, step: int) -> tuple[list, dict[str, float]]:
    """G episodes per sample (G environments reset with it), token-in/token-out; each whole
    trajectory is one training sample, its advantage from the episode's return."""
    from saccade.envs.trajectory import check_consistency, to_training_sample
    from saccade.inference.engine import SamplingParams

    cfg = setup.cfg
    G = cfg.rollout.group_size
    params = SamplingParams(temperature=cfg.engine.temperature, top_p=cfg.engine.top_p, max_tokens=cfg.engine.max_tokens)
    episodes = [s for s in samples for _ in range(G)]
    ids = [f"{s.sample_id}/{i}" for s in samples for i in range(G)]
    trajectories = run_task_episodes(setup, task, episodes, ids, params)
    rewards_GN = torch.tensor([t.total_reward for t in trajectories], dtype=torch.float32).view(len(samples), G)
    advantages_GN, keep = group_advantages_and_keep(cfg, rewards_GN)
    markers = tuple(cfg.env.loss_markers) if cfg.env.loss_on == "markers" else None
    check = cfg.env.check_consistency == "always" or (cfg.env.check_consistency == "first" and step == 0)
    train_samples = []
    for k, t in enumerate(trajectories):
        g, i = divmod(k, G)
        sample = to_training_sample(t, spatial_merge_size=setup.merge, advantage=float(advantages_GN[g, i]),
                                    tokenizer=setup.processor.tokenizer, markers=markers)
        if check:  # fails loudly: a run whose trainer sees other inputs than the engine must not go on
            check_consistency(sample, t.turns, spatial_merge_size=setup.merge)
        if keep[g]:
            train_samples.append(sample)
    sampled = torch.tensor([sum(turn.completion_ids.numel() for turn in t.turns) for t in trajectories],
                           dtype=torch.float32)
    metrics = {
        "reward_mean": float(rewards_GN.mean()),
        "reward_std": float(rewards_GN.std()) if rewards_GN.numel() > 1 else 0.0,
        "accuracy": float(np.mean([episode_success(t) for t in trajectories])),
        "turns_mean": float(np.mean([len(t.turns) for t in trajectories])),
        "images_mean": float(np.mean([len(t.image_keys) for t in trajectories])),
        "episode_tokens_mean": float(np.mean([t.num_tokens for t in trajectories])),
        "completion_len_mean": float(sampled.mean()),
        "completion_len_max": float(sampled.max()),
        "stopped_frac": float(np.mean([r == "stop" for t in trajectories for r in t.finish_reasons])),
        "groups_kept_frac": float(keep.float().mean()),
        "completion_tokens": float(sampled.sum()),
        "sampled_policy_version": float(min(t.policy_version for t in trajectories)),
        **final_info_means(trajectories),
    }
    return train_samples, metrics


def rollout_step(setup: Setup, samples: list, step: int, task=None) -> tuple[list, dict[str, float]]:
    """Sample G completions per prompt, score, compute advantages, build TrainingSamples."""
    if task is not None and is_episodic(task):
        return episode_rollout_step(setup, task, samples, step)
    from saccade.inference.engine import SamplingParams
    from saccade.orchestrator.samples import completion_to_sample

    cfg = setup.cfg
    params = SamplingParams(
        temperature=cfg.engine.temperature, top_p=cfg.engine.top_p, max_tokens=cfg.engine.max_tokens,
        n=cfg.rollout.group_size,
    )
    groups = setup.engine.generate(chat_requests(samples), params)
    rewards, correct = [], []
    for group, sample in zip(groups, samples, strict=True):
        scored = [reward_of(c.text, sample, cfg.rollout.reward_weights) for c in group]
        rewards.append([r for r, _ in scored])
        correct.append([parts.get("correct", 0.0) for _, parts in scored])
    rewards_GN = torch.tensor(rewards, dtype=torch.float32)
    advantages_GN, keep = group_advantages_and_keep(cfg, rewards_GN)
    train_samples = []
    for g, (group, sample) in enumerate(zip(groups, samples, strict=True)):
        if not keep[g]:
            continue
        for i, completion in enumerate(group):
            train_samples.append(
                completion_to_sample(
                    completion, sample_id=f"{sample.sample_id}/{i}", advantage=float(advantages_GN[g, i]),
                    reward=float(rewards_GN[g, i]), spatial_merge_size=setup.merge,
                )
            )
    lengths = torch.tensor([c.completion_ids.numel() for group in groups for c in group], dtype=torch.float32)
    metrics = {
        "reward_mean": float(rewards_GN.mean()),
        "reward_std": float(rewards_GN.std()) if rewards_GN.numel() > 1 else 0.0,
        "accuracy": float(np.mean(correct)),
        "completion_len_mean": float(lengths.mean()),
        "completion_len_max": float(lengths.max()),
        "stopped_frac": float(np.mean([c.finish_reason == "stop" for g in groups for c in g])),
        "groups_kept_frac": float(keep.float().mean()),
        "completion_tokens": float(lengths.sum()),
        "sampled_policy_version": float(min(c.policy_version for g in groups for c in g)),
    }
    return train_samples, metrics


def train_on_samples(setup: Setup, samples: list, optimizer, scheduler) -> dict[str, float]:
    """num_iterations optimizer steps over the packed samples; skips a step on NaN/inf."""
    from saccade.trainer.forward import forward_logprobs
    from saccade.trainer.loss import LossInputs, policy_loss
    from saccade.trainer.packing import pack

    cfg = setup.cfg
    model = setup.model
    banned = setup.engine.banned_token_ids
    temperature = cfg.engine.temperature
    loss_cfg = cfg.loss.to_loss_config()
    micro_batches = pack(
        samples, setup.cache.get, max_tokens=cfg.trainer.max_tokens,
        image_token_id=setup.image_token_id, spatial_merge_size=setup.merge,
    )
    total_loss_tokens = float(sum(int(mb.loss_mask.sum()) for mb in micro_batches))
    total_sequences = float(sum(mb.num_samples for mb in micro_batches))
    use_ref = cfg.loss.kl_coef > 0
    if use_ref and not cfg.lora.enabled:
        raise ValueError("loss.kl_coef > 0 needs LoRA (the reference is the base model with adapters off)")

    # Behaviour logprobs: the engine's. With TIS, the ratio is taken against the trainer's own
    # logprobs before the update, and the engine/trainer gap is corrected by a capped weight.
    old_logprobs, ref_logprobs = [], []
    with torch.no_grad():
        for mb in micro_batches:
            if cfg.loss.tis_cap is not None:
                lp, _ = forward_logprobs(model, mb, temperature=temperature, only_loss_tokens=True, banned_token_ids=banned)
                old_logprobs.append(lp)
            else:
                old_logprobs.append(mb.inference_logprobs)
            if use_ref:
                with model.disable_adapter():
                    ref, _ = forward_logprobs(model, mb, temperature=temperature, only_loss_tokens=True, banned_token_ids=banned)
                ref_logprobs.append(ref)

    params = [p for p in model.parameters() if p.requires_grad]
    sums: dict[str, float] = {}
    skipped = 0
    model.train()
    for _ in range(cfg.trainer.num_iterations):
        optimizer.zero_grad(set_to_none=True)
        finite = True
        for k, mb in enumerate(micro_batches):
            logprobs, entropy = forward_logprobs(
                model, mb, temperature=temperature, only_loss_tokens=True, banned_token_ids=banned
            )
            inputs = LossInputs(
                logprobs_N=logprobs,
                old_logprobs_N=old_logprobs[k],
                advantages_N=mb.advantages,
                loss_mask_N=mb.loss_mask,
                cu_seqlens=mb.cu_seqlens,
                inference_logprobs_N=mb.inference_logprobs,
                ref_logprobs_N=ref_logprobs[k] if use_ref else None,
                entropy_N=entropy,
                total_loss_tokens=total_loss_tokens,
                total_sequences=total_sequences,
            )
            loss, metrics = policy_loss(inputs, loss_cfg)
            if not torch.isfinite(loss):
                finite = False
                break
            loss.backward()
            weight = float(mb.loss_mask.sum()) / max(1.0, total_loss_tokens)
            sums["loss"] = sums.get("loss", 0.0) + float(loss.detach())
            for name, value in metrics.items():
                sums[name] = sums.get(name, 0.0) + float(value) * weight
        norm = grad_norm_or_none(params, cfg.trainer.grad_clip) if finite else None
        if norm is None:
            # Not applied: a NaN/inf loss or gradient would poison the weights and the optimizer state.
            optimizer.zero_grad(set_to_none=True)
            skipped += 1
            reason = "non-finite loss" if not finite else "non-finite gradient"
            print(f"step skipped: {reason}; the weights were not changed")
            continue
        sums["grad_norm"] = sums.get("grad_norm", 0.0) + norm
        optimizer.step()
        scheduler.step()
    applied = max(1, cfg.trainer.num_iterations - skipped)
    out = {k: v / (applied if k == "grad_norm" else cfg.trainer.num_iterations) for k, v in sums.items()}
    out.update(skipped_steps=float(skipped), micro_batches=float(len(micro_batches)), lr=scheduler.get_last_lr()[0])
    out["train_tokens"] = float(sum(mb.num_tokens for mb in micro_batches))
    return out


def train_rl(cfg: RunConfig, *, run_dir: Path, resume: bool = False, setup: Setup | None = None,
             stop_after: int | None = None, progress: bool = True) -> dict[str, Any]:
    """The RL loop. Returns final figures. `stop_after` ends early after that many steps (tests)."""
    from saccade.metrics import MetricsLogger, format_step
    from saccade.trainer.checkpoint import TrainState, latest_checkpoint, load_checkpoint, save_checkpoint

    from saccade.config import describe

    run_dir.mkdir(parents=True, exist_ok=True)
    (run_dir / "config.toml").write_text(describe(cfg))  # what this run ran with, resolved
    setup = setup or build_setup(cfg, run_dir)
    optimizer, scheduler = build_optimizer(setup.model, cfg)
    task = task_from_config(cfg)
    # Only built when the run evaluates: a data set's eval split is then opened (downloaded) too.
    eval_samples = (
        held_out_samples(task, cfg.data.eval_size, seed=cfg.trainer.seed + EVAL_SEED_OFFSET)
        if cfg.eval.every_steps else []
    )
    state = TrainState(step=0, data_position=0, policy_version=0, extra={})
    if resume:
        path = latest_checkpoint(run_dir)
        if path is None:
            raise ValueError(f"--resume: no complete checkpoint under {run_dir}; start without --resume")
        state = load_checkpoint(path, model=setup.model, optimizer=optimizer, scheduler=scheduler)
        setup.engine.set_rng_state(state.extra.get("engine_rng"))
    # From the first step on, the engine samples from exactly the trainer's weights: a vLLM
    # server may still hold the base model, or another run's (the embedded engine shares them).
    setup.engine.update_weights(version=state.policy_version)
    logger = MetricsLogger(
        run_dir, wandb=cfg.log.wandb, wandb_project=cfg.log.wandb_project, tensorboard=cfg.log.tensorboard,
        config=cfg.model_dump(), resume=resume,
    )
    if resume:
        logger.truncate_after(state.step)
    last: dict[str, float] = {}
    steps_without_signal = 0
    end = cfg.trainer.steps if stop_after is None else min(cfg.trainer.steps, state.step + stop_after)
    with logger, _progress(progress, end - state.step, "rl") as bar:
        for step in range(state.step, end):
            start = time.perf_counter()
            prompts = [
                train_sample(task, state.data_position + i, seed=cfg.trainer.seed)
                for i in range(cfg.rollout.prompts_per_step)
            ]
            state.data_position += len(prompts)
            samples, rollout_metrics = rollout_step(setup, prompts, step, task)
            rollout_s = time.perf_counter() - start
            train_metrics: dict[str, float] = {}
            if samples:
                train_metrics = train_on_samples(setup, samples, optimizer, scheduler)
            train_s = time.perf_counter() - start - rollout_s
            steps_without_signal = 0 if samples else steps_without_signal + 1
            stalled = stall_message(steps_without_signal, rollout_metrics, run_dir)
            if stalled:
                warnings.warn(stalled, RuntimeWarning, stacklevel=2)
            state.step = step + 1
            evaluating = bool(cfg.eval.every_steps) and state.step % cfg.eval.every_steps == 0
            checkpointing = bool(cfg.checkpoint.every_steps) and state.step % cfg.checkpoint.every_steps == 0
            # Push every k-th step, and whenever the run evaluates, checkpoints or ends, so those
            # see (and a resume restarts from) the engine holding the trainer's current weights.
            sync_s = 0.0
            if state.step % cfg.engine.sync_every_steps == 0 or evaluating or checkpointing or state.step == end:
                sync_s = setup.engine.update_weights(version=state.step)
            state.policy_version = setup.engine.policy_version
            step_s = time.perf_counter() - start
            metrics = {**rollout_metrics, **train_metrics}
            metrics.update(
                rollout_s=rollout_s, train_s=train_s, weight_sync_s=sync_s, step_s=step_s,
                tokens_per_s=(train_metrics.get("train_tokens", 0.0) + rollout_metrics["completion_tokens"]) / step_s,
                cache_hit_rate=setup.cache.stats.hit_rate,
                # Updates the policy made since the weights these rollouts were sampled from.
                policy_lag=step - rollout_metrics["sampled_policy_version"],
            )
            if evaluating:
                ev = evaluate(setup, eval_samples, max_tokens=cfg.engine.max_tokens, task=task)
                logger.log(state.step, {k: v for k, v in ev.items() if k != "n"}, phase="eval")
                metrics["eval_accuracy"] = ev["accuracy"]
            logger.log(state.step, metrics)
            last = metrics
            bar(format_step(metrics))
            if checkpointing or state.step == cfg.trainer.steps:  # and always at the end of the run
                state.extra["engine_rng"] = setup.engine.rng_state()
                save_checkpoint(
                    run_dir, model=setup.model, optimizer=optimizer, scheduler=scheduler, state=state,
                    keep_last=cfg.checkpoint.keep_last, base_model_path=setup.model_path,
                )
    return {"step": state.step, "last": last, "setup": setup}


class _progress:
    """A rich progress bar that shows the latest step summary; a no-op when disabled."""

    def __init__(self, enabled: bool, total: int, label: str):
        self.enabled, self.total, self.label = enabled, total, label

    def __enter__(self):
        if not self.enabled:
            return lambda text: None
        from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

        self._progress = Progress(
            TextColumn("[bold]{task.description}"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn(),
            TextColumn("{task.fields[info]}"),
        )
        self._progress.start()
        self._task = self._progress.add_task(self.label, total=self.total, info="")

        def advance(text: str) -> None:
            self._progress.update(self._task, advance=1, info=text)

        return advance

    def __exit__(self, *exc):
        if self.enabled:
            self._progress.stop()
        return False
