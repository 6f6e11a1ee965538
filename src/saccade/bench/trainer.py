"""Trainer benchmark: what caching image embeddings and packing buy, measured side by side.

`saccade bench trainer` runs, on one synthetic batch of multi-image conversations and in
one process, four training-step variants, interleaved step by step (the order rotates
every round), and reports medians and ratios (this machine drifts 20-25% between runs,
so only the ratios of interleaved runs mean much):

- cached: the saccade trainer. `load_policy_lm` + LoRA; image embeddings (and DeepStack
  features) come from the cache, which the frozen tower filled once before the bench;
  samples are packed (first-fit-decreasing) into micro-batches of <= max_tokens.
- full: the approach of prime-rl and TRL, the vision tower inside the trained model. The
  whole transformers `Qwen3VLForConditionalGeneration` with the same LoRA targets on the
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
on loss tokens only; then backward and an AdamW step over the LoRA weights. The warm-up
step runs with lr = 0, so every variant's warm-up loss is taken on the same weights and
they must agree (`max_warmup_loss_diff`): a check that the four do the same work.

Simplified on purpose: pixel values and tokenization are prepared once, outside the timed
steps, for every variant (real pipelines do that in data-loading workers); packing and
collation (cache lookups, padding) are inside the timed steps. No gradient checkpointing,
no reference model, no KL term; the engine's one-off encoding of the batch's images is
timed separately (`encode_once_s`) and not charged to the cached path's steps.
"""

from __future__ import annotations

import math
import os
import random
import statistics
import sys
import tempfile
import time
from concurrent.futures import ProcessPoolExecutor
from dataclasses import dataclass, replace
from multiprocessing import get_context
from pathlib import Path

import torch

from saccade.config import ImagesConfig
from saccade.data.images import image_to_data_url
from saccade.devices import resolve_device
from saccade.data.messages import messages_to_inputs
from saccade.config import LoraConfig
from saccade.memory import TextDims, model_dims, trainer_memory
from saccade.metrics import proc_status_kb
from saccade.models.lm import apply_lora, load_policy_lm
from saccade.models.loading import load_full_model, load_processor, load_vision_tower
from saccade.models.tiny import PRESETS, tiny_model_path
from saccade.models.vision import ImageEmbedding, VisionEncoder
from saccade.data.synthetic import synthetic_image
from saccade.models.lm import unwrap_policy
from saccade.trainer.forward import forward_logprobs, predicted_positions
from saccade.trainer.logprobs import token_logprobs_and_entropy
from saccade.trainer.packing import first_fit_decreasing, pack
from saccade.trainer.samples import MicroBatch, TrainingSample, make_sample

VARIANTS = ("cached", "full", "padded", "checkpointed")
LR = 1e-4
# About the size of a padded micro-batch (4 rows of the longest sample) on the default data.
# Bigger packed rows cost more attention under sdpa, which computes the whole (N x N)
# block-diagonal mask; flash-attention's varlen kernel would skip the off-diagonal blocks.
DEFAULT_MAX_TOKENS = 1024

_WORDS = (
    "red green blue yellow circle square triangle star left right above below count two three "
    "the a is of on in and largest smallest shape color image picture therefore answer"
).split()


# ----------------------------------------------------------------------------- data


@dataclass
class BenchBatch:
    """One step's worth of samples, with everything each variant needs prepared in advance."""

    samples: list[TrainingSample]
    embeddings: dict[str, ImageEmbedding]  # the cache: image key -> tower output
    pixel_values: dict[str, torch.Tensor]  # sample_id -> (patches, C*T*P*P), for the full path
    image_token_id: int
    pad_token_id: int
    merge: int
    max_tokens: int
    padded_rows: int
    full_layout: str

    @property
    def num_tokens(self) -> int:
        return sum(s.num_tokens for s in self.samples)

    @property
    def num_loss_tokens(self) -> int:
        return sum(int(s.loss_mask.sum()) for s in self.samples)

    def lookup(self, key: str) -> ImageEmbedding:
        return self.embeddings[key]


def bench_conversations(n: int, *, seed: int, max_side: int, max_images: int = 3) -> list[list[dict]]:
    """OpenAI-format conversations with 1..max_images images of varied sizes and answers of varied length.

    Lengths must vary, or padding costs nothing: image sides are drawn from 64..max_side px
    (an image costs (w/32)*(h/32) tokens), answers from 4..80 words.
    """
    rng = random.Random(seed)
    sides = list(range(64, max_side + 1, 32)) or [64]
    conversations = []
    for i in range(n):
        parts: list[dict] = []
        for k in range(rng.randint(1, max_images)):
            image = synthetic_image(rng.choice(sides), rng.choice(sides), seed * 100_000 + i * 10 + k)
            parts.append({"type": "image_url", "image_url": {"url": image_to_data_url(image)}})
        parts.append({"type": "text", "text": f"Q{i}: which shape is largest, and what color is it?"})
        answer = " ".join(rng.choice(_WORDS) for _ in range(rng.randint(4, 80)))
        conversations.append([{"role": "user", "content": parts}, {"role": "assistant", "content": answer}])
    return conversations


def prepare_batch(
    processor,
    encoder: VisionEncoder,
    conversations: list[list[dict]],
    *,
    seed: int,
    limits: ImagesConfig,
    max_tokens: int | None,
    padded_rows: int,
    full_layout: str,
) -> tuple[BenchBatch, dict[str, float]]:
    """Tokenize with `messages_to_inputs` (as generation does), build samples, encode the images.

    Returns the batch and the seconds the engine's side took, once, to preprocess the
    images (`preprocess_once_s`) and to run the tower on them (`encode_once_s`).
    """
    rng = random.Random(seed + 1)
    samples, pixels, images, keys = [], {}, [], []
    im_end = processor.tokenizer.convert_tokens_to_ids("<|im_end|>")
    for i, messages in enumerate(conversations):
        sample_id = f"bench-{i}"
        inputs = messages_to_inputs(messages, processor, limits=limits, sample=sample_id)
        prompt = messages_to_inputs(messages[:-1], processor, limits=limits, add_generation_prompt=True)
        n_prompt = prompt.input_ids.shape[0]
        assert torch.equal(inputs.input_ids[:n_prompt], prompt.input_ids), "chat template is not prefix-stable"
        # The completion the engine would have sampled: the answer up to and including <|im_end|>.
        end = int((inputs.input_ids == im_end).nonzero()[-1]) + 1
        loss_mask = torch.zeros(inputs.input_ids.shape[0], dtype=torch.bool)
        loss_mask[n_prompt:end] = True
        sample_keys = [encoder.key_for_hash(h) for h in inputs.image_hashes]
        images += inputs.images
        keys += sample_keys
        advantage = rng.choice([-1.0, 1.0]) * rng.uniform(0.5, 1.5)
        samples.append(
            make_sample(
                sample_id,
                inputs.input_ids,
                inputs.mm_token_type_ids,
                inputs.image_grid_thw,
                sample_keys,
                spatial_merge_size=encoder.merge,
                loss_mask=loss_mask,
                advantage=advantage,
            )
        )
        pixels[sample_id] = inputs.pixel_values
    # The engine's side, once for the whole run: preprocess every image and run the frozen
    # tower on all of them in one call (what `VisionEncoder.encode` does on cache misses).
    device = encoder.device
    encoder.encode_pixels(*encoder.preprocess(images[:1]))  # untimed: the first call pays one-off set-up
    _sync(device)
    t0 = time.perf_counter()
    pixels_PD, grid_I3 = encoder.preprocess(images)
    t1 = time.perf_counter()
    encoded = encoder.encode_pixels(pixels_PD, grid_I3)
    _sync(device)
    timings = {"preprocess_once_s": t1 - t0, "encode_once_s": time.perf_counter() - t1}
    embeddings = dict(zip(keys, encoded, strict=True))
    longest = max(s.num_tokens for s in samples)
    batch = BenchBatch(
        samples=samples,
        embeddings=embeddings,
        pixel_values=pixels,
        image_token_id=int(processor.image_token_id),
        pad_token_id=int(processor.tokenizer.pad_token_id),
        merge=encoder.merge,
        # Samples are never split, so the budget is at least the longest sample.
        max_tokens=max(max_tokens or DEFAULT_MAX_TOKENS, longest),
        padded_rows=padded_rows,
        full_layout=full_layout,
    )
    return batch, timings


@dataclass
class PaddedBatch:
    input_ids_BL: torch.Tensor
    position_ids_4BL: torch.Tensor
    loss_mask_BL: torch.Tensor
    advantages_BL: torch.Tensor
    image_embeds_NH: torch.Tensor | None
    deepstack_KNH: torch.Tensor | None


def pad_batches(batch: BenchBatch) -> list[PaddedBatch]:
    """Rows of `padded_rows` samples in dataset order, each right-padded to the longest of its rows."""
    out = []
    for start in range(0, len(batch.samples), batch.padded_rows):
        group = batch.samples[start : start + batch.padded_rows]
        B, L = len(group), max(s.num_tokens for s in group)
        input_ids_BL = torch.full((B, L), batch.pad_token_id, dtype=torch.long)
        position_ids_4BL = torch.zeros(4, B, L, dtype=torch.long)
        loss_mask_BL = torch.zeros(B, L, dtype=torch.bool)
        advantages_BL = torch.zeros(B, L)
        embeds, deepstack = [], []
        for b, s in enumerate(group):
            n = s.num_tokens
            input_ids_BL[b, :n] = s.input_ids
            position_ids_4BL[:, b, :n] = s.position_ids
            # Pads sit after the sample, so causal attention hides them from every real token;
            # their positions just continue each rotary row.
            position_ids_4BL[:, b, n:] = s.position_ids[:, -1:] + torch.arange(1, L - n + 1)
            loss_mask_BL[b, :n] = s.loss_mask
            advantages_BL[b] = s.advantage
            # Image features are scattered in row-major token order: row by row, image by image.
            for key in s.image_keys:
                embeds.append(batch.lookup(key).embeds)
                deepstack.append(batch.lookup(key).deepstack)
        out.append(
            PaddedBatch(
                input_ids_BL,
                position_ids_4BL,
                loss_mask_BL,
                advantages_BL,
                torch.cat(embeds) if embeds else None,
                torch.cat(deepstack, dim=1) if deepstack else None,
            )
        )
    return out


def pad_fraction(batch: BenchBatch) -> tuple[float, float]:
    """(padded layout, packed layout): pad tokens / tokens run through the model."""
    padded = pad_batches(batch)
    padded_total = sum(p.input_ids_BL.numel() for p in padded)
    bins = first_fit_decreasing([s.num_tokens for s in batch.samples], batch.max_tokens)
    # Packed rows hold only real tokens: each bin's row is exactly as long as its samples.
    packed_total = sum(sum(batch.samples[i].num_tokens for i in b) for b in bins)
    return 1 - batch.num_tokens / padded_total, 1 - batch.num_tokens / packed_total


# ----------------------------------------------------------------------------- models


def lora_settings() -> LoraConfig:
    return LoraConfig()


def _optimizer(model: torch.nn.Module):
    """The trainer's own AdamW (float32 master weights for bf16 full fine-tuning)."""
    from saccade.trainer.step import build_optimizer

    optimizer, _ = build_optimizer(model, lr=LR, weight_decay=0.0, schedule=lambda k: 1.0)
    return optimizer


def build_cached(model_path, *, dtype: torch.dtype, device: torch.device, seed: int, checkpointing: bool = False,
                 full_finetune: bool = False, attention: str = "auto"):
    """The saccade trainer's model: LM only, LoRA on its linears (or every LM weight), AdamW."""
    from saccade.models.lm import set_full_finetune

    policy = load_policy_lm(model_path, dtype=dtype, device=device, attn_implementation=attention)
    if checkpointing:
        policy.enable_activation_checkpointing()
    torch.manual_seed(seed)
    model = set_full_finetune(policy) if full_finetune else apply_lora(policy, lora_settings())
    return model, _optimizer(model)


def build_full(model_path, *, dtype: torch.dtype, device: torch.device, seed: int, full_finetune: bool = False,
               lora_rank: int | None = None):
    """The full Qwen3-VL, with the same LoRA targets anchored to the language model (or every
    language-model weight training): vision stays frozen. `lora_rank`: another rank (alpha 2x)."""
    import peft

    full = load_full_model(model_path, dtype=dtype).to(device)
    if full_finetune:
        for name, p in full.named_parameters():
            p.requires_grad_(".language_model." in name or name.startswith("lm_head"))
        full.train()
        return _FullFinetuned(full), _optimizer(full)
    settings = lora_settings()
    if lora_rank is not None:
        settings = LoraConfig(rank=lora_rank, alpha=2 * lora_rank)
    config = peft.LoraConfig(
        r=settings.rank,
        lora_alpha=settings.alpha,
        lora_dropout=settings.dropout,
        target_modules=rf"model\.language_model\..*\.({'|'.join(settings.target_modules)})",
        bias="none",
    )
    torch.manual_seed(seed)
    model = peft.get_peft_model(full, config)
    assert not any("visual" in n for n, p in model.named_parameters() if p.requires_grad), "vision must stay frozen"
    return model, _optimizer(model)


class _FullFinetuned(torch.nn.Module):
    """The full model without peft, answering `get_base_model()` as a PeftModel does."""

    def __init__(self, full: torch.nn.Module):
        super().__init__()
        self.full = full

    def get_base_model(self) -> torch.nn.Module:
        return self.full


def count_params(module: torch.nn.Module, *, trainable: bool = False) -> int:
    return sum(p.numel() for p in module.parameters() if p.requires_grad or not trainable)


# ----------------------------------------------------------------------------- steps


def _pg_loss(logprobs_N: torch.Tensor, advantages_N: torch.Tensor, loss_mask_N: torch.Tensor, n_loss: int):
    # Normalised by the whole step's loss tokens, so micro-batch losses sum to the step loss
    # whatever the layout.
    return -(advantages_N * logprobs_N * loss_mask_N).sum() / n_loss


def _optimizer_step(optimizer) -> None:
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)


def cached_step(model, optimizer, batch: BenchBatch, device: torch.device) -> float:
    """The saccade trainer's step: pack, forward on cached embeddings, loss, backward, AdamW."""
    total = 0.0
    mbs = pack(
        batch.samples,
        batch.lookup,
        max_tokens=batch.max_tokens,
        image_token_id=batch.image_token_id,
        spatial_merge_size=batch.merge,
    )
    for mb in mbs:
        logprobs_N, _ = forward_logprobs(model, mb, only_loss_tokens=True)
        loss = _pg_loss(logprobs_N, mb.advantages.to(device), mb.loss_mask.to(device), batch.num_loss_tokens)
        loss.backward()
        total += loss.item()
    _optimizer_step(optimizer)
    return total


def padded_step(model, optimizer, batch: BenchBatch, device: torch.device) -> float:
    """The cached path on right-padded (rows, longest) batches instead of packed rows."""
    policy = unwrap_policy(model)
    total = 0.0
    for pb in pad_batches(batch):
        embeds = pb.image_embeds_NH.to(device) if pb.image_embeds_NH is not None else None
        deepstack = pb.deepstack_KNH.to(device) if pb.deepstack_KNH is not None else None
        input_ids_BL = pb.input_ids_BL.to(device)
        hidden_BLH = policy.hidden_states(input_ids_BL, pb.position_ids_4BL.to(device), embeds, deepstack)
        # Same tokens as the packed path: loss tokens only, each predicted from the state before it.
        b_T, t_T = pb.loss_mask_BL.to(device).nonzero(as_tuple=True)
        logprobs_T, _ = token_logprobs_and_entropy(
            hidden_BLH[b_T, t_T - 1], policy.lm_head.weight, input_ids_BL[b_T, t_T], bias_V=policy.lm_head.bias
        )
        loss = -(pb.advantages_BL.to(device)[b_T, t_T] * logprobs_T).sum() / batch.num_loss_tokens
        loss.backward()
        total += loss.item()
    _optimizer_step(optimizer)
    return total


def full_micro_batches(batch: BenchBatch) -> list[tuple[MicroBatch, torch.Tensor | None]]:
    """The full path's micro-batches: the packed bins (or one sample each) plus their pixel values.

    Like `collate`, but without the cache: the image features come from the tower every step.
    """
    if batch.full_layout == "packed":
        bins = first_fit_decreasing([s.num_tokens for s in batch.samples], batch.max_tokens)
    else:
        bins = [[i] for i in range(len(batch.samples))]
    out = []
    for b in bins:
        group = [batch.samples[i] for i in b]
        lengths = [s.num_tokens for s in group]
        cu = torch.zeros(len(group) + 1, dtype=torch.int32)
        cu[1:] = torch.tensor(lengths).cumsum(0)
        mb = MicroBatch(
            input_ids=torch.cat([s.input_ids for s in group]).unsqueeze(0),
            position_ids=torch.cat([s.position_ids for s in group], dim=1).unsqueeze(1),
            loss_mask=torch.cat([s.loss_mask for s in group]),
            inference_logprobs=torch.cat([s.inference_logprobs for s in group]),
            advantages=torch.cat([torch.full((n,), s.advantage) for s, n in zip(group, lengths, strict=True)]),
            cu_seqlens=cu,
            image_embeds=None,
            deepstack=None,
            image_grid_thw=torch.cat([s.image_grid_thw for s in group]),
            sample_ids=[s.sample_id for s in group],
        )
        pixels = [batch.pixel_values[s.sample_id] for s in group if s.num_images]
        out.append((mb, torch.cat(pixels) if pixels else None))
    return out


def full_step(model, optimizer, batch: BenchBatch, device: torch.device) -> float:
    """A full-VLM step: the vision tower runs on the pixel values again, then the same loss."""
    full = model.get_base_model()
    dtype = full.lm_head.weight.dtype
    total = 0.0
    for mb, pixels_PD in full_micro_batches(batch):
        kwargs = {}
        if pixels_PD is not None:
            kwargs = dict(pixel_values=pixels_PD.to(device, dtype), image_grid_thw=mb.image_grid_thw.to(device))
        # Positions passed in (with the restarting text row), use_cache=False: without both,
        # packed samples would attend to each other.
        out = full.model(
            input_ids=mb.input_ids.to(device),
            position_ids=mb.position_ids.to(device),
            attention_mask=None,
            use_cache=False,
            **kwargs,
        )
        want_N = predicted_positions(mb, only_loss_tokens=True).to(device)
        source = want_N.nonzero().squeeze(-1) - 1
        logprobs_T, _ = token_logprobs_and_entropy(
            out.last_hidden_state[0, source], full.lm_head.weight, mb.input_ids[0].to(device)[want_N]
        )
        logprobs_N = torch.zeros(mb.num_tokens, device=device).masked_scatter(want_N, logprobs_T)
        loss = _pg_loss(logprobs_N, mb.advantages.to(device), mb.loss_mask.to(device), batch.num_loss_tokens)
        loss.backward()
        total += loss.item()
    _optimizer_step(optimizer)
    return total


STEPS = {"cached": cached_step, "full": full_step, "padded": padded_step, "checkpointed": cached_step}


class VisionTimer:
    """Wall time spent inside the full model's vision tower (forward hooks)."""

    def __init__(self, tower: torch.nn.Module, device: torch.device):
        self.device, self.seconds, self._start = device, 0.0, 0.0
        tower.register_forward_pre_hook(self._before)
        tower.register_forward_hook(self._after)

    def _before(self, *_):
        _sync(self.device)
        self._start = time.perf_counter()

    def _after(self, *_):
        _sync(self.device)
        self.seconds += time.perf_counter() - self._start


CACHED_FAMILY = ("cached", "padded", "checkpointed")  # one model and optimizer between them


def _set_checkpointing(model, on: bool) -> None:
    """Per-layer activation checkpointing on or off, on the model the cached variants share."""
    policy = unwrap_policy(model)
    if on:
        policy.enable_activation_checkpointing()  # as `trainer.activation_checkpointing` turns it on
    else:
        policy.language_model.gradient_checkpointing_disable()


def _run_rounds(names, runners, data, dev, steps, times, vision_s, warmup_loss, vision_timer, console) -> None:
    """One warm-up round (lr 0) and `steps` measured rounds of these variants, interleaved step
    by step; the order rotates every round so that no variant always runs first."""
    for round_ in range(steps + 1):
        warmup = round_ == 0
        k = round_ % len(names)
        for name in names[k:] + names[:k]:
            model, optimizer = runners[name]
            if name in CACHED_FAMILY:
                _set_checkpointing(model, name == "checkpointed")
            # lr 0 on the warm-up step: every variant's warm-up loss is taken on the initial weights.
            _set_lr(optimizer, 0.0 if warmup else LR)
            if vision_timer is not None:
                vision_timer.seconds = 0.0
            _sync(dev)
            t0 = time.perf_counter()
            loss = STEPS[name](model, optimizer, data, dev)
            _sync(dev)
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


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _set_lr(optimizer, lr: float) -> None:
    for group in optimizer.param_groups:
        group["lr"] = lr


# ----------------------------------------------------------------------------- memory


def _host_rss_mb() -> float:
    kb = proc_status_kb("VmRSS")
    if kb is None:  # not Linux: ru_maxrss is the best there is (bytes on macOS)
        import resource

        return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / (2**20 if sys.platform == "darwin" else 1024)
    return kb / 1024


def _host_peak_mb() -> float:
    kb = proc_status_kb("VmHWM")
    return _host_rss_mb() if kb is None else kb / 1024


def _reset_host_peak() -> bool:
    """Reset the kernel's peak-RSS mark to the current RSS (Linux >= 4.0). False if not possible."""
    try:
        Path("/proc/self/clear_refs").write_text("5")
        return True
    except OSError:
        return False


def measure_peak_memory(path_name: str, data_file: str, model_path: str, device: str, dtype: str,
                        threads: int, seed: int, full_finetune: bool = False, attention: str = "auto") -> dict:
    """Runs in a fresh spawned process: load, warm-up step, one step; report peak memory growth."""
    torch.set_num_threads(threads)
    # Both paths import the same modules before the baseline, so imports count for neither.
    import peft  # noqa: F401
    import transformers.models.qwen3_vl.modeling_qwen3_vl  # noqa: F401

    dev, dt = torch.device(device), getattr(torch, dtype)
    baseline_mb = _host_rss_mb()
    if dev.type == "cuda":
        torch.cuda.reset_peak_memory_stats(dev)
    batch: BenchBatch = torch.load(data_file, weights_only=False)
    if path_name == "full":
        model, optimizer = build_full(model_path, dtype=dt, device=dev, seed=seed, full_finetune=full_finetune)
    else:
        model, optimizer = build_cached(model_path, dtype=dt, device=dev, seed=seed,
                                        checkpointing=path_name == "checkpointed", full_finetune=full_finetune,
                                        attention=attention)
    loaded_mb = _host_rss_mb() - baseline_mb
    # Leave out the loading transient (from_pretrained may hold two copies for a moment).
    reset = _reset_host_peak()
    for lr in (0.0, LR):
        _set_lr(optimizer, lr)
        STEPS[path_name](model, optimizer, batch, dev)
    _sync(dev)
    out = {"loaded_mb": loaded_mb, "host_peak_mb": _host_peak_mb() - baseline_mb, "peak_reset": reset}
    if dev.type == "cuda":
        out["cuda_peak_mb"] = torch.cuda.max_memory_allocated(dev) / 2**20
    out["peak_mb"] = out.get("cuda_peak_mb", out["host_peak_mb"])
    return out


def measure_memory_in_fresh_processes(
    data: BenchBatch, model_path: str, dev: torch.device, dtype_name: str, threads: int, seed: int,
    full_finetune: bool = False, attention: str = "auto",
) -> dict[str, dict]:
    """The cached, full and checkpointed paths' peak memory, each in its own spawned process
    (a fresh interpreter).

    On the CPU two run at the same time, one thread each: a peak does not depend on speed, and
    the imports (most of their wall time) are single-threaded anyway. On a GPU one at a time:
    two 2B full fine-tunings (about 35 GB each) do not fit one 80 GB card together.
    """
    names = ("cached", "full", "checkpointed")
    at_once = 1 if dev.type == "cuda" else 2
    with tempfile.TemporaryDirectory(prefix="saccade-bench-") as tmp:
        files = {}
        for name in names:
            files[name] = str(Path(tmp) / f"{name}.pt")
            torch.save(_view_for(name, data), files[name])
        # max_tasks_per_child=1: each path gets a process of its own, never a used one.
        with ProcessPoolExecutor(max_workers=at_once, mp_context=get_context("spawn"), max_tasks_per_child=1) as pool:
            futures = {
                name: pool.submit(
                    measure_peak_memory, name, files[name], model_path, str(dev), dtype_name,
                    max(1, threads // at_once), seed, full_finetune, attention,
                )
                for name in names
            }
            return {name: f.result() for name, f in futures.items()}


# ----------------------------------------------------------------------------- the bench


def _load_avg() -> float | None:
    try:
        return os.getloadavg()[0]
    except OSError:
        return None


def _view_for(path_name: str, data: BenchBatch) -> BenchBatch:
    # Each memory process gets only the inputs its path reads: the cache for the cached paths,
    # pixel values for the full path (these count in its peak, as they would in a trainer).
    if path_name != "full":
        return replace(data, pixel_values={})
    return replace(data, embeddings={})


def run_trainer_bench(
    *,
    preset: str = "small",
    steps: int = 3,
    batch: int = 8,
    seed: int = 0,
    device: str = "auto",
    threads: int = 2,
    max_tokens: int | None = None,
    padded_rows: int = 4,
    max_side: int | None = None,
    max_images: int = 3,
    full_layout: str = "packed",
    measure_memory: bool = True,
    progress: bool = True,
    full_finetune: bool = False,
    peak_tflops: float | None = None,
    attention: str = "auto",
) -> dict:
    """Measure cached vs full-VLM and packed vs padded training steps; see the module docstring.

    steps: measured steps per variant, after one warm-up step each. batch: samples per step.
    max_tokens: packed micro-batch budget (default DEFAULT_MAX_TOKENS, raised to the longest sample).
    padded_rows: samples per padded micro-batch. max_side: largest image side drawn (default:
    the preset's max_pixels side). full_layout: "packed" (same micro-batches as cached) or
    "per_sample" (one sample per forward). device: "auto" (cuda if available), "cpu", "cuda".
    full_finetune: train every language-model weight instead of LoRA. peak_tflops: the
    device's dense bf16 peak for the MFU (default: known GPUs' spec sheet; none on a CPU).
    """
    if preset not in PRESETS:
        raise ValueError(f"unknown preset {preset!r}; choose one of {sorted(PRESETS)}")
    if min(steps, batch, padded_rows, max_images) < 1:
        raise ValueError("steps, batch, padded_rows and max_images must be >= 1")
    if full_layout not in ("packed", "per_sample"):
        raise ValueError(f"full_layout must be 'packed' or 'per_sample', not {full_layout!r}")
    from rich.console import Console

    console = Console(stderr=True, quiet=not progress)
    started = time.perf_counter()
    # Other processes on the machine change every figure: record how busy it was.
    load_start = _load_avg()
    previous_threads = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        dev = resolve_device(device, setting="--device")
        # fp32 on CPU (bf16 matmuls there are an emulation, not the production setting).
        dtype = torch.bfloat16 if dev.type == "cuda" else torch.float32
        dtype_name = str(dtype).removeprefix("torch.")
        spec = PRESETS[preset]
        model_path = str(tiny_model_path(preset, seed=0))
        limits = ImagesConfig(min_pixels=32 * 32, max_pixels=spec.max_pixels)
        side = max_side or math.isqrt(spec.max_pixels)

        # The engine's side, once: tokenize, and encode every image with the frozen tower.
        console.log(f"preparing {batch} conversations, preset {preset!r}, {dev} {dtype_name}, {threads} threads")
        processor = load_processor(model_path)
        tower = load_vision_tower(model_path, dtype=dtype, device=dev)
        vision_params = count_params(tower)
        encoder = VisionEncoder(tower, processor, limits=limits)
        conversations = bench_conversations(batch, seed=seed, max_side=side, max_images=max_images)
        data, encode_timings = prepare_batch(
            processor, encoder, conversations, seed=seed, limits=limits,
            max_tokens=max_tokens, padded_rows=padded_rows, full_layout=full_layout,
        )
        del tower, encoder
        _free(dev)  # the tower's memory back to the device before the memory processes start
        padded_frac, packed_frac = pad_fraction(data)
        console.log(
            f"{data.num_tokens:,} tokens in {batch} samples "
            f"({min(s.num_tokens for s in data.samples)}-{max(s.num_tokens for s in data.samples)} each); "
            f"padded layout is {padded_frac:.0%} padding"
        )

        # (a) peak memory: one fresh process per path, one after the other (this one waits).
        memory: dict[str, dict] = {}
        if measure_memory:
            console.log("peak memory of the cached and the full path, each in a fresh process")
            memory = measure_memory_in_fresh_processes(data, model_path, dev, dtype_name, threads, seed,
                                                       full_finetune=full_finetune, attention=attention)

        # Timing, in this process. cached, padded and checkpointed share one model and optimizer
        # (the same weights; checkpointing is switched on for its steps alone); the full VLM has
        # its own. With LoRA both are held and the four variants interleave step by step; with
        # full fine-tuning (about 35 GB of state per model at 2B) the cached family runs first,
        # is freed, then the full model runs: never more than one model's state on the device.
        interleave = not full_finetune
        common = dict(dtype=dtype, device=dev, seed=seed, full_finetune=full_finetune)
        times: dict[str, list[float]] = {name: [] for name in VARIANTS}
        vision_s: list[float] = []
        warmup_loss: dict[str, float] = {}
        families = [VARIANTS] if interleave else [CACHED_FAMILY, ("full",)]
        for family in families:
            console.log("loading " + " and ".join(
                ["the cached (LM-only) model"] * any(n != "full" for n in family) + ["the full model"] * ("full" in family)))
            runners: dict[str, tuple] = {}
            if any(n != "full" for n in family):
                cached_model, cached_opt = build_cached(model_path, attention=attention, **common)
                trainable_params = count_params(cached_model, trainable=True)
                lm_params = count_params(cached_model) - (0 if full_finetune else trainable_params)
                attention_used = unwrap_policy(cached_model).config.text_config._attn_implementation
                runners.update({n: (cached_model, cached_opt) for n in CACHED_FAMILY})
                del cached_model, cached_opt
            if "full" in family:
                full_model, full_opt = build_full(model_path, **common)
                vision_timer = VisionTimer(full_model.get_base_model().model.visual, dev)
                runners["full"] = (full_model, full_opt)
                del full_model, full_opt
            _run_rounds(family, runners, data, dev, steps, times, vision_s, warmup_loss, vision_timer
                        if "full" in family else None, console)
            runners.clear()  # the family's models and optimizers go before the next family's load
            _free(dev)
        console.log("warm-up losses: " + "  ".join(f"{n} {warmup_loss[n]:+.6f}" for n in VARIANTS))

        med = {name: statistics.median(times[name]) for name in VARIANTS}
        tps = {name: data.num_tokens / med[name] for name in VARIANTS}
        lengths = [s.num_tokens for s in data.samples]
        text = model_dims(model_path).text
        flops = lm_step_flops(text, lengths, data.num_loss_tokens, full_finetune=full_finetune)
        peak = peak_tflops if peak_tflops is not None else spec_peak_tflops(dev)
        result = {
            "config": {
                "preset": preset,
                "model": model_path,
                "lm_params": lm_params,
                "vision_params": vision_params,
                "trainable_params": trainable_params,
                "lora": {"rank": lora_settings().rank, "targets": lora_settings().target_modules},
                "full_finetune": full_finetune,
                "attention": attention_used,
                "interleaved": interleave,
                "peak_tflops": peak,
                "batch": batch,
                "steps": steps,
                "warmup_steps": 1,
                "device": str(dev),
                "dtype": dtype_name,
                "torch_threads": torch.get_num_threads(),
                "max_tokens": data.max_tokens,
                "padded_rows": padded_rows,
                "max_side": side,
                "max_images": max_images,
                "full_layout": full_layout,
                "seed": seed,
            },
            "batch_tokens": data.num_tokens,
            "batch_loss_tokens": data.num_loss_tokens,
            "batch_images": sum(s.num_images for s in data.samples),
            "batch_image_tokens": sum(int((s.input_ids == data.image_token_id).sum()) for s in data.samples),
            "sample_tokens_min": min(lengths),
            "sample_tokens_max": max(lengths),
            "packed_micro_batches": len(first_fit_decreasing(lengths, data.max_tokens)),
            "padded_micro_batches": math.ceil(batch / padded_rows),
            **encode_timings,
            # (a) cached embeddings vs full VLM
            "cached_step_s": med["cached"],
            "full_step_s": med["full"],
            "full_over_cached_step_time": med["full"] / med["cached"],
            "cached_tokens_per_s": tps["cached"],
            "full_tokens_per_s": tps["full"],
            "full_vision_s": statistics.median(vision_s),
            "full_vision_share": statistics.median(v / t for v, t in zip(vision_s, times["full"], strict=True)),
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
            "estimated_cached_peak_mb": estimated_peak_mb(text, data, dtype_name, full_finetune, checkpointing=False),
            "estimated_checkpointed_peak_mb": estimated_peak_mb(text, data, dtype_name, full_finetune,
                                                                checkpointing=True),
            # checks and raw figures
            "warmup_loss": warmup_loss,
            "max_warmup_loss_diff": max(abs(warmup_loss[n] - warmup_loss["cached"]) for n in VARIANTS),
            "step_times_s": times,
        }
        if memory:
            result.update(
                cached_peak_mb=memory["cached"]["peak_mb"],
                full_peak_mb=memory["full"]["peak_mb"],
                full_over_cached_peak_memory=memory["full"]["peak_mb"] / memory["cached"]["peak_mb"],
                checkpointed_peak_mb=memory["checkpointed"]["peak_mb"],
                activation_checkpointing_peak_ratio=memory["checkpointed"]["peak_mb"] / memory["cached"]["peak_mb"],
                memory=memory,
            )
            result.update(estimate_check(result, host=dev.type != "cuda"))
            if result["estimate_flag"] != "ok":
                console.log(f"[bold]saccade memory's estimate: {result['estimate_note']}[/bold]")
        result["config"]["load_avg_1m"] = {"start": load_start, "end": _load_avg()}
        result["wall_s"] = time.perf_counter() - started
        return result
    finally:
        torch.set_num_threads(previous_threads)


# ----------------------------------------------------------------------------- FLOPs, estimates


def lm_step_flops(text: TextDims, lengths: list[int], loss_tokens: int, *, full_finetune: bool) -> float:
    """The language model's FLOPs in one training step over samples of these lengths.

    Counted: the decoder's linears (P weights: 2 P per token forward, 2 P backward for the
    inputs' gradients, and with full fine-tuning 2 P for the weights'; LoRA's adapters are
    negligible); causal attention (2 q_dim n^2 per layer forward for a sample of n tokens,
    twice that backward); the lm_head on the loss tokens only, as the trainer computes it
    (2 V H each way, and the weight's gradient with full fine-tuning). Not counted: the vision
    tower (the cached path never runs it), norms and elementwise work, and recomputation
    (activation checkpointing, the chunked logprobs' backward): MFU counts the model's work.
    """
    linear = text.num_hidden_layers * sum(i * o for i, o in text.linear_shapes().values())
    passes = 6 if full_finetune else 4
    attention = 6 * text.num_hidden_layers * text.q_dim * sum(n * n for n in lengths)
    head = passes * text.vocab_size * text.hidden_size * loss_tokens
    return passes * linear * sum(lengths) + attention + head


# Dense bf16 peak, TFLOP/s, from the spec sheets (SXM parts), by the name CUDA reports.
SPEC_PEAK_TFLOPS = {"H100": 989.4, "H200": 989.4, "A100": 312.0}


def spec_peak_tflops(device: torch.device) -> float | None:
    if device.type != "cuda":
        return None
    name = torch.cuda.get_device_name(device)
    return next((v for k, v in SPEC_PEAK_TFLOPS.items() if k in name), None)


def estimated_peak_mb(text: TextDims, data: BenchBatch, dtype_name: str, full_finetune: bool, *,
                      checkpointing: bool) -> float:
    """`saccade memory`'s estimate of the cached path's peak for this batch (the assumed CUDA
    context left out: the measured peak is what the allocator handed out)."""
    from saccade.memory import ModelDims, VisionDims

    # The vision dims only size the micro-batch's image embeddings (main + DeepStack levels).
    levels = len(next(iter(data.embeddings.values())).deepstack) if data.embeddings else 0
    vision = VisionDims(1, 1, 1, text.hidden_size, 1, deepstack_levels=levels)
    est = trainer_memory(
        ModelDims("bench", text, vision), dtype=dtype_name, lora_rank=None if full_finetune else lora_settings().rank,
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
