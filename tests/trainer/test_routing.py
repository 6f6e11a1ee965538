"""The engine-vs-trainer routing split (`saccade.trainer.routing`), by hand. The load figures'
own test, and the ones that run the tiny MoE, are in tests/models/test_qwen3_vl_moe.py."""

from __future__ import annotations

import pytest
import torch

from saccade.trainer.routing import routing_differs, routing_split_figures, routing_split_sums


def test_routing_differs_compares_expert_sets_in_every_layer():
    # 4 tokens, 2 MoE layers, top-2. The engine's experts as a sample carries them (uint8).
    engine = torch.tensor([[[0, 1], [2, 3]],
                           [[0, 1], [2, 3]],
                           [[4, 5], [6, 7]],
                           [[4, 5], [6, 7]]], dtype=torch.uint8)
    trainer = torch.tensor([[[1, 0], [3, 2]],  # the same sets in another order: the same routing
                            [[0, 1], [2, 4]],  # layer 1 swapped expert 3 for 4
                            [[4, 5], [6, 7]],
                            [[5, 6], [6, 7]]])  # layer 0 differs
    assert routing_differs(trainer, engine).tolist() == [False, True, False, True]
    with pytest.raises(AssertionError):
        routing_differs(trainer[:, :1], engine)


def test_routing_split_by_hand():
    differs = torch.tensor([False, True, False, True])
    gap = torch.tensor([0.1, -0.5, -0.3, 0.7])  # trainer - engine: the sign does not count
    sums = routing_split_sums(differs, gap)
    assert sums.dtype == torch.float64
    assert sums.tolist() == pytest.approx([4, 2, 0.4, 1.2])
    assert routing_split_figures(sums.tolist()) == pytest.approx(
        {"routing_differs_frac": 0.5, "mismatch_abs_routing_same": 0.2, "mismatch_abs_routing_differs": 0.6})
    # Sums add over micro-batches and ranks: the figures are the whole step's, not a mean of means.
    other = routing_split_sums(torch.tensor([False]), torch.tensor([0.9]))
    assert routing_split_figures((sums + other).tolist()) == pytest.approx(
        {"routing_differs_frac": 0.4, "mismatch_abs_routing_same": 1.3 / 3, "mismatch_abs_routing_differs": 0.6})


def test_an_empty_group_has_no_figure():
    """No token routed differently: `mismatch_abs_routing_differs` is left out (not 0, not NaN);
    no token at all (no engine routing): nothing."""
    same = routing_split_sums(torch.tensor([False, False]), torch.tensor([1e-7, 3e-7]))
    assert routing_split_figures(same.tolist()) == pytest.approx(
        {"routing_differs_frac": 0.0, "mismatch_abs_routing_same": 2e-7})
    differs = routing_split_figures(routing_split_sums(torch.tensor([True]), torch.tensor([0.5])).tolist())
    assert differs == {"routing_differs_frac": 1.0, "mismatch_abs_routing_differs": 0.5}
    assert routing_split_figures([0.0, 0.0, 0.0, 0.0]) == {}
