"""The objectives against off-policy collapse (`saccade.trainer.loss`): GSPO's sequence ratio,
CISPO's detached clipped weight and masked importance sampling, by hand on two sequences; then
GSPO's and CISPO's gradients on the tiny model against finite differences.

The batch by hand: 2 packed sequences, each with one masked prompt token first.
  seq A: tokens 0..3, loss tokens 1,2,3, advantage +1
  seq B: tokens 4..6, loss tokens 5,6,   advantage -2
"""

from __future__ import annotations

import math

import pytest
import torch

from saccade.config import CispoLossConfig, GspoLossConfig, PpoClipLossConfig, ReinforceLossConfig
from saccade.trainer.loss import LossInputs, policy_loss

MASK = [False, True, True, True, False, True, True]
CU = [0, 4, 7]
ADV = [1.0, 1.0, 1.0, 1.0, -2.0, -2.0, -2.0]
OLD = [-1.0, -0.7, -1.2, -0.3, -2.0, -0.9, -1.1]
LOSS_IDX = [1, 2, 3, 5, 6]


def t(xs, dtype=torch.float64):
    return torch.tensor(xs, dtype=dtype)


def inputs(log_ratios, **kw) -> LossInputs:
    """logprobs = OLD + log ratio per token (0 where not given)."""
    lp = t([o + log_ratios.get(i, 0.0) for i, o in enumerate(OLD)]).requires_grad_(True)
    return LossInputs(logprobs_N=lp, old_logprobs_N=t(OLD), advantages_N=t(ADV), loss_mask_N=torch.tensor(MASK),
                      cu_seqlens=torch.tensor(CU, dtype=torch.int32), **kw)


def grad_of(loss, inp):
    (g,) = torch.autograd.grad(loss, inp.logprobs_N)
    return g.tolist()


# ------------------------------------------------------------------ GSPO

# log(pi / pi_old) per loss token: seq A 0.3, -0.1, 0.1 (mean 0.1: s_A = e^0.1 = 1.105171),
# seq B 0.02, -0.04 (mean -0.01: s_B = e^-0.01 = 0.990050). With eps 0.05 the band is [0.95, 1.05]:
#   seq A: s_A > 1.05 with A > 0: clipped, every token at -min(1.105171, 1.05) = -1.05, no gradient
#          (a token ratio would have clipped tokens 1 and 3 only: e^0.3 = 1.35, e^0.1 = 1.105;
#          token 2's e^-0.1 = 0.905 is inside)
#   seq B: inside: every token at -(s_B * -2) = 1.980100, gradient -A s_B = 1.980100 per token
#          over the denominator (token ratios would give 2 * e^0.02 and 2 * e^-0.04)
GSPO_LOG_RATIOS = {1: 0.3, 2: -0.1, 3: 0.1, 5: 0.02, 6: -0.04}
S_B = 0.9900498337491681  # e^-0.01


@pytest.mark.parametrize("norm, loss_value, grad_b", [
    # 'sequence' (GSPO's own): (mean of A's -1.05 + mean of B's 1.980100) / 2 sequences; B's
    # gradient 2 s_B / (2 tokens * 2 sequences)
    ("sequence", (-1.05 + 2 * S_B) / 2, 2 * S_B / 4),
    # 'token': (3 * -1.05 + 2 * 1.980100) / 5 loss tokens; B's gradient 2 s_B / 5
    ("token", (3 * -1.05 + 2 * 2 * S_B) / 5, 2 * S_B / 5),
])
def test_gspo_clips_the_sequence_ratio_by_hand(norm, loss_value, grad_b):
    inp = inputs(GSPO_LOG_RATIOS)
    loss, m = policy_loss(inp, GspoLossConfig(eps_low=0.05, eps_high=0.05, normalization=norm))
    assert loss.item() == pytest.approx(loss_value, rel=1e-12)  # 0.465050 and 0.162040
    assert grad_of(loss, inp) == pytest.approx([0.0, 0.0, 0.0, 0.0, 0.0, grad_b, grad_b], abs=1e-12)
    assert m["clip_frac_high"].item() == pytest.approx(3 / 5)  # seq A's three tokens
    assert m["clip_frac_low"].item() == 0.0 and m["clip_frac"].item() == pytest.approx(3 / 5)
    assert m["clip_frac_seq"].item() == pytest.approx(1 / 2)  # seq A of A and B: sequences, not tokens
    assert m["seq_log_ratio_abs"].item() == pytest.approx((3 * 0.1 + 2 * 0.01) / 5)  # 0.064
    token_ratios = [math.exp(GSPO_LOG_RATIOS[i]) for i in LOSS_IDX]
    assert m["ratio_mean"].item() == pytest.approx(sum(token_ratios) / 5)  # the tokens' ratios, as ever
    # The token-level clip on the same data: other tokens clipped, other gradients.
    ppo, _ = policy_loss(inputs(GSPO_LOG_RATIOS), PpoClipLossConfig(eps_low=0.05, eps_high=0.05, normalization=norm))
    assert ppo.item() != pytest.approx(loss_value)


def test_gspo_below_the_band_clips_only_a_negative_advantage():
    # both sequences at s = e^-0.1 = 0.904837 < 0.95: B (A < 0) is clipped, A (A > 0) is not
    inp = inputs({i: -0.1 for i in LOSS_IDX})
    loss, m = policy_loss(inp, GspoLossConfig(eps_low=0.05, eps_high=0.05, normalization="token"))
    s = math.exp(-0.1)
    assert loss.item() == pytest.approx((3 * -s + 2 * 2 * 0.95) / 5)
    assert grad_of(loss, inp) == pytest.approx([0.0, -s / 5, -s / 5, -s / 5, 0.0, 0.0, 0.0])
    assert m["clip_frac_low"].item() == pytest.approx(2 / 5) and m["clip_frac_high"].item() == 0.0


def test_gspo_defaults_are_the_papers():
    cfg = GspoLossConfig()
    assert (cfg.eps_low, cfg.eps_high, cfg.normalization) == (3e-4, 4e-4, "sequence")


# ------------------------------------------------------------------ CISPO

# Token ratios 1.0, 1.5, 0.5 (seq A, A = +1) and 0.5, 1.5 (seq B, A = -2). With eps_low 0.2 and
# eps_high 0.28 the weights are clip(r, 0.8, 1.28) = 1.0, 1.28, 0.8 | 0.8, 1.28, detached: every
# token's gradient is -w A over 5 loss tokens (token normalization): -0.2, -0.256, -0.16 | 0.32,
# 0.512. PPO's clip on the same data gives tokens 2 and 5 no gradient at all.
CISPO_LOG_RATIOS = {2: math.log(1.5), 3: math.log(0.5), 5: math.log(0.5), 6: math.log(1.5)}


def test_cispo_gradient_is_the_clipped_detached_weight_times_the_advantage_by_hand():
    inp = inputs(CISPO_LOG_RATIOS)
    loss, m = policy_loss(inp, CispoLossConfig(eps_low=0.2, eps_high=0.28))
    assert grad_of(loss, inp) == pytest.approx([0.0, -0.2, -0.256, -0.16, 0.0, 0.32, 0.512], abs=1e-12)
    # The value: sum of -w A logprob / 5, logprob = old + log r = -0.7, -0.794535, -0.993147 |
    # -1.593147, -0.694535: (0.7 + 1.017005 + 0.794518 - 2.549035 - 1.778010) / 5
    assert loss.item() == pytest.approx(-0.3631044812139012, rel=1e-12)
    assert m["clip_frac_low"].item() == pytest.approx(2 / 5)  # the 0.5s, whatever A's sign
    assert m["clip_frac_high"].item() == pytest.approx(2 / 5)  # the 1.5s
    assert m["clip_frac"].item() == pytest.approx(4 / 5)
    assert m["clip_frac_seq"].item() == 1.0  # a clipped weight in each sequence
    clipped = inputs(CISPO_LOG_RATIOS)
    ppo, _ = policy_loss(clipped, PpoClipLossConfig(eps_low=0.2, eps_high=0.28))
    g = grad_of(ppo, clipped)
    assert (g[2], g[5]) == (0.0, 0.0)


def test_cispo_by_default_has_no_lower_bound():
    inp = inputs(CISPO_LOG_RATIOS)
    cfg = CispoLossConfig()
    assert (cfg.eps_low, cfg.eps_high) == (1.0, 4.0)  # weights clipped to [0, 5]: none here
    loss, m = policy_loss(inp, cfg)
    assert grad_of(loss, inp) == pytest.approx([0.0, -0.2, -0.3, -0.1, 0.0, 0.2, 0.6], abs=1e-12)
    assert m["clip_frac"].item() == 0.0 and m["clip_frac_seq"].item() == 0.0


# ------------------------------------------------------------------ masked importance sampling

# pi_old / mu per loss token (logprobs == old: ratio 1, so every kind's gradient is -A w):
# 0.4, 3.0, 1.0 | 1.5, 0.55. The band [0.5, 2.0] masks tokens 1 (0.4) and 2 (3.0).
RAW_W = {1: 0.4, 2: 3.0, 3: 1.0, 5: 1.5, 6: 0.55}


def masked_is_inputs(**kw):
    inference = [o - math.log(RAW_W.get(i, 1.0)) for i, o in enumerate(OLD)]
    return inputs({}, inference_logprobs_N=t(inference), **kw)


@pytest.mark.parametrize("cfg", [PpoClipLossConfig(is_mask="on"), ReinforceLossConfig(is_mask="on"),
                                 CispoLossConfig(is_mask="on"), GspoLossConfig(is_mask="on", normalization="token")],
                         ids=lambda c: c.kind)
def test_masked_is_drops_the_tokens_outside_the_band_by_hand(cfg):
    inp = masked_is_inputs()
    loss, m = policy_loss(inp, cfg)
    # kept: tokens 3 (A = 1), 5 and 6 (A = -2): gradient -A / 5; the masked ones get none
    assert grad_of(loss, inp) == pytest.approx([0.0, 0.0, 0.0, -0.2, 0.0, 0.4, 0.4], abs=1e-12)
    assert m["is_masked_frac"].item() == pytest.approx(2 / 5)
    if cfg.kind == "ppo_clip":  # -A r over the kept tokens: (-1 + 2 + 2) / 5
        assert loss.item() == pytest.approx(3 / 5)


def test_without_tis_the_mask_reads_this_forwards_logprobs_and_the_ratio_stays_the_engines():
    """old_logprobs are the engine's (the train step's without TIS): the clipped ratio is pi / mu
    and the mask is taken on it too. pi / mu per loss token: 0.4, 3.0, 1.0 | 1.5, 0.55."""
    log_r = {i: math.log(w) for i, w in RAW_W.items()}
    inp = inputs(log_r, inference_logprobs_N=t(OLD))
    loss, m = policy_loss(inp, PpoClipLossConfig(is_mask="on"))
    # masked: 1 and 2. Kept: 3 (r 1, A 1: -1/5); 5 (r 1.5, A -2: min(-3, -2.56), unclipped:
    # -A r / 5 = 0.6); 6 (r 0.55, A -2: min(-1.1, -1.6), clipped below: no gradient)
    assert grad_of(loss, inp) == pytest.approx([0.0, 0.0, 0.0, -0.2, 0.0, 0.6, 0.0], abs=1e-12)
    assert m["is_masked_frac"].item() == pytest.approx(2 / 5)
    assert m["clip_frac_low"].item() == pytest.approx(1 / 5)  # token 6, against the engine


def test_masked_is_then_tis_truncates_what_the_mask_kept():
    inp = masked_is_inputs()
    loss, m = policy_loss(inp, PpoClipLossConfig(is_mask="on", tis_cap=1.2))
    # kept tokens weighted by min(w, 1.2): 1.0, 1.2, 0.55; token 2 (3.0) is masked, not truncated
    assert grad_of(loss, inp) == pytest.approx([0.0, 0.0, 0.0, -0.2, 0.0, 2 * 1.2 / 5, 2 * 0.55 / 5], abs=1e-12)
    assert m["tis_frac_truncated"].item() == pytest.approx(1 / 5)  # token 5 only
    assert m["tis_weight_mean"].item() == pytest.approx((1.0 + 1.2 + 0.55) / 3)  # over the kept tokens
    # TIS alone truncates token 2 to 1.2 and gives token 1 its 0.4
    alone = masked_is_inputs()
    loss, _ = policy_loss(alone, PpoClipLossConfig(tis_cap=1.2))
    assert grad_of(loss, alone) == pytest.approx([0.0, -0.4 / 5, -1.2 / 5, -0.2, 0.0, 2 * 1.2 / 5, 2 * 0.55 / 5])


def test_masked_tokens_keep_their_kl_term():
    ref = [o + 0.5 for o in OLD]  # d = ref - lp = 0.5 on every token: k3 slope 1 - e^0.5
    inp = masked_is_inputs(ref_logprobs_N=t(ref))
    loss, _ = policy_loss(inp, PpoClipLossConfig(is_mask="on", kl_coef=0.1))
    kl = 0.1 * (1 - math.exp(0.5)) / 5
    assert grad_of(loss, inp) == pytest.approx([0.0, kl, kl, -0.2 + kl, 0.0, 0.4 + kl, 0.4 + kl], abs=1e-12)


def test_masked_is_is_on_only_when_on():
    """`policy_loss` reads 'on' only: a run's 'auto' is resolved by `effective_loss`."""
    for mode in ("auto", "off"):
        loss, m = policy_loss(masked_is_inputs(), PpoClipLossConfig(is_mask=mode))
        assert "is_masked_frac" not in m and loss.item() == pytest.approx((-3 + 4) / 5)
    with pytest.raises(ValueError, match="is_mask is 'on' but inference_logprobs_N"):
        policy_loss(inputs({}), PpoClipLossConfig(is_mask="on"))


# ------------------------------------------------------------------ finite differences on the tiny model

# Directional derivatives of the loss along a random direction of the weights (unit norm), by
# central differences. Two directions: the final norm's weight, whose path to the loss (the tied
# lm_head, the logprobs, the loss) computes in float64, and every weight, whose path crosses the
# decoder's RMSNorms, which round to float32 inside (transformers' norms do so on purpose).
# Measured 2026-11-28, directions of seeds 100-103, GSPO and CISPO alike, relative gap to
# autograd: at most 1.6e-9 along the norm (h = 1e-4; 6e-10 for seed 100, used here) and 1.1e-4
# along every weight (h = 1e-2; 5e-5 for seed 100; smaller steps are worse there, float32
# rounding over 2h: 7e-3 at h = 1e-5). Tolerances: 1e-7 and 1e-3, some 60x and 9x the worst.
FD_CASES = {"norm": (1e-4, 1e-7), "all": (1e-2, 1e-3)}  # (h, tolerance)
SEEDS = (100,)  # one direction per case: each costs three forwards and a backward of the model


@pytest.fixture(scope="module")
def tiny64(tiny_path):
    """The tiny model in float64, full fine-tuning, and one packed micro-batch of three text-only
    samples (prompts of 6, 4, 5 tokens, completions of 5, 5, 4; advantages 1, -1, 0.5), with its
    logprobs at the start."""
    from saccade.models.lm import load_policy_lm, set_full_finetune
    from saccade.trainer.forward import forward_logprobs
    from saccade.trainer.packing import pack
    from saccade.trainer.samples import make_sample

    model = set_full_finetune(load_policy_lm(tiny_path)).double()
    gen = torch.Generator().manual_seed(0)
    samples = []
    for i, (prompt, completion, advantage) in enumerate([(6, 5, 1.0), (4, 5, -1.0), (5, 4, 0.5)]):
        n = prompt + completion
        loss_mask = torch.cat([torch.zeros(prompt, dtype=torch.bool), torch.ones(completion, dtype=torch.bool)])
        samples.append(make_sample(f"s{i}", torch.randint(10, 200, (n,), generator=gen),
                                   torch.zeros(n, dtype=torch.long), None, [], positions=model.positions,
                                   loss_mask=loss_mask, advantage=advantage))
    (mb,) = pack(samples, lambda key: None, max_tokens=64, image_token_id=model.image_token_id, spatial_merge_size=2)

    def logprobs():
        return forward_logprobs(model, mb, only_loss_tokens=True)[0]

    with torch.no_grad():
        lp0 = logprobs()
    assert lp0.dtype == torch.float64
    return model, mb, logprobs, lp0


def fd_errors(model, f, case: str, seed: int) -> tuple[float, float]:
    """(autograd's directional derivative of f, its relative gap to the central difference)."""
    params = [p for p in model.parameters() if p.requires_grad]
    final_norm = dict(model.named_parameters())["model.language_model.norm.weight"]
    gen = torch.Generator().manual_seed(seed)
    direction = [torch.randn(p.shape, generator=gen, dtype=torch.float64)
                 if case == "all" or p is final_norm else torch.zeros_like(p) for p in params]
    norm = math.sqrt(sum(float((v * v).sum()) for v in direction))
    direction = [v / norm for v in direction]
    model.zero_grad()
    f().backward()
    analytic = sum(float((p.grad * v).sum()) for p, v in zip(params, direction))
    h = FD_CASES[case][0]
    with torch.no_grad():
        for p, v in zip(params, direction):
            p.add_(h * v)
        plus = f().item()
        for p, v in zip(params, direction):
            p.sub_(2 * h * v)
        minus = f().item()
        for p, v in zip(params, direction):
            p.add_(h * v)
    numeric = (plus - minus) / (2 * h)
    return analytic, abs(numeric - analytic) / abs(analytic)


def with_log_ratios(mb, lp0, per_sample):
    """old_logprobs = lp0 - d, d given per sample (its loss tokens' log pi / pi_old)."""
    d = torch.zeros_like(lp0)
    for k, values in enumerate(per_sample):
        lo, hi = int(mb.cu_seqlens[k]), int(mb.cu_seqlens[k + 1])
        rows = torch.arange(lo, hi)[mb.loss_mask[lo:hi]]
        d[rows] = torch.tensor(values[: len(rows)], dtype=torch.float64)
    return lp0 - d, d


@pytest.mark.parametrize("case", list(FD_CASES))
def test_gspo_gradient_matches_finite_differences_on_the_tiny_model(tiny64, case):
    """GSPO-token's value is the sequence-level objective J(theta) and its gradient J's: the
    stop-gradients leave s_i's own dependence on theta to pi_t / sg(pi_t). Sequence ratios
    e^0.02 and e^0.01 inside the band, and e^-0.2 below it with A < 0 (clipped: no gradient)."""
    model, mb, logprobs, lp0 = tiny64
    old, _ = with_log_ratios(mb, lp0, [[0.12, -0.08, 0.07, -0.03, 0.02], [-0.1, -0.3, -0.15, -0.25, -0.2],
                                       [0.06, -0.04, 0.0, 0.02]])
    cfg = GspoLossConfig(eps_low=0.05, eps_high=0.05)
    adv, mask, cu = mb.advantages.double(), mb.loss_mask, mb.cu_seqlens

    def loss():
        return policy_loss(LossInputs(logprobs(), old, adv, mask, cu), cfg)[0]

    # The value is J's, computed apart: (1/S) sum_i -min(s_i A_i, clip(s_i) A_i)
    with torch.no_grad():
        lp = logprobs()
        J = 0.0
        for k in range(3):
            lo, hi = int(cu[k]), int(cu[k + 1])
            rows = torch.arange(lo, hi)[mask[lo:hi]]
            s, a = math.exp(float((lp[rows] - old[rows]).mean())), float(adv[lo])
            J += -min(s * a, min(max(s, 0.95), 1.05) * a) / 3
        assert loss().item() == pytest.approx(J, rel=1e-12)
    for seed in SEEDS:
        analytic, gap = fd_errors(model, loss, case, seed)
        assert abs(analytic) > 1e-4 and gap < FD_CASES[case][1], (seed, analytic, gap)


@pytest.mark.parametrize("case", list(FD_CASES))
def test_cispo_gradient_matches_finite_differences_on_the_tiny_model(tiny64, case):
    """CISPO's gradient is that of sum_t -w_t A_t log pi_t / N with w_t = clip(pi_t / pi_old_t)
    held at its value: token ratios e^0.5 (clipped to 1.28), e^-0.5 (to 0.8) and three inside.
    Its own value's difference quotient is not its gradient (the weight's stop-gradient)."""
    model, mb, logprobs, lp0 = tiny64
    old, d = with_log_ratios(mb, lp0, [[0.5, -0.5, 0.1, 0.0, -0.1]] * 3)
    cfg = CispoLossConfig(eps_low=0.2, eps_high=0.28)
    adv, mask, cu = mb.advantages.double(), mb.loss_mask, mb.cu_seqlens
    w = torch.exp(d).clamp(0.8, 1.28)

    def loss():
        return policy_loss(LossInputs(logprobs(), old, adv, mask, cu), cfg)[0]

    def held_weight():
        return torch.where(mask, -w * adv * logprobs(), torch.zeros_like(lp0)).sum() / mask.sum()

    for seed in SEEDS:
        analytic, own_gap = fd_errors(model, loss, case, seed)
        held, gap = fd_errors(model, held_weight, case, seed)
        assert analytic == pytest.approx(held, rel=1e-12)  # the same gradient, taken two ways
        assert abs(analytic) > 1e-4 and gap < FD_CASES[case][1], (seed, analytic, gap)
        assert own_gap > 0.1, own_gap  # the loss value's own difference quotient is another thing
