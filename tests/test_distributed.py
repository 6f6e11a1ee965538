"""saccade.distributed's pure parts (each rank's share of the prompts and of the micro-batches,
the mixed-precision policy, the process group's arguments), and the process group a rank joins."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
from datetime import timedelta
from pathlib import Path

import pytest
import torch

from saccade.distributed import SINGLE, World, balance, process_group_args, share_embeddings
from saccade.trainer.sharding import mixed_precision


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.mark.parametrize("size", [1, 2, 3, 4])
@pytest.mark.parametrize("n", [0, 1, 5, 8, 31])
def test_the_ranks_shares_cover_every_prompt_once_in_order(n, size):
    shares = [World(rank=r, size=size).share(n) for r in range(size)]
    assert [i for s in shares for i in s] == list(range(n))
    assert max(map(len, shares)) - min(map(len, shares)) <= 1


@pytest.mark.parametrize("size", [1, 2, 3, 4])
def test_balance_gives_every_rank_the_same_number_of_micro_batches_and_spreads_the_tokens(size):
    sizes = [256, 250, 240, 90, 60, 60, 30, 12, 5]
    ranks = balance(sizes, size)
    assert sorted(i for r in ranks for i in r) == list(range(len(sizes)))
    slots = -(-len(sizes) // size)
    assert all(len(r) <= slots for r in ranks)  # the rest is filled with padding micro-batches
    loads = [sum(sizes[i] for i in r) for r in ranks]
    assert max(loads) - min(loads) <= max(sizes)  # greedy: no rank ahead by more than one micro-batch
    assert balance(sizes, size) == ranks  # every rank computes the same assignment


def test_balance_of_two_ranks_pairs_long_with_short():
    assert balance([100, 90, 20, 10], 2) == [[0, 3], [1, 2]]
    assert balance([5], 2) == [[0], []]  # rank 1 runs one padding micro-batch
    assert balance([], 2) == [[], []]


def test_a_single_process_shares_nothing():
    assert SINGLE.size == 1 and SINGLE.is_main and not SINGLE.sharded
    assert list(SINGLE.share(3)) == [0, 1, 2]
    assert share_embeddings(["k"], cache=None, world=SINGLE) == 0  # no collective, no cache read


# ---------------------------------------------------------------------------- mixed precision


def _lora(tiny_path, dtype):
    from saccade.config import LoraConfig
    from saccade.models.lm import apply_lora, load_policy_lm

    return apply_lora(load_policy_lm(tiny_path, dtype=dtype), LoraConfig(rank=4))


def test_sharded_lora_is_gathered_as_stored_so_the_adapters_stay_float32(tiny_path):
    # The base in bf16 and the adapters in float32, as on one process: FSDP must cast nothing
    # (a param_dtype would round the adapters to bf16: tests/distributed/test_mixed_precision.py).
    policy = mixed_precision(_lora(tiny_path, torch.bfloat16), torch.bfloat16)
    assert policy.param_dtype is None and policy.reduce_dtype == torch.float32


def test_sharded_full_finetuning_keeps_float32_shards_and_computes_in_the_model_dtype(tiny_path):
    from saccade.models.lm import load_policy_lm, set_full_finetune

    model = set_full_finetune(load_policy_lm(tiny_path, dtype=torch.float32))
    policy = mixed_precision(model, torch.bfloat16)
    assert policy.param_dtype == torch.bfloat16 and policy.reduce_dtype == torch.float32
    assert mixed_precision(model, torch.float32).param_dtype is None


def test_mixed_precision_refuses_a_layout_it_would_compute_wrongly(tiny_path):
    from saccade.models.lm import load_policy_lm, set_full_finetune

    with pytest.raises(ValueError, match="load the LoRA base in model.dtype"):
        mixed_precision(_lora(tiny_path, torch.float32), torch.bfloat16)  # the layout before issue 28
    with pytest.raises(ValueError, match="must be float32"):
        mixed_precision(set_full_finetune(load_policy_lm(tiny_path, dtype=torch.bfloat16)), torch.bfloat16)


def test_the_trainer_loads_what_it_shards():
    from saccade.run.setup import weights_dtype

    bf16, fp32 = torch.bfloat16, torch.float32
    assert weights_dtype(bf16, sharded=False, lora=True) == bf16
    assert weights_dtype(bf16, sharded=False, lora=False) == bf16  # MasterWeights keep the float32 copies
    assert weights_dtype(bf16, sharded=True, lora=True) == bf16  # a frozen base: as on one process
    assert weights_dtype(bf16, sharded=True, lora=False) == fp32  # the shards are the master weights


# ---------------------------------------------------------------------------- the process group


def test_process_group_args_bind_nccl_to_the_local_gpu_and_carry_the_timeout():
    args = process_group_args(torch.device("cuda"), local_rank=3, timeout_s=5400)
    assert args == {"backend": "nccl", "device_id": torch.device("cuda", 3), "timeout": timedelta(seconds=5400)}
    assert process_group_args(torch.device("cuda", 1), 3, 60)["device_id"] == torch.device("cuda", 1)  # as asked
    assert process_group_args(torch.device("cpu"), 3, 60) == {"backend": "gloo", "timeout": timedelta(seconds=60)}
    with pytest.raises(ValueError, match="> 0"):
        process_group_args(torch.device("cpu"), 0, 0)


def test_the_config_timeout_outlasts_nccls_default():
    from saccade.config import TrainerConfig

    assert TrainerConfig().dist_timeout_s > 600  # NCCL's default: 10 min, less than a cold 8B download


PROBE = """
import os, sys, torch
import torch.distributed as dist
from saccade.distributed import init_world
device = sys.argv[1]
world = init_world(device, timeout_s=4321)
group = dist.distributed_c10d._get_default_group()
backend = group._get_backend(torch.device(device))
print(world.rank, world.size, world.local_rank, dist.get_backend(), backend.options._timeout.total_seconds(),
      torch.cuda.current_device() if device == "cuda" else -1, group.bound_device_id, flush=True)
dist.destroy_process_group()
os._exit(0)
"""


def _probe(device: str, tmp_path: Path) -> list[str]:
    env = {**os.environ, "RANK": "0", "WORLD_SIZE": "1", "LOCAL_RANK": "0", "MASTER_ADDR": "127.0.0.1",
           "MASTER_PORT": str(_free_port()), "OMP_NUM_THREADS": "1"}
    done = subprocess.run([sys.executable, "-c", PROBE, device], env=env, capture_output=True, text=True,
                          timeout=120, cwd=tmp_path)
    assert done.returncode == 0, done.stderr[-3000:]
    return done.stdout.split()


def test_the_timeout_reaches_the_gloo_process_group(tmp_path):
    # As torchrun starts a rank: RANK, WORLD_SIZE, LOCAL_RANK and the rendezvous in the environment.
    rank, size, local, backend, timeout, _, bound = _probe("cpu", tmp_path)
    assert (rank, size, local, backend, float(timeout), bound) == ("0", "1", "0", "gloo", 4321.0, "None")


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a GPU")
def test_on_cuda_the_rank_sets_its_device_before_the_nccl_group_and_binds_it(tmp_path):
    rank, size, local, backend, timeout, current, bound = _probe("cuda", tmp_path)
    assert (backend, float(timeout), current, bound) == ("nccl", 4321.0, "0", "cuda:0")
