"""The trainer benchmark, on the tiny preset: every figure is there, finite, and sane."""

from __future__ import annotations

import json
import math

import pytest

FIGURES = (
    "cached_step_s",
    "full_step_s",
    "full_over_cached_step_time",
    "cached_peak_mb",
    "full_peak_mb",
    "full_over_cached_peak_memory",
    "padded_pad_fraction",
    "packed_tokens_per_s",
    "padded_tokens_per_s",
    "packed_over_padded_tokens_per_s",
    "cached_tokens_per_s",
    "full_tokens_per_s",
    "full_vision_share",
    "checkpointed_step_s",
    "checkpointed_peak_mb",
    "activation_checkpointing_step_ratio",
    "activation_checkpointing_peak_ratio",
    "lm_flops_per_step",
    "cached_tflops",
    "estimated_cached_peak_mb",
    "estimated_checkpointed_peak_mb",
)


# `pytest -m long` (32 s): the default suite runs this bench on the tiny preset as a stage of
# `saccade bench gpu --device cpu --quick` (tests/tools/bench/test_bench_gpu.py); this checks its report in full.
@pytest.mark.long
def test_trainer_bench_on_tiny_preset():
    from saccade.tools.bench.trainer import format_report, run_trainer_bench
    from saccade.config.bench import TrainerBenchConfig

    result = run_trainer_bench(TrainerBenchConfig(preset="tiny", steps=1, batch=3, max_side=128, padded_rows=2),
                               progress=False)

    for key in FIGURES:
        assert key in result, key
        assert math.isfinite(result[key]) and result[key] > 0, (key, result[key])
    assert result["packed_pad_fraction"] == 0
    assert 0 < result["padded_pad_fraction"] < 1
    assert result["sample_tokens_min"] < result["sample_tokens_max"]
    # The warm-up step runs every variant on the same weights and tokens: same loss.
    assert result["max_warmup_loss_diff"] < 1e-4, result["warmup_loss"]
    config = result["config"]
    assert config["preset"] == "tiny" and config["lm_params"] > 0 and config["vision_params"] > 0
    assert config["batch"] == 3 and config["steps"] == 1 and config["torch_threads"] >= 1
    json.dumps(result)  # JSON-serialisable, as `--json` writes it
    report = format_report(result)
    assert "full / cached" in report and "packed / padded" in report and "with / without" in report
    assert result["cached_mfu"] is None  # no peak known for a CPU
    # Checkpointing recomputes: never faster in the model's FLOPs, and estimated lighter.
    assert result["estimated_checkpointed_peak_mb"] < result["estimated_cached_peak_mb"]


def test_lm_step_flops_by_hand():
    from saccade.tools.bench.trainer import lm_step_flops
    from saccade.tools.memory_dims import TextDims

    text = TextDims(vocab_size=10, hidden_size=4, num_hidden_layers=2, num_attention_heads=2, num_key_value_heads=1,
                    head_dim=2, intermediate_size=8, tie_word_embeddings=True)
    # per layer: q 4x4, k 4x2, v 4x2, o 4x4, gate 4x8, up 4x8, down 8x4 = 16+8+8+16+32+32+32 = 144
    linear, attention, head = 2 * 144, 6 * 2 * 4, 10 * 4
    lengths, loss = [3, 5], 4
    assert lm_step_flops(text, lengths, loss, full_finetune=False) == (
        4 * linear * 8 + attention * (9 + 25) + 4 * head * loss)
    assert lm_step_flops(text, lengths, loss, full_finetune=True) == (
        6 * linear * 8 + attention * (9 + 25) + 6 * head * loss)


def test_lm_step_flops_count_a_moe_layers_router_and_the_experts_a_token_runs():
    from dataclasses import replace

    from saccade.tools.bench.trainer import lm_step_flops
    from saccade.tools.memory_dims import ExpertDims, TextDims

    dense = TextDims(vocab_size=10, hidden_size=4, num_hidden_layers=2, num_attention_heads=2, num_key_value_heads=1,
                     head_dim=2, intermediate_size=8, tie_word_embeddings=True)
    # One of the two layers sparse: 6 experts of moe_intermediate 3, a token routed to 2 of them.
    moe = replace(dense, experts=ExpertDims(num_experts=6, per_token=2, intermediate_size=3, layers=1))
    # per layer: attention q 16 + k 8 + v 8 + o 16 = 48; dense MLP 96; MoE: router 6x4 + 2 experts x 3 x 4x3 = 96
    matmul = 2 * 48 + 96 + (6 * 4 + 2 * 3 * 4 * 3)
    attention, head, lengths, loss = 6 * 2 * 4, 10 * 4, [3, 5], 4
    assert lm_step_flops(moe, lengths, loss, full_finetune=False) == (
        4 * matmul * 8 + attention * (9 + 25) + 4 * head * loss)


@pytest.mark.slow
def test_trainer_bench_full_finetuning_on_tiny_preset():
    from saccade.tools.bench.trainer import run_trainer_bench
    from saccade.config.bench import TrainerBenchConfig

    result = run_trainer_bench(TrainerBenchConfig(preset="tiny", steps=1, batch=2, max_side=96, padded_rows=2,
                                                  full_finetune=True, measure_memory=False), progress=False)
    # Every variant trains every LM weight from the same start: the same warm-up loss.
    assert result["config"]["full_finetune"] and result["max_warmup_loss_diff"] < 1e-4, result["warmup_loss"]
    assert result["cached_tflops"] > 0
    assert result["config"]["trainable_params"] == result["config"]["lm_params"]


def test_the_estimate_is_checked_against_the_measured_peak():
    from saccade.tools.bench.trainer import estimate_check

    def check(cached, checkpointed, host=False):
        return estimate_check({"estimated_cached_peak_mb": cached, "cached_peak_mb": 100.0,
                               "estimated_checkpointed_peak_mb": checkpointed, "checkpointed_peak_mb": 50.0},
                              host=host)

    ok = check(110.0, 55.0)
    assert ok["estimate_flag"] == "ok" and ok["estimate_over_measured"] == {"cached": 1.1, "checkpointed": 1.1}
    below = check(110.0, 40.0)  # a run sized by the estimate could run out of memory
    assert below["estimate_flag"] == "below" and "checkpointed path's estimate is below" in below["estimate_note"]
    assert check(200.0, 55.0)["estimate_flag"] == "far above"
    assert "host RSS" in check(110.0, 55.0, host=True)["estimate_note"]
