"""Per-token log-probabilities and entropies without materializing the logits.

Why: an RL loss needs, for every sampled token, log p(target) and the entropy of the
next-token distribution. The obvious route, ``log_softmax(hidden @ lm_head.T)``, builds an
(N x V) float32 logits tensor, and autograd keeps it (plus the softmax) alive until backward.
With Qwen-sized vocabularies (V = 151,936) a 16k-token batch costs 16k x 152k x 4 B ~ 10 GB
for the logits alone, more than the rest of the step.

How: a custom ``torch.autograd.Function`` walks the tokens in chunks of ``chunk_size``.
Forward computes each chunk's logits in float32, reduces them to three numbers per token
(logsumexp, target logprob, entropy) and throws the chunk away; it saves only its inputs and
the per-token logsumexp (and the entropy, N floats) for backward. Backward recomputes each
chunk's logits (one extra matmul; cheap next to holding 10 GB) and turns them straight into
the gradient w.r.t. the logits, which it immediately pushes through the lm_head matmul.
Peak extra memory is therefore a few (chunk_size x V) float32 buffers instead of (N x V).

Gradients, with z the (temperature-scaled) logits of one token, p = softmax(z),
lse = logsumexp(z), log p = z - lse and H = -sum_j p_j log p_j:

    d logprob / d z_k = onehot_k - p_k
    d H       / d z_k = -p_k (z_k - sum_j p_j z_j) = -p_k (log p_k + H)

so for upstream gradients g_lp and g_H the gradient w.r.t. the logits is

    d L / d z_k = g_lp * onehot_k - p_k * (g_lp + g_H * (log p_k + H))

and the chain rule through ``z = (hidden @ weight.T + bias) / temperature`` divides by the
temperature.

Truncation (top_k, top_p, min_p; ``saccade.models.sampling``): the engine samples from, and
reports the logprob under, softmax(z) renormalised over a kept set K. Here K is recomputed per
token from the trainer's own z, by the engine's rule (``kept_tokens``), and the sampled target is
always added to it: where the two sets differ (a token at the set's boundary, whose logit differs
in the last bits, or a token sampled by older weights) the logprob stays finite, and the gap
shows in the mismatch metric instead of an infinite ratio. Masked tokens get z = -inf, so p = 0:
the formulas above hold over K with the sums over K (the set is piecewise constant in z, so no
gradient flows through its choice), and the entropy is that of the truncated distribution. The
set is recomputed in backward from the same chunk logits, so it is the forward's. With no
truncation none of this runs: the numerics are those of the plain softmax, bit for bit.

Numerics (``saccade.models.head``): the logits are the lm_head's products of the model-dtype
hidden state and weight, summed in float32, and everything after them (softmax, logprob,
entropy, their gradients) is float32 (float64 if an input is float64, so that ``gradcheck``
works): bf16 logits have ~3 significant digits, far too coarse for the policy/reference
log-ratios RL depends on. On CUDA the matmuls run on bf16 tensor cores with float32 output, and
no float32 copy of the weight is made; on the CPU a bf16 weight is upcast once per forward and
once per backward (the same numbers: bf16 products are exact in float32). In backward the
logits' gradient enters the two matmuls rounded to the model's dtype, as autograd of a bf16
layer would round it. Autocast is disabled inside, so calling this under ``torch.autocast``
does not change any of it. TF32 is off (``saccade.models.head.use_full_fp32_matmuls``).
"""

from __future__ import annotations

import contextlib
from typing import Any

import torch
from torch.autograd.function import once_differentiable

from saccade.models.head import accumulate_project_, matmul_weight, project
from saccade.models.sampling import SampledDistribution, kept_tokens

PLAIN = SampledDistribution()  # temperature 1, nothing truncated

__all__ = ["token_logprobs_and_entropy", "token_logprobs_and_entropy_reference"]


def token_logprobs_and_entropy(
    hidden_NH: torch.Tensor,
    weight_VH: torch.Tensor,
    targets_N: torch.Tensor,
    *,
    distribution: SampledDistribution = PLAIN,
    chunk_size: int = 1024,
    bias_V: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Log p(target) and next-token entropy per token, chunked over tokens.

    Args:
        hidden_NH: (N, H) final hidden states (after the final norm).
        weight_VH: (V, H) lm_head weight; gets a gradient only if it requires one.
        targets_N: (N,) integer token ids whose log-probability is wanted.
        distribution: the temperature the logits are divided by and the truncation (top_k,
            top_p, min_p) of the softmax: the distribution the inference engine sampled from.
        chunk_size: tokens per chunk; extra memory is a few (chunk_size x V) float32 buffers.
        bias_V: optional (V,) lm_head bias.

    Returns:
        ``(logprobs_N, entropy_N)``, float32 (float64 if an input is float64).
    """
    _check_inputs(hidden_NH, weight_VH, targets_N, bias_V, chunk_size)
    return _ChunkedLogprobsEntropy.apply(
        hidden_NH, weight_VH, targets_N.long(), bias_V, distribution, int(chunk_size)
    )


def token_logprobs_and_entropy_reference(
    hidden_NH: torch.Tensor,
    weight_VH: torch.Tensor,
    targets_N: torch.Tensor,
    *,
    distribution: SampledDistribution = PLAIN,
    chunk_size: int | None = None,
    bias_V: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Same contract as :func:`token_logprobs_and_entropy`, via full (N x V) logits.

    Plain autograd, for tests and benchmarks only. ``chunk_size`` is accepted and ignored so
    the two functions are interchangeable.
    """
    del chunk_size
    _check_inputs(hidden_NH, weight_VH, targets_N, bias_V, 1)
    compute_dtype = _compute_dtype(hidden_NH, weight_VH)
    logits_NV = hidden_NH.to(compute_dtype) @ weight_VH.to(compute_dtype).T
    if bias_V is not None:
        logits_NV = logits_NV + bias_V.to(compute_dtype)
    logits_NV = logits_NV / distribution.temperature
    if distribution.truncates:
        kept_NV = _kept_with_targets(logits_NV.detach(), targets_N.long(), distribution)
        logits_NV = logits_NV.masked_fill(~kept_NV, float("-inf"))
    logp_NV = torch.log_softmax(logits_NV, dim=-1)
    logprobs_N = logp_NV.gather(1, targets_N.long()[:, None]).squeeze(1)
    if distribution.truncates:
        # p log p = 0 where p = 0; masked_fill (not where) so no 0 * inf reaches the gradient.
        logp_NV = logp_NV.masked_fill(~kept_NV, 0.0)
    entropy_N = -(logp_NV.exp() * logp_NV).sum(dim=-1)
    return logprobs_N, entropy_N


class _ChunkedLogprobsEntropy(torch.autograd.Function):
    """Autograd node: chunked forward, logits recomputed chunk by chunk in backward."""

    @staticmethod
    def forward(
        ctx: Any,
        hidden_NH: torch.Tensor,
        weight_VH: torch.Tensor,
        targets_N: torch.Tensor,
        bias_V: torch.Tensor | None,
        distribution: SampledDistribution,
        chunk_size: int,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        num_tokens = hidden_NH.shape[0]
        compute_dtype = _compute_dtype(hidden_NH, weight_VH)
        out_kwargs = {"dtype": compute_dtype, "device": hidden_NH.device}
        logprobs_N = torch.empty(num_tokens, **out_kwargs)
        entropy_N = torch.empty(num_tokens, **out_kwargs)
        lse_N = torch.empty(num_tokens, **out_kwargs)

        operand_dtype = torch.promote_types(hidden_NH.dtype, weight_VH.dtype)
        with _no_autocast(hidden_NH.device):
            weight_mm_VH = matmul_weight(weight_VH)  # once per forward, never per chunk
            bias_cd_V = None if bias_V is None else bias_V.to(compute_dtype)
            for start in range(0, num_tokens, chunk_size):
                chunk = slice(start, min(start + chunk_size, num_tokens))
                logits_CV = _chunk_logits(
                    hidden_NH[chunk], weight_mm_VH, bias_cd_V, distribution.temperature, operand_dtype
                )
                kept_CV = _truncate_(logits_CV, targets_N[chunk], distribution)
                lse_C = torch.logsumexp(logits_CV, dim=-1)
                target_logit_C = logits_CV.gather(1, targets_N[chunk, None]).squeeze(1)
                logprobs_N[chunk] = target_logit_C - lse_C
                lse_N[chunk] = lse_C
                # -sum p log p rather than lse - sum p z: every term is >= 0, so there is no
                # cancellation between two large numbers when the logits are large.
                logp_CV = logits_CV.sub_(lse_C[:, None])  # in place: logits are not needed
                plogp_CV = logp_CV.exp().mul_(logp_CV)
                if kept_CV is not None:
                    plogp_CV.masked_fill_(~kept_CV, 0.0)  # p log p = 0 at p = 0 (not 0 * -inf)
                entropy_N[chunk] = -plogp_CV.sum(dim=-1)
                del logits_CV, logp_CV, plogp_CV, kept_CV

        ctx.save_for_backward(hidden_NH, weight_VH, targets_N, bias_V, lse_N, entropy_N)
        ctx.distribution = distribution
        ctx.chunk_size = chunk_size
        # Entropy is often only logged: let its gradient arrive as None and skip that term.
        ctx.set_materialize_grads(False)
        return logprobs_N, entropy_N

    @staticmethod
    @once_differentiable
    def backward(
        ctx: Any, grad_logprobs_N: torch.Tensor | None, grad_entropy_N: torch.Tensor | None
    ) -> tuple[torch.Tensor | None, ...]:
        hidden_NH, weight_VH, targets_N, bias_V, lse_N, entropy_N = ctx.saved_tensors
        needs_hidden, needs_weight, _, needs_bias, _, _ = ctx.needs_input_grad
        if grad_logprobs_N is None and grad_entropy_N is None:
            return None, None, None, None, None, None

        num_tokens = hidden_NH.shape[0]
        compute_dtype = lse_N.dtype
        distribution, chunk_size = ctx.distribution, ctx.chunk_size
        temperature = distribution.temperature
        # Fold d z / d logits = 1 / temperature into the per-token upstream gradients.
        g_lp_N = _scaled_upstream(grad_logprobs_N, compute_dtype, temperature)
        g_h_N = _scaled_upstream(grad_entropy_N, compute_dtype, temperature)

        grad_hidden_NH = torch.empty_like(hidden_NH) if needs_hidden else None
        # Accumulate over chunks in float32: summing many bf16 partial products would lose bits.
        grad_weight_VH = (
            torch.zeros(weight_VH.shape, dtype=compute_dtype, device=weight_VH.device)
            if needs_weight
            else None
        )
        grad_bias_V = (
            torch.zeros(bias_V.shape, dtype=compute_dtype, device=bias_V.device)
            if needs_bias
            else None
        )

        operand_dtype = torch.promote_types(hidden_NH.dtype, weight_VH.dtype)
        with _no_autocast(hidden_NH.device):
            weight_mm_VH = matmul_weight(weight_VH)
            bias_cd_V = None if bias_V is None else bias_V.to(compute_dtype)
            for start in range(0, num_tokens, chunk_size):
                chunk = slice(start, min(start + chunk_size, num_tokens))
                hidden_CH = hidden_NH[chunk]
                logits_CV = _chunk_logits(
                    hidden_CH, weight_mm_VH, bias_cd_V, temperature, operand_dtype
                )
                # The same logits as in forward, so the same kept set.
                kept_CV = _truncate_(logits_CV, targets_N[chunk], distribution)
                grad_logits_CV = _grad_logits_from_logits_(
                    logits_CV,
                    kept_CV,
                    lse_N[chunk],
                    entropy_N[chunk],
                    targets_N[chunk],
                    None if g_lp_N is None else g_lp_N[chunk],
                    None if g_h_N is None else g_h_N[chunk],
                )
                if grad_hidden_NH is not None:
                    grad_hidden_NH[chunk] = project(grad_logits_CV, weight_mm_VH, dtype=operand_dtype).to(
                        hidden_NH.dtype)
                if grad_weight_VH is not None:
                    accumulate_project_(grad_weight_VH, grad_logits_CV.T, hidden_CH, dtype=operand_dtype)
                if grad_bias_V is not None:
                    grad_bias_V += grad_logits_CV.sum(dim=0)
                del logits_CV, grad_logits_CV, kept_CV

        if grad_weight_VH is not None:
            grad_weight_VH = grad_weight_VH.to(weight_VH.dtype)
        if grad_bias_V is not None:
            grad_bias_V = grad_bias_V.to(bias_V.dtype)
        return grad_hidden_NH, grad_weight_VH, None, grad_bias_V, None, None


def _chunk_logits(
    hidden_CH: torch.Tensor,
    weight_VH: torch.Tensor,
    bias_V: torch.Tensor | None,
    temperature: float,
    operand_dtype: torch.dtype,
) -> torch.Tensor:
    """(C, V) temperature-scaled logits of one chunk, float32 (float64 for float64 inputs; a
    fresh tensor): `saccade.models.head.project`, the lm_head as vLLM computes it for RL."""
    logits_CV = project(hidden_CH, weight_VH.T, dtype=operand_dtype)
    if bias_V is not None:
        logits_CV.add_(bias_V)
    if temperature != 1.0:
        # Divide (not multiply by 1/T) to round exactly like the reference and the engine.
        logits_CV.div_(temperature)
    return logits_CV


def _kept_with_targets(
    z_CV: torch.Tensor, targets_C: torch.Tensor, distribution: SampledDistribution
) -> torch.Tensor:
    """(C, V) bool: the engine's kept set computed from these logits, plus each row's target."""
    kept_CV = kept_tokens(z_CV, distribution)
    kept_CV.scatter_(1, targets_C[:, None], True)
    return kept_CV


def _truncate_(
    logits_CV: torch.Tensor, targets_C: torch.Tensor, distribution: SampledDistribution
) -> torch.Tensor | None:
    """Mask, in place, the tokens outside the kept set to -inf; returns the set (None: no truncation)."""
    if not distribution.truncates:
        return None
    kept_CV = _kept_with_targets(logits_CV, targets_C, distribution)
    logits_CV.masked_fill_(~kept_CV, float("-inf"))
    return kept_CV


def _scaled_upstream(
    grad_N: torch.Tensor | None, compute_dtype: torch.dtype, temperature: float
) -> torch.Tensor | None:
    """Upstream gradient in the compute dtype, divided by the temperature (None stays None)."""
    return None if grad_N is None else grad_N.to(compute_dtype) / temperature


def _grad_logits_from_logits_(
    logits_CV: torch.Tensor,
    kept_CV: torch.Tensor | None,
    lse_C: torch.Tensor,
    entropy_C: torch.Tensor,
    targets_C: torch.Tensor,
    g_lp_C: torch.Tensor | None,
    g_h_C: torch.Tensor | None,
) -> torch.Tensor:
    """d loss / d logits for one chunk; overwrites ``logits_CV`` to keep two (C, V) buffers.

    ``g_lp_C`` / ``g_h_C`` are the upstream gradients of logprob / entropy, already divided
    by the temperature; either may be None (no gradient flows into that output). ``kept_CV``:
    the truncation's kept set (masked logits are -inf), or None.
    """
    logp_CV = logits_CV.sub_(lse_C[:, None])
    p_CV = logp_CV.exp()
    if kept_CV is not None:
        logp_CV.masked_fill_(~kept_CV, 0.0)  # p = 0 there: keeps 0 * -inf out of the products
    if g_h_C is None:
        # Logprob only: -p * g_lp (+ g_lp at the target, below).
        grad_CV = p_CV.mul_(-g_lp_C[:, None])
    else:
        # -p * (g_lp + g_h * (log p + H)), built in place in the log p buffer.
        offset_C = g_h_C * entropy_C
        if g_lp_C is not None:
            offset_C = offset_C + g_lp_C
        grad_CV = logp_CV.mul_(g_h_C[:, None]).add_(offset_C[:, None]).mul_(p_CV).neg_()
    if g_lp_C is not None:
        grad_CV.scatter_add_(1, targets_C[:, None], g_lp_C[:, None])
    return grad_CV


def _compute_dtype(hidden_NH: torch.Tensor, weight_VH: torch.Tensor) -> torch.dtype:
    """float32, or float64 if an input is float64 (bf16/fp16 inputs are upcast)."""
    input_dtype = torch.promote_types(hidden_NH.dtype, weight_VH.dtype)
    return torch.promote_types(input_dtype, torch.float32)


def _no_autocast(device: torch.device) -> contextlib.AbstractContextManager:
    """Disable autocast for ``device`` so the matmuls really run in the compute dtype."""
    if torch.amp.is_autocast_available(device.type):
        return torch.autocast(device_type=device.type, enabled=False)
    return contextlib.nullcontext()


def _check_inputs(
    hidden_NH: torch.Tensor,
    weight_VH: torch.Tensor,
    targets_N: torch.Tensor,
    bias_V: torch.Tensor | None,
    chunk_size: int,
) -> None:
    if hidden_NH.dim() != 2 or weight_VH.dim() != 2:
        raise ValueError(
            f"hidden must be (N, H) and weight (V, H); got {tuple(hidden_NH.shape)} and "
            f"{tuple(weight_VH.shape)}"
        )
    if hidden_NH.shape[1] != weight_VH.shape[1]:
        raise ValueError(f"hidden size mismatch: {hidden_NH.shape[1]} vs {weight_VH.shape[1]}")
    if targets_N.shape != (hidden_NH.shape[0],):
        raise ValueError(f"targets must be ({hidden_NH.shape[0]},); got {tuple(targets_N.shape)}")
    if targets_N.is_floating_point() or targets_N.is_complex():
        raise TypeError(f"targets must be integer token ids; got {targets_N.dtype}")
    if bias_V is not None and bias_V.shape != (weight_VH.shape[0],):
        raise ValueError(f"bias must be ({weight_VH.shape[0]},); got {tuple(bias_V.shape)}")
    if chunk_size < 1:
        raise ValueError(f"chunk_size must be >= 1; got {chunk_size}")
