"""`saccade demo views`: multi-turn view selection on the tiny model, on CPU.

1. Warm start: SFT on scripted episodes with random valid actions and random answers. It
   teaches the format (act, then answer with a color), not the task: success stays low.
2. GRPO on episodes: each trajectory (up to task.max_turns turns, a new rendered view after
   every action) is one training sample, token-in/token-out, its advantage from the
   episode's return within its group. The consistency check runs on the first batch.

Success is the share of held-out episodes answered correctly with greedy decoding, before
and after GRPO; the demo requires success_after >= success_before + 0.3 in <= 15 minutes.
"""

from __future__ import annotations

import random
import shutil
import time
from importlib import resources
from pathlib import Path
from typing import Any

import numpy as np
import torch

from saccade.config import RunConfig, load_config

SUCCESS_GAIN_MIN = 0.3
MINUTES_MAX = 15.0


def views_config_path() -> Path:
    return Path(str(resources.files("saccade") / "configs" / "views.toml"))


def load_views_config(overrides: list[str] | None = None, path: str | None = None) -> RunConfig:
    return load_config(RunConfig, path or views_config_path(), overrides or [])


def scripted_trajectory(setup, task, sample, replies: list[str], sample_id: str):
    """An episode whose assistant turns are given as text: tokenized once, trained on."""
    from saccade.envs.base import as_step_result
    from saccade.envs.trajectory import add_forced_turn, add_messages, start_trajectory

    env = task.make_env()
    engine = setup.engine
    t = start_trajectory(sample_id, env.reset(sample), setup.processor, limits=setup.images,
                         key_for_hash=engine.key_for_hash, sample=sample)
    for reply in replies:
        add_forced_turn(t, reply, setup.processor.tokenizer, end_of_turn_id=setup.continuation.end_of_turn_id)
        result = as_step_result(env.step({"role": "assistant", "content": reply}))
        t.rewards.append(result.reward)
        t.infos.append(result.info)
        if result.done:
            break
        add_messages(t, result.messages, setup.continuation, key_for_hash=engine.key_for_hash)
    t.done = True
    engine.encode_images(t.images, t.image_keys)
    return t


def warm_start(cfg: RunConfig, setup, task, *, run_dir: Path, progress: bool = True) -> dict[str, float]:
    """SFT on scripted episodes: random valid actions, then a random choice as the answer."""
    from saccade.envs.trajectory import to_training_sample
    from saccade.envs.views import scripted_replies
    from saccade.loops.sft import sft_loop

    rng = np.random.default_rng(cfg.trainer.seed + 1)

    def make_batch(step: int) -> list:
        batch = []
        for i in range(cfg.sft.batch_size):
            index = step * cfg.sft.batch_size + i
            sample = task.sample(index, seed=cfg.trainer.seed + 777)
            replies = scripted_replies(sample, rng, max_turns=task.max_turns)
            t = scripted_trajectory(setup, task, sample, replies, f"warm-{index}")
            batch.append(to_training_sample(t, positions=setup.positions))
        return batch

    return sft_loop(cfg, setup, run_dir=run_dir, make_batch=make_batch, progress=progress, phase="warm-start")


def run_episode_demo(cfg: RunConfig, task_name: str, warm_start, *, progress: bool = True):
    """The views and scenes demos' common course: a warm start, held-out greedy success, GRPO,
    success again. `warm_start(cfg, setup, task, run_dir=, progress=)` trains the warm start.
    Returns (task, held-out samples, success before, success after, start time)."""
    from saccade.orchestrator.evaluation import evaluate
    from saccade.tools.plot import plot_run
    from saccade.loops.rl import train_rl
    from saccade.run.setup import build_setup
    from saccade.run.tasks import task_from_config

    if cfg.task.kind != task_name:
        raise ValueError(f"saccade demo {task_name} needs task.kind = '{task_name}', got {cfg.task.kind!r}")
    start = time.perf_counter()
    root = cfg.run_dir
    for part in ("warm-start", "grpo"):
        shutil.rmtree(root / part, ignore_errors=True)
    root.mkdir(parents=True, exist_ok=True)
    random.seed(cfg.trainer.seed)
    setup = build_setup(cfg, root)
    task = task_from_config(cfg)
    held_out = task.eval_samples(cfg.eval.prompts)

    def success() -> dict[str, float]:
        return evaluate(setup, task, held_out, max_tokens=cfg.sampling.max_tokens, env=cfg.env)

    warm_start(cfg, setup, task, run_dir=root / "warm-start", progress=progress)
    before = success()
    grpo_cfg = cfg.model_copy(update={"log": cfg.log.model_copy(update={"dir": str(root / "grpo")})})
    train_rl(grpo_cfg, run_dir=grpo_cfg.run_dir, setup=setup, task=task, progress=progress)
    after = success()
    plot_run(root / "grpo")
    return task, held_out, before, after, start


def run_views_demo(cfg: RunConfig, *, progress: bool = True) -> dict[str, Any]:
    """Warm start, then GRPO on view-selection episodes; returns the figures."""
    _, _, before, after, start = run_episode_demo(cfg, "views", warm_start, progress=progress)
    root = cfg.run_dir
    return {
        "success_before": before["accuracy"],
        "success_after": after["accuracy"],
        "turns_before": before["turns"],
        "turns_after": after["turns"],
        # The two skills success needs: looking the right way, then reading the color.
        "seen_before": before["env_seen"],
        "seen_after": after["env_seen"],
        "correct_when_seen_before": correct_when_seen(before),
        "correct_when_seen_after": correct_when_seen(after),
        "color_chance": 1 / cfg.task.num_choices,
        "eval_episodes": cfg.eval.prompts,
        "places": list(cfg.task.places),
        "max_turns": cfg.task.max_turns,
        "grpo_steps": cfg.trainer.steps,
        "engine": cfg.engine.kind,
        "torch_threads": torch.get_num_threads(),
        "run_dir": str(root),
        "minutes": (time.perf_counter() - start) / 60,
    }


def correct_when_seen(result: dict[str, float]) -> float:
    """The share of right answers among episodes that brought the object into view (an answer
    only counts once it was seen, so this is success / seen)."""
    return result["env_correct"] / result["env_seen"] if result["env_seen"] else 0.0


def views_verdict(result: dict[str, Any]) -> list[str]:
    """What the demo's result misses of its bar (empty: it passed)."""
    misses = []
    if result["success_after"] < result["success_before"] + SUCCESS_GAIN_MIN:
        misses.append(f"success_after {result['success_after']:.3f} < success_before "
                      f"{result['success_before']:.3f} + {SUCCESS_GAIN_MIN}")
    if result["minutes"] > MINUTES_MAX:
        misses.append(f"minutes {result['minutes']:.1f} > {MINUTES_MAX}")
    return misses
