"""Router load balance of a mixture-of-experts language model: pure functions over the experts
each token was sent to (`ModelFamily.record_routing` records them during the trainer's forward).

`expert_counts` turns one forward's chosen experts (per MoE layer, (N, top_k)) and a token mask
into assignment counts (layers, E); counts add over micro-batches and ranks, so a step's figures
are computed once from the sums (`load_figures`):

- `router_max_over_mean`: the busiest expert's share over the mean share, averaged over layers
  (1 = balanced; E / top_k at worst, every token to the same top_k experts);
- `router_cv`: the coefficient of variation of the shares (population std / mean), averaged;
- `router_dead_experts`: (layer, expert) pairs that got no token at all.

Engine vs trainer: where the engine reports the experts it sampled each token with
(`TrainingSample.routed_experts`; the embedded engine does), `routing_differs` marks the loss
tokens whose top-k set differs from the trainer's forward in some MoE layer and
`routing_split_sums` splits |trainer - engine| logprob by it; from the summed figures
(`routing_split_figures`): `routing_differs_frac`, `mismatch_abs_routing_same`,
`mismatch_abs_routing_differs`.
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


def load_figures(counts_YE: torch.Tensor) -> dict[str, float]:
    """The step's balance figures from summed counts (layers with no counted token are left out)."""
    counts_YE = counts_YE.double().cpu()
    seen = counts_YE.sum(1) > 0
    if not seen.any():
        return {}
    load_YE = counts_YE[seen] / counts_YE[seen].sum(1, keepdim=True)
    mean_Y = load_YE.mean(1)
    return {
        "router_max_over_mean": float((load_YE.max(1).values / mean_Y).mean()),
        "router_cv": float((load_YE.std(1, unbiased=False) / mean_Y).mean()),
        "router_dead_experts": float((counts_YE[seen] == 0).sum()),
    }


# ---------------------------------------------------------------- engine vs trainer routing
#
# A loss token's logprob is computed from its predecessor's hidden state, so "the token's
# experts" are the ones its predecessor position was routed to, in every MoE layer: those the
# engine used to compute the logits it sampled the token from, and those the trainer's forward
# used to score it. Where the two differ in any layer, the two logits went through different
# experts, and their logprob gap is expected to be larger than where only the numerics differ.


def routing_differs(trainer_TYK: torch.Tensor, engine_TYK: torch.Tensor) -> torch.Tensor:
    """(T,) bool: True where a token's top-k expert *set* differs between trainer and engine in
    at least one MoE layer. Both (T, layers, top_k) expert ids; the order within the top-k is
    ignored (the same experts in another order compute the same sum)."""
    assert trainer_TYK.shape == engine_TYK.shape, (tuple(trainer_TYK.shape), tuple(engine_TYK.shape))
    trainer_sorted = trainer_TYK.long().sort(-1).values
    engine_sorted = engine_TYK.to(trainer_TYK.device).long().sort(-1).values
    return (trainer_sorted != engine_sorted).flatten(1).any(1)


def routing_split_sums(differs_T: torch.Tensor, gap_T: torch.Tensor) -> torch.Tensor:
    """(4,) float64 sums that add over micro-batches and ranks: [tokens, tokens whose routing
    differs, |gap| summed over the tokens whose routing is the same, |gap| summed over those
    whose routing differs]. `gap_T`: trainer logprob - engine logprob per token."""
    differs = differs_T.to(torch.float64)
    gap = gap_T.detach().abs().to(torch.float64)
    return torch.stack([torch.ones_like(gap).sum(), differs.sum(), (gap * (1 - differs)).sum(), (gap * differs).sum()])


def routing_split_figures(sums: Sequence[float]) -> dict[str, float]:
    """The step's figures from summed `routing_split_sums`:

    - `routing_differs_frac`: the fraction of tokens whose top-k set differs in some layer;
    - `mismatch_abs_routing_same` / `mismatch_abs_routing_differs`: mean |trainer - engine|
      logprob over each group.

    A group with no token has no mean: its figure is left out (as `mismatch_abs_lag0` is), not
    logged as 0 or NaN; no token at all (no engine routing seen) gives {}."""
    tokens, differing, gap_same, gap_differs = (float(s) for s in sums)
    if tokens == 0:
        return {}
    out = {"routing_differs_frac": differing / tokens}
    if tokens - differing > 0:
        out["mismatch_abs_routing_same"] = gap_same / (tokens - differing)
    if differing > 0:
        out["mismatch_abs_routing_differs"] = gap_differs / differing
    return out
