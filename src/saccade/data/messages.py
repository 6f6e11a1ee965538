"""OpenAI-format chat messages -> model inputs. The one function every stage uses.

Generation, training and evaluation all call `messages_to_inputs`, so the token ids, the
number of image placeholders and the pixels can never differ between them. Messages
follow the OpenAI chat format; an image part may be

    {"type": "image_url", "image_url": {"url": "data:image/png;base64,..." | "file:///..." | "https://..."}}
    {"type": "image", "image": PIL.Image | bytes | path | url}

Images are loaded and checked by `saccade.data.images.load_image` (clear errors naming the
sample) and resized by the model's own image processor within `ImagesConfig.min_pixels`
and `max_pixels`, the same values everywhere.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch
from PIL import Image

from saccade.timing import timed
from saccade.config import ImagesConfig
from saccade.data.images import blank_like, image_hash, load_image

IMAGE_PART_TYPES = ("image", "image_url", "input_image")
# Tokens that only the processor may write: typed into text they would desynchronise the
# image placeholders and the images.
VISION_TOKENS = ("<|image_pad|>", "<|video_pad|>", "<|vision_start|>", "<|vision_end|>")


def _check_text(text: Any, *, sample: str | None, turn: int) -> str:
    if not isinstance(text, str):
        raise ValueError(f"sample {sample!r}: message {turn} has a text part without a string 'text'")
    for token in VISION_TOKENS:
        if token in text:
            raise ValueError(
                f"sample {sample!r}: message {turn} contains {token} in its text; "
                "vision tokens are written by the processor: pass images as image parts instead"
            )
    return text


@dataclass
class ModelInputs:
    """One conversation, tokenized, with its images preprocessed."""

    input_ids: torch.Tensor  # (L,) int64; image pads already expanded to one per merged patch
    mm_token_type_ids: torch.Tensor  # (L,) int64; 0 text, 1 image
    pixel_values: torch.Tensor | None  # (patches, C*T*P*P) or None without images
    image_grid_thw: torch.Tensor | None  # (n_images, 3) int64 or None
    images: list[Image.Image] = field(default_factory=list)  # loaded RGB images, in order
    image_hashes: list[str] = field(default_factory=list)  # content hashes, in order
    text: str = ""  # the rendered chat template, pads not expanded

    @property
    def num_images(self) -> int:
        return len(self.images)


def extract_images(
    messages: list[dict[str, Any]], *, limits: ImagesConfig, sample: str | None = None
) -> tuple[list[dict[str, Any]], list[Image.Image]]:
    """Load every image in order; return messages whose image parts are plain {"type": "image"}."""
    if not isinstance(messages, list) or not messages:
        raise ValueError(f"sample {sample!r}: messages must be a non-empty list of {{role, content}} dicts")
    normalized: list[dict[str, Any]] = []
    images: list[Image.Image] = []
    for turn, message in enumerate(messages):
        if not isinstance(message, dict) or "role" not in message or "content" not in message:
            raise ValueError(f"sample {sample!r}: message {turn} needs 'role' and 'content'")
        content = message["content"]
        if content is None or isinstance(content, str):
            normalized.append({"role": message["role"], "content": _check_text(content or "", sample=sample, turn=turn)})
            continue
        if not isinstance(content, list):
            raise ValueError(f"sample {sample!r}: message {turn} content must be a string or a list of parts")
        parts = []
        for part in content:
            kind = part.get("type") if isinstance(part, dict) else None
            if kind == "text":
                parts.append({"type": "text", "text": _check_text(part.get("text"), sample=sample, turn=turn)})
            elif kind in IMAGE_PART_TYPES:
                images.append(load_image(image_source(part, kind), limits=limits, sample=sample))
                parts.append({"type": "image"})
            else:
                raise ValueError(
                    f"sample {sample!r}: message {turn} has a content part of type {kind!r}; "
                    "supported: 'text', 'image_url', 'image'"
                )
        normalized.append({"role": message["role"], "content": parts})
    return normalized, images


def image_source(part: dict[str, Any], kind: str):
    """What an image part of kind `kind` (one of IMAGE_PART_TYPES) points at, for `load_image`."""
    value = part.get(kind)
    if value is None and kind == "image":
        value = part.get("url") or part.get("path")
    if value is None and kind == "input_image":  # OpenAI Responses: {"type": "input_image", "image_url": "..."}
        value = part.get("image_url")
    if isinstance(value, dict):  # {"url": ...} in OpenAI's image_url
        value = value.get("url", value)
    return value


def with_blank_images(messages: list[dict[str, Any]], *, limits: ImagesConfig = ImagesConfig(),
                      sample: str | None = None) -> list[dict[str, Any]]:
    """`messages` with every image part replaced by a blank one of that image's size
    (`blank_like`), as {"type": "image", "image": ...}; roles, text and order as they were. The
    model then reads the same tokens at the same positions, and only what the images showed is
    gone: the counterfactual the visual-reliance figures score. Each image is loaded as the
    engine loads it (`load_image`: EXIF orientation can swap its sides) to learn its size."""
    blanked = []
    for message in messages:
        content = message.get("content")
        if not isinstance(content, list):
            blanked.append(message)
            continue
        parts = []
        for part in content:
            kind = part.get("type") if isinstance(part, dict) else None
            if kind in IMAGE_PART_TYPES:
                image = load_image(image_source(part, kind), limits=limits, sample=sample)
                part = {"type": "image", "image": blank_like(image)}
            parts.append(part)
        blanked.append({**message, "content": parts})
    return blanked


def render_chat(processor, messages: list[dict[str, Any]], *, add_generation_prompt: bool) -> str:
    """The model's chat template applied to normalized messages (images as {"type": "image"})."""
    return processor.apply_chat_template(messages, tokenize=False, add_generation_prompt=add_generation_prompt)


def processor_size(limits: ImagesConfig) -> dict[str, int]:
    """The image processor's `size` for these limits: the resize bounds in pixels."""
    return {"shortest_edge": limits.min_pixels, "longest_edge": limits.max_pixels}


def messages_to_inputs(
    messages: list[dict[str, Any]],
    processor,
    *,
    limits: ImagesConfig = ImagesConfig(),
    add_generation_prompt: bool = False,
    sample: str | None = None,
) -> ModelInputs:
    """Tokenize a conversation and preprocess its images: the single source of truth."""
    with timed("image_prep"):
        normalized, images = extract_images(messages, limits=limits, sample=sample)
    with timed("templating"):
        text = render_chat(processor, normalized, add_generation_prompt=add_generation_prompt)
    with timed("image_prep"):  # the processor call: tokenizing (cheap) and resizing/patchifying the images
        return tokenize_rendered(text, images, processor, limits=limits, sample=sample)


def tokenize_rendered(
    text: str, images: list[Image.Image], processor, *, limits: ImagesConfig = ImagesConfig(), sample: str | None = None
) -> ModelInputs:
    """Rendered chat text (one image placeholder per image) and its images -> model inputs."""
    kwargs: dict[str, Any] = dict(text=[text], return_tensors="pt", return_mm_token_type_ids=True)
    if images:
        kwargs["images"] = images
        kwargs["images_kwargs"] = {"size": processor_size(limits)}
    encoded = processor(**kwargs)
    input_ids = encoded["input_ids"][0].long()
    types = encoded.get("mm_token_type_ids")
    mm_types = types[0].long() if types is not None else torch.zeros_like(input_ids)
    n_pads = int((input_ids == processor.image_token_id).sum())
    grid = encoded["image_grid_thw"].long() if images else None
    expected = 0 if grid is None else int((grid.prod(-1) // processor.image_processor.merge_size**2).sum())
    if n_pads != expected:
        raise ValueError(
            f"sample {sample!r}: the text holds {n_pads} image-pad tokens but the images need {expected}; "
            "do not write <|image_pad|> into message text, use image parts"
        )
    return ModelInputs(
        input_ids=input_ids,
        mm_token_type_ids=mm_types,
        pixel_values=encoded["pixel_values"] if images else None,
        image_grid_thw=grid,
        images=images,
        image_hashes=[image_hash(im) for im in images],
        text=text,
    )
