"""`saccade bench step` and `bench rollout --no-vllm` on the tiny model: real steps, real figures."""

from __future__ import annotations

import json

import pytest

from saccade.tools.bench.step import OVERHEAD_PARTS, ROLLOUT_PARTS, TRAIN_PARTS, run_step_bench
from saccade.config.bench import RolloutBenchConfig, StepBenchConfig


# `pytest -m long` (32 s): the default suite runs this bench on the tiny preset as a stage of
# `saccade bench gpu --device cpu --quick` (tests/tools/bench/test_bench_gpu.py); this checks its report in full.
@pytest.mark.long
def test_step_bench_breaks_the_step_down_and_runs_the_reference(tmp_path):
    r = run_step_bench(StepBenchConfig(steps=1, trace=str(tmp_path / "trace")), log=lambda *_: None)
    parts = r["saccade_parts_s"]
    # Every part of the step was timed where it runs, and together they are the step.
    for part in ("templating", "image_prep", "encode", "prefill", "decode", "rewards", "samples", "pack",
                 "forward", "logprobs", "backward", "optimizer"):
        assert parts[part] > 0, part
    assert sum(parts.values()) == pytest.approx(r["saccade_s"], rel=1e-6)
    assert r["saccade_rollout_s"] == pytest.approx(sum(parts.get(p, 0.0) for p in ROLLOUT_PARTS))
    assert r["saccade_train_s"] == pytest.approx(sum(parts.get(p, 0.0) for p in TRAIN_PARTS))
    assert 0 < r["overhead_frac"] == pytest.approx(sum(parts.get(p, 0.0) for p in OVERHEAD_PARTS) / r["saccade_s"])
    assert {"prep", "generate", "forward", "backward", "optimizer"} <= set(r["reference_parts_s"])
    # 8 prompts x 8 samples on both sides; each group's prompt computed once on saccade's.
    assert r["completion_tokens"] > 0 and r["reference_completion_tokens"] > 0
    assert r["forward_tokens"] < r["train_tokens"]
    assert r["image_tokens"] == 4 and r["goal_ratio"] == 2.0
    assert (tmp_path / "trace" / "saccade_step.json").stat().st_size > 0
    assert json.loads((tmp_path / "trace" / "reference_step.json").read_text())


@pytest.mark.slow
def test_rollout_bench_compares_the_embedded_engine_with_hf_generate():
    from saccade.tools.bench.engine import format_rollout, run_rollout_bench

    r = run_rollout_bench(RolloutBenchConfig(prompts=3, samples=4, max_tokens=4, repeats=1, vllm=False))
    # Both engines sampled every completion of the same 3 prompts x 4: 1 to 4 tokens each.
    assert set(r["completion_tokens"]) == {"embedded", "hf_generate"}
    assert all(3 * 4 <= t <= 3 * 4 * 4 for t in r["completion_tokens"].values()), r["completion_tokens"]
    assert "vllm_tokens_per_s" not in r and "HF generate" in format_rollout(r)
