"""saccade.distributed's pure parts: each rank's share of the prompts and of the micro-batches,
and the mixed-precision policy."""

from __future__ import annotations

import pytest
import torch

from saccade.distributed import SINGLE, World, balance, mixed_precision, share_embeddings


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
    from saccade.setup import weights_dtype

    bf16, fp32 = torch.bfloat16, torch.float32
    assert weights_dtype(bf16, sharded=False, lora=True) == bf16
    assert weights_dtype(bf16, sharded=False, lora=False) == bf16  # MasterWeights keep the float32 copies
    assert weights_dtype(bf16, sharded=True, lora=True) == bf16  # a frozen base: as on one process
    assert weights_dtype(bf16, sharded=True, lora=False) == fp32  # the shards are the master weights
