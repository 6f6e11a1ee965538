"""Group-relative advantages (GRPO, RLOO) and the zero-variance filter (DAPO).

Each prompt is sampled G times (a group); a rollout's advantage is its reward relative to a
baseline from its group, `rollout.advantage_baseline`:
- ``"group_mean"`` (GRPO): ``A = r - mean(group)``;
- ``"rloo"`` (RLOO): ``A = r - mean(the other G - 1 rewards)`` (`leave_one_out_mean`), a
  baseline that does not depend on the rollout it is subtracted from. It equals the group
  mean's advantage times G / (G - 1). verl's adv_estimator = "rloo", TRL's RLOOTrainer.
Then divided by ``std + eps``, `rollout.advantage_scaling`:
- ``"group"`` (GRPO): the group's std;
- ``"batch"``: the std of the whole step's rewards, every group's, those the zero-variance
  filter then drops included (TRL's scale_rewards = "batch"; "Part I: Tricks or Traps? A Deep
  Dive into RL for LLM Reasoning", arXiv 2508.08221: group mean, batch std). A group whose
  rewards barely differ is then not blown up to unit scale;
- ``"none"`` (Dr. GRPO, arXiv 2503.20783): no division.
Every std is the *sample* std (Bessel's correction, ``torch.std``'s default, unbiased), as in
TRL's GRPOTrainer and DeepSeekMath.

A group whose rewards are all equal carries no learning signal: its advantages are exactly
0 (never NaN, never the 1e-8 noise that ``mean`` rounding would give divided by a tiny std),
and ``zero_variance_groups`` flags it so that DAPO-style dynamic sampling can drop it.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import Tensor

BASELINES = ("group_mean", "rloo")  # rollout.advantage_baseline
SCALINGS = ("group", "batch", "none")  # rollout.advantage_scaling


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


def leave_one_out_mean(rewards_PG: Tensor) -> Tensor:
    """(num_groups, G) -> (num_groups, G): each reward's mean of the other G - 1 rewards of its
    group, RLOO's baseline (Kool et al. 2019, "Buy 4 REINFORCE samples, get a baseline for
    free!"; Ahmadian et al. 2024, arXiv 2402.14740); G >= 2."""
    G = rewards_PG.shape[1]
    assert G >= 2, G
    return (rewards_PG.sum(dim=1, keepdim=True) - rewards_PG) / (G - 1)


def group_advantages(
    rewards_PG: Tensor | Sequence[Sequence[float]], *, baseline: str = "group_mean", scaling: str = "group",
    eps: float = 1e-6,
) -> Tensor:
    """(num_groups, G) rewards -> (num_groups, G) advantages.

    ``A = r - b``, b the group's mean (``baseline="group_mean"``) or the mean of the other G - 1
    rewards (``"rloo"``); divided by ``(std + eps)``, the std of the group (``scaling="group"``)
    or of every reward given (``"batch"``), or not at all (``"none"``), with the sample (unbiased,
    n-1) std. Zero-variance groups (including groups of one) give exactly 0, whatever the options.
    """
    if not eps >= 0:
        raise ValueError(f"eps must be >= 0, got {eps}")
    if baseline not in BASELINES:
        raise ValueError(f"baseline must be one of {BASELINES}, got {baseline!r}")
    if scaling not in SCALINGS:
        raise ValueError(f"scaling must be one of {SCALINGS}, got {scaling!r}")
    r = _as_groups(rewards_PG)
    if r.shape[1] < 2:  # a group of one has no relative signal (and no sample std)
        return torch.zeros_like(r)
    centered = r - (r.mean(dim=1, keepdim=True) if baseline == "group_mean" else leave_one_out_mean(r))
    if scaling == "group":
        centered = centered / (r.std(dim=1, keepdim=True) + eps)
    elif scaling == "batch":
        centered = centered / (r.std() + eps)
    flat = zero_variance_groups(r)
    return torch.where(flat[:, None], torch.zeros_like(centered), centered)
