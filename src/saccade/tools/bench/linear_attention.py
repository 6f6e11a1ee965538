"""Packed rows through Qwen3.5's Gated DeltaNet layers on the device: exactness and speed of the
varlen path (`saccade.models.linear_attention`), for `saccade bench gpu`'s `linear-attention`
stage and scripts/bench_linear_attention.py.

- `packing_check`: a packed micro-batch of mixed lengths, with images and a shared-prompt group,
  on the kernels `choose_kernels` picks on the device (flash-linear-attention's on CUDA when it
  imports), against each sample alone on the reference (torch) kernels: logprobs and every
  parameter's gradient, max |Δ| against the CPU tests' bars.
- `grpo_timing`: forward + backward of a GRPO group packed whole or with its prompt shared, the
  linear layers on the varlen path or the padded one, side by side.
"""

from __future__ import annotations

import contextlib
import importlib.util
import logging
import os
import statistics
import time
from typing import Any, Callable

import torch

# The CPU tests' bars, fp32: per-token logprob max |Δ| (tests/models/test_families.py, TOLERANCE),
# and a gradient's max |Δ| relative to max(1, its largest entry), packed against each sample alone
# (tests/models/test_linear_attention.py, GRAD_TOL: the reference kernel's rounding alone moves
# A_log's gradient by up to 1.1e-5 when tokens follow a sample).
LOGPROB_BAR = 1e-5
GRAD_BAR = 5e-5


@contextlib.contextmanager
def forced_kernels(kernels):
    """The linear layers' path for packed rows forced: `VarlenKernels`, or None for the padded one
    (the layer's own forward over right-padded batches)."""
    from saccade.models import linear_attention

    chosen = linear_attention.choose_kernels
    linear_attention.choose_kernels = lambda device, shared_prompts=False: kernels
    try:
        yield
    finally:
        linear_attention.choose_kernels = chosen


@contextlib.contextmanager
def reference_layer_kernels():
    """The layer's own forward on transformers' torch kernels even where flash-linear-attention
    imports: transformers binds `torch_chunk_gated_delta_rule` (and `causal_conv1d_fn`) to the
    package's kernel at import when it is there, the torch function kept as `__wrapped__`."""
    from transformers.models.qwen3_5 import modeling_qwen3_5 as m

    names = ("torch_chunk_gated_delta_rule", "causal_conv1d_fn")
    saved = {n: getattr(m, n) for n in names}
    for n, fn in saved.items():
        setattr(m, n, getattr(fn, "__wrapped__", fn))
    try:
        yield
    finally:
        for n, fn in saved.items():
            setattr(m, n, fn)


def fla_status(device: str) -> dict[str, Any]:
    """Whether flash-linear-attention is installed and its varlen kernels import, and whether a
    packed row on `device` is expected to run on them (CUDA with fla installed)."""
    from saccade.models.linear_attention import fla_kernels

    installed = importlib.util.find_spec("fla") is not None
    status: dict[str, Any] = {"installed": installed, "imports": False, "error": None}
    if installed:
        status["imports"] = fla_kernels() is not None
        if not status["imports"]:
            try:  # fla_kernels swallows the error: say what it was
                importlib.import_module("fla.ops.gated_delta_rule")
            except Exception as err:  # noqa: BLE001
                status["error"] = f"{type(err).__name__}: {err}"
    status["expected"] = device == "cuda" and installed
    return status


class _Lines(logging.Handler):
    def __init__(self) -> None:
        super().__init__()
        self.lines: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.lines.append(record.getMessage())


def packing_check(model_path, *, device: str, completions: tuple[int, ...] = (4, 9, 17)) -> dict[str, Any]:
    """fp32, every parameter trained: the parity conversations (one image, several, different
    sizes, text only, multi-turn), each prompt with `completions` of those lengths, packed in one
    micro-batch with the prompts shared (a group's prompt once in the row) on the kernels
    `choose_kernels` picks on `device`; against each sample alone (prompt + completion) on the
    reference torch kernels (`TORCH_VARLEN`, the same as the layer's own forward). Compares the
    completions' logprobs and the parameters' gradients of sum_i w_i * sum(logprobs_i)."""
    from saccade.config import ImagesConfig
    from saccade.models import linear_attention as la
    from saccade.models.head import use_full_fp32_matmuls
    from saccade.models.lm import load_policy_lm, set_full_finetune
    from saccade.models.loading import load_processor, load_vision_tower
    from saccade.models.vision import EmbeddingCache, VisionEncoder
    from saccade.tools.parity import grouped_samples
    from saccade.trainer.forward import forward_logprobs
    from saccade.trainer.packing import pack

    use_full_fp32_matmuls()
    fla_precision = {"fla_default": None, "used": None}
    if device == "cuda":
        # The bars are fp32's (the CPU tests'), so fla computes in IEEE fp32 here, as torch does after
        # use_full_fp32_matmuls: Triton's fp32 dots by TRITON_F32_DEFAULT (read when Triton compiles,
        # before the first forward), and the gated-delta forward's triangular solve, whose precision
        # fla sets explicitly to TF32 on sm >= 80 (which the variable does not override), by its
        # module constant (la.fla_solve_precision). Training runs in bf16 at fla's own setting.
        os.environ.setdefault("TRITON_F32_DEFAULT", "ieee")
        try:
            fla_precision["fla_default"] = la.fla_solve_precision()
            fla_precision["used"] = la.fla_solve_precision("ieee")
        except ImportError:
            pass  # no fla: the torch kernels run, and missed_fla says so
    processor = load_processor(model_path)
    limits = ImagesConfig(min_pixels=32 * 32, max_pixels=256 * 256)
    encoder = VisionEncoder(load_vision_tower(model_path), processor, limits=limits, cache=EmbeddingCache())
    policy = set_full_finetune(load_policy_lm(model_path, device=device))
    samples = grouped_samples(processor, encoder, completions, torch.Generator().manual_seed(0))
    weight = {s.sample_id: (i % 3) - 1.0 for i, s in enumerate(samples)}
    packing = dict(image_token_id=policy.image_token_id, spatial_merge_size=encoder.merge)

    def run(mbs) -> tuple[dict, dict]:
        policy.zero_grad(set_to_none=True)
        logprobs = {}
        for mb in mbs:
            lp, _ = forward_logprobs(policy, mb, only_loss_tokens=True)
            mine = {}
            for k, sid in enumerate(mb.sample_ids):
                lo, hi = int(mb.cu_seqlens[k]), int(mb.cu_seqlens[k + 1])
                mine[sid] = lp[lo:hi][mb.loss_mask[lo:hi].to(lp.device)]
            sum((weight[sid] * v).sum() for sid, v in mine.items()).backward()
            logprobs.update({sid: v.detach().cpu() for sid, v in mine.items()})
        return logprobs, {n: p.grad.detach().cpu() for n, p in policy.named_parameters() if p.grad is not None}

    lines = _Lines()
    logger = logging.getLogger("saccade.linear_attention")
    logger.addHandler(lines)
    try:
        packed_mbs = pack(samples, encoder.cache.get, max_tokens=1 << 16, share_prompts=True, **packing)
        assert len(packed_mbs) == 1
        mb = packed_mbs[0]
        shared = sorted({(a, b) for a, b in mb.context or [] if b > a})  # the prompts held once
        packed, packed_grads = run(packed_mbs)
        kernels = la.choose_kernels(torch.device(device), shared_prompts=bool(shared))
    finally:
        logger.removeHandler(lines)
    with forced_kernels(la.TORCH_VARLEN):
        alone, alone_grads = run([m for s in samples for m in pack([s], encoder.cache.get, max_tokens=1 << 16,
                                                                     **packing)])
    logprob_max = max(float((packed[k] - alone[k]).abs().max()) for k in alone)
    relative = {n: float((packed_grads[n] - g).abs().max() / g.abs().max().clamp(min=1)) for n, g in alone_grads.items()}
    worst = max(relative, key=relative.get)
    linear = {n: d for n, d in relative.items() if "linear_attn" in n}
    fla = fla_status(device)
    fla_kernels = la.fla_kernels() if fla["installed"] else None
    used = kernels.name if kernels is not None else "padded (the layer's own forward)"
    fla_used = kernels is not None and fla_kernels is not None and kernels.name == fla_kernels.name
    kernel_error = missed_fla(device, fla_used, fla)
    return {
        "model": str(model_path), "device": device, "dtype": "float32",
        "samples": len(samples), "tokens": int(mb.cu_seqlens[-1]), "segments": len(mb.sample_ids),
        "alone_tokens": sum(int(s.input_ids.numel()) for s in samples),
        "shared_prompts": len(shared), "images": int(sum(len(s.image_keys) for s in samples)),
        "kernels": used, "fla": fla, "triton_f32_default": os.environ.get("TRITON_F32_DEFAULT"), "fla_used": fla_used,
        "fla_solve_precision": fla_precision,
        "kernel_log": lines.lines, "kernel_error": kernel_error,
        "logprob_max_abs": logprob_max, "logprob_bar": LOGPROB_BAR,
        "grad_max_rel": relative[worst], "grad_worst": worst, "grad_bar": GRAD_BAR,
        "linear_attn_grad_max_rel": max(linear.values()) if linear else None, "parameters": len(relative),
        "passed": verdict(logprob_max, relative[worst], kernel_error),
    }


def missed_fla(device: str, fla_used: bool, fla: dict[str, Any]) -> str | None:
    """Why the check fails on its kernels, or None: on CUDA, the packed row must have run on
    flash-linear-attention (`fla_status`: the stage exists to check it; scripts/gpu-wheels.sh brings
    it to the GPU machine). On the CPU any kernels are right (fla needs CUDA)."""
    if device != "cuda" or fla_used:
        return None
    if not fla["installed"]:
        return "flash-linear-attention was expected on CUDA but is not installed (scripts/gpu-wheels.sh brings it)"
    if not fla["imports"]:
        return f"flash-linear-attention is installed but does not import: {fla['error']}"
    return "flash-linear-attention imports but choose_kernels did not pick it for the packed row"


def verdict(logprob_max: float, grad_max_rel: float, kernel_error: str | None) -> bool:
    """Within both CPU bars, on the kernels expected (fla on CUDA)."""
    return kernel_error is None and logprob_max <= LOGPROB_BAR and grad_max_rel <= GRAD_BAR


# ----------------------------------------------------------------------------- timing


def grpo_rows(policy, *, prompt: int, group: int, completions: tuple[int, int] = (60, 120), seed: int = 0) -> dict:
    """A GRPO group: a prompt of `prompt` tokens (20 of text, one image of 64 tokens, the rest text)
    and `group` completions of `completions` tokens (inclusive), as two packed rows: every sample
    whole, and the prompt shared (PackedLayout's context: once in the row). Each row is
    (ids, lengths, starts, context); `image_embeds_MH` the image's random embedding."""
    vocab = policy.lm_head.weight.shape[0]
    image_token = policy.config.image_token_id
    gen = torch.Generator().manual_seed(seed)
    words = torch.arange(vocab)[torch.arange(vocab) < min(image_token, 8000)]  # plain tokens
    lengths = torch.randint(completions[0], completions[1] + 1, (group,), generator=gen).tolist()

    def text(n):
        return words[torch.randint(0, len(words), (1, n), generator=gen)]

    P = prompt
    prompt_ids = torch.cat([text(20), torch.full((1, 64), image_token), text(P - 84)], 1)
    outs = [text(n) for n in lengths]
    return {
        "completions": lengths,
        "image_embeds_MH": torch.randn(64, policy.config.text_config.hidden_size, generator=gen),
        "whole": (torch.cat([torch.cat([prompt_ids, o], 1) for o in outs], 1), [P + n for n in lengths], None, None),
        "shared": (torch.cat([prompt_ids, *outs], 1), [P + lengths[0], *lengths[1:]], [0] + [P] * (group - 1),
                   [(0, 0)] + [(0, P)] * (group - 1)),
    }


def grpo_step(policy, rows: dict, which: str) -> None:
    """Forward + backward of one packed row (`grpo_rows`' "whole" or "shared") through PolicyLM's
    hidden states, every trainable parameter's gradient."""
    ids, lengths, starts, context = rows[which]
    starts = starts or [0] * len(lengths)
    device = policy.lm_head.weight.device
    positions = torch.cat([torch.arange(s, s + n) for s, n in zip(starts, lengths)])  # text positions, all 4 rows
    images = int((ids == policy.config.image_token_id).sum()) // 64
    embeds = rows["image_embeds_MH"].to(device, policy.lm_head.weight.dtype).repeat(images, 1)
    hidden = policy.hidden_states(ids.to(device), positions.view(1, 1, -1).expand(4, 1, -1).contiguous().to(device),
                                  image_embeds_NH=embeds, cu_seqlens=torch.tensor([0, *lengths]).cumsum(0),
                                  context=context)
    policy.zero_grad(set_to_none=True)
    hidden.float().square().mean().backward()


def side_by_side(fns: list[Callable[[], Any]], repeats: int, *, cuda: bool = False) -> list[float]:
    """Median ms of each fn, timed in turns (fn 1, fn 2, ..., fn 1, ...) after one warm-up each, so
    that other jobs on the machine slow them alike (CUDA: synchronised around each)."""
    sync = torch.cuda.synchronize if cuda else (lambda: None)
    for fn in fns:
        fn()
    times: list[list[float]] = [[] for _ in fns]
    for _ in range(repeats):
        for fn, kept in zip(fns, times):
            sync()
            t = time.perf_counter()
            fn()
            sync()
            kept.append(time.perf_counter() - t)
    return [1000 * statistics.median(kept) for kept in times]


def grpo_timing(model_path, *, device: str, dtype: torch.dtype, prompt: int, group: int,
                completions: tuple[int, int], repeats: int) -> dict[str, Any]:
    """Forward + backward of a GRPO group (`grpo_rows`) in `dtype` on `device`, every parameter
    trained: the linear layers on the varlen path (fla's kernels on CUDA where they import, else
    the torch loop) against the padded path on the reference torch kernels, packed whole and with
    the prompt shared. On CUDA with fla installed, also the padded path on the kernels transformers
    picks itself (fla's chunk rule over the padded batch)."""
    from saccade.models import linear_attention as la
    from saccade.models.lm import load_policy_lm, set_full_finetune

    policy = set_full_finetune(load_policy_lm(model_path, dtype=dtype, device=device))
    rows = grpo_rows(policy, prompt=prompt, group=group, completions=completions)
    fla = la.fla_kernels() if device == "cuda" else None
    varlen = fla or la.TORCH_VARLEN

    def case(kernels, which, reference):
        def fn():
            with forced_kernels(kernels), (reference_layer_kernels() if reference else contextlib.nullcontext()):
                grpo_step(policy, rows, which)
        return fn

    cases = [("varlen", varlen, False), ("padded, torch reference", None, True)]
    if fla is not None:
        cases.append(("padded, transformers' kernels", None, False))
    names = [(which, name) for which in ("whole", "shared") for name, _, _ in cases]
    fns = [case(k, which, ref) for which in ("whole", "shared") for _, k, ref in cases]
    if device == "cuda":
        torch.cuda.reset_peak_memory_stats()
    ms = side_by_side(fns, repeats, cuda=device == "cuda")
    result: dict[str, Any] = {
        "model": str(model_path), "device": device, "dtype": str(dtype).removeprefix("torch."), "prompt": prompt,
        "group": group, "completions": rows["completions"], "repeats": repeats, "varlen_kernels": varlen.name,
        "tokens": {w: int(rows[w][0].shape[1]) for w in ("whole", "shared")},
        "ms": {f"{w}, {n}": t for (w, n), t in zip(names, ms)},
    }
    for w in ("whole", "shared"):
        result[f"{w}_padded_over_varlen"] = result["ms"][f"{w}, padded, torch reference"] / result["ms"][f"{w}, varlen"]
    if device == "cuda":
        result["cuda_peak_mb"] = torch.cuda.max_memory_allocated() / 2**20
    return result
