"""The trainer benchmark's four variants (`saccade bench trainer`): their models and their steps.

Every step is one `saccade.trainer.step.optimizer_step`, the trainer's own (gradients
accumulated over the micro-batches, each sent to the device one ahead of the one computed,
the non-finite check, the clip, AdamW); the variants differ in the micro-batch loss they hand
it and the layout it runs on:

- cached: `load_policy_lm` + LoRA (or every language-model weight), image embeddings from the
  cache, packed micro-batches;
- checkpointed: the same model with per-layer activation checkpointing on;
- padded: the same model on right-padded rows;
- full: transformers' whole model with the same LoRA targets on the language model, the
  vision tower run again on the pixel values every step.

All compute the same loss on the same tokens, -(advantage * logprob) summed over the step's
loss tokens / their count. Each variant's peak memory is measured in a fresh process
(`measure_memory_in_fresh_processes`).
"""

from __future__ import annotations

import sys
import tempfile
import time
from concurrent.futures import ProcessPoolExecutor
from dataclasses import replace
from multiprocessing import get_context
from pathlib import Path

import torch

from saccade.tools.bench.trainer_data import BenchBatch, FullMicroBatch, PaddedBatch, full_micro_batches, pad_batches
from saccade.config import LoraConfig
from saccade.models.lm import apply_lora, load_policy_lm, lora_target_modules, set_full_finetune, unwrap_policy
from saccade.models.loading import load_family, load_full_model
from saccade.process_stats import proc_status_kb
from saccade.timing import synchronize
from saccade.trainer.forward import forward_logprobs, predicted_positions
from saccade.trainer.logprobs import token_logprobs_and_entropy
from saccade.trainer.packing import pack
from saccade.trainer.step import build_optimizer, optimizer_step, staged

VARIANTS = ("cached", "full", "padded", "checkpointed")
CACHED_FAMILY = ("cached", "padded", "checkpointed")  # one model and optimizer between them
LR = 1e-4
GRAD_CLIP = 1.0  # trainer.grad_clip's default: the clip is part of the trainer's step


# ----------------------------------------------------------------------------- models


def lora_settings() -> LoraConfig:
    return LoraConfig()


def _optimizer(model: torch.nn.Module):
    """The trainer's own AdamW (float32 master weights for bf16 full fine-tuning) and a constant
    schedule: (optimizer, scheduler)."""
    return build_optimizer(model, lr=LR, weight_decay=0.0, schedule=lambda k: 1.0)


def build_cached(model_path, *, dtype: torch.dtype, device: torch.device, seed: int, checkpointing: bool = False,
                 full_finetune: bool = False, attention: str = "auto"):
    """The saccade trainer's model: LM only, LoRA on its linears (or every LM weight); with its
    AdamW and scheduler."""
    policy = load_policy_lm(model_path, dtype=dtype, device=device, attn_implementation=attention)
    if checkpointing:
        policy.enable_activation_checkpointing()
    torch.manual_seed(seed)
    model = set_full_finetune(policy) if full_finetune else apply_lora(policy, lora_settings())
    return (model, *_optimizer(model))


def build_full(model_path, *, dtype: torch.dtype, device: torch.device, seed: int, full_finetune: bool = False,
               lora_rank: int | None = None):
    """The family's full model, with the same LoRA targets anchored to the language model (or every
    language-model weight training): vision stays frozen. `lora_rank`: another rank (alpha 2x).
    Returns (model, optimizer, scheduler)."""
    import peft

    full = load_full_model(model_path, dtype=dtype).to(device)
    if full_finetune:
        for name, p in full.named_parameters():
            p.requires_grad_(".language_model." in name or name.startswith("lm_head"))
        full.train()
        return (_FullFinetuned(full), *_optimizer(full))
    settings = lora_settings()
    if lora_rank is not None:
        settings = LoraConfig(rank=lora_rank, alpha=2 * lora_rank)
    # The family's parameter targets too (MoE experts), as `apply_lora` wraps them on the cached
    # path: without them the full path would train fewer adapters and the ratios would compare
    # unequal work. The tower has no parameter of those names.
    family = load_family(model_path)
    parameters = list(family.lora_target_parameters)
    config = peft.LoraConfig(
        r=settings.rank,
        lora_alpha=settings.alpha,
        lora_dropout=settings.dropout,
        target_modules=rf"model\.language_model\..*\.({'|'.join(lora_target_modules(settings, family))})",
        bias="none",
        **({"target_parameters": parameters} if parameters else {}),
    )
    torch.manual_seed(seed)
    model = peft.get_peft_model(full, config)
    assert not any("visual" in n for n, p in model.named_parameters() if p.requires_grad), "vision must stay frozen"
    return (model, *_optimizer(model))


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


def cached_step(model, optimizer, scheduler, batch: BenchBatch, device: torch.device) -> float:
    """The saccade trainer's step: pack (page-locked on a GPU, as `saccade rl` hands a step over),
    then forward on cached embeddings, loss, backward and AdamW. Returns the step's loss."""
    micro_batches = staged(pack(batch.samples, batch.lookup, max_tokens=batch.max_tokens,
                                image_token_id=batch.image_token_id, spatial_merge_size=batch.merge,
                                video_token_id=batch.video_token_id), device)

    def loss(k: int, mb):
        logprobs_N, _ = forward_logprobs(model, mb, only_loss_tokens=True)
        return _pg_loss(logprobs_N, mb.advantages, mb.loss_mask, batch.num_loss_tokens), {}

    return optimizer_step(optimizer, scheduler, micro_batches, loss, device=device, grad_clip=GRAD_CLIP).sums["loss"]


def padded_step(model, optimizer, scheduler, batch: BenchBatch, device: torch.device) -> float:
    """The cached path on right-padded (rows, longest) batches instead of packed rows."""
    policy = unwrap_policy(model)

    def loss(k: int, pb: PaddedBatch):
        hidden_BLH = policy.hidden_states(pb.input_ids_BL, pb.position_ids_4BL, pb.image_embeds_MH, pb.deepstack_ZMH)
        # Same tokens as the packed path: loss tokens only, each predicted from the state before it.
        b_T, t_T = pb.loss_mask_BL.nonzero(as_tuple=True)
        logprobs_T, _ = token_logprobs_and_entropy(
            hidden_BLH[b_T, t_T - 1], policy.lm_head.weight, pb.input_ids_BL[b_T, t_T], bias_V=policy.lm_head.bias
        )
        return -(pb.advantages_BL[b_T, t_T] * logprobs_T).sum() / batch.num_loss_tokens, {}

    return optimizer_step(optimizer, scheduler, pad_batches(batch), loss, device=device,
                          grad_clip=GRAD_CLIP).sums["loss"]


def full_step(model, optimizer, scheduler, batch: BenchBatch, device: torch.device) -> float:
    """A full-VLM step: the vision tower runs on the pixel values again, then the same loss."""
    full = model.get_base_model()
    dtype = full.lm_head.weight.dtype

    def loss(k: int, fmb: FullMicroBatch):
        mb, kwargs = fmb.micro_batch, {}
        if fmb.pixels_XD is not None:
            kwargs = dict(pixel_values=fmb.pixels_XD.to(dtype), image_grid_thw=mb.image_grid_thw)
        # Positions passed in (with the restarting text row), use_cache=False: without both,
        # packed samples would attend to each other.
        out = full.model(input_ids=mb.input_ids, position_ids=mb.position_ids, attention_mask=None, use_cache=False,
                         **kwargs)
        want_N = predicted_positions(mb, only_loss_tokens=True).to(device)
        source = want_N.nonzero().squeeze(-1) - 1
        logprobs_T, _ = token_logprobs_and_entropy(out.last_hidden_state[0, source], full.lm_head.weight,
                                                   mb.input_ids[0][want_N])
        logprobs_N = torch.zeros(mb.num_tokens, device=device).masked_scatter(want_N, logprobs_T)
        return _pg_loss(logprobs_N, mb.advantages, mb.loss_mask, batch.num_loss_tokens), {}

    return optimizer_step(optimizer, scheduler, full_micro_batches(batch), loss, device=device,
                          grad_clip=GRAD_CLIP).sums["loss"]


STEPS = {"cached": cached_step, "full": full_step, "padded": padded_step, "checkpointed": cached_step}


def set_checkpointing(model, on: bool) -> None:
    """Per-layer activation checkpointing on or off, on the model the cached variants share."""
    policy = unwrap_policy(model)
    if on:
        policy.enable_activation_checkpointing()  # as `trainer.activation_checkpointing` turns it on
    else:
        policy.language_model.gradient_checkpointing_disable()


def set_lr(optimizer, lr: float) -> None:
    """The next step's learning rate (0: the warm-up step, which leaves the weights as they are)."""
    for group in optimizer.param_groups:
        group["lr"] = lr


class VisionTimer:
    """Wall time spent inside the full model's vision tower (forward hooks)."""

    def __init__(self, tower: torch.nn.Module, device: torch.device):
        self.device, self.seconds, self._start = device, 0.0, 0.0
        tower.register_forward_pre_hook(self._before)
        tower.register_forward_hook(self._after)

    def _before(self, *_):
        synchronize(self.device)
        self._start = time.perf_counter()

    def _after(self, *_):
        synchronize(self.device)
        self.seconds += time.perf_counter() - self._start


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

    load_family(model_path).full_model_class()  # imports the family's transformers modules

    dev, dt = torch.device(device), getattr(torch, dtype)
    baseline_mb = _host_rss_mb()
    if dev.type == "cuda":
        torch.cuda.reset_peak_memory_stats(dev)
    batch: BenchBatch = torch.load(data_file, weights_only=False)
    if path_name == "full":
        model, optimizer, scheduler = build_full(model_path, dtype=dt, device=dev, seed=seed,
                                                 full_finetune=full_finetune)
    else:
        model, optimizer, scheduler = build_cached(model_path, dtype=dt, device=dev, seed=seed,
                                        checkpointing=path_name == "checkpointed", full_finetune=full_finetune,
                                        attention=attention)
    loaded_mb = _host_rss_mb() - baseline_mb
    # Leave out the loading transient (from_pretrained may hold two copies for a moment).
    reset = _reset_host_peak()
    for lr in (0.0, LR):
        set_lr(optimizer, lr)
        STEPS[path_name](model, optimizer, scheduler, batch, dev)
    synchronize(dev)
    out = {"loaded_mb": loaded_mb, "host_peak_mb": _host_peak_mb() - baseline_mb, "peak_reset": reset,
           # what the trained model holds of a vision tower: nothing on the cached paths
           "tower_params": sum(p.numel() for n, p in model.named_parameters() if "visual" in n)}
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


def _view_for(path_name: str, data: BenchBatch) -> BenchBatch:
    # Each memory process gets only the inputs its path reads: the cache for the cached paths,
    # pixel values for the full path (these count in its peak, as they would in a trainer).
    if path_name != "full":
        return replace(data, pixel_values={})
    return replace(data, embeddings={})
