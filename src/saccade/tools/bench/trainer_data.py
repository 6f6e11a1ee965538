"""The trainer benchmark's batch (`saccade bench trainer`), prepared once for every variant.

One step's worth of synthetic multi-image conversations (`bench_conversations`), tokenized as
generation tokenizes them and turned into training samples, their images through the frozen
tower once (`prepare_batch`: the cache the cached variants read); and the layouts the variants
run on: packed micro-batches (`saccade.trainer.packing.pack`, at step time), right-padded rows
(`pad_batches`) and the full model's micro-batches with their pixel values (`full_micro_batches`).
Each layout's micro-batch has `.to(device)`, so `saccade.trainer.step.optimizer_step` sends it
to the device one ahead of the one being computed, as the trainer does.
"""

from __future__ import annotations

import random
import time
from dataclasses import dataclass, fields, replace

import torch

from saccade.config import ImagesConfig
from saccade.data.images import image_to_data_url
from saccade.data.messages import messages_to_inputs
from saccade.data.synthetic import synthetic_image
from saccade.models.vision import ImageEmbedding, VisionEncoder
from saccade.timing import synchronize
from saccade.trainer.packing import first_fit_decreasing
from saccade.trainer.samples import MicroBatch, TrainingSample, make_sample

# About the size of a padded micro-batch (4 rows of the longest sample) on the default data.
# Bigger packed rows cost more attention under sdpa, which computes the whole (N x N)
# block-diagonal mask; flash-attention's varlen kernel would skip the off-diagonal blocks.
DEFAULT_MAX_TOKENS = 1024

_WORDS = (
    "red green blue yellow circle square triangle star left right above below count two three "
    "the a is of on in and largest smallest shape color image picture therefore answer"
).split()



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
    video_token_id: int | None = None  # set when the samples hold clips (`saccade bench video-memory`)

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
                positions=encoder.positions,
                loss_mask=loss_mask,
                advantage=advantage,
            )
        )
        pixels[sample_id] = inputs.pixel_values
    # The engine's side, once for the whole run: preprocess every image and run the frozen
    # tower on all of them in one call (what `VisionEncoder.encode` does on cache misses).
    device = encoder.device
    encoder.encode_pixels(*encoder.preprocess(images[:1]))  # untimed: the first call pays one-off set-up
    synchronize(device)
    t0 = time.perf_counter()
    pixels_XD, grid_I3 = encoder.preprocess(images)
    t1 = time.perf_counter()
    encoded = encoder.encode_pixels(pixels_XD, grid_I3)
    synchronize(device)
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
    """Rows of samples, each right-padded to the longest of them."""

    input_ids_BL: torch.Tensor
    position_ids_4BL: torch.Tensor
    loss_mask_BL: torch.Tensor
    advantages_BL: torch.Tensor
    image_embeds_MH: torch.Tensor | None
    deepstack_ZMH: torch.Tensor | None

    def to(self, device: torch.device) -> PaddedBatch:
        return replace(self, **{f.name: getattr(self, f.name).to(device) for f in fields(self)
                                if getattr(self, f.name) is not None})


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


@dataclass
class FullMicroBatch:
    """A micro-batch of the full model: the packed samples and their images' pixel values."""

    micro_batch: MicroBatch
    pixels_XD: torch.Tensor | None

    def to(self, device: torch.device) -> FullMicroBatch:
        return FullMicroBatch(self.micro_batch.to(device),
                              None if self.pixels_XD is None else self.pixels_XD.to(device))


def full_micro_batches(batch: BenchBatch) -> list[FullMicroBatch]:
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
        out.append(FullMicroBatch(mb, torch.cat(pixels) if pixels else None))
    return out
