"""Golden metrics: short fixed-seed fp32 runs whose per-step metrics must stay bit for bit.

Recorded before the trainer was split by role (issue 14); a change that should not move
the numerics (a refactor, a new option left off) must reproduce them exactly. A change that
is meant to move them rewrites the file on purpose:

    SACCADE_WRITE_GOLDEN=1 uv run pytest tests/test_golden.py

and says why in its commit. Three runs on the tiny model, each a few steps:
- `shapes_full`: single-turn shapes, full fine-tuning, two optimizer steps per batch (the
  second off-policy, so the clip can act) and TIS against the trainer's own logprobs;
- `shapes_lora_kl`: LoRA, k3 KL to the adapter-free base, entropy bonus, sequence normalisation;
- `episodes`: multi-turn episodes with 1-2 new images every turn, as whole-trajectory samples.
A random model's replies earn no task reward, so every run scores them with a hash of the
text: rewards vary within groups and the weights move.
"""

from __future__ import annotations

import json
import os
import zlib
from pathlib import Path

import pytest
import torch

from saccade.config import RunConfig, load_config
from saccade.envs.examples import LookAgainEnv
from saccade.envs.base import StepResult
from saccade.metrics import read_metrics

GOLDEN = Path(__file__).parent / "golden" / "metrics.json"
# Wall-clock figures and the logger's own fields differ run to run; everything else must not.
TIMED = {"time", "elapsed_s", "rollout_s", "train_s", "weight_sync_s", "step_s", "tokens_per_s"}

COMMON = [
    "--trainer.seed", "5",
    "--trainer.max_tokens", "256",
    "--rollout.prompts_per_step", "3",
    "--rollout.group_size", "4",
    "--rollout.filter_zero_variance", "false",
    "--engine.max_tokens", "6",
    "--loss.max_completion_tokens", "6",
    "--data.eval_size", "4",
    "--eval.every_steps", "2",
    "--checkpoint.every_steps", "0",
]
RUNS = {
    "shapes_full": ("configs/demo.toml", [
        "--trainer.steps", "3", "--trainer.num_iterations", "2", "--loss.tis_cap", "2.0", "--trainer.lr", "2e-3",
    ]),
    "shapes_lora_kl": ("configs/demo.toml", [
        "--trainer.steps", "3", "--lora.enabled", "true", "--lora.rank", "4", "--loss.kl_coef", "0.05",
        "--loss.entropy_coef", "0.01", "--loss.normalization", "sequence", "--trainer.lr", "2e-3",
    ]),
    "episodes": ("configs/views.toml", [
        "--trainer.steps", "2", "--rollout.prompts_per_step", "2", "--env.max_turns", "3",
        "--loss.max_completion_tokens", "18", "--trainer.max_tokens", "512",
    ]),
}


def hash_reward(text: str) -> float:
    """A reward in [0, 1] that depends on the sampled text only."""
    return (zlib.crc32(text.encode()) % 7) / 6.0


class HashLookAgainEnv(LookAgainEnv):
    """LookAgainEnv (1-2 new images each turn, up to max_turns), scored by the reply's hash."""

    def step(self, assistant_message: dict) -> StepResult:
        result = super().step(assistant_message)
        reward = hash_reward(assistant_message["content"])
        info = {**result.info, "correct": float(reward > 0.5)} if result.done else result.info
        return StepResult(result.messages, reward, result.done, info)


class HashEpisodesTask:
    """Episodes of HashLookAgainEnv; samples are plain ints."""

    max_turns = 3

    def train_sample(self, position: int, *, seed: int):
        return SampleId(f"train-{seed}-{position}")

    def eval_samples(self, n: int):
        return [SampleId(f"eval-{i}") for i in range(n)]

    def make_env(self):
        return HashLookAgainEnv(max_turns=self.max_turns, seed=1)


class SampleId(str):
    @property
    def sample_id(self) -> str:
        return str(self)


def _hash_reward_of(text, sample, weights):
    value = hash_reward(text)
    return value, {"correct": float(value > 0.5)}


def run_golden(name: str, tmp_path: Path, monkeypatch) -> list[dict]:
    import saccade.rl as rl

    config, extra = RUNS[name]
    cfg = load_config(RunConfig, config, [*COMMON, *extra, "--log.dir", str(tmp_path / name)])
    monkeypatch.setattr(rl, "reward_of", _hash_reward_of)
    if name == "episodes":
        monkeypatch.setattr(rl, "task_from_config", lambda cfg, **_: HashEpisodesTask())
    threads = torch.get_num_threads()
    torch.set_num_threads(2)  # reductions may split differently with another thread count
    try:
        rl.train_rl(cfg, run_dir=cfg.run_dir, progress=False)
    finally:
        torch.set_num_threads(threads)
    return [{k: v for k, v in r.items() if k not in TIMED} for r in read_metrics(cfg.run_dir)]


@pytest.mark.slow
@pytest.mark.parametrize("name", list(RUNS))
def test_golden_metrics_are_reproduced_bit_for_bit(name, tmp_path, monkeypatch):
    records = run_golden(name, tmp_path, monkeypatch)
    if os.environ.get("SACCADE_WRITE_GOLDEN"):
        golden = json.loads(GOLDEN.read_text()) if GOLDEN.exists() else {}
        golden[name] = records
        GOLDEN.parent.mkdir(exist_ok=True)
        GOLDEN.write_text(json.dumps(golden, indent=1, sort_keys=True) + "\n")
        pytest.skip(f"golden metrics of {name!r} written to {GOLDEN}")
    expected = json.loads(GOLDEN.read_text())[name]
    assert [(r["step"], r["phase"]) for r in records] == [(r["step"], r["phase"]) for r in expected]
    for got, want in zip(records, expected, strict=True):
        where = f"{name} step {want['step']} ({want['phase']})"
        missing = sorted(set(want) - set(got))
        assert not missing, f"{where}: metrics no longer logged: {missing}"
        differ = {k: (got[k], v) for k, v in want.items() if got[k] != v}
        assert not differ, f"{where}: (got, golden) {differ}"
    # Not vacuous: the weights moved and the rewards varied.
    train = [r for r in expected if r["phase"] == "train"]
    assert len({r["loss"] for r in train}) > 1 and all(r["reward_std"] > 0 for r in train)
