"""Router load balance of a mixture-of-experts language model: pure functions over the experts
each token was sent to (`ModelFamily.record_routing` records them during the trainer's forward).

`expert_counts` turns one forward's chosen experts (per MoE layer, (N, top_k)) and a token mask
into assignment counts (layers, E); counts add over micro-batches and ranks, so a step's figures
are computed once from the sums (`load_figures`):

- `router_max_over_mean`: the busiest expert's share over the mean share, averaged over layers
  (1 = balanced; E / top_k at worst, every token to the same top_k experts);
- `router_cv`: the coefficient of variation of the shares (population std / mean), averaged;
- `router_dead_experts`: (layer, expert) pairs that got no token at all.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch


def expert_counts(chosen: Sequence[torch.Tensor], num_experts: int,
                  token_mask_N: torch.Tensor | None = None) -> torch.Tensor:
    """(layers, E) float64 counts of top-k assignments, from one (N, top_k) index tensor per MoE
    layer; `token_mask_N` (N,) says which tokens count (None: all)."""
    rows = []
    for chosen_NK in chosen:
        N, K = chosen_NK.shape
        weight_NK = torch.ones(N, K, dtype=torch.float64, device=chosen_NK.device)
        if token_mask_N is not None:
            assert token_mask_N.shape == (N,), (tuple(token_mask_N.shape), N)
            weight_NK = weight_NK * token_mask_N.to(weight_NK.device, torch.float64).reshape(N, 1)
        rows.append(torch.zeros(num_experts, dtype=torch.float64, device=chosen_NK.device).scatter_add_(
            0, chosen_NK.reshape(-1).long(), weight_NK.reshape(-1)))
    return torch.stack(rows)


def load_figures(counts_LE: torch.Tensor) -> dict[str, float]:
    """The step's balance figures from summed counts (layers with no counted token are left out)."""
    counts_LE = counts_LE.double().cpu()
    seen = counts_LE.sum(1) > 0
    if not seen.any():
        return {}
    load_LE = counts_LE[seen] / counts_LE[seen].sum(1, keepdim=True)
    mean_L = load_LE.mean(1)
    return {
        "router_max_over_mean": float((load_LE.max(1).values / mean_L).mean()),
        "router_cv": float((load_LE.std(1, unbiased=False) / mean_L).mean()),
        "router_dead_experts": float((counts_LE[seen] == 0).sum()),
    }
