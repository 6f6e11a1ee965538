"""The parity bench in bfloat16 (the fp32 figures are tests/models/test_lm.py's): the two paths
round differently, within the bf16 bar, and the classic mistakes still stand far above it."""

from __future__ import annotations

import pytest
import torch

from saccade.parity import BF16_TOLERANCE, run_parity, tolerance


@pytest.mark.slow
def test_bf16_parity_on_the_cpu(tiny_path):
    result = run_parity(tiny_path, dtype=torch.bfloat16)
    assert result["dtype"] == "bfloat16" and tolerance("bfloat16") == BF16_TOLERANCE
    assert 0 < result["lm_only_vs_full_max_abs"] <= BF16_TOLERANCE  # bf16 rounding, not zero
    assert result["packed_vs_unpacked_max_abs"] <= BF16_TOLERANCE
    mistakes = min(result["deepstack_dropped_max_abs"], result["positions_1d_max_abs"])
    assert mistakes > 10 * result["lm_only_vs_full_max_abs"]  # bf16 noise is not a mistake's size
    assert result["lm_only_vs_full_mean_abs"] < result["lm_only_vs_full_max_abs"]
