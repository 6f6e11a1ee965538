"""Policy losses against hand computations (expected values are written out as plain floats).

The shared batch: 2 packed sequences, each with one masked prompt token first.
  seq A: tokens 0..3, loss tokens 1,2,3 with ratios 1.0, 1.5, 0.5 and advantage +1
  seq B: tokens 4..6, loss tokens 5,6   with ratios 0.5, 1.5      and advantage -2
eps_low = 0.2, eps_high = 0.28, so the clip range is [0.8, 1.28]. Per-token objectives
min(r*A, clip(r)*A):
  A1: r=1.0       -> 1.0
  A2: r=1.5, A>0  -> min(1.5, 1.28) = 1.28   (clip-high active: no gradient)
  A3: r=0.5, A>0  -> min(0.5, 0.8)  = 0.5    (below the range, but A>0: unclipped)
  B1: r=0.5, A<0  -> min(-1, -1.6)  = -1.6   (clip-low active: no gradient)
  B2: r=1.5, A<0  -> min(-3, -2.56) = -3     (above the range, but A<0: unclipped)
Loss tokens (-objective): -1, -1.28, -0.5, 1.6, 3; their sum is 1.82.
"""

from __future__ import annotations

import math

import pytest
import torch
from pydantic import TypeAdapter

from saccade.config import LossConfig, PpoClipLossConfig, ReinforceLossConfig
from saccade.trainer.loss import LossInputs, masked_mean, per_sequence_mean, policy_loss

MASK = [False, True, True, True, False, True, True]
CU = [0, 4, 7]
RATIOS = [1.0, 1.0, 1.5, 0.5, 1.0, 0.5, 1.5]  # masked entries are irrelevant
ADV = [1.0, 1.0, 1.0, 1.0, -2.0, -2.0, -2.0]
OLD = [-1.0, -0.7, -1.2, -0.3, -2.0, -0.9, -1.1]
LOSS_IDX = [1, 2, 3, 5, 6]
KINDS = ["ppo_clip", "reinforce", "cispo", "gspo"]


def loss_config(**fields) -> LossConfig:
    """The [loss] variant its `kind` names (ppo_clip unless told), as a config file gives it."""
    return TypeAdapter(LossConfig).validate_python({"kind": "ppo_clip", **fields})


def t(xs, dtype=torch.float64):
    return torch.tensor(xs, dtype=dtype)


def make_inputs(ratios=RATIOS, adv=ADV, old=OLD, mask=MASK, cu=CU, **kw) -> LossInputs:
    lp = t([o + math.log(r) for o, r in zip(old, ratios)]).requires_grad_(True)
    return LossInputs(
        logprobs_N=lp,
        old_logprobs_N=t(old),
        advantages_N=t(adv),
        loss_mask_N=torch.tensor(mask),
        cu_seqlens=torch.tensor(cu, dtype=torch.int32),
        **kw,
    )


def grad_of(loss, inp):
    (g,) = torch.autograd.grad(loss, inp.logprobs_N)
    return g.tolist()


# ------------------------------------------------------------------ ppo_clip and normalizations


def test_ppo_clip_token_normalization_value_and_grads():
    inp = make_inputs()
    loss, m = policy_loss(inp, PpoClipLossConfig(normalization="token"))
    assert loss.item() == pytest.approx(1.82 / 5)
    # d(-r*A)/d lp = -r*A per unclipped token, / 5 loss tokens; clipped tokens and masked ones: 0
    expected = [0.0, -1.0 * 1 / 5, 0.0, -0.5 * 1 / 5, 0.0, 0.0, -1.5 * -2 / 5]
    assert grad_of(loss, inp) == pytest.approx(expected)
    assert m["clip_frac_low"].item() == pytest.approx(1 / 5)
    assert m["clip_frac_high"].item() == pytest.approx(1 / 5)
    assert m["clip_frac"].item() == pytest.approx(2 / 5)
    assert m["clip_frac_seq"].item() == 1.0  # A2 clips seq A, B1 clips seq B: both sequences
    assert m["ratio_mean"].item() == pytest.approx((1.0 + 1.5 + 0.5 + 0.5 + 1.5) / 5)
    assert m["loss_tokens"].item() == 5
    assert all(not v.requires_grad and v.dim() == 0 for v in m.values())


def test_the_three_normalizations_differ_on_the_same_data():
    values = {}
    for norm in ("token", "sequence", "constant"):
        loss, _ = policy_loss(make_inputs(), PpoClipLossConfig(normalization=norm, max_completion_tokens=4))
        values[norm] = loss.item()
    assert values["token"] == pytest.approx(1.82 / 5)  # 0.364
    seq_a = (-1 - 1.28 - 0.5) / 3
    seq_b = (1.6 + 3) / 2
    assert values["sequence"] == pytest.approx((seq_a + seq_b) / 2)  # 0.68667
    assert values["constant"] == pytest.approx(1.82 / (2 * 4))  # 0.2275
    assert len({round(v, 6) for v in values.values()}) == 3


def test_clip_high_boundary_uses_eps_high_not_eps_low():
    # ratio 1.25 with A>0: clipped under symmetric eps 0.2, not under clip-higher eps_high 0.28
    inp = make_inputs(ratios=[1.25] * 7, adv=[1.0] * 7)
    loss, m = policy_loss(inp, PpoClipLossConfig(eps_low=0.2, eps_high=0.28))
    assert loss.item() == pytest.approx(-1.25)
    assert m["clip_frac_high"].item() == 0.0
    inp = make_inputs(ratios=[1.25] * 7, adv=[1.0] * 7)
    loss, m = policy_loss(inp, PpoClipLossConfig(eps_low=0.2, eps_high=0.2))
    assert loss.item() == pytest.approx(-1.2)
    assert m["clip_frac_high"].item() == 1.0
    assert grad_of(loss, inp) == pytest.approx([0.0] * 7)


@pytest.mark.parametrize(
    "norm, denoms",
    [
        # per loss token: seq A has 3 loss tokens, seq B 2; S = 2 sequences; constant M = 10
        ("token", [5, 5, 5, 5, 5]),
        ("sequence", [3 * 2, 3 * 2, 3 * 2, 2 * 2, 2 * 2]),
        ("constant", [2 * 10] * 5),
    ],
)
def test_ppo_grad_at_ratio_one_is_minus_advantage_over_denominator(norm, denoms):
    adv = [0.0, 0.5, -1.0, 2.0, 0.0, -3.0, 1.5]
    inp = make_inputs(ratios=[1.0] * 7, adv=adv)
    loss, _ = policy_loss(inp, PpoClipLossConfig(normalization=norm, max_completion_tokens=10))
    expected = [0.0] * 7
    for i, d in zip(LOSS_IDX, denoms):
        expected[i] = -adv[i] / d
    assert grad_of(loss, inp) == pytest.approx(expected)


# ------------------------------------------------------------------ reinforce


def test_reinforce_value_and_grads():
    inp = make_inputs()
    loss, m = policy_loss(inp, ReinforceLossConfig(normalization="token"))
    lp = [OLD[i] + math.log(RATIOS[i]) for i in range(7)]
    expected_loss = sum(-ADV[i] * lp[i] for i in LOSS_IDX) / 5
    assert loss.item() == pytest.approx(expected_loss)
    expected_grad = [0.0] * 7
    for i in LOSS_IDX:
        expected_grad[i] = -ADV[i] / 5
    assert grad_of(loss, inp) == pytest.approx(expected_grad)
    assert "clip_frac" not in m


# ------------------------------------------------------------------ truncated importance sampling

# exp(old - inference) per loss token: 0.5, 3.0, 1.0, 2.5, 1.0; with cap 2 -> 0.5, 2, 1, 2, 1
RAW_W = {1: 0.5, 2: 3.0, 3: 1.0, 5: 2.5, 6: 1.0}
CAPPED_W = {1: 0.5, 2: 2.0, 3: 1.0, 5: 2.0, 6: 1.0}


def tis_inputs():
    inference = list(OLD)
    for i, w in RAW_W.items():
        inference[i] = OLD[i] - math.log(w)
    return make_inputs(ratios=[1.0] * 7, inference_logprobs_N=t(inference))


@pytest.mark.parametrize("kind", ["ppo_clip", "reinforce"])
def test_tis_weights_are_capped_and_scale_the_policy_gradient(kind):
    inp = tis_inputs()
    loss, m = policy_loss(inp, loss_config(kind=kind, tis_cap=2.0))
    # per-token gradient of both kinds at ratio 1 is -A * w / 5
    expected_grad = [0.0] * 7
    for i in LOSS_IDX:
        expected_grad[i] = -ADV[i] * CAPPED_W[i] / 5
    assert grad_of(loss, inp) == pytest.approx(expected_grad)
    if kind == "ppo_clip":  # objective r*A = A at r = 1: loss = sum(-A w)/5 = (-0.5 - 2 - 1 + 4 + 2)/5
        assert loss.item() == pytest.approx(2.5 / 5)
    assert m["tis_weight_mean"].item() == pytest.approx((0.5 + 2 + 1 + 2 + 1) / 5)
    assert m["tis_frac_truncated"].item() == pytest.approx(2 / 5)
    # mismatch: logprobs == old here, so |lp - inference| = |log raw_w|
    assert m["mismatch_abs"].item() == pytest.approx(sum(abs(math.log(w)) for w in RAW_W.values()) / 5)
    # k3 of KL(mu || pi): r - log r - 1 with r = pi/mu = raw_w
    assert m["mismatch_kl"].item() == pytest.approx(sum(w - math.log(w) - 1 for w in RAW_W.values()) / 5)


def test_inference_logprobs_without_cap_only_adds_metrics():
    plain, _ = policy_loss(make_inputs(ratios=[1.0] * 7), PpoClipLossConfig())
    with_inf, m = policy_loss(tis_inputs(), PpoClipLossConfig())
    assert with_inf.item() == pytest.approx(plain.item())
    assert "mismatch_abs" in m and "tis_weight_mean" not in m


def test_tis_cap_without_inference_logprobs_is_a_user_error():
    with pytest.raises(ValueError, match="inference_logprobs_N"):
        policy_loss(make_inputs(), PpoClipLossConfig(tis_cap=2.0))


# ------------------------------------------------------------------ KL and entropy


def test_kl_k3_value_and_gradient_sign():
    # A = 0, so only the KL term remains. d = ref - lp per loss token:
    d = {1: math.log(2.0), 2: -math.log(2.0), 3: 0.0, 5: math.log(2.0), 6: -math.log(2.0)}
    ref = list(OLD)
    for i, di in d.items():
        ref[i] = OLD[i] + di
    inp = make_inputs(ratios=[1.0] * 7, adv=[0.0] * 7, ref_logprobs_N=t(ref))
    loss, m = policy_loss(inp, PpoClipLossConfig(kl_coef=0.1))
    # k3 = e^d - d - 1: d=ln2 -> 2 - ln2 - 1 = 0.30685; d=-ln2 -> 0.5 + ln2 - 1 = 0.19315
    k3 = {i: math.exp(di) - di - 1 for i, di in d.items()}
    assert k3[1] == pytest.approx(0.306853, abs=1e-6) and k3[2] == pytest.approx(0.193147, abs=1e-6)
    assert m["kl"].item() == pytest.approx(sum(k3.values()) / 5)
    assert loss.item() == pytest.approx(0.1 * sum(k3.values()) / 5)
    g = grad_of(loss, inp)
    for i, di in d.items():  # d k3 / d lp = 1 - e^d
        assert g[i] == pytest.approx(0.1 * (1 - math.exp(di)) / 5)
    # descent moves lp toward ref: below ref (d>0) -> negative grad; above ref (d<0) -> positive
    assert g[1] < 0 and g[5] < 0 and g[2] > 0 and g[6] > 0 and g[3] == 0


# d = ref - lp on the loss tokens 1, 2, 3, 5, 6 (A = 0: only the KL term remains), and each
# estimator's per-token value and its derivative w.r.t. lp, computed by hand:
#   k1 = -d:             -0.5, 1.0, 0, -2.0, 0.25                      d/dlp: 1 everywhere
#   k2 = d^2 / 2:         0.125, 0.5, 0, 2.0, 0.03125                  d/dlp: -d
#   k3 = e^d - d - 1:     e^0.5 - 1.5 = 0.1487212707, e^-1 = 0.3678794412, 0,
#                         e^2 - 3 = 4.3890560989, e^-0.25 - 0.75 = 0.0288007831
#                                                                      d/dlp: 1 - e^d
KL_D = {1: 0.5, 2: -1.0, 3: 0.0, 5: 2.0, 6: -0.25}
KL_BY_HAND = {
    "k1": ([-0.5, 1.0, 0.0, -2.0, 0.25], [1.0, 1.0, 1.0, 1.0, 1.0]),
    "k2": ([0.125, 0.5, 0.0, 2.0, 0.03125], [-0.5, 1.0, 0.0, -2.0, 0.25]),
    "k3": ([0.1487212707, 0.3678794412, 0.0, 4.3890560989, 0.0288007831],
           [1 - 1.6487212707, 1 - 0.3678794412, 0.0, 1 - 7.3890560989, 1 - 0.7788007831]),
}


@pytest.mark.parametrize("estimator", list(KL_BY_HAND))
def test_each_kl_estimator_by_hand(estimator):
    values, slopes = KL_BY_HAND[estimator]
    ref = list(OLD)
    for i, di in KL_D.items():
        ref[i] = OLD[i] + di
    inp = make_inputs(ratios=[1.0] * 7, adv=[0.0] * 7, ref_logprobs_N=t(ref))
    loss, m = policy_loss(inp, PpoClipLossConfig(kl_coef=0.1, kl_estimator=estimator))
    assert m["kl"].item() == pytest.approx(sum(values) / 5, abs=1e-9)  # the metric: the estimator's mean
    assert loss.item() == pytest.approx(0.1 * sum(values) / 5, abs=1e-9)  # token normalization: / 5
    g = grad_of(loss, inp)
    assert [g[i] for i in KL_D] == pytest.approx([0.1 * s / 5 for s in slopes], abs=1e-9)
    assert g[0] == g[4] == 0.0  # the prompt tokens


def test_kl_estimators_on_average_over_a_vocabulary():
    """What each estimator's value and gradient are on average over tokens sampled from pi,
    summed exactly over a 6-token vocabulary (weights pi, detached): k1 and k3 values are
    unbiased for KL(pi || ref), k2's is not; as loss terms, k1's gradient averages to 0, k2's
    is the gradient of KL(pi || ref), k3's the gradient of KL(ref || pi)."""
    from saccade.trainer.loss import KL_ESTIMATORS

    gen = torch.Generator().manual_seed(0)
    theta = torch.randn(6, generator=gen, dtype=torch.float64).requires_grad_(True)
    ref_V = torch.log_softmax(torch.randn(6, generator=gen, dtype=torch.float64), 0)
    lp_V = torch.log_softmax(theta, 0)
    pi_V = lp_V.exp().detach()

    def grad(scalar):
        (g,) = torch.autograd.grad(scalar, theta, retain_graph=True)
        return g

    kl_pi_ref = (lp_V.exp() * (lp_V - ref_V)).sum()
    kl_ref_pi = (ref_V.exp() * (ref_V - lp_V)).sum()
    average = {name: (pi_V * k(lp_V, ref_V)).sum() for name, k in KL_ESTIMATORS.items()}
    assert average["k1"].item() == pytest.approx(kl_pi_ref.item(), rel=1e-12)
    assert average["k3"].item() == pytest.approx(kl_pi_ref.item(), rel=1e-12)
    assert abs(average["k2"].item() - kl_pi_ref.item()) > 1e-3  # biased
    assert torch.allclose(grad(average["k1"]), torch.zeros(6, dtype=torch.float64), atol=1e-15)
    assert torch.allclose(grad(average["k2"]), grad(kl_pi_ref), rtol=1e-12, atol=1e-15)
    assert torch.allclose(grad(average["k3"]), grad(kl_ref_pi), rtol=1e-12, atol=1e-15)
    assert not torch.allclose(grad(kl_pi_ref), grad(kl_ref_pi), atol=1e-3)  # the two KLs' gradients differ


def test_kl_metric_without_coef_does_not_change_the_loss():
    ref = [o + math.log(r) + 0.3 for o, r in zip(OLD, RATIOS)]  # ref - lp = 0.3 everywhere
    base, _ = policy_loss(make_inputs(), PpoClipLossConfig())
    loss, m = policy_loss(make_inputs(ref_logprobs_N=t(ref)), PpoClipLossConfig(kl_coef=0.0))
    assert loss.item() == pytest.approx(base.item())
    assert m["kl"].item() == pytest.approx(math.exp(0.3) - 0.3 - 1)


def test_entropy_bonus_is_subtracted():
    ent = t([9.0, 1.0, 2.0, 3.0, 9.0, 0.5, 1.5]).requires_grad_(True)
    inp = make_inputs(ratios=[1.0] * 7, adv=[0.0] * 7, entropy_N=ent)
    loss, m = policy_loss(inp, PpoClipLossConfig(entropy_coef=0.01))
    mean_ent = (1.0 + 2.0 + 3.0 + 0.5 + 1.5) / 5  # masked 9.0s excluded
    assert m["entropy"].item() == pytest.approx(mean_ent)
    assert loss.item() == pytest.approx(-0.01 * mean_ent)
    (g,) = torch.autograd.grad(loss, ent)
    assert g.tolist() == pytest.approx([0.0, -0.002, -0.002, -0.002, 0.0, -0.002, -0.002])


def test_missing_ref_or_entropy_for_nonzero_coef_is_a_user_error():
    with pytest.raises(ValueError, match="ref_logprobs_N"):
        policy_loss(make_inputs(), PpoClipLossConfig(kl_coef=0.1))
    with pytest.raises(ValueError, match="entropy_N"):
        policy_loss(make_inputs(), PpoClipLossConfig(entropy_coef=0.1))


# ------------------------------------------------------------------ masking


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("norm", ["token", "sequence", "constant"])
def test_masked_tokens_with_garbage_contribute_zero_and_finite_grads(kind, norm):
    cfg = loss_config(kind=kind, normalization=norm, tis_cap=2.0, is_mask="on", kl_coef=0.1, entropy_coef=0.01)
    inference = [o - 0.1 for o in OLD]
    ref = [o + 0.2 for o in OLD]
    clean = make_inputs(entropy_N=t([1.0] * 7), inference_logprobs_N=t(inference), ref_logprobs_N=t(ref))
    ref_loss, ref_m = policy_loss(clean, cfg)
    ref_grad = grad_of(ref_loss, clean)

    def spoil(xs, a, b):  # garbage at the two masked positions, 0 and 4
        return t([a, *xs[1:4], b, *xs[5:]])

    nan, inf = float("nan"), float("inf")
    garbage = LossInputs(
        logprobs_N=spoil(clean.logprobs_N.tolist(), nan, -inf).requires_grad_(True),
        old_logprobs_N=spoil(OLD, inf, nan),
        advantages_N=spoil(ADV, nan, inf),
        loss_mask_N=torch.tensor(MASK),
        cu_seqlens=torch.tensor(CU, dtype=torch.int32),
        inference_logprobs_N=spoil(inference, nan, -inf),
        ref_logprobs_N=spoil(ref, -inf, nan),
        entropy_N=spoil([1.0] * 7, nan, inf),
    )
    loss, m = policy_loss(garbage, cfg)
    assert loss.item() == pytest.approx(ref_loss.item())
    g = grad_of(loss, garbage)
    assert all(math.isfinite(x) for x in g)
    assert g[0] == 0.0 and g[4] == 0.0
    assert g == pytest.approx(ref_grad)
    for k, v in ref_m.items():
        assert m[k].item() == pytest.approx(v.item()), k


def test_no_loss_tokens_gives_zero_loss_not_nan():
    inp = make_inputs(mask=[False] * 7)
    for norm in ("token", "sequence", "constant"):
        loss, m = policy_loss(inp, PpoClipLossConfig(normalization=norm))
        assert loss.item() == 0.0
        assert grad_of(loss, inp) == [0.0] * 7
        assert all(math.isfinite(v.item()) for v in m.values())


# ------------------------------------------------------------------ gradient accumulation


def _three_sequence_batch():
    # seq 0: 4 tokens (3 loss), seq 1: 3 tokens (2 loss), seq 2: 5 tokens (4 loss)
    mask = [False, True, True, True, False, True, True, False, True, True, True, True]
    cu = [0, 4, 7, 12]
    old = [-1.0, -0.7, -1.2, -0.3, -2.0, -0.9, -1.1, -0.5, -0.4, -2.2, -1.3, -0.8]
    lp = [-1.0, -0.5, -1.5, -0.2, -2.0, -1.0, -0.6, -0.5, -0.6, -2.0, -1.0, -1.1]
    adv = [1.0] * 4 + [-0.5] * 3 + [2.0] * 5
    inference = [o - 0.05 * (i % 3) for i, o in enumerate(old)]
    ref = [o + 0.1 * ((i % 2) - 0.5) for i, o in enumerate(old)]
    ent = [0.3 + 0.1 * i for i in range(12)]
    return mask, cu, old, lp, adv, inference, ref, ent


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("norm", ["token", "sequence", "constant"])
def test_grad_accumulation_with_totals_equals_the_whole_batch(kind, norm):
    mask, cu, old, lp, adv, inference, ref, ent = _three_sequence_batch()
    # pi_old / mu is 1, e^0.05 or e^0.1: TIS truncates the second, the mask drops the third
    cfg = loss_config(kind=kind, normalization=norm, max_completion_tokens=8, tis_cap=1.05, is_mask="on",
                      is_mask_high=1.08, kl_coef=0.1, entropy_coef=0.01)

    def inputs(lp_N, sl, cu_local, **totals):
        return LossInputs(
            logprobs_N=lp_N,
            old_logprobs_N=t(old[sl]),
            advantages_N=t(adv[sl]),
            loss_mask_N=torch.tensor(mask[sl]),
            cu_seqlens=torch.tensor(cu_local, dtype=torch.int32),
            inference_logprobs_N=t(inference[sl]),
            ref_logprobs_N=t(ref[sl]),
            entropy_N=t(ent[sl]),
            **totals,
        )

    lp_full = t(lp).requires_grad_(True)
    whole, _ = policy_loss(inputs(lp_full, slice(0, 12), cu), cfg)
    (g_whole,) = torch.autograd.grad(whole, lp_full)

    lp_acc = t(lp).requires_grad_(True)
    totals = dict(total_loss_tokens=9.0, total_sequences=3.0)  # 3 + 2 + 4 loss tokens; 3 sequences
    mb1, _ = policy_loss(inputs(lp_acc[:7], slice(0, 7), [0, 4, 7], **totals), cfg)
    mb2, _ = policy_loss(inputs(lp_acc[7:], slice(7, 12), [0, 5], **totals), cfg)
    (g_acc,) = torch.autograd.grad(mb1 + mb2, lp_acc)

    assert (mb1 + mb2).item() == pytest.approx(whole.item(), rel=1e-12, abs=1e-12)
    assert g_acc.tolist() == pytest.approx(g_whole.tolist(), rel=1e-12, abs=1e-12)

    # without the overrides each micro-batch normalizes by its own counts: not the same loss
    nb1, _ = policy_loss(inputs(t(lp[:7]), slice(0, 7), [0, 4, 7]), cfg)
    nb2, _ = policy_loss(inputs(t(lp[7:]), slice(7, 12), [0, 5]), cfg)
    assert (nb1 + nb2).item() != pytest.approx(whole.item())


# ------------------------------------------------------------------ helpers and validation


def test_helpers_by_hand():
    x = t([5.0, 1.0, 2.0, 3.0, float("nan"), 4.0, 6.0])
    mask = torch.tensor(MASK)
    assert masked_mean(x, mask).item() == pytest.approx((1 + 2 + 3 + 4 + 6) / 5)
    assert per_sequence_mean(x, mask, torch.tensor(CU, dtype=torch.int32)).tolist() == pytest.approx([2.0, 5.0])
    # an empty sequence (cu repeats) gets 0
    assert per_sequence_mean(x, mask, torch.tensor([0, 4, 4, 7])).tolist() == pytest.approx([2.0, 0.0, 5.0])


def test_float32_inputs_stay_float32():
    inp = make_inputs()
    inp.logprobs_N = inp.logprobs_N.detach().float().requires_grad_(True)
    loss, _ = policy_loss(inp, PpoClipLossConfig())
    assert loss.dtype == torch.float32
    assert loss.item() == pytest.approx(1.82 / 5, rel=1e-5)


@pytest.mark.parametrize(
    "kw, match",
    [
        (dict(cu=[0, 4, 6]), "cu_seqlens"),
        (dict(cu=[1, 4, 7]), "cu_seqlens"),
        (dict(cu=[0, 5, 4, 7]), "cu_seqlens"),
        (dict(total_loss_tokens=0.0), "total_loss_tokens"),
        (dict(total_sequences=-1.0), "total_sequences"),
        (dict(ref_logprobs_N=t([0.0] * 6)), "ref_logprobs_N"),
    ],
)
def test_bad_inputs_are_value_errors(kw, match):
    with pytest.raises(ValueError, match=match):
        policy_loss(make_inputs(**kw), PpoClipLossConfig())


def test_non_bool_mask_is_a_value_error():
    inp = make_inputs()
    inp.loss_mask_N = inp.loss_mask_N.float()
    with pytest.raises(ValueError, match="bool"):
        policy_loss(inp, PpoClipLossConfig())


@pytest.mark.parametrize(
    "kw",
    [
        dict(kind="ppo"),
        dict(normalization="mean"),
        dict(is_mask="yes"),
        dict(is_mask_low=1.0),
        dict(is_mask_high=1.0),
        dict(kind="cispo", eps_low=1.5),
        dict(kind="gspo", eps_low=1.0),
        dict(eps_low=1.0),
        dict(eps_high=-0.1),
        dict(max_completion_tokens=0),
        dict(tis_cap=0.0),
        dict(kl_coef=-1.0),
        dict(kl_estimator="k4"),
        dict(entropy_coef=-1.0),
    ],
)
def test_bad_config_is_a_value_error(kw):
    with pytest.raises(ValueError):
        loss_config(**kw)
