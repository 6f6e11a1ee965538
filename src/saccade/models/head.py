"""The vocabulary projection (lm_head) and the matmul precision, decided once for every place
that scores or samples a token: the trainer's logprobs, the embedded engine's sampling, the
parity checks.

Logits: the hidden state and the head's weight stay in the model's dtype and their products
are summed in float32; the logits come out in float32 and are never rounded to bf16. That is
vLLM's lm_head with `head_dtype = "float32"` (`--hf-overrides '{"head_dtype": "float32"}'`, which
`saccade serve` sets and vLLM's docs call "required for RL training-inference consistency"):
on CUDA `torch.mm(hidden, weight.T, out_dtype=torch.float32)` (bf16 tensor cores, float32
accumulation, no float32 copy of the weight). vLLM's default instead rounds the logits to the
model's dtype before its float32 softmax, about 3 significant digits: 0.06 on a logit of 20.
Elsewhere (CPU) both operands are upcast and multiplied in float32: the same numbers up to the
order of the sum, because the product of two bf16 values is exact in float32 (8-bit significands
make at most 16 bits; float32 holds 24), which is also vLLM's own CPU fallback.

The gradient through the head (the trainer's backward) takes the same path: the logits'
gradient rounded to the model's dtype (as autograd of a bf16 layer rounds it), float32 sums.

TF32 (`use_full_fp32_matmuls`): off everywhere saccade computes. In a bf16 run it changes
nothing that matters (the matmuls are bf16, the head's sums float32 either way); in a float32
run it would round every matmul's operands to 10-bit significands on the GPU, where the CPU and
vLLM's float32 runs do not.
"""

from __future__ import annotations

import functools

import torch

LOW_PRECISION = (torch.bfloat16, torch.float16)


def use_full_fp32_matmuls() -> None:
    """TF32 off for matmuls and cuDNN convolutions (the vision tower's patch embedding): a
    float32 run computes in float32 on every device. Called where a run, a benchmark or a
    parity check builds its models."""
    torch.set_float32_matmul_precision("highest")
    torch.backends.cuda.matmul.allow_tf32 = False
    torch.backends.cudnn.allow_tf32 = False


def matmul_weight(weight: torch.Tensor) -> torch.Tensor:
    """The head's weight as `project` wants it, made once per forward or per rollout, never per
    token: on CUDA the weight itself; on the CPU a float32 copy of a bf16 weight (no float32-out
    bf16 matmul there). `project` gives the same numbers with either."""
    if weight.is_cuda or weight.dtype not in LOW_PRECISION:
        return weight
    return weight.float()


def project(a_MK: torch.Tensor, b_KN: torch.Tensor, *, dtype: torch.dtype) -> torch.Tensor:
    """a @ b with both operands in `dtype` (the model's), products summed in float32; float32 out
    (float64 when `dtype` is float64, for gradcheck). `b` may be `matmul_weight`'s float32 copy of
    a `dtype` tensor; `a` is rounded to `dtype` if it is wider (a float32 gradient)."""
    out_dtype = torch.promote_types(dtype, torch.float32)
    a_MK = a_MK.to(dtype)
    if dtype in LOW_PRECISION and a_MK.is_cuda and b_KN.dtype == dtype:
        return torch.mm(a_MK, b_KN, out_dtype=out_dtype)
    return a_MK.to(out_dtype) @ b_KN.to(out_dtype)


def head_logits(hidden_NH: torch.Tensor, weight_VH: torch.Tensor, *, dtype: torch.dtype,
                bias_V: torch.Tensor | None = None) -> torch.Tensor:
    """(N, V) float32 logits of the lm_head: `weight_VH` is the head's weight or its
    `matmul_weight`, `dtype` the model's; `bias_V` (float32) is added after the sum."""
    logits_NV = project(hidden_NH, weight_VH.T, dtype=dtype)
    if bias_V is not None:
        logits_NV.add_(bias_V)
    return logits_NV


def accumulate_project_(acc_MN: torch.Tensor, a_MK: torch.Tensor, b_KN: torch.Tensor, *, dtype: torch.dtype) -> None:
    """acc += a @ b, as `project` computes the product, into the float32 accumulator `acc` (the
    lm_head's weight gradient over chunks). On CUDA the bf16 matmul adds into it directly (no
    (vocab x hidden) temporary); elsewhere one float32 addmm, the weight gradient autograd
    itself would compute (bit for bit what the trainer computed before issue 28)."""
    if (dtype in LOW_PRECISION and acc_MN.is_cuda and b_KN.dtype == dtype and acc_MN.dtype == torch.float32
            and addmm_takes_out_dtype(acc_MN.device, dtype)):
        torch.addmm(acc_MN, a_MK.to(dtype), b_KN, out_dtype=torch.float32, out=acc_MN)
        return
    # One fused addmm, as autograd's own weight gradient: a product added separately rounds twice.
    out_dtype = acc_MN.dtype
    acc_MN.addmm_(a_MK.to(dtype).to(out_dtype), b_KN.to(out_dtype))


@functools.cache
def addmm_takes_out_dtype(device: torch.device, dtype: torch.dtype) -> bool:
    """Whether this torch's `addmm` takes `out_dtype` for `dtype` operands on `device`: asked once,
    on 1 x 1 tensors, so that the hot path never catches an error. A failure there would have been
    taken for "not supported" and so hidden a CUDA out-of-memory or a device error (the fallback
    used to wrap every call)."""
    acc = torch.zeros(1, 1, device=device, dtype=torch.float32)
    one = torch.ones(1, 1, device=device, dtype=dtype)
    try:
        torch.addmm(acc, one, one, out_dtype=torch.float32, out=acc)
    except (TypeError, NotImplementedError):
        return False
    except RuntimeError as err:  # "out_dtype is not supported for ..." and the like
        if "out_dtype" in str(err) or "not implemented" in str(err).lower():
            return False
        raise
    return float(acc) == 1.0
