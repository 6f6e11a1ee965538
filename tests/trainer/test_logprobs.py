"""Chunked logprob/entropy autograd function vs. the materialize-everything reference.

Tolerances (all explicit below):
- float32 forward: atol 1e-5, rtol 1e-6. Both paths compute in float32 but sum in different
  orders (chunked matmul blocking, logsumexp vs log_softmax), so they agree to a few ulps of
  values of size ~10.
- float32 gradients: atol 1e-5, rtol 1e-4.
- bf16 inputs vs. the float32 reference on the same (bf16-rounded) values: the forward is
  computed in float32, so it matches as tightly as float32 does; bf16 gradients are
  rounded to bf16 (8 bits of mantissa), so they get rtol 1e-2, atol 1e-2.
- gradcheck runs in float64 with its defaults (eps 1e-6, atol 1e-5, rtol 1e-3).
"""

from __future__ import annotations

import math

import pytest
import torch

from saccade.models.sampling import SampledDistribution
from saccade.trainer.logprobs import (
    token_logprobs_and_entropy,
    token_logprobs_and_entropy_reference,
)

FWD_TOL = {"atol": 1e-5, "rtol": 1e-6}
GRAD_TOL = {"atol": 1e-5, "rtol": 1e-4}
BF16_GRAD_TOL = {"atol": 1e-2, "rtol": 1e-2}

N, H, V = 37, 16, 50  # N is prime: no chunk size below divides it evenly

# Plain softmax at two temperatures, and each truncation (alone and together) at T = 0.7.
DISTRIBUTIONS = {
    "T1": SampledDistribution(),
    "T0.7": SampledDistribution(temperature=0.7),
    "top_k": SampledDistribution(temperature=0.7, top_k=5),
    "top_p": SampledDistribution(temperature=0.7, top_p=0.8),
    "min_p": SampledDistribution(temperature=0.7, min_p=0.1),
    "all": SampledDistribution(temperature=0.7, top_k=8, top_p=0.9, min_p=0.05),
}


def _make_inputs(
    *,
    n: int = N,
    with_bias: bool = False,
    dtype: torch.dtype = torch.float32,
    logit_scale: float = 1.0,
    seed: int = 0,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor | None]:
    gen = torch.Generator().manual_seed(seed)
    # Logits with std ~ 2 * logit_scale: peaked enough that entropies are far from log V.
    hidden_NH = torch.randn(n, H, generator=gen, dtype=torch.float64)
    weight_VH = torch.randn(V, H, generator=gen, dtype=torch.float64) * (0.5 * logit_scale)
    targets_N = torch.randint(0, V, (n,), generator=gen)
    bias_V = torch.randn(V, generator=gen, dtype=torch.float64) if with_bias else None
    cast = lambda t: None if t is None else t.to(dtype)  # noqa: E731
    return cast(hidden_NH), cast(weight_VH), targets_N, cast(bias_V)


def _leaves(*tensors: torch.Tensor | None) -> list[torch.Tensor | None]:
    return [None if t is None else t.detach().clone().requires_grad_(True) for t in tensors]


def _loss(
    logprobs_N: torch.Tensor, entropy_N: torch.Tensor, mode: str, seed: int = 1
) -> torch.Tensor:
    """Random upstream gradients on the outputs selected by ``mode``."""
    gen = torch.Generator().manual_seed(seed)
    a_N = torch.randn(logprobs_N.shape, generator=gen, dtype=logprobs_N.dtype)
    b_N = torch.randn(entropy_N.shape, generator=gen, dtype=entropy_N.dtype)
    if mode == "logprobs":
        return (a_N * logprobs_N).sum()
    if mode == "entropy":
        return (b_N * entropy_N).sum()
    return (a_N * logprobs_N).sum() + (b_N * entropy_N).sum()


@pytest.mark.parametrize("chunk_size", [1, 8, 16, 37, 1024])
@pytest.mark.parametrize("name", list(DISTRIBUTIONS))
@pytest.mark.parametrize("with_bias", [False, True])
def test_forward_matches_reference(chunk_size: int, name: str, with_bias: bool) -> None:
    hidden_NH, weight_VH, targets_N, bias_V = _make_inputs(with_bias=with_bias)
    kwargs = {"distribution": DISTRIBUTIONS[name], "bias_V": bias_V}

    logprobs_N, entropy_N = token_logprobs_and_entropy(
        hidden_NH, weight_VH, targets_N, chunk_size=chunk_size, **kwargs
    )
    ref_logprobs_N, ref_entropy_N = token_logprobs_and_entropy_reference(
        hidden_NH, weight_VH, targets_N, **kwargs
    )

    assert logprobs_N.dtype == entropy_N.dtype == torch.float32
    assert logprobs_N.shape == entropy_N.shape == (N,)
    torch.testing.assert_close(logprobs_N, ref_logprobs_N, **FWD_TOL)
    torch.testing.assert_close(entropy_N, ref_entropy_N, **FWD_TOL)
    assert (logprobs_N <= 0).all()
    log_v = torch.log(torch.tensor(float(V)))
    assert (entropy_N >= 0).all() and (entropy_N <= log_v + 1e-5).all()


def test_forward_is_stable_for_large_logits() -> None:
    # Logits in the hundreds: a naive exp() would overflow; entropies are near zero.
    hidden_NH, weight_VH, targets_N, _ = _make_inputs(logit_scale=100.0)
    logprobs_N, entropy_N = token_logprobs_and_entropy(
        hidden_NH, weight_VH, targets_N, chunk_size=8
    )
    ref_logprobs_N, ref_entropy_N = token_logprobs_and_entropy_reference(
        hidden_NH, weight_VH, targets_N
    )
    assert torch.isfinite(logprobs_N).all() and torch.isfinite(entropy_N).all()
    # Logprobs are ~ -100s here, so an absolute tolerance scaled to their size.
    torch.testing.assert_close(logprobs_N, ref_logprobs_N, atol=1e-3, rtol=1e-6)
    torch.testing.assert_close(entropy_N, ref_entropy_N, atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("chunk_size", [1, 8, 1024])
@pytest.mark.parametrize("name", list(DISTRIBUTIONS))
@pytest.mark.parametrize("with_bias", [False, True])
@pytest.mark.parametrize("mode", ["both", "logprobs", "entropy"])
def test_backward_matches_reference(
    chunk_size: int, name: str, with_bias: bool, mode: str
) -> None:
    distribution = DISTRIBUTIONS[name]
    inputs = _make_inputs(with_bias=with_bias)
    hidden_NH, weight_VH, targets_N, bias_V = inputs

    leaves = _leaves(hidden_NH, weight_VH, bias_V)
    logprobs_N, entropy_N = token_logprobs_and_entropy(
        leaves[0], leaves[1], targets_N, distribution=distribution, chunk_size=chunk_size,
        bias_V=leaves[2],
    )
    _loss(logprobs_N, entropy_N, mode).backward()

    ref_leaves = _leaves(hidden_NH, weight_VH, bias_V)
    ref_logprobs_N, ref_entropy_N = token_logprobs_and_entropy_reference(
        ref_leaves[0], ref_leaves[1], targets_N, distribution=distribution, bias_V=ref_leaves[2]
    )
    _loss(ref_logprobs_N, ref_entropy_N, mode).backward()

    for leaf, ref_leaf in zip(leaves, ref_leaves, strict=True):
        if leaf is None:
            continue
        assert leaf.grad is not None and leaf.grad.dtype == leaf.dtype
        torch.testing.assert_close(leaf.grad, ref_leaf.grad, **GRAD_TOL)


@pytest.mark.parametrize("with_bias", [False, True])
@pytest.mark.parametrize("truncated", [False, True])
def test_gradcheck_float64(with_bias: bool, truncated: bool) -> None:
    # Truncated: min_p and top_k drop tokens of most rows (the set does not move under gradcheck's
    # 1e-6 steps: no logit of these random inputs sits that close to a boundary).
    distribution = SampledDistribution(temperature=0.7, top_k=4 if truncated else 0, min_p=0.1 if truncated else 0.0)
    gen = torch.Generator().manual_seed(0)
    n, h, v = 5, 3, 7
    hidden_NH = torch.randn(n, h, generator=gen, dtype=torch.float64, requires_grad=True)
    weight_VH = torch.randn(v, h, generator=gen, dtype=torch.float64, requires_grad=True)
    targets_N = torch.randint(0, v, (n,), generator=gen)
    bias_V = torch.randn(v, generator=gen, dtype=torch.float64, requires_grad=True)

    def fn(*args: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return token_logprobs_and_entropy(
            args[0], args[1], targets_N, distribution=distribution, chunk_size=2,
            bias_V=args[2] if with_bias else None,
        )

    args = (hidden_NH, weight_VH, bias_V) if with_bias else (hidden_NH, weight_VH)
    assert fn(*args)[0].dtype == torch.float64  # float64 in, float64 compute and out
    assert torch.autograd.gradcheck(fn, args)


def test_frozen_weight_gets_no_grad() -> None:
    hidden_NH, weight_VH, targets_N, bias_V = _make_inputs(with_bias=True)
    (hidden_leaf,) = _leaves(hidden_NH)
    logprobs_N, entropy_N = token_logprobs_and_entropy(
        hidden_leaf, weight_VH, targets_N, chunk_size=8, bias_V=bias_V
    )
    _loss(logprobs_N, entropy_N, "both").backward()
    assert weight_VH.grad is None and bias_V.grad is None

    (ref_hidden_leaf,) = _leaves(hidden_NH)
    ref_logprobs_N, ref_entropy_N = token_logprobs_and_entropy_reference(
        ref_hidden_leaf, weight_VH, targets_N, bias_V=bias_V
    )
    _loss(ref_logprobs_N, ref_entropy_N, "both").backward()
    torch.testing.assert_close(hidden_leaf.grad, ref_hidden_leaf.grad, **GRAD_TOL)


def test_weight_only_grad() -> None:
    # Hidden states that do not require grad (e.g. a detached trunk) must still train the head.
    hidden_NH, weight_VH, targets_N, _ = _make_inputs()
    (weight_leaf,) = _leaves(weight_VH)
    outputs = token_logprobs_and_entropy(hidden_NH, weight_leaf, targets_N, chunk_size=8)
    _loss(*outputs, "both").backward()
    (ref_weight_leaf,) = _leaves(weight_VH)
    ref_outputs = token_logprobs_and_entropy_reference(hidden_NH, ref_weight_leaf, targets_N)
    _loss(*ref_outputs, "both").backward()
    assert hidden_NH.grad is None
    torch.testing.assert_close(weight_leaf.grad, ref_weight_leaf.grad, **GRAD_TOL)


def test_bfloat16_inputs() -> None:
    hidden_NH, weight_VH, targets_N, bias_V = _make_inputs(with_bias=True, dtype=torch.bfloat16)
    leaves = _leaves(hidden_NH, weight_VH, bias_V)
    logprobs_N, entropy_N = token_logprobs_and_entropy(
        leaves[0], leaves[1], targets_N, distribution=SampledDistribution(temperature=0.7), chunk_size=8,
        bias_V=leaves[2]
    )
    assert logprobs_N.dtype == entropy_N.dtype == torch.float32
    _loss(logprobs_N, entropy_N, "both").backward()

    # Reference on the same bf16 values, upcast: the forward is float32 math on both sides.
    ref_leaves = _leaves(*(t.float() for t in (hidden_NH, weight_VH, bias_V)))
    ref_logprobs_N, ref_entropy_N = token_logprobs_and_entropy_reference(
        ref_leaves[0], ref_leaves[1], targets_N, distribution=SampledDistribution(temperature=0.7),
        bias_V=ref_leaves[2]
    )
    _loss(ref_logprobs_N, ref_entropy_N, "both").backward()
    torch.testing.assert_close(logprobs_N, ref_logprobs_N, **FWD_TOL)
    torch.testing.assert_close(entropy_N, ref_entropy_N, **FWD_TOL)

    for leaf, ref_leaf in zip(leaves, ref_leaves, strict=True):
        assert leaf.grad.dtype == torch.bfloat16
        torch.testing.assert_close(leaf.grad.float(), ref_leaf.grad, **BF16_GRAD_TOL)


def test_autocast_does_not_lower_precision() -> None:
    hidden_NH, weight_VH, targets_N, _ = _make_inputs()
    with torch.autocast(device_type="cpu", dtype=torch.bfloat16):
        logprobs_N, entropy_N = token_logprobs_and_entropy(
            hidden_NH, weight_VH, targets_N, chunk_size=8
        )
    ref_logprobs_N, ref_entropy_N = token_logprobs_and_entropy_reference(
        hidden_NH, weight_VH, targets_N
    )
    torch.testing.assert_close(logprobs_N, ref_logprobs_N, **FWD_TOL)
    torch.testing.assert_close(entropy_N, ref_entropy_N, **FWD_TOL)


@pytest.mark.parametrize("context", [torch.no_grad, torch.inference_mode])
def test_forward_only_without_grad(context) -> None:
    hidden_NH, weight_VH, targets_N, _ = _make_inputs()
    hidden_leaf, weight_leaf = _leaves(hidden_NH, weight_VH)
    with context():
        logprobs_N, entropy_N = token_logprobs_and_entropy(
            hidden_leaf, weight_leaf, targets_N, chunk_size=8
        )
    assert logprobs_N.grad_fn is None and not logprobs_N.requires_grad
    ref_logprobs_N, ref_entropy_N = token_logprobs_and_entropy_reference(
        hidden_NH, weight_VH, targets_N
    )
    torch.testing.assert_close(logprobs_N, ref_logprobs_N, **FWD_TOL)
    torch.testing.assert_close(entropy_N, ref_entropy_N, **FWD_TOL)


def test_empty_batch() -> None:
    hidden_NH, weight_VH, targets_N, bias_V = _make_inputs(n=0, with_bias=True)
    leaves = _leaves(hidden_NH, weight_VH, bias_V)
    logprobs_N, entropy_N = token_logprobs_and_entropy(
        leaves[0], leaves[1], targets_N, chunk_size=8, bias_V=leaves[2]
    )
    assert logprobs_N.shape == entropy_N.shape == (0,)
    (logprobs_N.sum() + entropy_N.sum()).backward()
    assert leaves[0].grad.shape == (0, H)
    assert torch.equal(leaves[1].grad, torch.zeros(V, H))
    assert torch.equal(leaves[2].grad, torch.zeros(V))


def test_int32_targets_accepted() -> None:
    hidden_NH, weight_VH, targets_N, _ = _make_inputs()
    logprobs_N, _ = token_logprobs_and_entropy(hidden_NH, weight_VH, targets_N.int())
    ref_logprobs_N, _ = token_logprobs_and_entropy_reference(hidden_NH, weight_VH, targets_N)
    torch.testing.assert_close(logprobs_N, ref_logprobs_N, **FWD_TOL)


@pytest.mark.parametrize(
    ("kwargs", "error"),
    [
        ({"chunk_size": 0}, ValueError),
        ({"bias_V": torch.zeros(V + 1)}, ValueError),
    ],
)
def test_rejects_bad_arguments(kwargs: dict, error: type[Exception]) -> None:
    hidden_NH, weight_VH, targets_N, _ = _make_inputs()
    with pytest.raises(error):
        token_logprobs_and_entropy(hidden_NH, weight_VH, targets_N, **kwargs)


def test_rejects_bad_shapes() -> None:
    hidden_NH, weight_VH, targets_N, _ = _make_inputs()
    with pytest.raises(ValueError):
        token_logprobs_and_entropy(hidden_NH[:, :-1], weight_VH, targets_N)
    with pytest.raises(ValueError):
        token_logprobs_and_entropy(hidden_NH, weight_VH, targets_N[:-1])
    with pytest.raises(TypeError):
        token_logprobs_and_entropy(hidden_NH, weight_VH, targets_N.float())


# --- truncation (top_k, top_p, min_p), by hand ---------------------------------------------
# One row of logits log([0.5, 0.25, 0.15, 0.1]): at T = 1 the probabilities are those numbers.
PROBS = [0.5, 0.25, 0.15, 0.1]


def _truncated(target: int, distribution: SampledDistribution) -> tuple[float, float]:
    """(logprob of target, entropy) of the row above; the lm_head is the identity (logits = hidden)."""
    logits_1V = torch.tensor([PROBS], dtype=torch.float64).log()
    lp, ent = token_logprobs_and_entropy(
        logits_1V, torch.eye(4, dtype=torch.float64), torch.tensor([target]), distribution=distribution
    )
    return float(lp), float(ent)


def _entropy(*p: float) -> float:
    return -sum(x * math.log(x) for x in p)


@pytest.mark.parametrize(
    ("distribution", "target", "logprob", "entropy"),
    [
        # top_k 2 keeps {0.5, 0.25}: renormalised [2/3, 1/3].
        (SampledDistribution(top_k=2), 1, math.log(1 / 3), _entropy(2 / 3, 1 / 3)),
        # min_p 0.25: p >= 0.25 * 0.5 = 0.125 keeps three: [0.5, 0.25, 0.15] / 0.9.
        (SampledDistribution(min_p=0.25), 2, math.log(0.15 / 0.9), _entropy(0.5 / 0.9, 0.25 / 0.9, 0.15 / 0.9)),
        # top_p 0.7: from the least likely, cumulative 0.1, 0.25, 0.5, 1; drop those <= 0.3.
        (SampledDistribution(top_p=0.7), 0, math.log(0.5 / 0.75), _entropy(2 / 3, 1 / 3)),
        # top_p 0.4 keeps the most likely alone: logprob 0, entropy 0.
        (SampledDistribution(top_p=0.4), 0, 0.0, 0.0),
        # The order: min_p 0.25 keeps three, top_k 2 keeps [2/3, 1/3], and top_p 0.6 over *that*
        # (cumulative 1/3 <= 0.4 dropped) keeps one; top_p 0.6 on the original would keep two.
        (SampledDistribution(min_p=0.25, top_k=2, top_p=0.6), 0, 0.0, 0.0),
        # min_p after the temperature: at T = 0.5, p ~ [0.25, 0.0625, 0.0225, 0.01], ratios to the
        # most likely [1, 0.25, 0.09, 0.04]: min_p 0.22 keeps two (at T = 1 it would keep three).
        (SampledDistribution(temperature=0.5, min_p=0.22), 1, math.log(0.2), _entropy(0.8, 0.2)),
        # A target outside the kept set is added to it: top_k 1 keeps {0}, target 2 joins:
        # [0.5, 0.15] / 0.65; the logprob stays finite.
        (SampledDistribution(top_k=1), 2, math.log(0.15 / 0.65), _entropy(0.5 / 0.65, 0.15 / 0.65)),
    ],
)
def test_truncated_logprob_and_entropy_by_hand(distribution, target, logprob, entropy) -> None:
    got_logprob, got_entropy = _truncated(target, distribution)
    assert got_logprob == pytest.approx(logprob, abs=1e-12)
    assert got_entropy == pytest.approx(entropy, abs=1e-12)


def test_truncated_gradient_by_hand() -> None:
    # d logprob / d z over the kept set {0, 1} (top_k 2, target 1) is onehot - p = [-2/3, 2/3];
    # the dropped tokens get no gradient.
    logits_1V = torch.tensor([PROBS], dtype=torch.float64).log().requires_grad_(True)
    lp, _ = token_logprobs_and_entropy(
        logits_1V, torch.eye(4, dtype=torch.float64), torch.tensor([1]), distribution=SampledDistribution(top_k=2)
    )
    lp.sum().backward()
    torch.testing.assert_close(logits_1V.grad, torch.tensor([[-2 / 3, 2 / 3, 0.0, 0.0]], dtype=torch.float64))


def test_no_truncation_is_bit_identical_to_the_plain_softmax() -> None:
    # Options at their "off" values take the plain path: the same bits as before they existed.
    hidden_NH, weight_VH, targets_N, _ = _make_inputs()
    plain = token_logprobs_and_entropy(hidden_NH, weight_VH, targets_N, chunk_size=8,
                                       distribution=SampledDistribution(temperature=0.7))
    off = token_logprobs_and_entropy(hidden_NH, weight_VH, targets_N, chunk_size=8,
                                     distribution=SampledDistribution(temperature=0.7, top_k=0, top_p=1.0, min_p=0.0))
    assert torch.equal(plain[0], off[0]) and torch.equal(plain[1], off[1])
    assert not SampledDistribution(top_k=0, top_p=1.0, min_p=0.0).truncates
