"""Trainer benchmark: what caching image embeddings and packing buy, measured side by side.

`saccade bench trainer` runs, on one synthetic batch of multi-image conversations and in
one process, four training-step variants, interleaved step by step (the order rotates
every round), and reports medians and ratios (this machine drifts 20-25% between runs,
so only the ratios of interleaved runs mean much):

- cached: the saccade trainer. `load_policy_lm` + LoRA; image embeddings (and DeepStack
  features) come from the cache, which the frozen tower filled once before the bench;
  samples are packed (first-fit-decreasing) into micro-batches of <= max_tokens.
- full: the approach of prime-rl and TRL, the vision tower inside the trained model. The
  whole transformers model (the family's `full_model_class`) with the same LoRA targets on the
  language model only (peft, pattern anchored to `model.language_model`; the tower stays
  frozen); every step runs the vision tower again on the pixel values. By default it runs
  on the very same packed micro-batches as `cached` (all images of a micro-batch through
  the tower in one call, our M-RoPE positions passed in), so the ratio is the cost of
  re-running the tower alone, not of a layout; `full_layout="per_sample"` runs it one
  sample at a time (no padding, one forward per sample) instead.
- padded: the cached path on padded batches: rows of `padded_rows` samples in dataset
  order, each row right-padded to the longest of its batch (pad tokens at the end, so
  causal attention keeps the real tokens exact; the loss is masked on pads).
- checkpointed: the cached path with per-layer activation checkpointing
  (`trainer.activation_checkpointing`): each decoder layer is recomputed in backward.

(a) cached vs full: median step time, tokens/s and peak memory. Peak memory is taken in a
fresh spawned process per path (the two at once, one thread each: a peak does not depend
on speed), over a warm-up step and one step, as the growth over that process's resident
set after its imports (CPU: the kernel's VmHWM, reset with /proc/self/clear_refs after
loading, so the loading transient is left out; CUDA: max_memory_allocated). Not
`ru_maxrss`: a spawned child inherits its parent's ru_maxrss through exec. The peak holds
weights, LoRA + AdamW state, the step's inputs and activations.
(b) packed vs padded: the fraction of pad tokens in the padded layout and real tokens/s
of both ("packed" is the `cached` variant of (a)). Under sdpa (CPU) a packed row pays
attention over its whole (N x N) block-diagonal mask, so packing saves the pads' linear
layers but not all of the attention; keep max_tokens moderate.
(c) activation checkpointing: step time and peak memory of `checkpointed` over `cached`
(`activation_checkpointing_step_ratio`, `activation_checkpointing_peak_ratio`), the peak
measured like (a)'s, in a fresh process.
(d) the language model's FLOPs per step (`lm_step_flops`: the vision tower, which the cached
path never runs, and recomputation are not counted), the cached path's achieved TFLOP/s
and, given the device's peak (`--peak-tflops`; known for H100/H200/A100), its MFU; and
`saccade memory`'s estimate of each cached path's peak beside the measured one.

`full_finetune=True` trains every language-model weight (bf16 weights with float32 master
weights on a GPU, as the trainer does) in every variant instead of LoRA. cached, padded and
checkpointed share one model and optimizer (checkpointing switched on for its steps only);
with LoRA the full model is held beside it and all four interleave; with full fine-tuning
(at 2B about 35 GB of weights, master weights, gradients and AdamW state per model) the
cached three run first and are freed before the full model loads, so one 80 GB card holds
the bench, and the full/cached ratios come from runs one after the other, not interleaved.
The peak-memory processes run one at a time on a GPU, two at a time on the CPU.

All variants compute the same loss on the same tokens, -(advantage * logprob * loss_mask)
summed over the step's loss tokens / their count, through the chunked logprob function,
on loss tokens only; each step is the trainer's own optimizer step
(`saccade.trainer.step.optimizer_step`, as `saccade rl` and SFT run it: backward, the
non-finite check, the clip, AdamW), handed each variant's loss. The warm-up
step runs with lr = 0, so every variant's warm-up loss is taken on the same weights and
they must agree (`max_warmup_loss_diff`): a check that the four do the same work.

The batch and its layouts are in `saccade.tools.bench.trainer_data`, the variants' models and steps
and the fresh-process memory measurement in `saccade.tools.bench.trainer_variants`; this module runs
them and reports.

Simplified on purpose: pixel values and tokenization are prepared once, outside the timed
steps, for every variant (real pipelines do that in data-loading workers); packing and
collation (cache lookups, padding) are inside the timed steps. No reference model, no KL
term; the engine's one-off encoding of the batch's images is timed separately
(`encode_once_s`) and not charged to the cached path's steps.
"""

from __future__ import annotations

import math
import os
import statistics
import time
from dataclasses import dataclass

import torch

from saccade.tools.bench.trainer_data import BenchBatch, bench_conversations, pad_fraction, prepare_batch
from saccade.tools.bench.trainer_variants import (
    CACHED_FAMILY,
    LR,
    STEPS,
    VARIANTS,
    VisionTimer,
    build_cached,
    build_full,
    count_params,
    lora_settings,
    measure_memory_in_fresh_processes,
    set_checkpointing,
    set_lr,
)
from saccade.config import ImagesConfig
from saccade.config.bench import TrainerBenchConfig
from saccade.devices import resolve_device
from saccade.tools.memory import trainer_memory
from saccade.tools.memory_dims import LINEARS, ModelDims, TextDims, model_dims
from saccade.models.lm import unwrap_policy
from saccade.models.loading import load_processor, load_vision_tower
from saccade.models.presets import preset_family, preset_path
from saccade.models.vision import VisionEncoder
from saccade.timing import synchronize
from saccade.trainer.packing import first_fit_decreasing


# ----------------------------------------------------------------------------- the bench


def _load_avg() -> float | None:
    try:
        return os.getloadavg()[0]
    except OSError:
        return None


def run_trainer_bench(cfg: TrainerBenchConfig, *, progress: bool = True) -> dict:
    """Measure cached vs full-VLM and packed vs padded training steps; see the module docstring
    and `TrainerBenchConfig` (saccade.config.bench) for each option. max_tokens unset:
    DEFAULT_MAX_TOKENS, raised to the longest sample either way. full_layout: "packed" (the full
    VLM on the cached path's micro-batches) or "per_sample" (one sample per forward)."""
    assert preset_family(cfg.preset) is not None, cfg.preset  # TrainerBenchConfig.preset is a preset's name
    from rich.console import Console

    console = Console(stderr=True, quiet=not progress)
    started = time.perf_counter()
    load_start = _load_avg()  # other processes on the machine change every figure: how busy it was
    previous_threads = torch.get_num_threads()
    torch.set_num_threads(cfg.threads)
    try:
        dev = resolve_device(cfg.device, setting="--device")
        # fp32 on CPU (bf16 matmuls there are an emulation, not the production setting).
        dtype = torch.bfloat16 if dev.type == "cuda" else torch.float32
        model_path = str(preset_path(cfg.preset))
        prepared = _prepare(cfg, model_path, dev, dtype, console)
        memory: dict[str, dict] = {}
        if cfg.measure_memory:  # (a) peak memory: one fresh process per path, one after the other
            console.log("peak memory of the cached and the full path, each in a fresh process")
            memory = measure_memory_in_fresh_processes(
                prepared.data, model_path, dev, _dtype_name(dtype), cfg.threads, cfg.seed,
                full_finetune=cfg.full_finetune, attention=cfg.attn)
        timed = _time_variants(cfg, model_path, prepared.data, dev, dtype, console)
        result = _figures(cfg, model_path, dev, dtype, prepared, timed)
        if memory:
            result.update(_memory_figures(memory))
            result.update(estimate_check(result, host=dev.type != "cuda"))
            if result["estimate_flag"] != "ok":
                console.log(f"[bold]saccade memory's estimate: {result['estimate_note']}[/bold]")
        result["config"]["load_avg_1m"] = {"start": load_start, "end": _load_avg()}
        result["wall_s"] = time.perf_counter() - started
        return result
    finally:
        torch.set_num_threads(previous_threads)


def _dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


@dataclass
class _Prepared:
    """The engine's side, done once: the batch, what encoding it took, the tower's size, the image side."""

    data: BenchBatch
    encode_timings: dict[str, float]
    vision_params: int
    side: int


def _prepare(cfg: TrainerBenchConfig, model_path: str, dev: torch.device, dtype: torch.dtype, console) -> _Prepared:
    """Tokenize the conversations and encode every image with the frozen tower, once; the tower is
    freed before anything is timed or measured."""
    max_pixels = load_processor(model_path).image_processor.size["longest_edge"]  # the preset's
    limits = ImagesConfig(min_pixels=32 * 32, max_pixels=max_pixels)
    side = cfg.max_side or math.isqrt(max_pixels)
    console.log(f"preparing {cfg.batch} conversations, preset {cfg.preset!r}, {dev} {_dtype_name(dtype)}, "
                f"{cfg.threads} threads")
    processor = load_processor(model_path)
    tower = load_vision_tower(model_path, dtype=dtype, device=dev)
    vision_params = count_params(tower)
    encoder = VisionEncoder(tower, processor, limits=limits)
    conversations = bench_conversations(cfg.batch, seed=cfg.seed, max_side=side, max_images=cfg.max_images)
    data, encode_timings = prepare_batch(
        processor, encoder, conversations, seed=cfg.seed, limits=limits,
        max_tokens=cfg.max_tokens, padded_rows=cfg.padded_rows, full_layout=cfg.full_layout,
    )
    del tower, encoder
    _free(dev)  # the tower's memory back to the device before the memory processes start
    padded_frac, _ = pad_fraction(data)
    console.log(
        f"{data.num_tokens:,} tokens in {cfg.batch} samples "
        f"({min(s.num_tokens for s in data.samples)}-{max(s.num_tokens for s in data.samples)} each); "
        f"padded layout is {padded_frac:.0%} padding"
    )
    return _Prepared(data, encode_timings, vision_params, side)


@dataclass
class _Timed:
    """Every variant's measured step times, the full VLM's seconds in its tower, the warm-up losses,
    and what the cached model is (its parameters, its attention kernel)."""

    times: dict[str, list[float]]
    vision_s: list[float]
    warmup_loss: dict[str, float]
    lm_params: int
    trainable_params: int
    attention_used: str
    interleaved: bool


def _time_variants(cfg: TrainerBenchConfig, model_path: str, data: BenchBatch, dev: torch.device,
                   dtype: torch.dtype, console) -> _Timed:
    """Timing, in this process. cached, padded and checkpointed share one model and optimizer (the
    same weights; checkpointing is switched on for its steps alone); the full VLM has its own. With
    LoRA both are held and the four variants interleave step by step; with full fine-tuning (about
    35 GB of state per model at 2B) the cached family runs first, is freed, then the full model
    runs: never more than one model's state on the device."""
    interleave = not cfg.full_finetune
    common = dict(dtype=dtype, device=dev, seed=cfg.seed, full_finetune=cfg.full_finetune)
    times: dict[str, list[float]] = {name: [] for name in VARIANTS}
    vision_s: list[float] = []
    warmup_loss: dict[str, float] = {}
    lm_params = trainable_params = 0
    attention_used = ""
    for family in [VARIANTS] if interleave else [CACHED_FAMILY, ("full",)]:
        console.log("loading " + " and ".join(
            ["the cached (LM-only) model"] * any(n != "full" for n in family) + ["the full model"] * ("full" in family)))
        runners: dict[str, tuple] = {}
        vision_timer = None
        if any(n != "full" for n in family):
            cached_model, *cached_opt = build_cached(model_path, attention=cfg.attn, **common)
            trainable_params = count_params(cached_model, trainable=True)
            lm_params = count_params(cached_model) - (0 if cfg.full_finetune else trainable_params)
            attention_used = unwrap_policy(cached_model).config.text_config._attn_implementation
            runners.update({n: (cached_model, *cached_opt) for n in CACHED_FAMILY})
            del cached_model, cached_opt
        if "full" in family:
            full_model, *full_opt = build_full(model_path, **common)
            vision_timer = VisionTimer(full_model.get_base_model().model.visual, dev)
            runners["full"] = (full_model, *full_opt)
            del full_model, full_opt
        _run_rounds(family, runners, data, dev, cfg.steps, times, vision_s, warmup_loss, vision_timer, console)
        runners.clear()  # the family's models and optimizers go before the next family's load
        _free(dev)
    console.log("warm-up losses: " + "  ".join(f"{n} {warmup_loss[n]:+.6f}" for n in VARIANTS))
    return _Timed(times, vision_s, warmup_loss, lm_params, trainable_params, attention_used, interleave)


def _figures(cfg: TrainerBenchConfig, model_path: str, dev: torch.device, dtype: torch.dtype,
             prepared: _Prepared, timed: _Timed) -> dict:
    """The bench's result from what was measured: (a) cached vs full, (b) packed vs padded, (c)
    activation checkpointing, (d) FLOPs and `saccade memory`'s estimates, and the raw figures."""
    data, times = prepared.data, timed.times
    med = {name: statistics.median(times[name]) for name in VARIANTS}
    tps = {name: data.num_tokens / med[name] for name in VARIANTS}
    lengths = [s.num_tokens for s in data.samples]
    dims = model_dims(model_path)
    flops = lm_step_flops(dims.text, lengths, data.num_loss_tokens, full_finetune=cfg.full_finetune)
    peak = cfg.peak_tflops if cfg.peak_tflops is not None else spec_peak_tflops(dev)
    padded_frac, packed_frac = pad_fraction(data)
    dtype_name = _dtype_name(dtype)
    return {
        "config": {
            "preset": cfg.preset,
            "model": model_path,
            "lm_params": timed.lm_params,
            "vision_params": prepared.vision_params,
            "trainable_params": timed.trainable_params,
            "lora": {"rank": lora_settings().rank, "targets": list(lora_settings().target_modules or dims.lora_targets)},
            "full_finetune": cfg.full_finetune,
            "attention": timed.attention_used,
            "interleaved": timed.interleaved,
            "peak_tflops": peak,
            "batch": cfg.batch,
            "steps": cfg.steps,
            "warmup_steps": 1,
            "device": str(dev),
            "dtype": dtype_name,
            "torch_threads": torch.get_num_threads(),
            "max_tokens": data.max_tokens,
            "padded_rows": cfg.padded_rows,
            "max_side": prepared.side,
            "max_images": cfg.max_images,
            "full_layout": cfg.full_layout,
            "seed": cfg.seed,
        },
        "batch_tokens": data.num_tokens,
        "batch_loss_tokens": data.num_loss_tokens,
        "batch_images": sum(s.num_images for s in data.samples),
        "batch_image_tokens": sum(int((s.input_ids == data.image_token_id).sum()) for s in data.samples),
        "sample_tokens_min": min(lengths),
        "sample_tokens_max": max(lengths),
        "packed_micro_batches": len(first_fit_decreasing(lengths, data.max_tokens)),
        "padded_micro_batches": math.ceil(cfg.batch / cfg.padded_rows),
        **prepared.encode_timings,
        # (a) cached embeddings vs full VLM
        "cached_step_s": med["cached"],
        "full_step_s": med["full"],
        "full_over_cached_step_time": med["full"] / med["cached"],
        "cached_tokens_per_s": tps["cached"],
        "full_tokens_per_s": tps["full"],
        "full_vision_s": statistics.median(timed.vision_s),
        "full_vision_share": statistics.median(v / t for v, t in zip(timed.vision_s, times["full"], strict=True)),
        # (b) packed vs padded; "packed" is the cached variant above
        "padded_pad_fraction": padded_frac,
        "packed_pad_fraction": packed_frac,
        "packed_step_s": med["cached"],
        "padded_step_s": med["padded"],
        "packed_tokens_per_s": tps["cached"],
        "padded_tokens_per_s": tps["padded"],
        "packed_over_padded_tokens_per_s": tps["cached"] / tps["padded"],
        # (c) activation checkpointing, on the cached path
        "checkpointed_step_s": med["checkpointed"],
        "activation_checkpointing_step_ratio": med["checkpointed"] / med["cached"],
        # (d) the language model's FLOPs (no vision tower, no recomputation)
        "lm_flops_per_step": flops,
        "cached_tflops": flops / med["cached"] / 1e12,
        "cached_mfu": flops / med["cached"] / 1e12 / peak if peak else None,
        "estimated_cached_peak_mb": estimated_peak_mb(dims, data, dtype_name, cfg.full_finetune, checkpointing=False),
        "estimated_checkpointed_peak_mb": estimated_peak_mb(dims, data, dtype_name, cfg.full_finetune,
                                                            checkpointing=True),
        # checks and raw figures
        "warmup_loss": timed.warmup_loss,
        "max_warmup_loss_diff": max(abs(timed.warmup_loss[n] - timed.warmup_loss["cached"]) for n in VARIANTS),
        "step_times_s": times,
    }


def _memory_figures(memory: dict[str, dict]) -> dict:
    """The measured peaks of the cached, full and checkpointed paths, and their ratios."""
    return dict(
        cached_peak_mb=memory["cached"]["peak_mb"],
        full_peak_mb=memory["full"]["peak_mb"],
        full_over_cached_peak_memory=memory["full"]["peak_mb"] / memory["cached"]["peak_mb"],
        checkpointed_peak_mb=memory["checkpointed"]["peak_mb"],
        activation_checkpointing_peak_ratio=memory["checkpointed"]["peak_mb"] / memory["cached"]["peak_mb"],
        memory=memory,
    )


def _run_rounds(names, runners, data, dev, steps, times, vision_s, warmup_loss, vision_timer, console) -> None:
    """One warm-up round (lr 0) and `steps` measured rounds of these variants, interleaved step
    by step; the order rotates every round so that no variant always runs first."""
    for round_ in range(steps + 1):
        warmup = round_ == 0
        k = round_ % len(names)
        for name in names[k:] + names[:k]:
            model, optimizer, scheduler = runners[name]
            if name in CACHED_FAMILY:
                set_checkpointing(model, name == "checkpointed")
            # lr 0 on the warm-up step: every variant's warm-up loss is taken on the initial weights.
            set_lr(optimizer, 0.0 if warmup else LR)
            if vision_timer is not None:
                vision_timer.seconds = 0.0
            synchronize(dev)
            t0 = time.perf_counter()
            loss = STEPS[name](model, optimizer, scheduler, data, dev)
            synchronize(dev)
            elapsed = time.perf_counter() - t0
            if warmup:
                warmup_loss[name] = loss
                continue
            times[name].append(elapsed)
            if name == "full":
                vision_s.append(vision_timer.seconds)
        if not warmup:
            console.log(f"step {round_}/{steps}: " + "  ".join(f"{n} {times[n][-1]:.2f}s" for n in names))


def _free(device: torch.device) -> None:
    import gc

    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()


# ----------------------------------------------------------------------------- FLOPs, estimates


def lm_step_flops(text: TextDims, lengths: list[int], loss_tokens: int, *, full_finetune: bool) -> float:
    """The language model's FLOPs in one training step over samples of these lengths.

    Counted: the decoder's linears (P weights a token multiplies through: 2 P per token forward,
    2 P backward for the inputs' gradients, and with full fine-tuning 2 P for the weights'; LoRA's
    adapters are negligible; a MoE layer counts its router and the top-k experts a token runs,
    not all of them); causal attention (2 q_dim n^2 per layer forward for a sample of n tokens,
    twice that backward); the lm_head on the loss tokens only, as the trainer computes it
    (2 V H each way, and the weight's gradient with full fine-tuning). Not counted: the vision
    tower (the cached path never runs it), norms and elementwise work, and recomputation
    (activation checkpointing, the chunked logprobs' backward): MFU counts the model's work.
    """
    passes = 6 if full_finetune else 4
    attention = 6 * text.num_hidden_layers * text.q_dim * sum(n * n for n in lengths)
    head = passes * text.vocab_size * text.hidden_size * loss_tokens
    return passes * token_matmul_params(text) * sum(lengths) + attention + head


def token_matmul_params(text: TextDims) -> int:
    """The decoder weights one token multiplies through: every layer's attention linears, the dense
    layers' MLP, and in each MoE layer the router and the `per_token` experts it is routed to."""
    shapes = text.linear_shapes()
    attention = sum(i * o for name, (i, o) in shapes.items() if name in LINEARS[:4])
    mlp = sum(i * o for name, (i, o) in shapes.items() if name in LINEARS[4:])
    dense = text.num_hidden_layers - text.moe_layers
    moe = text.experts.mlp_params(text.hidden_size, active=True) if text.moe_layers else 0
    return text.num_hidden_layers * attention + dense * mlp + text.moe_layers * moe


# Dense bf16 peak, TFLOP/s, from the spec sheets (SXM parts), by the name CUDA reports.
SPEC_PEAK_TFLOPS = {"H100": 989.4, "H200": 989.4, "A100": 312.0}


def spec_peak_tflops(device: torch.device) -> float | None:
    if device.type != "cuda":
        return None
    name = torch.cuda.get_device_name(device)
    return next((v for k, v in SPEC_PEAK_TFLOPS.items() if k in name), None)


def estimated_peak_mb(dims: ModelDims, data: BenchBatch, dtype_name: str, full_finetune: bool, *,
                      checkpointing: bool) -> float:
    """`saccade memory`'s estimate of the cached path's peak for this batch (the assumed CUDA
    context left out: the measured peak is what the allocator handed out)."""
    from saccade.tools.memory_dims import VisionDims

    # The vision dims only size the micro-batch's image embeddings (main + DeepStack levels).
    levels = len(next(iter(data.embeddings.values())).deepstack) if data.embeddings else 0
    vision = VisionDims(1, 1, 1, dims.text.hidden_size, 1, deepstack_levels=levels)
    est = trainer_memory(
        ModelDims("bench", dims.text, vision, lora_targets=dims.lora_targets), dtype=dtype_name, lora_rank=None if full_finetune else lora_settings().rank,
        max_tokens=data.max_tokens, loss_fraction=data.num_loss_tokens / data.num_tokens,
        activation_checkpointing=checkpointing,
    )
    return (est.total - est.get("CUDA context")) * 1024


# The estimate may sit this far above the measured peak before the bench calls it far above.
ESTIMATE_FAR_ABOVE = 1.5


def estimate_check(result: dict, *, host: bool) -> dict:
    """`saccade memory`'s estimate against the measured peak of the cached path, with and without
    activation checkpointing: the ratios (estimate / measured) and a flag, "below" when an
    estimate is under its measured peak (a run sized by it could run out of memory), "far above"
    when it is over ESTIMATE_FAR_ABOVE times it (memory left idle), else "ok". On the CPU the
    measured peak is the process's resident-set growth, which adds torch's CPU allocator and
    the batch's host data to what the estimate counts (what CUDA would hold): "below" is
    expected there and says little."""
    ratios = {name: result[f"estimated_{name}_peak_mb"] / result[f"{name}_peak_mb"]
              for name in ("cached", "checkpointed")}
    if min(ratios.values()) < 1:
        flag = "below"
    elif max(ratios.values()) > ESTIMATE_FAR_ABOVE:
        flag = "far above"
    else:
        flag = "ok"
    worst = min(ratios, key=ratios.get) if flag == "below" else max(ratios, key=ratios.get)
    note = (f"estimate / measured peak {ratios['cached']:.2f} (checkpointed {ratios['checkpointed']:.2f})"
            + ("" if flag == "ok" else f": the {worst} path's estimate is {flag} the measured peak")
            + (" (host RSS: the CPU allocator and host data are not in the estimate)" if host else ""))
    return {"estimate_over_measured": ratios, "estimate_flag": flag, "estimate_note": note}


# ----------------------------------------------------------------------------- report


def format_report(result: dict) -> str:
    """A plain-text table of the figures and their ratios."""
    c = result["config"]
    times = result["step_times_s"]
    spread = lambda name: f"{min(times[name]):.2f}-{max(times[name]):.2f}"  # noqa: E731
    peak = lambda key: f"{result[key]:>10.0f}" if key in result else f"{'-':>10}"  # noqa: E731
    load = c.get("load_avg_1m") or {}
    tuning = " full FT" if c["full_finetune"] else " + LoRA"
    lines = [
        f"saccade trainer bench: preset {c['preset']} (LM {c['lm_params'] / 1e6:.1f}M params, "
        f"vision {c['vision_params'] / 1e6:.1f}M, "
        + ("full fine-tuning" if c["full_finetune"] else f"LoRA r{c['lora']['rank']}")
        + f": {c['trainable_params'] / 1e6:.2f}M trainable)",
        f"{c['device']} {c['dtype']}, {c['torch_threads']} torch threads; batch of {c['batch']} samples = "
        f"{result['batch_tokens']:,} tokens ({result['batch_image_tokens']:,} image, {result['batch_loss_tokens']:,} "
        f"in the loss), {result['batch_images']} images, {result['sample_tokens_min']}-{result['sample_tokens_max']} "
        "tokens per sample",
        f"medians of {c['steps']} {'interleaved ' if c.get('interleaved', True) else ''}steps per variant after 1 "
        f"warm-up; packed micro-batches "
        f"<= {c['max_tokens']} tokens ({result['packed_micro_batches']} per step)",
        "",
        f"(a) cached image embeddings vs full VLM (vision tower every step; full layout: {c['full_layout']})",
        f"  {'':<26}{'step s':>9}{'range s':>13}{'tokens/s':>10}{'peak MB':>10}",
        f"  {'cached (LM' + tuning + ')':<26}{result['cached_step_s']:>9.2f}{spread('cached'):>13}"
        f"{result['cached_tokens_per_s']:>10.0f}" + peak("cached_peak_mb"),
        f"  {'full VLM (' + tuning.strip(' +') + ')':<26}{result['full_step_s']:>9.2f}{spread('full'):>13}"
        f"{result['full_tokens_per_s']:>10.0f}" + peak("full_peak_mb"),
        f"  {'full / cached':<26}{result['full_over_cached_step_time']:>8.2f}x{'':>23}"
        + (f"{result['full_over_cached_peak_memory']:>9.2f}x" if "full_over_cached_peak_memory" in result else ""),
        f"  vision tower: {result['full_vision_share']:.0%} of the full step ({result['full_vision_s']:.2f} s); "
        f"the same images through the tower once, for the cache: {result['encode_once_s']:.2f} s "
        f"(+ {result['preprocess_once_s']:.2f} s preprocessing)",
        "",
        f"(b) packed vs padded, cached path (padded: {c['padded_rows']} samples per batch, dataset order, "
        f"{result['padded_micro_batches']} batches per step)",
        f"  {'':<26}{'pad frac':>9}{'step s':>9}{'range s':>13}{'real tokens/s':>15}",
        f"  {'packed':<26}{result['packed_pad_fraction']:>9.1%}{result['packed_step_s']:>9.2f}{spread('cached'):>13}"
        f"{result['packed_tokens_per_s']:>15.0f}",
        f"  {'padded':<26}{result['padded_pad_fraction']:>9.1%}{result['padded_step_s']:>9.2f}{spread('padded'):>13}"
        f"{result['padded_tokens_per_s']:>15.0f}",
        f"  {'packed / padded':<26}{'':>31}{result['packed_over_padded_tokens_per_s']:>14.2f}x",
        "",
        "(c) activation checkpointing (per decoder layer), cached path",
        f"  {'':<26}{'step s':>9}{'range s':>13}{'peak MB':>10}",
        f"  {'without':<26}{result['cached_step_s']:>9.2f}{spread('cached'):>13}" + peak("cached_peak_mb"),
        f"  {'with':<26}{result['checkpointed_step_s']:>9.2f}{spread('checkpointed'):>13}" + peak("checkpointed_peak_mb"),
        f"  {'with / without':<26}{result['activation_checkpointing_step_ratio']:>8.2f}x{'':>13}"
        + (f"{result['activation_checkpointing_peak_ratio']:>9.2f}x" if "activation_checkpointing_peak_ratio" in result
           else ""),
        "",
        f"(d) language-model FLOPs per step {result['lm_flops_per_step'] / 1e12:.3f} T (no vision tower, no "
        f"recomputation): cached path {result['cached_tflops']:.2f} TFLOP/s"
        + (f", MFU {result['cached_mfu']:.1%} of {c['peak_tflops']:g}" if result.get("cached_mfu") else "")
        + f"; saccade memory estimates the peak at {result['estimated_cached_peak_mb']:.0f} MB "
        f"({result['estimated_checkpointed_peak_mb']:.0f} MB checkpointed)",
        *([f"  {'' if result['estimate_flag'] == 'ok' else 'FLAG: '}{result['estimate_note']}"]
          if "estimate_flag" in result else []),
        "",
        f"warm-up losses of the four variants agree to {result['max_warmup_loss_diff']:.1e} (same weights, same "
        f"tokens); wall time {result['wall_s']:.0f} s",
    ]
    if load.get("start") is not None:
        lines.append(
            f"machine load (1-min average, lagging) {load['start']:.1f} at start, {load['end']:.1f} at end, "
            f"{os.cpu_count()} cores; a wide 'range s' means other processes took the cores for a while"
        )
    return "\n".join(lines)
