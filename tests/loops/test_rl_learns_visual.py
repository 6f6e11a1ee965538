"""Learning the visual task itself, in the suite (issue 31): the demo's recipe from its warm
start (`tiny-warm`: SFT on random options, so at chance, 1/3, and blind to the image), 30 GRPO
steps on the shapes color questions, scored on 64 held-out questions every 10 steps.

Held-out greedy accuracy must rise well above chance, and the rise must come from the image:
the same questions with every image blank stay near chance (`visual_gain`).

The bar holds on more than one CPU kind (RL amplifies float differences between them). Best
held-out accuracy at step 20 or 30, seed 0-3 on a 2-core AMD EPYC: 0.672, 0.672, 0.656, 0.672
(the 2/3 plateau: two colors told apart; blank 0.33-0.34); seed 0 on a 2-core Intel Xeon: 0.5625
(issue 50), which missed the former bar of 0.6. The bar is 0.5: a policy blind to the image
(chance 1/3) reaches it on 64 questions with probability 0.004 (binomial), so it still says
"learned from the image", and both machines pass with a margin. About 30 s on this 2-core machine."""

from __future__ import annotations

import pytest

from saccade.config import RunConfig, load_config
from saccade.tools.demo import resolve_warm_start
from saccade.metrics import read_metrics
from saccade.loops.rl import train_rl

STEPS = 30


@pytest.mark.slow
@pytest.mark.parametrize("seed", [0])
def test_held_out_accuracy_rises_from_chance_through_the_image_in_30_steps(tmp_path, seed):
    cfg = resolve_warm_start(load_config(RunConfig, "configs/demo.toml", [
        "--model.path", "tiny-warm", "--trainer.steps", str(STEPS), "--trainer.seed", str(seed),
        "--eval.every_steps", "10", "--checkpoint.every_steps", "0", "--trainer.torch_threads", "1",
        "--log.dir", str(tmp_path / "run")]))
    train_rl(cfg, run_dir=cfg.run_dir, progress=False)
    evals = [r for r in read_metrics(cfg.run_dir) if r["phase"] == "eval"]
    assert [r["step"] for r in evals] == [10, 20, 30]
    curve = [(r["accuracy"], r["accuracy_blank"]) for r in evals]
    best = max(evals[1:], key=lambda r: r["accuracy"])
    assert best["accuracy"] >= 0.5, curve  # chance is 1/3
    assert best["visual_gain"] >= 0.15, curve  # what it learned is in the image
    assert all(abs(r["accuracy_blank"] - 1 / 3) < 0.15 for r in evals), curve  # blind, it guesses
