"""How the sampled distribution is shaped from the logits, shared by the engines and the trainer.

An engine samples from softmax of the logits divided by the temperature, restricted to a kept
set (min_p, then top_k, then top_p; off by default), and reports the logprob of the sampled
token under that renormalised, truncated distribution. The trainer must score the very same
distribution, so both take one `SampledDistribution` and the kept set comes from one function,
`kept_tokens`, that follows vLLM 0.32's sampler rule for rule (docs/precision.md, "Sampling
options"):

1. temperature: z = logits / T (vision tokens already banned by a huge negative logit);
2. min_p: with p = softmax(z), drop tokens with p < min_p * max(p);
3. top_k: drop tokens whose z is below the k-th largest z still kept (ties at the k-th value stay);
4. top_p: over the distribution renormalised on what is left, sorted from least to most likely,
   drop tokens whose inclusive cumulative probability is <= 1 - top_p (the most likely always stays).

The set is a function of the logits; no gradient flows through the choice of the set (it is
piecewise constant), only through the kept logits.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class SampledDistribution:
    """Temperature and truncation of the distribution an engine samples from (never greedy)."""

    temperature: float = 1.0  # > 0: the logits are divided by it
    top_k: int = 0  # keep the k most likely tokens; 0 keeps all (vLLM's own "off")
    top_p: float = 1.0  # nucleus: keep the most likely tokens whose mass reaches top_p; 1 keeps all
    min_p: float = 0.0  # keep tokens with p >= min_p * max p; 0 keeps all

    def __post_init__(self):
        if not self.temperature > 0:
            raise ValueError(f"temperature must be > 0 for a sampled distribution; got {self.temperature}")
        if self.top_k < 0:
            raise ValueError(f"top_k must be >= 0 (0: off); got {self.top_k}")
        if not 0 < self.top_p <= 1:
            raise ValueError(f"top_p must be in (0, 1]; got {self.top_p}")
        if not 0 <= self.min_p < 1:
            raise ValueError(f"min_p must be in [0, 1); got {self.min_p}")

    @property
    def truncates(self) -> bool:
        """Whether any token can be dropped (False: plain softmax of logits / temperature)."""
        return self.top_k > 0 or self.top_p < 1.0 or self.min_p > 0.0


def kept_tokens(z_CV: torch.Tensor, distribution: SampledDistribution) -> torch.Tensor:
    """(C, V) bool: the tokens each row may sample, from its temperature-scaled logits z_CV.

    The same operations, in the same order and dtype, as vLLM 0.32's CPU sampler
    (`MinPLogitsProcessor.apply`, then `apply_top_k_top_p_pytorch`), so that equal logits give
    equal sets. Every row keeps at least its most likely token. `z_CV` is not modified.
    """
    kept_CV = torch.ones_like(z_CV, dtype=torch.bool)
    if not distribution.truncates:
        return kept_CV
    masked_CV = z_CV
    if distribution.min_p > 0:
        probs_CV = torch.softmax(z_CV, dim=-1)
        threshold_C1 = probs_CV.amax(dim=-1, keepdim=True).mul_(distribution.min_p)
        kept_CV &= probs_CV >= threshold_C1
        masked_CV = z_CV.masked_fill(~kept_CV, float("-inf"))
        del probs_CV
    vocab = z_CV.shape[-1]
    top_k = distribution.top_k if 0 < distribution.top_k < vocab else 0
    if distribution.top_p == 1.0:
        if top_k:  # vLLM's top-k-only path: the k-th largest value (ties with it stay)
            kth_C1 = masked_CV.topk(top_k, dim=-1).values[:, -1:]
            kept_CV &= masked_CV >= kth_C1
        return kept_CV
    # vLLM's sorted path, step for step: one ascending sort, top_k then top_p on the sorted
    # values. Sorting the same values as vLLM does orders ties as it does, so a tie at the top_p
    # boundary is decided the same way.
    sorted_CV, order_CV = masked_CV.sort(dim=-1, descending=False)
    if top_k:
        kth_C1 = sorted_CV[:, vocab - top_k : vocab - top_k + 1]
        sorted_CV = sorted_CV.masked_fill(sorted_CV < kth_C1, float("-inf"))
    cumulative_CV = sorted_CV.softmax(dim=-1).cumsum_(dim=-1)
    # 1 - p in float32, as vLLM computes it from its float32 top_p tensor.
    one_minus_p = 1 - torch.tensor(distribution.top_p, dtype=torch.float32, device=z_CV.device)
    drop_sorted_CV = cumulative_CV <= one_minus_p.to(cumulative_CV.dtype)
    drop_sorted_CV[:, -1] = False  # the most likely token always stays
    drop_sorted_CV |= sorted_CV == float("-inf")  # below the k-th value (or dropped by min_p)
    kept_CV &= ~torch.zeros_like(kept_CV).scatter_(-1, order_CV, drop_sorted_CV)
    return kept_CV
