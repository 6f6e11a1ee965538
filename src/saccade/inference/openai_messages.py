"""Chat messages as `saccade serve` takes them: images and clips inline, decoded and sampled here.

`to_openai_messages` turns saccade's messages (images and clips in any form `load_image` and
`load_video` read) into OpenAI chat messages that a server can run without reading a file or
fetching a URL:

- an image becomes an `image_url` part with a PNG data URL (its content hash names its cache key);
- a clip is decoded and sampled here, once (`load_video`, as the embedded engine does), and goes
  as a `video_url` part holding its sampled frames (`clip_frames_url`: vLLM's frame-sequence data
  URL, each frame PNG), never its file. Which source frames they are, at what rate, goes beside
  them in the request (`clip_request_fields`: vLLM's per-request `media_io_kwargs`), with the
  video processor's bounds (`mm_processor_kwargs`), so the server's processor computes the
  tokens, timestamps and seconds per temporal patch that transformers' does here.

vLLM applies one `media_io_kwargs["video"]` to every clip of a request: a prompt's clips must
then share their rate and frame numbers, or the prompt is refused by name (sample it with the
embedded engine). `/encode_videos` takes each clip's own (`encode_video_bodies`).
"""

from __future__ import annotations

import base64
import io
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch
from PIL import Image

from saccade.config import ImagesConfig
from saccade.data.images import image_hash, image_to_data_url, load_image
from saccade.data.messages import (
    IMAGE_PART_TYPES, VIDEO_PART_TYPES, has_clips, image_source, video_sampling, video_source,
)
from saccade.data.videos import ClipRefs, VideoClip, VideoError, VideoSampling, load_video, video_cache_key
from saccade.serving.wire import FRAMES_URL_PREFIX, MAX_FRAMES_PER_REQUEST

# One /encode_videos request carries at most this many bytes of frames (saccade serve refuses
# bodies over 64 MB by default); a batch's clips go in as few requests as that allows, a clip whole.
ENCODE_VIDEO_CHUNK_BYTES = 32 * 2**20


@dataclass
class OpenAIMessages:
    """A request's messages as a server takes them, and what the trainer will need of its images
    and clips: their content hashes (images) and the clips themselves, in order."""

    messages: list[dict[str, Any]]
    image_hashes: list[str] = field(default_factory=list)
    image_urls: list[str] = field(default_factory=list)
    clips: list[VideoClip] = field(default_factory=list)
    clip_urls: list[str] = field(default_factory=list)  # each clip's frame-sequence URL, made once
    sampling: VideoSampling | None = None  # the model's clip settings, when there are clips

    def clip_keys(self) -> list[str]:
        return [video_cache_key(c.content_hash, self.sampling) for c in self.clips]


def to_openai_messages(messages: list[dict[str, Any]], limits: ImagesConfig, sample: str,
                       processor=None) -> OpenAIMessages:
    """Messages with every image as an image_url data URL and every clip as its sampled frames
    (`processor`: the model's, whose video processor samples them; needed only for clips)."""
    sampling = None
    if has_clips(messages):
        if processor is None:
            raise VideoError("a clip needs the model's processor to be sampled", sample=sample)
        sampling = video_sampling(processor, limits)
    out = OpenAIMessages([], sampling=sampling)
    for message in messages:
        content = message.get("content")
        if not isinstance(content, list):
            out.messages.append(dict(message))
            continue
        parts = []
        for part in content:
            kind = part.get("type")
            if kind in VIDEO_PART_TYPES:
                clip = load_video(video_source(part, kind), sampling=sampling, sample=sample, fps=part.get("fps"),
                                  limits=limits)
                out.clips.append(clip)
                out.clip_urls.append(clip_frames_url(clip))
                parts.append({"type": "video_url", "video_url": {"url": out.clip_urls[-1]}})
            elif kind in IMAGE_PART_TYPES:
                image = load_image(image_source(part, kind), limits=limits, sample=sample)
                url = image_to_data_url(image)
                out.image_hashes.append(image_hash(image))
                out.image_urls.append(url)
                parts.append({"type": "image_url", "image_url": {"url": url}})
            else:
                parts.append(dict(part))
        out.messages.append({**message, "content": parts})
    return out


def clip_frames_url(clip: VideoClip) -> str:
    """The clip's sampled frames as one frame-sequence data URL (`wire.FRAMES_URL_PREFIX`), each
    frame PNG: vLLM reads each as an image, lossless, so the server sees the frames decoded here."""
    if clip.num_frames > MAX_FRAMES_PER_REQUEST:
        raise VideoError(f"a clip of {clip.num_frames} frames; a server takes at most {MAX_FRAMES_PER_REQUEST} in one "
                         "request: lower images.video.max_frames (or fps)")
    return FRAMES_URL_PREFIX + ",".join(_png(frame) for frame in clip.frames)


def _png(frame: np.ndarray) -> str:
    buffer = io.BytesIO()
    Image.fromarray(frame).save(buffer, format="PNG", compress_level=1)  # for transport, not archiving
    return base64.b64encode(buffer.getvalue()).decode("ascii")


def clip_request_fields(clips: list[VideoClip], sampling: VideoSampling | None, sample: str) -> dict[str, Any]:
    """The chat request's fields that make the server process its clips as transformers does here:
    which source frames were sent (`media_io_kwargs`) and the video processor's bounds, with no
    sampling again (`mm_processor_kwargs`). Empty without clips."""
    if not clips:
        return {}
    settings = {repr(c.media_io_kwargs()) for c in clips}
    if len(settings) > 1:
        raise VideoError("the prompt's clips differ in frame rate or frame numbers, and a vLLM server applies one "
                         "setting to every clip of a request: give each prompt one clip (or clips sampled alike), "
                         "or sample with the embedded engine (engine.kind = 'embedded')", sample=sample)
    return {"media_io_kwargs": {"video": clips[0].media_io_kwargs()},
            "mm_processor_kwargs": sampling.processor_kwargs()}


def clip_refs(keys: list[str], clips: list[VideoClip], grids: list[torch.Tensor], sampling: VideoSampling) -> ClipRefs:
    """The prompt's `ClipRefs`: cache keys, the grids the server's tower gave, and each clip's
    seconds per temporal patch (transformers' rule: temporal patch size / sampled frame rate)."""
    if not clips:
        return ClipRefs()
    seconds = [sampling.temporal_patch_size / clip.sampled_fps() for clip in clips]
    return ClipRefs(list(keys), torch.stack(grids).long(), torch.tensor(seconds, dtype=torch.float32))


def encode_video_bodies(clips: dict[str, VideoClip], sampling: VideoSampling,
                        urls: dict[str, str] | None = None) -> list[tuple[list[str], dict]]:
    """(keys, /encode_videos body) chunks for these clips (key -> clip): whole clips, at most
    ENCODE_VIDEO_CHUNK_BYTES of frames and MAX_FRAMES_PER_REQUEST frames a request, in order.
    `urls`: clips' frame-sequence URLs already made (key -> URL; `OpenAIMessages.clip_urls`)."""
    chunks: list[tuple[list[str], dict]] = []
    size = frames = 0
    for key, clip in clips.items():
        url = (urls or {}).get(key) or clip_frames_url(clip)
        if (not chunks or size + len(url) > ENCODE_VIDEO_CHUNK_BYTES
                or frames + clip.num_frames > MAX_FRAMES_PER_REQUEST):
            chunks.append(([], {"videos": [], **sampling.processor_kwargs()}))
            size = frames = 0
        meta = clip.media_io_kwargs()
        chunks[-1][0].append(key)
        chunks[-1][1]["videos"].append({"frames": url, "fps": meta["fps"], "frames_indices": meta["frames_indices"],
                                        "total_num_frames": meta["total_num_frames"]})
        size += len(url)
        frames += clip.num_frames
    return chunks
