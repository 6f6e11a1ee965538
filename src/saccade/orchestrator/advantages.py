"""Group-relative advantages (GRPO) and the zero-variance filter (DAPO).

Each prompt is sampled G times (a group); a rollout's advantage is its reward relative to its
group: ``A = r - mean(group)``, divided by ``std(group) + eps`` when ``scale_by_std``
(GRPO; Dr. GRPO drops the division). The std is the *sample* std (Bessel's correction,
``torch.std``'s default, unbiased), as in TRL's GRPOTrainer and DeepSeekMath.

A group whose rewards are all equal carries no learning signal: its advantages are exactly
0 (never NaN, never the 1e-8 noise that ``mean`` rounding would give divided by a tiny std),
and ``zero_variance_groups`` flags it so that DAPO-style dynamic sampling can drop it.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import Tensor


def _as_groups(rewards_PG: Tensor | Sequence[Sequence[float]]) -> Tensor:
    """(num_groups, G) float tensor; ValueError for ragged, non-2-D or non-finite rewards."""
    if not isinstance(rewards_PG, Tensor) and all(isinstance(g, Sequence) for g in rewards_PG):
        lengths = {len(g) for g in rewards_PG}
        if len(lengths) > 1:
            raise ValueError(f"all groups must have the same size, got sizes {sorted(lengths)}")
    r = torch.as_tensor(rewards_PG)
    if r.dim() != 2:
        raise ValueError(f"rewards must be (num_groups, G), got shape {tuple(r.shape)}")
    if not r.is_floating_point():
        r = r.float()
    if not torch.isfinite(r).all():
        bad = (~torch.isfinite(r)).any(dim=1).nonzero().flatten().tolist()
        raise ValueError(f"rewards must be finite; groups {bad} hold NaN or inf")
    return r


def zero_variance_groups(rewards_PG: Tensor | Sequence[Sequence[float]]) -> Tensor:
    """(num_groups,) bool: True where every reward in the group is the same (no signal)."""
    r = _as_groups(rewards_PG)
    return (r == r[:, :1]).all(dim=1)


def group_advantages(
    rewards_PG: Tensor | Sequence[Sequence[float]], *, scale_by_std: bool = True, eps: float = 1e-6
) -> Tensor:
    """(num_groups, G) rewards -> (num_groups, G) advantages.

    ``A = r - mean`` per group, divided by ``(std + eps)`` if ``scale_by_std``, with the sample
    (unbiased, n-1) std. Zero-variance groups (including groups of one) give exactly 0.
    """
    if not eps >= 0:
        raise ValueError(f"eps must be >= 0, got {eps}")
    r = _as_groups(rewards_PG)
    if r.shape[1] < 2:  # a group of one has no relative signal (and no sample std)
        return torch.zeros_like(r)
    centered = r - r.mean(dim=1, keepdim=True)
    if scale_by_std:
        centered = centered / (r.std(dim=1, keepdim=True) + eps)
    flat = zero_variance_groups(r)
    return torch.where(flat[:, None], torch.zeros_like(centered), centered)
