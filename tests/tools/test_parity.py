"""The parity bench in bfloat16 (the fp32 figures are tests/models/test_lm.py's): the two paths
round differently, within the bf16 bar, and the classic mistakes still stand far above it."""

from __future__ import annotations

import pytest
import torch

from saccade.tools.parity import BF16_TOLERANCE, run_parity, tolerance


@pytest.mark.slow
def test_bf16_parity_on_the_cpu(tiny_path):
    result = run_parity(tiny_path, dtype=torch.bfloat16)
    assert result["dtype"] == "bfloat16" and tolerance("bfloat16") == BF16_TOLERANCE
    # Exactly 0 on this CPU since the rotary buffers stay float32: one sample runs the same kernels
    # on the same bf16 weights as the full model (it was 4.6e-3 with them rounded to bf16).
    assert 0 <= result["lm_only_vs_full_max_abs"] <= BF16_TOLERANCE
    assert result["packed_vs_unpacked_max_abs"] <= BF16_TOLERANCE
    mistakes = min(result["deepstack_dropped_max_abs"], result["positions_1d_max_abs"])
    assert mistakes > 10 * result["lm_only_vs_full_max_abs"]  # bf16 noise is not a mistake's size
    assert result["lm_only_vs_full_mean_abs"] <= result["lm_only_vs_full_max_abs"]
    assert 0 < result["packed_vs_unpacked_max_abs"]  # packing runs other kernels: bf16 rounding, not zero


@pytest.mark.slow
def test_bf16_parity_holds_at_long_positions_and_fails_with_bf16_rotary_buffers(tiny_path):
    """One conversation of 1,500 tokens (an image, then text), in bf16: the LM-only path against
    the full model, bucket by bucket of positions, within NOISE_FACTOR of the full model's own
    bf16-vs-fp32 noise there. Then the rotary inverse frequencies are rounded to bf16, as
    `module.to(bf16)` used to leave them: the angle error grows with the position and the same
    check goes red."""
    from saccade.tools.parity import NOISE_FACTOR, load_parity_models, long_context_figures

    models = load_parity_models(tiny_path, dtype=torch.bfloat16)
    good = long_context_figures(models, lengths=(1500,))
    assert good["rotary_not_fp32"] == [] and good["passed"], good
    buckets = good["lengths"]["1500"]["buckets"]
    assert [b["end"] for b in buckets] == [256, 1024, 1500]
    assert all(b["noise_mean"] > 0 for b in buckets)  # bf16 is not fp32: the bar is not zero

    for module in (models.policy, models.encoder.tower):
        for name, buf in list(module.named_buffers()):
            if name.endswith("inv_freq"):
                owner, _, leaf = name.rpartition(".")
                module.get_submodule(owner)._buffers[leaf] = buf.to(torch.bfloat16)
    broken = long_context_figures(models, lengths=(1500,))
    assert not broken["passed"] and broken["rotary_not_fp32"]
    ratios = [b["ratio"] for b in broken["lengths"]["1500"]["buckets"]]
    assert all(r > NOISE_FACTOR for r in ratios), ratios
    assert ratios[-1] > ratios[0]  # the error grows with the position
