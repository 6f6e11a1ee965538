"""`saccade bench video-memory`: the trainer's peak memory against frames per clip, the text fixed.

The claim it measures (docs/video.md, "Memory"): the trainer never runs the vision tower and
never holds a clip's pixel values, so a clip costs it its tokens and nothing more; its peak grows
with the step's tokens, linearly, whatever those tokens stand for.

For each frame count, one step's batch: `samples` completions of one prompt, the prompt a clip of
that many frames (`side` x `side` px, 2 frames a second, a square moving right) and one fixed
question, each completion the same `answer_words` words. The clip goes through
`messages_to_inputs` (the model's own video processor) and the frozen tower once
(`VisionEncoder.encode_videos`), before anything is measured; the batch handed on holds the
samples and the clip's cached embedding, not its pixels. Then, in a fresh spawned process per
frame count, one after the other (`trainer_variants.measure_peak_memory`, as `saccade bench
trainer` measures its cached path): the trainer's model (`load_policy_lm` + LoRA, or every
language-model weight), a warm-up step at lr 0 and one step, each the trainer's own pack
(`video_token_id`: clips gathered after images) and `optimizer_step`. The samples are packed
whole (no shared prompts) into one micro-batch, so the peak is the whole step's tokens'.

Peak memory is the process's growth over its resident set after imports (CPU: the kernel's
VmHWM, reset after loading; CUDA: max_memory_allocated), weights, optimizer state, the batch and
activations included. Reported per frame count: the clip's video pads, the tokens per sample and
per step, the peak, the tower parameters the trained model holds (0), the pixel values a trainer
that runs the tower would have been handed for the step (`pixel_values_videos`, float32, per
sample, times `samples`), and the least-squares line of peak against step tokens: its slope (KiB
per token), intercept, and largest residual, beside `saccade memory`'s activation bytes per prompt
token (`activation_bytes_per_token`, loss fraction 0: a clip's tokens are never loss tokens).
"""

from __future__ import annotations

import random
import tempfile
import time
from concurrent.futures import ProcessPoolExecutor
from multiprocessing import get_context
from pathlib import Path

import numpy as np
import torch

from saccade.config import ImagesConfig, VideoConfig
from saccade.config.bench import VideoMemoryBenchConfig
from saccade.data.messages import messages_to_inputs
from saccade.devices import resolve_device
from saccade.models.loading import load_processor, load_vision_tower
from saccade.models.presets import preset_path
from saccade.models.vision import VisionEncoder
from saccade.tools.bench.trainer_data import BenchBatch
from saccade.tools.bench.trainer_variants import measure_peak_memory
from saccade.trainer.samples import make_sample

QUESTION = "Which way does the white square move, and how far does it go?"
FPS = 2.0  # the clip's frames 1/FPS seconds apart (its timestamps)
_WORDS = "the square moves right from the left edge to the right edge across the frame over time".split()


def moving_square(frames: int, side: int, seed: int) -> np.ndarray:
    """(frames, side, side, 3) uint8 RGB: a white square of side/4 moving left to right over a
    background of one random colour."""
    rng = np.random.default_rng(seed)
    out = np.empty((frames, side, side, 3), np.uint8)
    out[:] = rng.integers(0, 200, 3, dtype=np.uint8)
    box = side // 4
    for i in range(frames):
        x = i * (side - box) // max(1, frames - 1)
        out[i, side // 2 - box // 2: side // 2 + box // 2, x:x + box] = 255
    return out


def clip_conversation(frames: np.ndarray, answer: str) -> list[dict]:
    """The clip (frames, height, width, 3) uint8, FPS apart, and the question in the user turn; the
    answer after."""
    return [
        {"role": "user", "content": [{"type": "video", "video": frames, "fps": FPS},
                                     {"type": "text", "text": QUESTION}]},
        {"role": "assistant", "content": answer},
    ]


def clip_limits(cfg: VideoMemoryBenchConfig, frames: int) -> ImagesConfig:
    """Bounds that leave every frame at side x side (Qwen3-VL's video processor bounds all the
    frames together) and take `frames` whole."""
    pixels = cfg.side * cfg.side
    video = VideoConfig(min_pixels=32 * 32, max_pixels=pixels * frames, max_frames=frames)
    return ImagesConfig(min_pixels=32 * 32, max_pixels=max(pixels, 32 * 32), video=video)


def prepare_point(cfg: VideoMemoryBenchConfig, processor, tower, frames: int) -> tuple[BenchBatch, dict]:
    """One step's batch at `frames` frames per clip: `cfg.samples` completions of the clip's prompt,
    the clip through the tower once. Returns the batch (samples and the clip's embedding, no pixel
    values) and what the point is made of."""
    limits = clip_limits(cfg, frames)
    encoder = VisionEncoder(tower, processor, limits=limits)  # its sampling settings are the point's
    words = [_WORDS[k % len(_WORDS)] for k in range(cfg.answer_words)]
    messages = clip_conversation(moving_square(frames, cfg.side, cfg.seed), " ".join(words))
    inputs = messages_to_inputs(messages, processor, limits=limits, sample=f"clip-{frames}")
    prompt = messages_to_inputs(messages[:-1], processor, limits=limits, add_generation_prompt=True)
    n_prompt = prompt.input_ids.shape[0]
    assert torch.equal(inputs.input_ids[:n_prompt], prompt.input_ids), "chat template is not prefix-stable"
    im_end = processor.tokenizer.convert_tokens_to_ids("<|im_end|>")
    end = int((inputs.input_ids == im_end).nonzero()[-1]) + 1
    loss_mask = torch.zeros(inputs.input_ids.shape[0], dtype=torch.bool)
    loss_mask[n_prompt:end] = True
    embeddings = encoder.encode_videos(inputs.clips, inputs.videos.keys)  # the engine's side, once
    rng = random.Random(cfg.seed + frames)
    samples = [
        make_sample(f"clip-{frames}-{k}", inputs.input_ids, inputs.mm_token_type_ids, inputs.image_grid_thw, [],
                    positions=encoder.positions, loss_mask=loss_mask, videos=inputs.videos,
                    advantage=rng.choice([-1.0, 1.0]) * rng.uniform(0.5, 1.5))
        for k in range(cfg.samples)
    ]
    step_tokens = sum(s.num_tokens for s in samples)
    batch = BenchBatch(
        samples=samples,
        embeddings=dict(zip(inputs.videos.keys, embeddings, strict=True)),
        pixel_values={},  # the trainer is never handed a pixel
        image_token_id=int(processor.image_token_id),
        pad_token_id=int(processor.tokenizer.pad_token_id),
        merge=encoder.merge,
        max_tokens=step_tokens,  # one micro-batch: the peak is the whole step's tokens'
        padded_rows=1,
        full_layout="packed",
        video_token_id=int(processor.video_token_id),
    )
    pixels = inputs.pixel_values_videos
    info = {
        "frames": frames,
        "grid_thw": inputs.videos.grid_thw[0].tolist(),
        "video_pads": int((inputs.input_ids == processor.video_token_id).sum()),
        "tokens_per_sample": int(inputs.input_ids.shape[0]),
        "loss_tokens_per_sample": int(loss_mask.sum()),
        "step_tokens": step_tokens,
        "embedding_mb": sum(e.embeds.numel() + e.deepstack.numel() for e in embeddings) * 4 / 2**20,
        # what a trainer that runs the tower would be handed for the step: every sample's pixel values
        "pixel_values_mb": cfg.samples * pixels.numel() * 4 / 2**20,
    }
    return batch, info


def line_fit(x: list[float], y: list[float]) -> tuple[float, float, float]:
    """(slope, intercept, largest |residual|) of the least-squares line y = slope * x + intercept."""
    X = np.array(x, float)
    Y = np.array(y, float)
    slope, intercept = np.polyfit(X, Y, 1)
    return float(slope), float(intercept), float(np.abs(Y - (slope * X + intercept)).max())


def run_video_memory_bench(cfg: VideoMemoryBenchConfig, *, progress: bool = True) -> dict:
    """Measure the trainer's peak at each frame count of `cfg.frames` (the module docstring says how)."""
    from rich.console import Console

    from saccade.tools.memory import activation_bytes_per_token
    from saccade.tools.memory_dims import model_dims

    console = Console(stderr=True, quiet=not progress)
    started = time.perf_counter()
    previous = torch.get_num_threads()
    torch.set_num_threads(cfg.threads)
    try:
        dev = resolve_device(cfg.device, setting="--device")
        dtype = torch.bfloat16 if dev.type == "cuda" else torch.float32
        dtype_name = str(dtype).removeprefix("torch.")
        model_path = str(preset_path(cfg.preset))
        processor = load_processor(model_path)
        tower = load_vision_tower(model_path, dtype=dtype, device=dev)
        points, batches = [], []
        for frames in cfg.frames:
            batch, info = prepare_point(cfg, processor, tower, frames)
            batches.append(batch)
            points.append(info)
            console.log(f"{frames} frames: {info['video_pads']} video pads, {info['tokens_per_sample']} tokens a "
                        f"sample, {info['step_tokens']} a step")
        del tower  # the engine's side is done: nothing of it is measured
        with tempfile.TemporaryDirectory(prefix="saccade-bench-video-") as tmp:
            for info, batch in zip(points, batches, strict=True):
                path = Path(tmp) / f"{info['frames']}.pt"
                torch.save(batch, path)
                # One fresh process per point, one at a time (max_tasks_per_child=1: never a used one).
                with ProcessPoolExecutor(max_workers=1, mp_context=get_context("spawn"), max_tasks_per_child=1) as pool:
                    measured = pool.submit(measure_peak_memory, "cached", str(path), model_path, str(dev), dtype_name,
                                           cfg.threads, cfg.seed, cfg.full_finetune).result()
                info.update(peak_mb=measured["peak_mb"], loaded_mb=measured["loaded_mb"],
                            tower_params=measured["tower_params"], peak_reset=measured["peak_reset"])
                console.log(f"{info['frames']} frames: peak {info['peak_mb']:.1f} MiB over {info['step_tokens']} tokens")
        slope_mb, intercept_mb, residual_mb = line_fit([p["step_tokens"] for p in points], [p["peak_mb"] for p in points])
        dims = model_dims(model_path)
        per_token = activation_bytes_per_token(dims.text, dtype_bytes=dtype.itemsize,
                                               lora_rank=None if cfg.full_finetune else 16, loss_fraction=0.0)
        return {
            "config": {**cfg.model_dump(), "device": str(dev), "dtype": dtype_name},
            "points": points,
            "slope_kib_per_token": slope_mb * 1024,
            "intercept_mb": intercept_mb,
            "max_residual_mb": residual_mb,
            "estimated_activation_kib_per_prompt_token": per_token / 1024,
            "tower_params_in_trainer": max(p["tower_params"] for p in points),
            "wall_s": time.perf_counter() - started,
        }
    finally:
        torch.set_num_threads(previous)


def format_video_memory_report(result: dict) -> str:
    """A markdown table, a row per frame count, and the line through the peaks."""
    cfg = result["config"]
    lines = [
        f"preset {cfg['preset']}, {cfg['device']} {cfg['dtype']}, {'full fine-tuning' if cfg['full_finetune'] else 'LoRA r16'}, "
        f"{cfg['samples']} completions a step of {cfg['answer_words']} words, frames {cfg['side']} x {cfg['side']} px",
        "",
        "| frames | video pads | tokens / sample | tokens / step | trainer peak (MiB) | peak / token (KiB) "
        "| tower params in trainer | pixel values a tower-running trainer holds (MiB) |",
        "|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for p in result["points"]:
        lines.append(f"| {p['frames']} | {p['video_pads']} | {p['tokens_per_sample']} | {p['step_tokens']} "
                     f"| {p['peak_mb']:.1f} | {p['peak_mb'] * 1024 / p['step_tokens']:.1f} | {p['tower_params']} "
                     f"| {p['pixel_values_mb']:.1f} |")
    lines += [
        "",
        f"peak = {result['intercept_mb']:.1f} MiB + {result['slope_kib_per_token']:.2f} KiB x tokens per step "
        f"(least squares; largest residual {result['max_residual_mb']:.2f} MiB); saccade memory's activation "
        f"bytes per prompt token: {result['estimated_activation_kib_per_prompt_token']:.2f} KiB",
    ]
    return "\n".join(lines)
