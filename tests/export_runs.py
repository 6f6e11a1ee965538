"""Short real runs of the tiny model for the export tests (tests/tools/test_export.py) and the vLLM
test that serves the exports (tests/serving/test_vllm_export.py): the LoRA run and its exports
are session fixtures (tests/conftest.py), trained once for both."""

from __future__ import annotations

from pathlib import Path

from stub_tasks import scored_task

from saccade.config import RunConfig, load_config
from saccade.loops.rl import train_rl

# Two RL steps with rewards that vary, a large learning rate so the weights really move.
FAST = [
    "--trainer.seed", "3",
    "--trainer.lr", "2e-2",
    "--rollout.prompts_per_step", "2",
    "--rollout.group_size", "4",
    "--rollout.filter_zero_variance", "false",
    "--sampling.max_tokens", "4",
    "--loss.max_completion_tokens", "4",
    "--eval.prompts", "4",
    "--eval.every_steps", "0",
    "--checkpoint.every_steps", "0",
]
LORA = ["--trainer.steps", "2", "--lora", "true", "--lora.rank", "4"]
FULL = ["--trainer.steps", "1", "--lora", "false"]


def train_run(run_dir: Path, base: Path, extra: list[str]):
    """(run folder, the trained model in eval mode) of FAST + `extra` from `base`."""
    cfg = load_config(RunConfig, "configs/demo.toml",
                      [*FAST, *extra, "--model.path", str(base), "--log.dir", str(run_dir)])
    result = train_rl(cfg, run_dir=cfg.run_dir, task=scored_task(cfg), progress=False)
    return cfg.run_dir, result["setup"].model.eval()
