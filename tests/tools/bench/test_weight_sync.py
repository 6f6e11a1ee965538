"""`saccade bench weight-sync`'s estimates at scale (saccade.tools.bench.weight_sync): the bytes
from a published config, the arithmetic as printed, one row for each way that exists. The measured
half needs a vLLM server: tests/cli/test_benches.py runs the command."""

from __future__ import annotations

from saccade.tools.bench.weight_sync import (
    FILES_BPS, GLOO_BPS, HBM_COPY_BPS, NIC_BPS, NVLINK_BPS, changed_lines, measured_changed, published_params,
    scale_estimates,
)


def test_the_language_model_is_the_published_model_less_its_vision_tower():
    lm, whole = published_params("Qwen/Qwen3-VL-8B-Instruct")
    assert whole == 8_767_123_696 and lm == whole - 576_388_336
    lm2, whole2 = published_params("Qwen/Qwen3-VL-2B-Instruct")
    assert whole2 == 2_127_532_032 and lm2 == whole2 - 406_957_056  # a tied head counted once


def test_each_estimate_is_the_bytes_over_the_assumed_bandwidth_for_each_way_that_exists():
    lines = scale_estimates("8B", 8_190_735_360, 8_767_123_696, servers=7, changed=[(1e-6, 0.02), (1e-5, 0.2)])
    assert "8.19B params x 2 B = 16.38 GB (whole model 17.53 GB)" in lines[0]
    lm_gb, whole_gb = 2 * 8_190_735_360 / 1e9, 2 * 8_767_123_696 / 1e9
    labels = [line.split("(")[0].strip() for line in lines[1:]]
    assert labels == ["nccl, one node", "nccl, across nodes", "sparse_nccl, one node, lr 1e-06",
                      "sparse_nccl, one node, lr 1e-05", "ipc, one shared GPU", "gloo, 7 servers", "files"]
    shown = [float(line.rsplit("= ", 1)[1].removesuffix(" s")) for line in lines[1:]]
    assert shown == [round(lm_gb / (NVLINK_BPS / 1e9), 3), round(lm_gb / (NIC_BPS / 1e9), 3),
                     round(lm_gb * 0.02 * 3 / (NVLINK_BPS / 1e9), 4), round(lm_gb * 0.2 * 3 / (NVLINK_BPS / 1e9), 4),
                     round(2 * lm_gb / (HBM_COPY_BPS / 1e9), 4), round(7 * lm_gb / (GLOO_BPS / 1e9), 1),
                     round(2 * whole_gb / (FILES_BPS / 1e9), 1)]  # as printed
    assert "16.38 GB x 0.0200 x (4 + 2) / 2 = 0.98 GB (0.06 of dense)" in lines[3]  # sparse beside dense
    assert len(scale_estimates("8B", 8_190_735_360, 8_767_123_696)) == 6  # no measured share: no sparse row


def test_the_sparse_rows_are_the_measured_shares_and_say_so():
    measured = measured_changed()
    assert measured == [(1e-6, 0.0354), (2e-6, 0.0639), (1e-5, 0.2002)]  # saccade bench changed-weights, 2026-12-06
    assert "MEASURED by `saccade bench changed-weights`" in changed_lines(measured)[0]
    assert "6.39% at lr 2e-06" in changed_lines(measured)[0]
    assert "no row" in changed_lines([])[0]
