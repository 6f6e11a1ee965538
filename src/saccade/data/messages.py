"""OpenAI-format chat messages -> model inputs. The one function every stage uses.

Generation, training and evaluation all call `messages_to_inputs`, so the token ids, the
number of image placeholders and the pixels can never differ between them. Messages
follow the OpenAI chat format; an image part may be

    {"type": "image_url", "image_url": {"url": "data:image/png;base64,..." | "file:///..." | "https://..."}}
    {"type": "image", "image": PIL.Image | bytes | path | url}

and a clip (video) part, in any turn, beside images and text (the formats vLLM's chat route
takes, and transformers' chat templates'):

    {"type": "video_url", "video_url": {"url": "file:///clip.mp4" | "data:video/mp4;base64,..."}}
    {"type": "video", "video": path | url | bytes | [frames] | (frames, H, W, 3) uint8 array, "fps": 2.0}

Images are loaded and checked by `saccade.data.images.load_image` (clear errors naming the
sample) and resized by the model's own image processor within `ImagesConfig.min_pixels`
and `max_pixels`, the same values everywhere. Clips are decoded, sampled and checked once by
`saccade.data.videos.load_video` under `[images.video]` (`VideoSampling`: the model's video
processor's own settings where unset), then expanded by the model's processor itself (Qwen3-VL,
Qwen3.5: a timestamp and a frame group per temporal patch; Qwen2.5-VL: one run of pads, and
its seconds per temporal patch). `ModelInputs` carries them: `pixel_values_videos`, `clips`
(the decoded frames) and `videos` (`ClipRefs`: cache keys, grids, seconds per temporal patch).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch
from PIL import Image

from saccade.timing import timed
from saccade.config import ImagesConfig
from saccade.data.images import blank_like, image_hash, load_image
from saccade.data.videos import ClipRefs, VideoClip, VideoError, VideoSampling, blank_clip, load_video, video_cache_key

IMAGE_PART_TYPES = ("image", "image_url", "input_image")
VIDEO_PART_TYPES = ("video", "video_url")
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

    input_ids: torch.Tensor  # (L,) int64; image and video pads already expanded to one per merged patch
    mm_token_type_ids: torch.Tensor  # (L,) int64; 0 text, 1 image, 2 video
    pixel_values: torch.Tensor | None  # (patches, C*T*P*P) or None without images
    image_grid_thw: torch.Tensor | None  # (n_images, 3) int64 or None
    images: list[Image.Image] = field(default_factory=list)  # loaded RGB images, in order
    image_hashes: list[str] = field(default_factory=list)  # content hashes, in order
    text: str = ""  # the rendered chat template, pads not expanded
    pixel_values_videos: torch.Tensor | None = None  # (patches, C*T*P*P): every clip's, in order; None without
    clips: list[VideoClip] = field(default_factory=list)  # the decoded, sampled clips, in order
    videos: ClipRefs = field(default_factory=ClipRefs)  # their cache keys, grids and seconds per temporal patch

    @property
    def num_images(self) -> int:
        return len(self.images)

    @property
    def num_videos(self) -> int:
        return len(self.clips)


def extract_images(
    messages: list[dict[str, Any]], *, limits: ImagesConfig, sample: str | None = None
) -> tuple[list[dict[str, Any]], list[Image.Image]]:
    """Load every image in order; return messages whose image parts are plain {"type": "image"}.
    A conversation with a clip is refused: `extract_visuals` reads those."""
    normalized, images, clips = extract_visuals(messages, limits=limits, sample=sample)
    return normalized, images


def extract_visuals(
    messages: list[dict[str, Any]], *, limits: ImagesConfig, sample: str | None = None,
    sampling: VideoSampling | None = None,
) -> tuple[list[dict[str, Any]], list[Image.Image], list[VideoClip]]:
    """Load every image and clip in order; return messages whose image parts are plain
    {"type": "image"} and clip parts {"type": "video"}. `sampling`: how clips are sampled (the
    model's `VideoSampling`); a clip without it is refused."""
    if not isinstance(messages, list) or not messages:
        raise ValueError(f"sample {sample!r}: messages must be a non-empty list of {{role, content}} dicts")
    normalized: list[dict[str, Any]] = []
    images: list[Image.Image] = []
    clips: list[VideoClip] = []
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
            elif kind in VIDEO_PART_TYPES:
                if sampling is None:
                    raise VideoError(f"message {turn} has a clip, and the caller gave no video sampling "
                                     "(messages_to_inputs gives the model's)", sample=sample)
                clips.append(load_video(video_source(part, kind), sampling=sampling, sample=sample,
                                        fps=part.get("fps"), limits=limits))
                parts.append({"type": "video"})
            else:
                raise ValueError(
                    f"sample {sample!r}: message {turn} has a content part of type {kind!r}; "
                    "supported: 'text', 'image_url', 'image', 'video_url', 'video'"
                )
        normalized.append({"role": message["role"], "content": parts})
    return normalized, images, clips


def video_source(part: dict[str, Any], kind: str):
    """What a clip part of kind `kind` (one of VIDEO_PART_TYPES) points at, for `load_video`."""
    value = part.get(kind)
    if value is None and kind == "video":
        value = part.get("url") or part.get("path")
    if isinstance(value, dict) and "url" in value:  # {"url": ...} in vLLM's video_url
        value = value["url"]
    return value


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
                      sample: str | None = None, sampling: VideoSampling | None = None) -> list[dict[str, Any]]:
    """`messages` with every image part replaced by a blank one of that image's size
    (`blank_like`), as {"type": "image", "image": ...}, and every clip by a clip of gray frames with
    the same frames' count, size and timestamps (`blank_clip`, which needs the model's `sampling`);
    roles, text and order as they were. The model then reads the same tokens at the same
    positions, and only what the images showed is gone: the counterfactual the visual-reliance
    figures score. Each image is loaded as the engine loads it (`load_image`: EXIF orientation
    can swap its sides) to learn its size."""
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
            elif kind in VIDEO_PART_TYPES:
                if sampling is None:
                    raise VideoError("blanking a clip needs the model's video sampling", sample=sample)
                clip = load_video(video_source(part, kind), sampling=sampling, sample=sample, fps=part.get("fps"),
                                  limits=limits)
                part = {"type": "video", "video": blank_clip(clip)}
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
    """Tokenize a conversation and preprocess its images and clips: the single source of truth."""
    with timed("image_prep"):
        sampling = video_sampling(processor, limits) if has_clips(messages) else None
        normalized, images, clips = extract_visuals(messages, limits=limits, sample=sample, sampling=sampling)
    with timed("templating"):
        text = render_chat(processor, normalized, add_generation_prompt=add_generation_prompt)
    with timed("image_prep"):  # the processor call: tokenizing (cheap) and resizing/patchifying the images
        return tokenize_rendered(text, images, processor, limits=limits, sample=sample, clips=clips, sampling=sampling)


def has_clips(messages: Any) -> bool:
    """Whether any message holds a clip part."""
    return isinstance(messages, list) and any(
        isinstance(part, dict) and part.get("type") in VIDEO_PART_TYPES
        for m in messages if isinstance(m, dict) and isinstance(m.get("content"), list) for part in m["content"])


def video_sampling(processor, limits: ImagesConfig) -> VideoSampling:
    """The model's clip settings: `[images.video]` over its video processor's own (`VideoSampling`)."""
    return VideoSampling.from_processor(processor, limits)


def tokenize_rendered(
    text: str, images: list[Image.Image], processor, *, limits: ImagesConfig = ImagesConfig(), sample: str | None = None,
    clips: list[VideoClip] | None = None, sampling: VideoSampling | None = None,
) -> ModelInputs:
    """Rendered chat text (one placeholder per image and per clip) and its images and clips ->
    model inputs. The processor expands every placeholder itself (a clip's timestamps included)."""
    clips = list(clips or [])
    kwargs: dict[str, Any] = dict(text=[text], return_tensors="pt", return_mm_token_type_ids=True)
    if images:
        kwargs["images"] = images
        kwargs["images_kwargs"] = {"size": processor_size(limits)}
    if clips:
        sampling = sampling or video_sampling(processor, limits)
        kwargs["videos"] = [clip.frames for clip in clips]
        kwargs["videos_kwargs"] = {**sampling.processor_kwargs(), "video_metadata": [c.metadata() for c in clips]}
    try:
        encoded = processor(**kwargs)
    except ValueError as err:
        if not clips:
            raise
        raise VideoError(f"the video processor refused a clip: {err}", sample=sample) from err
    input_ids = encoded["input_ids"][0].long()
    types = encoded.get("mm_token_type_ids")
    mm_types = types[0].long() if types is not None else torch.zeros_like(input_ids)
    grid = encoded["image_grid_thw"].long() if images else None
    _check_pads(input_ids, processor.image_token_id, grid, processor.image_processor.merge_size, "image", sample)
    videos = ClipRefs()
    if clips:
        video_grid = encoded["video_grid_thw"].long()
        _check_pads(input_ids, processor.video_token_id, video_grid, processor.video_processor.merge_size, "video",
                    sample)
        seconds = encoded.get("second_per_grid_ts")  # Qwen2.5-VL's processor gives them; the same rule otherwise
        if seconds is None:
            seconds = [sampling.temporal_patch_size / clip.sampled_fps() for clip in clips]
        videos = ClipRefs([video_cache_key(clip.content_hash, sampling) for clip in clips], video_grid,
                          torch.as_tensor(seconds, dtype=torch.float32).reshape(len(clips)))
    else:
        _check_pads(input_ids, getattr(processor, "video_token_id", None), None, 1, "video", sample)
    return ModelInputs(
        input_ids=input_ids,
        mm_token_type_ids=mm_types,
        pixel_values=encoded["pixel_values"] if images else None,
        image_grid_thw=grid,
        images=images,
        image_hashes=[image_hash(im) for im in images],
        text=text,
        pixel_values_videos=encoded["pixel_values_videos"] if clips else None,
        clips=clips,
        videos=videos,
    )


def _check_pads(input_ids: torch.Tensor, pad_id: int | None, grid: torch.Tensor | None, merge: int, what: str,
                sample: str | None) -> None:
    """The text holds exactly one pad per merged patch of its images (or clips)."""
    if pad_id is None:
        return
    n_pads = int((input_ids == pad_id).sum())
    expected = 0 if grid is None else int((grid.prod(-1) // merge**2).sum())
    if n_pads != expected:
        raise ValueError(
            f"sample {sample!r}: the text holds {n_pads} {what}-pad tokens but the {what}s need {expected}; "
            f"do not write <|{what}_pad|> into message text, use {what} parts"
        )
