"""GRPO-family policy losses as pure functions over flat, packed per-token tensors.

Everything here works on one packed micro-batch: tensors of shape (N,) (suffix ``_N``) with
``cu_seqlens`` (S+1,) marking where each of the S samples starts and ends. Only tokens with
``loss_mask`` True enter the loss; the others contribute exactly 0 to the loss and to every
gradient, even if their logprobs are NaN or -inf (prompt tokens, image pads, padding).

Which logprobs are which
------------------------
- ``logprobs_N``: log pi_theta(token), the policy being trained, recomputed by the trainer
  in this forward pass. The only input that carries gradient (besides ``entropy_N``).
- ``old_logprobs_N``: the policy the importance ratio ``exp(logprobs - old_logprobs)`` is
  taken against, detached. Either the inference engine's logprobs (the behaviour policy that
  actually sampled the tokens), or the trainer's own recomputation at the start of the step
  (pi_theta_old as the trainer sees it). The caller decides.
- ``inference_logprobs_N``: the engine's logprobs of the sampled tokens (mu). Needed for
  truncated and masked importance sampling and for the train/inference mismatch metrics.
- ``ref_logprobs_N``: the frozen reference policy (the start weights: `saccade.trainer.reference`),
  for the KL penalty, estimated per token by ``kl_estimator`` (k1, k2, k3; below).

The policy-gradient term, per `LossConfig.kind` (each a pure function below, whose docstring
names its paper, equation and the peers' setting it matches): ``ppo_clip`` (`ppo_clip_objective`),
``reinforce`` (-A * logprobs), ``cispo`` (`cispo_objective`: the clipped ratio as a detached
weight, every token keeping its gradient) and ``gspo`` (`gspo_objective`: one ratio per
sequence, clipped per sequence, in the per-token "GSPO-token" form so that packing and the
normalizations below apply unchanged; a sequence is a sample, whole in one micro-batch).

Two corrections for rollouts that the trainer's policy did not sample, on every kind, applied to
the policy-gradient term only (not to the KL and entropy regularisers, as in verl), by the
engine-versus-trainer ratio ``w = pi_old / mu``, detached:
- Truncated importance sampling (TIS; Yao et al. 2025, "Your efficient RL framework secretly
  brings you off-policy RL training"; `tis_weight`), when ``tis_cap`` is set: the engine (mu)
  and the trainer (pi_old) disagree a little about the same weights, so the tokens sampled by mu
  are reweighted by ``min(w, tis_cap)`` with ``w = exp(old_logprobs - inference_logprobs)``. It
  only makes sense when ``old_logprobs`` are the trainer's own; if they are the engine's, w == 1.
  For REINFORCE, pass the trainer's detached logprobs of the current weights as
  ``old_logprobs`` to get w = pi/mu.
- Masked importance sampling (`is_mask_keep`; IcePop, Ring-1T, arXiv 2510.18855), when
  ``is_mask == "on"``: a token whose w leaves ``[is_mask_low, is_mask_high]`` gets weight 0, and
  TIS, when on, truncates the tokens it kept. Its trainer side is ``old_logprobs`` when TIS is
  on (they are the trainer's then); otherwise ``old_logprobs`` are taken to be the engine's,
  the ratio the objective clips stays pi / mu (its trust region reaches back to the policy that
  sampled), and the mask takes this forward's logprobs, detached: pi_old itself at a batch's
  first optimizer step, and at later ones the policy as the update has moved it.
`saccade.config.effective_loss` resolves a run's ``tis`` and ``is_mask`` ('auto': on when rollouts
can come from older weights); here ``is_mask`` "auto" is off, like ``tis_cap`` unset.

Normalization (the denominator that turns the sum of per-token losses into one scalar)
-------------------------------------------------------------------------------------
- ``"sequence"`` (GRPO): mean over each sequence's loss tokens, then mean over sequences.
  A sequence without loss tokens contributes 0 but still counts as a sequence.
- ``"token"`` (DAPO / BNPO): sum over all loss tokens / number of loss tokens.
- ``"constant"`` (Dr. GRPO): sum over all loss tokens / (num_sequences * max_completion_tokens).

For gradient accumulation, ``LossInputs.total_loss_tokens`` / ``total_sequences`` replace the
micro-batch's own counts with the whole step's, so that the sum of the micro-batch losses
equals the loss of the whole batch (exactly, for all three normalizations).

Metrics are detached 0-dim tensors, averaged over the micro-batch's loss tokens (no device
sync; the train step sums them weighted by each micro-batch's loss tokens): ``clip_frac_low``
and ``clip_frac_high`` (ppo_clip: ratio < 1 - eps_low with A < 0, ratio > 1 + eps_high with
A > 0, where the clip is active and the token gets no gradient; gspo: the same of the token's
sequence ratio, so a sequence's tokens are clipped all or none and the figure weighs
sequences by their loss tokens; cispo: the weight was clipped below or above, whatever A, and
the token keeps its gradient), ``clip_frac`` (their sum), ``clip_frac_seq`` (the share of the
micro-batch's sequences with a clipped loss token: a mean over sequences, which the train step
weighs by sequences, not tokens; gspo: the sequences clipped), ``seq_log_ratio_abs`` (gspo: mean
|log s_i|, the spread of the sequence ratios, sequences weighted by their loss tokens),
``ratio_mean``, ``kl`` (the ``kl_estimator``'s mean, when ref given), ``entropy`` (when
given), ``is_masked_frac`` (masked IS on: the share of loss tokens masked),
``tis_weight_mean`` (over the tokens kept) and ``tis_frac_truncated`` (share of the loss
tokens) when TIS is on, ``mismatch_abs`` (mean |logprobs - inference_logprobs|) and
``mismatch_kl`` (k3 estimate of KL(mu || pi)) when inference logprobs are given, and
``loss_tokens`` (count in this micro-batch).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

from saccade.config import (
    CispoLossConfig, GspoLossConfig, LossConfig, PpoClipLossConfig, ReinforceLossConfig,
)


@dataclass
class LossInputs:
    logprobs_N: Tensor  # current policy logprobs (requires grad)
    old_logprobs_N: Tensor  # the ratio's denominator policy (engine's or trainer's old), detached
    advantages_N: Tensor  # each token carries its sample's advantage
    loss_mask_N: Tensor  # bool
    cu_seqlens: Tensor  # (S+1,) sample boundaries in the packed row
    inference_logprobs_N: Tensor | None = None  # the engine's logprobs: TIS, masked IS, mismatch metrics
    ref_logprobs_N: Tensor | None = None  # the reference policy's logprobs: KL
    entropy_N: Tensor | None = None  # per-token entropy of the current policy
    total_loss_tokens: float | None = None  # "token": loss tokens over the whole step's batch
    total_sequences: float | None = None  # "sequence"/"constant": sequences over the whole step


# ---------------------------------------------------------------------------------------------
# Small pure helpers
# ---------------------------------------------------------------------------------------------


def masked_sum(x_N: Tensor, mask_N: Tensor) -> Tensor:
    """Sum of x over mask; masked-out entries contribute exactly 0 (even NaN/inf)."""
    return torch.where(mask_N, x_N, torch.zeros_like(x_N)).sum()


def masked_mean(x_N: Tensor, mask_N: Tensor) -> Tensor:
    """Mean of x over mask (0 when the mask is empty)."""
    return masked_sum(x_N, mask_N) / mask_N.sum().clamp(min=1)


def sequence_ids(cu_seqlens: Tensor, n: int) -> Tensor:
    """(N,) index of the sequence each token belongs to, from (S+1,) boundaries (no device sync)."""
    positions_N = torch.arange(n, device=cu_seqlens.device, dtype=cu_seqlens.dtype)
    return torch.searchsorted(cu_seqlens[1:].contiguous(), positions_N, right=True)


def per_sequence_sum(x_N: Tensor, mask_N: Tensor, cu_seqlens: Tensor) -> Tensor:
    """(S,) sum of x over each sequence's masked tokens."""
    S = cu_seqlens.shape[0] - 1
    seq_N = sequence_ids(cu_seqlens, x_N.shape[0]).to(x_N.device)
    x_N = torch.where(mask_N, x_N, torch.zeros_like(x_N))
    return torch.zeros(S, dtype=x_N.dtype, device=x_N.device).index_add(0, seq_N, x_N)


def per_sequence_mean(x_N: Tensor, mask_N: Tensor, cu_seqlens: Tensor) -> Tensor:
    """(S,) mean of x over each sequence's masked tokens (0 for a sequence with none)."""
    sums_S = per_sequence_sum(x_N, mask_N, cu_seqlens)
    counts_S = per_sequence_sum(mask_N.to(sums_S.dtype), mask_N, cu_seqlens)
    return sums_S / counts_S.clamp(min=1)


# Per-token estimators of KL(pi || ref) on tokens sampled from pi (Schulman, "Approximating KL
# divergence", 2020), with d = log ref - log pi. Their values and the gradients they give as a
# loss term differ; on average over tokens sampled from pi (tests/trainer/test_loss.py checks
# each over a whole vocabulary):
#   k1 = -d               value: unbiased, high variance, negative on some tokens.
#                         gradient: grad log pi, which averages to 0: it regularises nothing.
#   k2 = d^2 / 2          value: biased (close for a small KL), low variance, >= 0.
#                         gradient: -d grad log pi, on average the gradient of KL(pi || ref).
#   k3 = e^d - d - 1      value: unbiased, low variance, >= 0.
#                         gradient: (1 - e^d) grad log pi, on average the gradient of KL(ref || pi).


def k1_kl(logprobs_N: Tensor, ref_logprobs_N: Tensor) -> Tensor:
    """Per-token k1 estimator of KL(pi || ref): log pi - log ref. Its gradient w.r.t. lp is 1."""
    return logprobs_N - ref_logprobs_N


def k2_kl(logprobs_N: Tensor, ref_logprobs_N: Tensor) -> Tensor:
    """Per-token k2 estimator of KL(pi || ref): (log pi - log ref)^2 / 2. Always >= 0; its
    gradient w.r.t. lp is lp - ref, which pushes lp toward ref."""
    return 0.5 * (logprobs_N - ref_logprobs_N) ** 2


def k3_kl(logprobs_N: Tensor, ref_logprobs_N: Tensor) -> Tensor:
    """Per-token k3 estimator of KL(pi || ref) on tokens sampled from pi: exp(d) - d - 1, d = ref - lp.

    Always >= 0; its gradient w.r.t. lp is 1 - exp(ref - lp), which pushes lp toward ref.
    """
    d_N = ref_logprobs_N - logprobs_N
    return torch.exp(d_N) - d_N - 1.0


KL_ESTIMATORS = {"k1": k1_kl, "k2": k2_kl, "k3": k3_kl}  # `LossConfig.kl_estimator` names one


# ---------------------------------------------------------------------------------------------
# The policy-gradient terms and the off-policy corrections, one pure function each. A term
# returns the per-token loss (N,) and where its clip acted below and above (bool (N,)).
# ---------------------------------------------------------------------------------------------


def ppo_clip_objective(ratio_N: Tensor, adv_N: Tensor, eps_low: float,
                       eps_high: float) -> tuple[Tensor, Tensor, Tensor]:
    """The clipped PPO surrogate (Schulman et al. 2017, arXiv 1707.06347, eq. 7), per token
    -min(r A, clip(r, 1 - eps_low, 1 + eps_high) A) with r = pi / pi_old; DAPO's clip-higher
    (arXiv 2503.14476) when eps_high > eps_low. Where the clip is active (r < 1 - eps_low with
    A < 0, r > 1 + eps_high with A > 0) the token gets no gradient. Matches verl's
    loss_mode "vanilla" (clip_ratio_low, clip_ratio_high) and TRL's loss_type "grpo"/"dapo"
    (epsilon, epsilon_high)."""
    clipped_N = ratio_N.clamp(1.0 - eps_low, 1.0 + eps_high)
    pg_N = -torch.minimum(ratio_N * adv_N, clipped_N * adv_N)
    r_N = ratio_N.detach()
    return pg_N, (r_N < 1.0 - eps_low) & (adv_N < 0), (r_N > 1.0 + eps_high) & (adv_N > 0)


def cispo_objective(logprobs_N: Tensor, ratio_N: Tensor, adv_N: Tensor, eps_low: float,
                    eps_high: float) -> tuple[Tensor, Tensor, Tensor]:
    """CISPO (MiniMax-M1, arXiv 2506.13585, the J_CISPO objective), per token
    -sg(r_hat) A log pi with r_hat = clip(r, 1 - eps_low, 1 + eps_high), r = pi / pi_old.

    The weight is detached, so the gradient is -r_hat A grad log pi on *every* token: the clip
    bounds a token's weight and never takes its gradient (PPO's clip does, on the tokens it
    clips). The loss value, -r_hat A log pi, is not the surrogate's value. Matches verl's
    loss_mode "cispo" (clip_ratio_low = 10: no lower bound, clip_ratio_high) and TRL's loss_type
    "cispo" (its epsilon_high is the cap 1 + eps_high, with no lower bound)."""
    r_N = ratio_N.detach()
    w_N = r_N.clamp(1.0 - eps_low, 1.0 + eps_high)
    return -w_N * adv_N * logprobs_N, r_N < 1.0 - eps_low, r_N > 1.0 + eps_high


def gspo_objective(logprobs_N: Tensor, old_logprobs_N: Tensor, adv_N: Tensor, mask_N: Tensor, cu_seqlens: Tensor,
                   eps_low: float, eps_high: float) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """GSPO (Qwen, arXiv 2507.18071) in the paper's GSPO-token form: sequence i's ratio
    s_i = exp(mean over its loss tokens of (log pi - log pi_old)), and per token
    s_i,t = sg(s_i) * pi_t / sg(pi_t) in -min(s_i,t A, clip(s_i,t, 1 - eps_low, 1 + eps_high) A).

    s_i,t's value is s_i, so the clip acts on whole sequences (all of a sequence's tokens or
    none, with its advantage A_i); its gradient is s_i grad log pi_t. Under 'sequence'
    normalization the loss is the paper's J_GSPO and its gradient s_i A_i / |y_i| sum_t
    grad log pi_t per sequence. The fourth output is each token's log s_i (detached), for the
    metrics. Matches verl's loss_mode "gspo" (clip_ratio_low = 3e-4, clip_ratio_high = 4e-4,
    loss_agg_mode "seq-mean-token-mean") and TRL's importance_sampling_level "sequence" with
    loss_type "grpo" (epsilon = 3e-4, epsilon_high = 4e-4)."""
    log_s_S = per_sequence_mean((logprobs_N - old_logprobs_N).detach(), mask_N, cu_seqlens)
    log_s_N = log_s_S[sequence_ids(cu_seqlens, logprobs_N.shape[0]).to(log_s_S.device)]
    s_N = torch.exp(log_s_N + (logprobs_N - logprobs_N.detach()))  # value s_i; gradient s_i * grad log pi_t
    pg_N, low_N, high_N = ppo_clip_objective(s_N, adv_N, eps_low, eps_high)
    return pg_N, low_N, high_N, log_s_N


def clipped_sequences_frac(clipped_N: Tensor, mask_N: Tensor, cu_seqlens: Tensor) -> Tensor:
    """The share of the micro-batch's sequences with at least one loss token clipped (gspo: the
    sequences clipped, whose tokens are clipped all or none). A mean over sequences, not tokens: the
    train step weighs it by each micro-batch's sequences (`saccade.trainer.step.ClippedObjective`)."""
    any_S = per_sequence_sum(clipped_N.to(torch.float32), mask_N, cu_seqlens) > 0
    return any_S.to(torch.float32).mean()


def is_mask_keep(old_logprobs_N: Tensor, inference_logprobs_N: Tensor, low: float, high: float) -> Tensor:
    """Masked importance sampling (IcePop, Ring-1T, arXiv 2510.18855, its mask M(k) over k =
    pi_old / mu): True where low <= pi_old / mu <= high, the tokens that keep their policy
    gradient; the others get weight 0, not truncated. IcePop's M(k) is k inside the band: that
    is this mask and TIS together (`tis_weight`), as TRL's vllm_importance_sampling_mode =
    "token_mask" (clip_min, clip_max) is. The mask alone matches verl's rollout_correction
    rollout_rs = "token_k1" with rollout_rs_threshold = "0.5_2.0", and prime-rl's
    token_mask_low / token_mask_high (0.125, 8 there)."""
    w_N = torch.exp(old_logprobs_N - inference_logprobs_N)
    return (w_N >= low) & (w_N <= high)


def tis_weight(old_logprobs_N: Tensor, inference_logprobs_N: Tensor, cap: float) -> tuple[Tensor, Tensor]:
    """Truncated importance sampling (Yao et al. 2025, "Your efficient RL framework secretly
    brings you off-policy RL training"): the weight min(pi_old / mu, cap), and the raw pi_old /
    mu. Matches verl's rollout_is = "token" with rollout_is_threshold (2.0) and TRL's
    vllm_importance_sampling_mode = "token_truncate" (vllm_importance_sampling_clip_max)."""
    raw_w_N = torch.exp(old_logprobs_N - inference_logprobs_N)
    return raw_w_N.clamp(max=cap), raw_w_N


# ---------------------------------------------------------------------------------------------
# The loss
# ---------------------------------------------------------------------------------------------


def _check_inputs(inp: LossInputs, cfg: LossConfig) -> None:
    mask = inp.loss_mask_N
    if mask.dim() != 1:
        raise ValueError(f"loss_mask_N must be 1-D (N,), got shape {tuple(mask.shape)}")
    if mask.dtype != torch.bool:
        raise ValueError(f"loss_mask_N must be bool, got {mask.dtype}")
    N = mask.shape[0]
    named = {
        "logprobs_N": inp.logprobs_N,
        "old_logprobs_N": inp.old_logprobs_N,
        "advantages_N": inp.advantages_N,
        "inference_logprobs_N": inp.inference_logprobs_N,
        "ref_logprobs_N": inp.ref_logprobs_N,
        "entropy_N": inp.entropy_N,
    }
    for name, t in named.items():
        if t is not None and tuple(t.shape) != (N,):
            raise ValueError(f"{name} must have shape ({N},) like loss_mask_N, got {tuple(t.shape)}")
    cu = inp.cu_seqlens
    if cu.dim() != 1 or cu.shape[0] < 2:
        raise ValueError(f"cu_seqlens must be 1-D (S+1,) with S >= 1, got shape {tuple(cu.shape)}")
    bounds = cu.tolist()  # S+1 small ints: one cheap sync, worth it against silent misattribution
    if bounds[0] != 0 or bounds[-1] != N or any(b > a for a, b in zip(bounds[1:], bounds[:-1])):
        raise ValueError(f"cu_seqlens must rise from 0 to N={N}, got {bounds}")
    if cfg.tis_cap is not None and inp.inference_logprobs_N is None:
        raise ValueError("tis_cap is set but inference_logprobs_N was not given")
    if cfg.is_mask == "on" and inp.inference_logprobs_N is None:
        raise ValueError("is_mask is 'on' but inference_logprobs_N was not given")
    if cfg.kl_coef > 0 and inp.ref_logprobs_N is None:
        raise ValueError("kl_coef > 0 but ref_logprobs_N was not given")
    if cfg.entropy_coef > 0 and inp.entropy_N is None:
        raise ValueError("entropy_coef > 0 but entropy_N was not given")
    if inp.total_loss_tokens is not None and not inp.total_loss_tokens > 0:
        raise ValueError(f"total_loss_tokens must be > 0, got {inp.total_loss_tokens}")
    if inp.total_sequences is not None and not inp.total_sequences > 0:
        raise ValueError(f"total_sequences must be > 0, got {inp.total_sequences}")


def policy_loss(inp: LossInputs, cfg: LossConfig) -> tuple[Tensor, dict[str, Tensor]]:
    """The scalar loss of one micro-batch and its metrics (detached 0-dim tensors).

    Per loss token t of sequence i, with ratio_t = exp(logprobs_t - old_logprobs_t), A_t the
    advantage and sg() a stopped gradient:
      ppo_clip:  pg_t = -min(ratio_t * A_t, clip(ratio_t, 1 - eps_low, 1 + eps_high) * A_t)
      reinforce: pg_t = -A_t * logprobs_t
      cispo:     pg_t = -sg(clip(ratio_t, 1 - eps_low, 1 + eps_high)) * A_t * logprobs_t
      gspo:      pg_t = -min(s_it * A_t, clip(s_it, 1 - eps_low, 1 + eps_high) * A_t), with
                 s_i = exp(mean of logprobs - old_logprobs over i's loss tokens) and
                 s_it = sg(s_i) * exp(logprobs_t - sg(logprobs_t))
      loss_t = m_t * w_t * pg_t + kl_coef * kl_t - entropy_coef * entropy_t
    with, r_t = exp(old_t - inference_t): w_t = min(r_t, tis_cap) when tis_cap is set, else 1;
    m_t = [is_mask_low <= r_t <= is_mask_high] when is_mask is "on", else 1, with lp_t in place
    of old_t when tis_cap is unset (old_t are the engine's then); both detached; kl_t the
    `kl_estimator`'s, with d_t = ref_t - lp_t: k1 -d_t, k2 d_t^2 / 2, k3 exp(d_t) - d_t - 1 (the
    default). The loss is the normalized sum of loss_t (see the module docstring). Computed in
    float32 (float64 if logprobs are float64).
    """
    _check_inputs(inp, cfg)
    mask_N = inp.loss_mask_N
    dtype = torch.promote_types(inp.logprobs_N.dtype, torch.float32)

    def clean(t: Tensor | None) -> Tensor | None:
        # Zero the masked-out entries *before* any arithmetic: torch.where's backward sends 0
        # (not 0 * NaN) to the unselected branch, so garbage there can reach neither the loss
        # nor the gradient. Multiplying by the mask instead would give NaN * 0 = NaN.
        if t is None:
            return None
        t = t.to(dtype)
        return torch.where(mask_N, t, torch.zeros_like(t))

    lp_N = clean(inp.logprobs_N)
    old_N = clean(inp.old_logprobs_N).detach()
    adv_N = clean(inp.advantages_N).detach()
    inf_N = clean(inp.inference_logprobs_N)
    ref_N = clean(inp.ref_logprobs_N)
    ent_N = clean(inp.entropy_N)
    if inf_N is not None:
        inf_N = inf_N.detach()
    if ref_N is not None:
        ref_N = ref_N.detach()

    metrics: dict[str, Tensor] = {}
    ratio_N = torch.exp(lp_N - old_N)
    metrics["ratio_mean"] = masked_mean(ratio_N.detach(), mask_N)

    if isinstance(cfg, ReinforceLossConfig):
        pg_N, low_N, high_N = -adv_N * lp_N, None, None
    elif isinstance(cfg, PpoClipLossConfig):
        pg_N, low_N, high_N = ppo_clip_objective(ratio_N, adv_N, cfg.eps_low, cfg.eps_high)
    elif isinstance(cfg, CispoLossConfig):
        pg_N, low_N, high_N = cispo_objective(lp_N, ratio_N, adv_N, cfg.eps_low, cfg.eps_high)
    else:
        assert isinstance(cfg, GspoLossConfig), cfg.kind
        pg_N, low_N, high_N, log_s_N = gspo_objective(lp_N, old_N, adv_N, mask_N, inp.cu_seqlens,
                                                      cfg.eps_low, cfg.eps_high)
        metrics["seq_log_ratio_abs"] = masked_mean(log_s_N.abs(), mask_N)
    if low_N is not None and high_N is not None:
        metrics["clip_frac_low"] = masked_mean(low_N.to(dtype), mask_N)
        metrics["clip_frac_high"] = masked_mean(high_N.to(dtype), mask_N)
        metrics["clip_frac"] = masked_mean((low_N | high_N).to(dtype), mask_N)
        metrics["clip_frac_seq"] = clipped_sequences_frac(low_N | high_N, mask_N, inp.cu_seqlens)

    if inf_N is not None:
        metrics["mismatch_abs"] = masked_mean((lp_N.detach() - inf_N).abs(), mask_N)
        metrics["mismatch_kl"] = masked_mean(k3_kl(inf_N, lp_N.detach()), mask_N)  # KL(mu || pi), mu sampled
    kept_N = mask_N
    if cfg.is_mask == "on":  # first the mask, then TIS truncates what it kept
        assert inf_N is not None
        trainer_N = old_N if cfg.tis_cap is not None else lp_N.detach()  # pi_old (see the module docstring)
        keep_N = is_mask_keep(trainer_N, inf_N, cfg.is_mask_low, cfg.is_mask_high)
        pg_N = torch.where(keep_N, pg_N, torch.zeros_like(pg_N))
        kept_N = mask_N & keep_N
        metrics["is_masked_frac"] = masked_mean((~keep_N).to(dtype), mask_N)
    if cfg.tis_cap is not None:
        assert inf_N is not None
        w_N, raw_w_N = tis_weight(old_N, inf_N, cfg.tis_cap)
        pg_N = pg_N * w_N
        metrics["tis_weight_mean"] = masked_mean(w_N, kept_N)
        metrics["tis_frac_truncated"] = masked_mean((kept_N & (raw_w_N > cfg.tis_cap)).to(dtype), mask_N)

    loss_N = pg_N
    if ref_N is not None:
        kl_N = KL_ESTIMATORS[cfg.kl_estimator](lp_N, ref_N)
        metrics["kl"] = masked_mean(kl_N.detach(), mask_N)
        if cfg.kl_coef > 0:
            loss_N = loss_N + cfg.kl_coef * kl_N
    if ent_N is not None:
        metrics["entropy"] = masked_mean(ent_N.detach(), mask_N)
        if cfg.entropy_coef > 0:
            loss_N = loss_N - cfg.entropy_coef * ent_N

    n_seq = inp.total_sequences if inp.total_sequences is not None else inp.cu_seqlens.shape[0] - 1
    if cfg.normalization == "sequence":
        loss = per_sequence_mean(loss_N, mask_N, inp.cu_seqlens).sum() / n_seq
    elif cfg.normalization == "token":
        n_tok = inp.total_loss_tokens if inp.total_loss_tokens is not None else mask_N.sum().clamp(min=1)
        loss = masked_sum(loss_N, mask_N) / n_tok
    else:
        assert cfg.normalization == "constant", cfg.normalization
        loss = masked_sum(loss_N, mask_N) / (n_seq * cfg.max_completion_tokens)

    metrics["loss_tokens"] = mask_N.sum().to(dtype)
    return loss, {k: v.detach() for k, v in metrics.items()}
