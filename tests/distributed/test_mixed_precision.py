"""FSDP2's mixed precision computes what one process computes: bf16 base, float32 LoRA (issue 28).

Each run is tests/distributed/precision_worker.py in fresh processes: the tiny model with LoRA
(random B matrices) in bf16, six text samples in three micro-batches, one forward and backward
through the trainer's `forward_logprobs`. One process is the reference; under torchrun (gloo
on this CPU) the model is sharded by `saccade.trainer.sharding.shard_model`.

Measured on this CPU (2026-11, torch 2.13), against the single process:
- sharded at world 1 and world 2: logprobs, loss and every gradient bit for bit equal
  (difference 0); the adapters compute in float32, the base in bf16, as in one process;
- the layout before the fix (base loaded float32, FSDP `param_dtype` bf16 for every group),
  world 1: the adapters compute in bf16; logprob max 6.4e-3 (mean 1.9e-3), loss 2.4e-4
  relative, gradients 1.25e-2 relative (global norm of the difference), 3.1e-2 for the worst
  tensor. World 2 gives the same figures.
- the same number of FSDP collectives in both layouts (one all-gather per layer each way, one
  reduce-scatter per layer); timing, small preset, world 2, 5 interleaved pairs: no
  difference above this shared machine's noise (docs/distributed.md).
The bars: world 1 runs the same operations on the same values, so it must be exact; world 2
sums two ranks' gradients in another order than one process accumulates its micro-batches,
so gradients get 1e-6 relative (measured 0 here); the control must miss the bars by far.
"""

from __future__ import annotations

import os
import socket
import subprocess
import sys
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[2]
WORKER = str(Path(__file__).with_name("precision_worker.py"))
GRAD_RTOL = 1e-6  # world 2: float32 reduction order only

pytestmark = pytest.mark.slow


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def run_worker(out: Path, world: int | None, *args: str) -> dict:
    """world None: one process, no torchrun; else torchrun with that many ranks."""
    launcher = [] if world is None else [
        "-m", "torch.distributed.run", "--nproc-per-node", str(world), "--rdzv-backend", "c10d",
        "--rdzv-endpoint", f"127.0.0.1:{_free_port()}"]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT / "src")}
    done = subprocess.run([sys.executable, *launcher, WORKER, str(out), *args], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-6000:]
    return torch.load(out)


def gaps(got: dict, want: dict) -> dict[str, float]:
    """Largest |logprob difference|, relative loss difference, and the gradients' difference:
    its global norm over the reference's, and the worst tensor's max over that tensor's max."""
    assert got["logprobs"].keys() == want["logprobs"].keys() and got["grads"].keys() == want["grads"].keys()
    logprob = max(float((got["logprobs"][k] - v).abs().max()) for k, v in want["logprobs"].items())
    diff = sum(float((got["grads"][k] - v).norm()) ** 2 for k, v in want["grads"].items()) ** 0.5
    norm = sum(float(v.norm()) ** 2 for v in want["grads"].values()) ** 0.5
    worst = max(float((got["grads"][k] - v).abs().max() / v.abs().max()) for k, v in want["grads"].items())
    return {"logprob": logprob, "loss": abs(got["loss"] - want["loss"]) / abs(want["loss"]),
            "grad": diff / norm, "grad_worst": worst}


@pytest.fixture(scope="module")
def single(tmp_path_factory) -> dict:
    out = run_worker(tmp_path_factory.mktemp("single") / "out.pt", None)
    assert out["dtypes"] == {"lora": ["float32"], "base": ["bfloat16"]}  # peft's layout on one process
    assert len(out["logprobs"]) == 3 and all(v.abs().max() > 0 for v in out["grads"].values())
    return out


def test_sharded_lora_computes_in_float32_and_matches_one_process_exactly_at_world_1(single, tmp_path):
    got = run_worker(tmp_path / "out.pt", 1)
    assert got["sharded"] and got["dtypes"] == {"lora": ["float32"], "base": ["bfloat16"]}
    assert gaps(got, single) == {"logprob": 0.0, "loss": 0.0, "grad": 0.0, "grad_worst": 0.0}


def test_sharded_lora_matches_one_process_at_world_2(single, tmp_path):
    got = run_worker(tmp_path / "out.pt", 2)
    assert got["world_size"] == 2 and got["dtypes"] == {"lora": ["float32"], "base": ["bfloat16"]}
    g = gaps(got, single)
    assert g["logprob"] == 0.0, g  # each micro-batch is computed whole on one rank, from the same weights
    assert g["loss"] <= 1e-12 and g["grad_worst"] <= GRAD_RTOL, g
    # Mixed dtypes cost no extra collective: per micro-batch (rank 0 runs 2, one of them padding)
    # one all-gather for the root and one per decoder layer (4) each way, one reduce-scatter per
    # layer (the root trains nothing). The layout before the fix made exactly as many.
    assert got["collectives"] == {"all_gather": 2 * (1 + 2 * 4), "reduce_scatter": 2 * 4}


def test_casting_the_adapters_to_bf16_misses_the_bars(single, tmp_path):
    # The negative control: the layout before issue 28 reproduces the gap the fix removes.
    got = run_worker(tmp_path / "out.pt", 1, "--cast-adapters")
    assert got["dtypes"] == {"lora": ["bfloat16"], "base": ["bfloat16"]}
    g = gaps(got, single)
    assert g["logprob"] > 1e-3 and g["loss"] > 1e-5 and g["grad"] > 1e-3 and g["grad_worst"] > 1000 * GRAD_RTOL, g
