"""`saccade demo scenes`: view selection in generated 3D rooms on the tiny model, on CPU.

The scenes are mesh rooms (`saccade.scenes.generate.generate_room`) rendered by
`saccade.scenes.render.MeshRenderer` at 64 px; the question asks the colour of a labelled
object that the start view does not show ("What color is the chair?"). The start pose is a
close view of the object turned half a turn away (and shows no other labelled object), so
"turn 180 left" (or right) brings it into view: the views demo's task (docs/envs.md) in a
real renderer, kept small enough for a 4-layer model to learn from pixels in minutes. What
the two skills need is logged apart: `seen` (turned to the object) and right colour once
seen.

1. Warm start: SFT on scripted episodes, a random turn (90 or 180 degrees, left or right)
   then a random option. It teaches the format (act, then answer with an option), not the
   task.
2. GRPO on whole episodes, token-in/token-out (saccade.envs), the consistency check on
   the first batch.

Success is the share of held-out episodes (rooms from another seed) answered correctly
with greedy decoding, before and after GRPO; the demo requires success_after >=
success_before + 0.3 within 15 minutes.
"""

from __future__ import annotations

import time
from importlib import resources
from pathlib import Path
from typing import Any

import numpy as np
import torch

from saccade.config import RunConfig, load_config
from saccade.tools.demo_views import (
    MINUTES_MAX, SUCCESS_GAIN_MIN, correct_when_seen, run_episode_demo, scripted_trajectory, views_verdict,
)

__all__ = ["MINUTES_MAX", "SUCCESS_GAIN_MIN", "load_scenes_config", "run_scenes_demo", "scenes_verdict"]


def scenes_config_path() -> Path:
    return Path(str(resources.files("saccade") / "configs" / "scenes.toml"))


def load_scenes_config(overrides: list[str] | None = None, path: str | None = None) -> RunConfig:
    return load_config(RunConfig, path or scenes_config_path(), overrides or [])


def warm_start(cfg: RunConfig, setup, task, *, run_dir: Path, progress: bool = True) -> dict[str, float]:
    """SFT on scripted episodes: random valid actions, then a random option as the answer."""
    from saccade.data.rows import RowSkipped
    from saccade.envs.scenes import scripted_replies
    from saccade.envs.trajectory import to_training_sample
    from saccade.loops.sft import sft_loop

    rng = np.random.default_rng(cfg.trainer.seed + 1)
    turn = cfg.task.start_turn or 90.0
    # Turns only, by a quarter or a half turn either way: the one that shows the object is among
    # them (start_turn 90 or 180) but so are wrong ones; which one to take is left to RL.
    turns = tuple(sorted({90.0, 180.0, turn})) if cfg.task.start_turn else None

    def make_batch(step: int) -> list:
        batch = []
        index = step * cfg.sft.batch_size * 2
        while len(batch) < cfg.sft.batch_size:
            index += 1
            try:
                sample = task.sample(index, seed=cfg.trainer.seed + 777)
            except RowSkipped:  # a room with no usable question
                continue
            replies = scripted_replies(sample, rng, max_turns=task.max_turns, turn_deg=turn, turns=turns)
            t = scripted_trajectory(setup, task, sample, replies, f"warm-{index}")
            batch.append(to_training_sample(t, positions=setup.positions))
        return batch

    return sft_loop(cfg, setup, run_dir=run_dir, make_batch=make_batch, progress=progress, phase="warm-start")


def run_scenes_demo(cfg: RunConfig, *, progress: bool = True) -> dict[str, Any]:
    """Warm start, then GRPO on mesh-scene episodes; returns the figures."""
    task, held_out, before, after, start = run_episode_demo(cfg, "scenes", warm_start, progress=progress)
    root = cfg.run_dir
    return {
        "success_before": before["accuracy"],
        "success_after": after["accuracy"],
        "turns_before": before["turns"],
        "turns_after": after["turns"],
        "seen_before": before["env_seen"],
        "seen_after": after["env_seen"],
        "correct_when_seen_before": correct_when_seen(before),
        "correct_when_seen_after": correct_when_seen(after),
        "refusals_after": after["env_refusals"],
        "render_cache_hit_rate": task.renderer.stats.hit_rate,
        "color_chance": 1 / cfg.task.num_choices,
        "eval_episodes": len(held_out),
        "max_turns": cfg.task.max_turns,
        "render_size": cfg.task.render_size,
        "grpo_steps": cfg.trainer.steps,
        "engine": cfg.engine.kind,
        "torch_threads": torch.get_num_threads(),
        "run_dir": str(root),
        "minutes": (time.perf_counter() - start) / 60,
    }


def scenes_verdict(result: dict[str, Any]) -> list[str]:
    """What the demo's result misses of its bar (empty: it passed): the views demo's bar."""
    return views_verdict(result)
