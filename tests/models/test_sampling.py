"""The kept set of a truncated distribution: vLLM's rule, by hand and against vLLM's own code."""

from __future__ import annotations

import importlib.util

import pytest
import torch

from saccade.models.sampling import SampledDistribution, kept_tokens

# One row whose probabilities at T = 1 are [0.5, 0.25, 0.15, 0.1].
Z_1V = torch.tensor([[0.5, 0.25, 0.15, 0.1]]).log()


@pytest.mark.parametrize(
    ("distribution", "kept"),
    [
        (SampledDistribution(), [1, 1, 1, 1]),
        (SampledDistribution(top_k=2), [1, 1, 0, 0]),
        (SampledDistribution(top_k=4), [1, 1, 1, 1]),
        (SampledDistribution(top_k=100), [1, 1, 1, 1]),  # k >= V: nothing dropped
        (SampledDistribution(min_p=0.25), [1, 1, 1, 0]),  # p >= 0.125
        (SampledDistribution(min_p=0.6), [1, 0, 0, 0]),  # p >= 0.3
        (SampledDistribution(top_p=0.7), [1, 1, 0, 0]),  # 0.5 < 0.7 <= 0.75
        (SampledDistribution(top_p=0.8), [1, 1, 1, 0]),  # 0.75 < 0.8 <= 0.9
        (SampledDistribution(top_p=0.4), [1, 0, 0, 0]),
        # top_p applies to what min_p and top_k left, renormalised: [2/3, 1/3] -> one token
        # (on the original probabilities top_p 0.6 keeps two).
        (SampledDistribution(min_p=0.25, top_k=2, top_p=0.6), [1, 0, 0, 0]),
    ],
)
def test_kept_tokens_by_hand(distribution, kept):
    assert kept_tokens(Z_1V, distribution).int().tolist() == [kept]


def test_ties_at_the_kth_value_are_kept():
    # vLLM masks `logits < kth largest`: a tie with the k-th value stays.
    z_1V = torch.tensor([[3.0, 2.0, 2.0, 1.0]])
    assert kept_tokens(z_1V, SampledDistribution(top_k=2)).int().tolist() == [[1, 1, 1, 0]]


def test_the_input_is_not_modified():
    z_1V = Z_1V.clone()
    kept_tokens(z_1V, SampledDistribution(min_p=0.25, top_k=2, top_p=0.6))
    assert torch.equal(z_1V, Z_1V)


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [({"temperature": 0.0}, "temperature"), ({"top_k": -1}, "top_k"), ({"top_p": 0.0}, "top_p"),
     ({"top_p": 1.5}, "top_p"), ({"min_p": 1.0}, "min_p"), ({"min_p": -0.1}, "min_p")],
)
def test_bad_values_are_value_errors(kwargs, match):
    with pytest.raises(ValueError, match=match):
        SampledDistribution(**kwargs)


@pytest.mark.skipif(importlib.util.find_spec("vllm") is None, reason="compares with vLLM's own sampler code")
@pytest.mark.parametrize("options", [{"top_k": 7}, {"top_p": 0.6}, {"top_k": 20, "top_p": 0.9}, {"min_p": 0.2},
                                     {"min_p": 0.05, "top_k": 10, "top_p": 0.8}])
def test_kept_tokens_equal_vllms(options):
    """The same set as vLLM 0.32's CPU sampler: MinPLogitsProcessor.apply's rule (restated: its
    constructor needs a whole engine config), then vLLM's own apply_top_k_top_p_pytorch."""
    from vllm.v1.sample.ops.topk_topp_sampler import apply_top_k_top_p_pytorch

    distribution = SampledDistribution(temperature=0.7, **options)
    gen = torch.Generator().manual_seed(0)
    z_CV = torch.randn(64, 300, generator=gen) * 3 / distribution.temperature
    z_CV[:, :10] = z_CV[:, 10:20]  # ties, too
    theirs_CV = z_CV.clone()
    if distribution.min_p:
        probs = torch.softmax(theirs_CV, dim=-1)
        theirs_CV.masked_fill_(probs < probs.amax(dim=-1, keepdim=True).mul_(distribution.min_p), float("-inf"))
    k = torch.full((64,), distribution.top_k, dtype=torch.int32) if distribution.top_k else None
    p = torch.full((64,), distribution.top_p, dtype=torch.float32) if distribution.top_p < 1 else None
    theirs_CV = apply_top_k_top_p_pytorch(theirs_CV, k, p, allow_cpu_sync=True)
    kept_CV = kept_tokens(z_CV, distribution)
    assert torch.equal(kept_CV, theirs_CV > float("-inf"))
    assert 0 < int(kept_CV.sum()) < kept_CV.numel()
