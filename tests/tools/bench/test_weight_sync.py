"""`saccade bench weight-sync`'s estimates at scale (saccade.tools.bench.weight_sync): the bytes
from the published configs, the arithmetic printed as done. The measured half needs a vLLM
server: tests/cli/test_benches.py runs the command."""

from __future__ import annotations

from saccade.tools.bench.weight_sync import FILES_BPS, NIC_BPS, NVLINK_BPS, published_params, scale_estimates


def test_the_language_model_is_the_published_model_less_its_vision_tower():
    lm, whole = published_params("Qwen/Qwen3-VL-8B-Instruct")
    assert (lm, whole) == (8_190_735_360, 8_767_123_696)  # 8.77B in all (the preset table's figure)
    lm2, whole2 = published_params("Qwen/Qwen3-VL-2B-Instruct")
    assert whole2 == 2_127_532_032 and lm2 == whole2 - 406_957_056  # a tied head counted once


def test_each_estimate_is_the_bytes_over_the_assumed_bandwidth():
    lines = scale_estimates("8B", 8_190_735_360, 8_767_123_696)
    assert "8.19B params x 2 B = 16.38 GB (whole model 17.53 GB)" in lines[0]
    lm_gb, whole_gb = 2 * 8_190_735_360 / 1e9, 2 * 8_767_123_696 / 1e9
    shown = [float(line.rsplit("= ", 1)[1].removesuffix(" s")) for line in lines[1:]]
    assert shown == [round(lm_gb / (NVLINK_BPS / 1e9), 3), round(lm_gb / (NIC_BPS / 1e9), 3),
                     round(2 * whole_gb / (FILES_BPS / 1e9), 1)]  # as printed
