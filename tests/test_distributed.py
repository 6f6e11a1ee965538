"""saccade.distributed's pure parts: each rank's share of the prompts and of the micro-batches."""

from __future__ import annotations

import pytest

from saccade.distributed import SINGLE, World, balance, share_embeddings


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
