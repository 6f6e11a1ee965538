"""Parity of the frozen-vision training path against the full transformers model.

The trainer's claim is that (cached image embeddings + DeepStack + M-RoPE positions)
through the language model alone gives the same logprobs as the full model on pixel
values, packed or not. This module measures it on a fixed set of conversations and
also measures how far two classic mistakes move the logprobs (DeepStack dropped,
1-D positions), so a test can insist they are caught. Used by the tests and by
`saccade bench parity`.

With a clip (`video`: a video file, `saccade bench parity --video PATH`), the conversations
gain clips (`video_conversations`: a clip alone, a clip beside images and text, a clip in a
later turn, and the same file's frames given as a list) and the figures cover them: the full
model reads the clip's pixels (`pixel_values_videos`, and Qwen2.5-VL's `second_per_grid_ts`),
the LM-only path its cached embedding.
"""

from __future__ import annotations

import inspect
from dataclasses import dataclass

import torch

from saccade.config import ImagesConfig
from saccade.config.bench import ParityBenchConfig
from saccade.data.messages import ModelInputs, messages_to_inputs
from saccade.data.synthetic import synthetic_image
from saccade.models.vision import VisionEncoder
from saccade.trainer.forward import forward_logprobs
from saccade.trainer.logprobs import token_logprobs_and_entropy
from saccade.trainer.packing import collate
from saccade.trainer.samples import TrainingSample, make_sample

# fp32 bar for the LM-only path against the full model, packed or not (max |Δ logprob|).
TOLERANCE = 1e-5
# bf16: the two paths round differently (the full model's causal attention against the packed
# path's block mask: another sdpa kernel, and 28 layers of bf16 rounding after it). Measured
# on this CPU (docs/precision.md): tiny 4.6e-3; the qwen3vl-2b preset 0.10 (mean 0.024).
# The real mistakes move it by 1.2-2.0 at 2B (DeepStack dropped, 1-D positions).
BF16_TOLERANCE = 0.25


def tolerance(dtype: str) -> float:
    return TOLERANCE if dtype == "float32" else BF16_TOLERANCE


def parity_conversations() -> dict[str, list[dict]]:
    """The cases the issue names: one image, several, different sizes, text only, multi-turn."""
    img = lambda w, h, s: {"type": "image", "image": synthetic_image(w, h, s)}  # noqa: E731
    text = lambda t: {"type": "text", "text": t}  # noqa: E731
    return {
        "one_image": [
            {"role": "user", "content": [img(64, 64, 1), text("What color is the circle?")]},
            {"role": "assistant", "content": "The circle is red."},
        ],
        "several_images": [
            {"role": "user", "content": [img(64, 64, 2), img(64, 64, 3), text("Which has more shapes?"), img(64, 64, 4)]},
            {"role": "assistant", "content": "The second one has more."},
        ],
        "different_sizes": [
            {"role": "user", "content": [img(96, 48, 5), text("Compare them."), img(40, 120, 6), img(130, 70, 7)]},
            {"role": "assistant", "content": "The first is wide and the second is tall."},
        ],
        "text_only": [
            {"role": "system", "content": "Answer briefly."},
            {"role": "user", "content": "How many sides does a triangle have?"},
            {"role": "assistant", "content": "Three."},
        ],
        "multi_turn": [
            {"role": "user", "content": [img(64, 64, 8), text("What is in the image?")]},
            {"role": "assistant", "content": "A blue square."},
            {"role": "user", "content": [text("Now look at this one."), img(80, 64, 9), img(48, 48, 10)]},
            {"role": "assistant", "content": "Two green circles."},
        ],
    }


def video_conversations(video: str) -> dict[str, list[dict]]:
    """Conversations with the clip at `video` (a file): alone, between images and text, in a later
    turn after a text-only one, and its first frames given as a list beside the file."""
    img = lambda w, h, s: {"type": "image", "image": synthetic_image(w, h, s)}  # noqa: E731
    text = lambda t: {"type": "text", "text": t}  # noqa: E731
    clip = {"type": "video_url", "video_url": {"url": str(video)}}
    frames = {"type": "video", "video": [synthetic_image(64, 48, 20 + i) for i in range(3)], "fps": 1.0}
    return {
        "clip": [
            {"role": "user", "content": [clip, text("What moves in the clip?")]},
            {"role": "assistant", "content": "A white square, left to right."},
        ],
        "clip_image_text": [
            {"role": "user", "content": [img(64, 64, 11), text("Is this frame in the clip?"), clip]},
            {"role": "assistant", "content": "No."},
            {"role": "user", "content": [img(48, 80, 12), text("And this one?")]},
            {"role": "assistant", "content": "Not that either."},
        ],
        "clip_later_turn": [
            {"role": "user", "content": "I will show you a clip."},
            {"role": "assistant", "content": "Go ahead."},
            {"role": "user", "content": [clip, frames, text("Which came first?")]},
            {"role": "assistant", "content": "The square."},
        ],
    }


@dataclass
class ParityInputs:
    name: str
    inputs: ModelInputs
    sample: TrainingSample


def full_model_logprobs(full_model, inputs: ModelInputs, positions_3L: torch.Tensor | None = None) -> torch.Tensor:
    """(L,) logprob of each token under the full transformers model on pixel values; [0] = 0.

    The logits come from the model's final hidden state through the lm_head as the trainer
    computes them (`saccade.models.head`: float32 sums; in fp32 models exactly what `.logits`
    holds), in chunks, so that in bf16 the figure compares the two paths to the hidden state,
    not two precisions of the head, and 8k positions never hold (positions x vocab) logits.
    `positions_3L`: M-RoPE positions to run it on, where transformers' own depart from the
    family's published rule (`ModelFamily.transformers_clip_positions`); else its own."""
    device = full_model.lm_head.weight.device
    ids = inputs.input_ids.unsqueeze(0).to(device)
    kwargs = dict(input_ids=ids, mm_token_type_ids=inputs.mm_token_type_ids.unsqueeze(0).to(device))
    if inputs.pixel_values is not None:
        kwargs.update(pixel_values=inputs.pixel_values.to(device, full_model.lm_head.weight.dtype),
                      image_grid_thw=inputs.image_grid_thw.to(device))
    if inputs.pixel_values_videos is not None:
        kwargs.update(pixel_values_videos=inputs.pixel_values_videos.to(device, full_model.lm_head.weight.dtype),
                      video_grid_thw=inputs.videos.grid_thw.to(device))
        if "second_per_grid_ts" in inspect.signature(full_model.model.forward).parameters:  # Qwen2.5-VL
            kwargs["second_per_grid_ts"] = inputs.videos.second_per_grid.to(device)
    if positions_3L is not None:
        kwargs["position_ids"] = positions_3L.unsqueeze(1).to(device)
    with torch.no_grad():
        hidden_LH = full_model.model(**kwargs, use_cache=False).last_hidden_state[0]
        scored, _ = token_logprobs_and_entropy(hidden_LH[:-1], full_model.lm_head.weight, ids[0, 1:])
    logprobs = torch.zeros(ids.shape[1])
    logprobs[1:] = scored.cpu()
    return logprobs


def published_positions(family, case: ParityInputs) -> torch.Tensor | None:
    """The family's published M-RoPE positions for a case holding a clip, where transformers' own
    depart from them (`ModelFamily.transformers_clip_positions`); None: the full model's own."""
    if family.transformers_clip_positions or not case.sample.num_videos:
        return None
    return case.sample.position_ids[1:]


def prepare(processor, encoder: VisionEncoder, limits: ImagesConfig, video: str | None = None) -> list[ParityInputs]:
    """The parity conversations (with `video`: the clip's too) as samples, their images and clips
    encoded; positions by the encoder's family."""
    conversations = parity_conversations() | (video_conversations(video) if video is not None else {})
    out = []
    for name, messages in conversations.items():
        inputs = messages_to_inputs(messages, processor, limits=limits, sample=name)
        keys = [encoder.key_for_hash(h) for h in inputs.image_hashes]
        encoder.encode(inputs.images, keys)
        if inputs.clips:
            encoder.encode_videos(inputs.clips, inputs.videos.keys,
                                  pixels=(inputs.pixel_values_videos, inputs.videos.grid_thw))
        sample = make_sample(
            name, inputs.input_ids, inputs.mm_token_type_ids, inputs.image_grid_thw, keys, positions=encoder.positions,
            videos=inputs.videos,
        )
        out.append(ParityInputs(name, inputs, sample))
    return out


def grouped_samples(processor, encoder: VisionEncoder, completion_lengths, generator: torch.Generator,
                    video: str | None = None) -> list[TrainingSample]:
    """GRPO-like groups on the parity prompts (with `video`, the clip's too): after each prompt, one
    completion of random ids per entry of `completion_lengths` (its length), the loss on the
    completion only, advantage g - 1 for the g-th. Packed with shared prompts, each group's prompt
    is one context."""
    samples = []
    for c in prepare(processor, encoder, encoder.limits, video):
        prompt = c.inputs.input_ids
        for g, n in enumerate(completion_lengths):
            samples.append(make_sample(
                f"{c.name}/{g}", torch.cat([prompt, torch.randint(10, 200, (n,), generator=generator)]),
                torch.cat([c.inputs.mm_token_type_ids, torch.zeros(n, dtype=torch.long)]), c.inputs.image_grid_thw,
                c.sample.image_keys, positions=encoder.positions,
                loss_mask=torch.cat([torch.zeros(len(prompt), dtype=torch.bool), torch.ones(n, dtype=torch.bool)]),
                advantage=g - 1.0, videos=c.inputs.videos))
    return samples


def _lookup(encoder: VisionEncoder):
    def lookup(key: str):
        hit = encoder.cache.get(key)
        assert hit is not None, f"image {key} is not in the cache"
        return hit

    return lookup


def lm_logprobs(policy, cases: list[ParityInputs], encoder: VisionEncoder, *, image_token_id: int, merge: int,
                packed: bool, drop_deepstack: bool = False, positions_1d: bool = False,
                video_token_id: int | None = None) -> list[torch.Tensor]:
    """Per-case (L,) logprobs from the LM-only path, one micro-batch per case or all packed in one."""
    groups = [[c.sample for c in cases]] if packed else [[c.sample] for c in cases]
    results: list[torch.Tensor] = []
    for group in groups:
        mb = collate(group, _lookup(encoder), image_token_id=image_token_id, spatial_merge_size=merge,
                     video_token_id=video_token_id)
        if drop_deepstack:
            mb.deepstack = None
        if positions_1d:
            # The classic mistake: plain 1-D positions on every rotary axis (still restarting per sample).
            mb.position_ids = mb.position_ids[:1].expand(4, -1, -1).clone()
        with torch.no_grad():
            logprobs, _ = forward_logprobs(policy, mb)
        results.extend(logprobs.cpu()[sl] for sl in mb.sample_slices())
    return results


def max_abs(a: list[torch.Tensor], b: list[torch.Tensor]) -> float:
    return max(float((x - y).abs().max()) if x.numel() else 0.0 for x, y in zip(a, b, strict=True))


def mean_abs(a: list[torch.Tensor], b: list[torch.Tensor]) -> float:
    """Mean |Δ| over every token of every case (the first token of each, never predicted, left out)."""
    return float(torch.cat([(x[1:] - y[1:]).abs() for x, y in zip(a, b, strict=True)]).mean())


def run_parity_bench(cfg: ParityBenchConfig) -> dict:
    """`saccade bench parity`: `run_parity` on the config's model (a preset or `<preset>-warm`
    resolved to its folder), dtype and device, with the minutes it took."""
    import time

    from saccade.tools.demo import resolve_model_name
    from saccade.devices import resolve_device

    start = time.perf_counter()
    result = run_parity(resolve_model_name(cfg.model), dtype=getattr(torch, cfg.dtype), device=resolve_device(cfg.device),
                        video=cfg.video)
    result["minutes"] = (time.perf_counter() - start) / 60
    return result


def run_parity(model_path, *, limits: ImagesConfig | None = None, dtype: torch.dtype = torch.float32,
               device: str | torch.device = "cpu", video: str | None = None) -> dict:
    """All four figures plus per-case detail, on any folder of a known family, in `dtype` on `device`;
    with `video` (a file), on the clip's conversations too (`video_conversations`), with the
    figures of the cases that hold a clip apart (`clip_*`)."""
    from saccade.models.head import use_full_fp32_matmuls
    from saccade.models.lm import load_policy_lm
    from saccade.models.loading import load_family, load_full_model, load_processor, load_vision_tower

    use_full_fp32_matmuls()
    processor = load_processor(model_path)
    if limits is None:
        size = processor.image_processor.size
        limits = ImagesConfig(min_pixels=size["shortest_edge"], max_pixels=min(size["longest_edge"], 256 * 256))
    full = load_full_model(model_path, dtype=dtype).to(device)
    tower = load_vision_tower(model_path, dtype=dtype, device=device)
    policy = load_policy_lm(model_path, dtype=dtype, device=device).eval()
    encoder = VisionEncoder(tower, processor, limits=limits)
    merge = encoder.merge
    if video is not None:
        from pathlib import Path

        if not Path(video).is_file():
            raise ValueError(f"--video {video!r}: no such file")
    cases = prepare(processor, encoder, limits, video)
    family = load_family(model_path)
    reference = [full_model_logprobs(full, c.inputs, published_positions(family, c)) for c in cases]
    common = dict(image_token_id=policy.image_token_id, merge=merge, video_token_id=policy.video_token_id)
    single = lm_logprobs(policy, cases, encoder, packed=False, **common)
    packed = lm_logprobs(policy, cases, encoder, packed=True, **common)
    no_deepstack = lm_logprobs(policy, cases, encoder, packed=False, drop_deepstack=True, **common)
    flat_positions = lm_logprobs(policy, cases, encoder, packed=False, positions_1d=True, **common)
    per_case = {
        c.name: {
            "tokens": c.sample.num_tokens,
            "images": c.sample.num_images,
            "clips": c.sample.num_videos,
            "lm_only_vs_full_max_abs": max_abs([s], [r]),
            "packed_vs_full_max_abs": max_abs([p], [r]),
        }
        for c, s, p, r in zip(cases, single, packed, reference)
    }
    image_cases = [i for i, c in enumerate(cases) if c.sample.num_images or c.sample.num_videos]
    pick = lambda xs, which=image_cases: [xs[i] for i in which]  # noqa: E731
    clips = [i for i, c in enumerate(cases) if c.sample.num_videos]
    clip_figures = {} if not clips else {
        "clip_lm_only_vs_full_max_abs": max_abs(pick(single, clips), pick(reference, clips)),
        "clip_packed_vs_full_max_abs": max_abs(pick(packed, clips), pick(reference, clips)),
        "clip_deepstack_dropped_max_abs": max_abs(pick(no_deepstack, clips), pick(reference, clips)),
        "clip_positions_1d_max_abs": max_abs(pick(flat_positions, clips), pick(reference, clips)),
        "clip_grids": {cases[i].name: cases[i].sample.videos.grid_thw.tolist() for i in clips},
    }
    return {
        "model": str(model_path),
        "family": policy.family.name,
        "deepstack_levels": policy.num_deepstack_levels,
        "dtype": str(dtype).removeprefix("torch."),
        "device": str(device),
        "lm_only_vs_full_max_abs": max_abs(single, reference),
        "packed_vs_unpacked_max_abs": max_abs(packed, single),
        "packed_vs_full_max_abs": max_abs(packed, reference),
        "lm_only_vs_full_mean_abs": mean_abs(single, reference),
        "packed_vs_unpacked_mean_abs": mean_abs(packed, single),
        # The two mistakes are measured on the cases that have images (text-only is unaffected).
        "deepstack_dropped_max_abs": max_abs(pick(no_deepstack), pick(reference)),
        "positions_1d_max_abs": max_abs(pick(flat_positions), pick(reference)),
        "cases": per_case,
        "cache": {"hit_rate": encoder.cache.stats.hit_rate, "entries": len(encoder.cache)},
        "video": None if video is None else str(video),
        **clip_figures,
    }


# --- long contexts --------------------------------------------------------------------------
# Rounding errors that grow with the position (rotary frequencies rounded to bf16: about 1e-3 x
# position radians at rope_theta 5e6) hide in short conversations. Here one conversation, an
# image then text, is scored at 1k+ positions by the LM-only path and by the full model, both in
# the low precision, beside the full model's own bf16-vs-fp32 noise at the same positions.

LONG_CONTEXT_LENGTHS = (1024, 8192)
# Position buckets (token index ranges) the figures are reported in.
POSITION_EDGES = (0, 256, 1024, 2048, 4096, 8192, 16384, 32768)
# The bar, bucket by bucket: mean |LM-only bf16 - full bf16| <= NOISE_FACTOR x mean |full bf16 - full
# fp32|. Both paths run the same bf16 weights through the same kernels (one sample: packed_sdpa is
# causal sdpa), so they agree far below the precision's own noise (exactly, on this CPU); a real
# discrepancy adds an error of the noise's own size or more. Measured on the tiny model at 1k-3k
# positions (docs/precision.md): 0.00 with the rotary buffers in float32, 0.89-1.24 with them
# rounded to bf16 (1.45 on the small preset at 2k-3k), the ratio growing with the position.
NOISE_FACTOR = 0.5


@dataclass
class ParityModels:
    """The three models a long-context check compares, and the tower that feeds the LM-only path."""

    processor: object
    encoder: VisionEncoder
    limits: ImagesConfig
    policy: object  # PolicyLM in `dtype`
    full: object  # the full model in `dtype`
    full_fp32: object  # the full model in float32: the reference
    dtype: torch.dtype
    device: torch.device


def load_parity_models(model_path, *, dtype: torch.dtype = torch.bfloat16, device: str | torch.device = "cpu",
                       limits: ImagesConfig | None = None) -> ParityModels:
    from saccade.models.head import use_full_fp32_matmuls
    from saccade.models.lm import load_policy_lm
    from saccade.models.loading import load_family, load_full_model, load_processor, load_vision_tower

    use_full_fp32_matmuls()
    device = torch.device(device)
    processor = load_processor(model_path)
    if limits is None:
        size = processor.image_processor.size
        limits = ImagesConfig(min_pixels=size["shortest_edge"], max_pixels=min(size["longest_edge"], 256 * 256))
    encoder = VisionEncoder(load_vision_tower(model_path, dtype=dtype, device=device), processor, limits=limits)
    policy = load_policy_lm(model_path, dtype=dtype, device=device).eval()
    full = load_full_model(model_path, dtype=dtype).to(device)
    full_fp32 = load_full_model(model_path, dtype=torch.float32).to(device)
    return ParityModels(processor, encoder, limits, policy, full, full_fp32, dtype, device)


def long_conversation(processor, limits: ImagesConfig, n_tokens: int, seed: int = 0) -> ModelInputs:
    """An image, then text, cut to exactly `n_tokens` tokens (the image whole, in the first ones)."""
    import random

    rng = random.Random(seed)
    words = ("the red circle is left of a blue square and three green stars are above it while a yellow "
             "triangle turns toward the camera near the wall so count every shape you can see").split()
    text = " ".join(rng.choice(words) for _ in range(n_tokens))  # a word is at least one token
    messages = [{"role": "user", "content": [{"type": "image", "image": synthetic_image(64, 64, seed)},
                                             {"type": "text", "text": text}]}]
    inputs = messages_to_inputs(messages, processor, limits=limits, sample=f"long-{n_tokens}")
    if inputs.input_ids.shape[0] < n_tokens:
        raise ValueError(f"the conversation has {inputs.input_ids.shape[0]} tokens, fewer than {n_tokens}")
    inputs.input_ids = inputs.input_ids[:n_tokens]
    inputs.mm_token_type_ids = inputs.mm_token_type_ids[:n_tokens]
    return inputs


def by_position(diff_L: torch.Tensor, length: int) -> list[dict]:
    """Mean and max of |Δ| per position bucket (position 0, never predicted, left out)."""
    out = []
    for start, end in zip(POSITION_EDGES, POSITION_EDGES[1:]):
        lo, hi = max(start, 1), min(end, length)
        if lo >= hi:
            continue
        part = diff_L[lo:hi]
        out.append({"start": start, "end": hi, "mean": float(part.mean()), "max": float(part.max())})
    return out


def long_context_figures(models: ParityModels, lengths=LONG_CONTEXT_LENGTHS) -> dict:
    """Per length: |LM-only - full| (both in `models.dtype`) and the full model's own noise
    (|full - full fp32|), bucket by bucket, and whether every bucket is within NOISE_FACTOR."""
    from saccade.models.loading import rotary_buffers_not_fp32

    out: dict = {"dtype": str(models.dtype).removeprefix("torch."), "device": str(models.device),
                 "noise_factor": NOISE_FACTOR, "rotary_not_fp32": rotary_buffers_not_fp32(models.policy)
                 + rotary_buffers_not_fp32(models.encoder.tower), "lengths": {}}
    merge = models.encoder.merge
    for n in lengths:
        inputs = long_conversation(models.processor, models.limits, n)
        keys = [models.encoder.key_for_hash(h) for h in inputs.image_hashes]
        models.encoder.encode(inputs.images, keys)
        sample = make_sample(f"long-{n}", inputs.input_ids, inputs.mm_token_type_ids, inputs.image_grid_thw, keys,
                             positions=models.encoder.positions)
        lm = lm_logprobs(models.policy, [ParityInputs("long", inputs, sample)], models.encoder,
                         image_token_id=models.policy.image_token_id, merge=merge, packed=False)[0]
        full = full_model_logprobs(models.full, inputs)
        reference = full_model_logprobs(models.full_fp32, inputs)
        lm_vs_full = by_position((lm - full).abs(), n)
        noise = by_position((full - reference).abs(), n)
        lm_vs_fp32 = by_position((lm - reference).abs(), n)
        buckets = [{"start": a["start"], "end": a["end"], "lm_vs_full_mean": a["mean"], "lm_vs_full_max": a["max"],
                    "noise_mean": b["mean"], "noise_max": b["max"], "lm_vs_full_fp32_mean": c["mean"],
                    "ratio": a["mean"] / b["mean"] if b["mean"] else float("inf")}
                   for a, b, c in zip(lm_vs_full, noise, lm_vs_fp32)]
        out["lengths"][str(n)] = {
            "buckets": buckets,
            "lm_vs_full_fp32_mean": float((lm - reference).abs()[1:].mean()),
            "passed": all(b["ratio"] <= NOISE_FACTOR for b in buckets),
        }
    out["passed"] = not out["rotary_not_fp32"] and all(v["passed"] for v in out["lengths"].values())
    return out


def long_context_parity(model_path, *, lengths=LONG_CONTEXT_LENGTHS, dtype: torch.dtype = torch.bfloat16,
                        device: str | torch.device = "cpu") -> dict:
    """`long_context_figures` on a model folder: the bf16 check at 1k and 8k positions."""
    result = long_context_figures(load_parity_models(model_path, dtype=dtype, device=device), lengths)
    result["model"] = str(model_path)
    return result
