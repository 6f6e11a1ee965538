"""The single entry point for clips (video) entering saccade: decode, sample, check, hash.

Every clip saccade touches (a chat message's video part, a data set's video column) goes
through :func:`load_video`, which returns a :class:`VideoClip`: the sampled frames, decoded
once, with what the processors need to know about them (the source's frame rate and frame
count, which frames were taken). What a clip may be:

- a local video file: a path (``str`` or ``os.PathLike``) or a ``file://`` URL;
- ``data:video/<format>;base64,<payload>`` (vLLM's chat route takes the same), or raw bytes;
- an ``http(s)://`` URL, only with ``images.allow_remote`` (as images);
- a `VideoClip` (already decoded: a blanked one, one an episode carries), as it is;
- a list of frames (PIL images, ``(H, W, 3)`` uint8 arrays, or anything `load_image` reads),
  or one ``(frames, H, W, 3)`` uint8 array: a clip already sampled, taken whole, its frames
  ``1 / fps`` seconds apart (the part's ``fps``, else ``images.video.frame_list_fps``).

Files are decoded with transformers' own OpenCV reader (`transformers.video_utils.read_video_opencv`,
opencv-python-headless being installed with vLLM; transformers' default decoders, torchcodec
and torchvision's, are not installed here), the frames picked by the model's own video
processor (`sample_frames`: Qwen3-VL's fps with min/max frames, Qwen2-VL's by temporal patch),
under the settings of `[images.video]` (`VideoSampling`: unset keys are the processor's own).
Given the same file and settings, transformers' processor, called on the file itself, samples
the same frames (tests/data/test_videos.py holds them equal).

Refused with a :class:`VideoError` that names the sample (an `ImageError`, so the data sets'
skip rules and the engines' error paths take clips as they take images): a file OpenCV cannot
open or that holds fewer frames than its header says (corrupt, truncated), zero frames, a frame
rate of 0, frames of more than ``images.max_source_pixels`` each or a clip of more than
``images.video.max_source_pixels`` decoded pixels in all, more than the settings' most frames,
frames of different sizes, a remote URL unless allowed.

A clip is decoded and sampled once: `DecodedClips`, an LRU under
``images.video.decoded_cache_bytes`` keyed by the source's content hash and the sampling
settings, hands a clip read again (the next turn of an episode, the next epoch) back as it
was. Its embedding's cache key (`video_cache_key`) is the sampled frames' content hash, the
sampling settings and the pixel limits: the engine and the trainer find the same frames' same
features under it.

A clip goes to a vLLM server as its sampled frames, never as its file
(`saccade.inference.openai_messages.clip_frames_url`): vLLM's frame-sequence data URL (``data:video/jpeg;base64,<frame>,<frame>,...``, each frame PNG, which
vLLM reads as any image: lossless), with `VideoClip.media_io_kwargs` telling vLLM which source
frames they are, so the server neither decodes nor samples again and its processor sees the
frames, timestamps and frame rate transformers' did here.

`ClipRefs` is what every stage after the processor carries of a prompt's or a sample's clips:
their cache keys, grids and seconds per temporal patch (the frames stay with the engine).
"""

from __future__ import annotations

import copy
import hashlib
import os
import tempfile
import threading
from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import torch
from PIL import Image

from saccade.config import ImagesConfig
from saccade.data.images import (
    ImageError, MissingImageError, TooManyPixelsError, _decode_data_url, _fetch_remote, _file_url_to_path, _shorten,
    load_image,
)

__all__ = [
    "BlankedClip", "ClipRefs", "DecodedClips", "MissingVideoError", "VideoClip", "VideoError", "VideoSampling",
    "VideoTooManyPixelsError", "blank_clip", "clip_hash", "load_video", "video_cache_key",
]

_MAX_DICT_DEPTH = 4


class VideoError(ImageError):
    """A bad clip: the message says which sample, what is wrong and what to do."""


class MissingVideoError(VideoError, MissingImageError):
    """There is no clip where one was expected: None, or a file that is not there."""


class VideoTooManyPixelsError(VideoError, TooManyPixelsError):
    """A clip's frames, one or all together, hold more decoded pixels than the limits allow."""


# --------------------------------------------------------------------------- the settings


@dataclass(frozen=True)
class VideoSampling:
    """`[images.video]` resolved against a model's video processor: what `load_video` samples and
    what the processor resizes with. `from_processor` makes it; `key` is what a clip's cache key
    adds to its frames' hash."""

    do_sample: bool  # False: a file's every frame (Qwen2-VL's processor, with neither fps nor num_frames set)
    fps: float | None
    num_frames: int | None
    min_frames: int
    max_frames: int
    min_pixels: int  # the processor's size.shortest_edge
    max_pixels: int  # the processor's size.longest_edge
    cap_pixels_per_frame: bool
    temporal_patch_size: int
    frame_list_fps: float
    max_frame_pixels: int  # images.max_source_pixels: one decoded frame
    max_source_pixels: int  # images.video.max_source_pixels: a clip's decoded frames together
    decoded_cache_bytes: int = 0  # images.video.decoded_cache_bytes: the budget of `DECODED`
    sampler: str = ""  # the video processor's class: its `sample_frames` is the rule (Qwen3-VL's, Qwen2-VL's)
    # The video processor with these settings, whose `sample_frames` picks the frames.
    processor: Any = field(default=None, compare=False, repr=False)

    @classmethod
    def from_processor(cls, processor, limits: ImagesConfig) -> VideoSampling:
        """The settings for `processor` (a whole processor, or its video processor) under `limits`."""
        video = getattr(processor, "video_processor", processor)
        if video is None or not hasattr(video, "sample_frames"):
            raise VideoError("this model's processor has no video processor: it reads no clips")
        cfg = limits.video
        by_fps, by_count = cfg.fps is not None, cfg.num_frames is not None
        configured = copy.copy(video)
        configured.fps = cfg.fps if by_fps else (None if by_count else video.fps)
        configured.num_frames = cfg.num_frames if by_count else (None if by_fps else video.num_frames)
        configured.min_frames = cfg.min_frames if cfg.min_frames is not None else video.min_frames
        configured.max_frames = cfg.max_frames if cfg.max_frames is not None else video.max_frames
        configured.do_sample_frames = bool(video.do_sample_frames) or by_fps or by_count
        size = video.size
        return cls(
            do_sample=configured.do_sample_frames, fps=configured.fps, num_frames=configured.num_frames,
            min_frames=int(configured.min_frames), max_frames=int(configured.max_frames),
            min_pixels=int(cfg.min_pixels if cfg.min_pixels is not None else size.shortest_edge),
            max_pixels=int(cfg.max_pixels if cfg.max_pixels is not None else size.longest_edge),
            cap_pixels_per_frame=cfg.cap_pixels_per_frame, temporal_patch_size=int(video.temporal_patch_size),
            frame_list_fps=cfg.frame_list_fps, max_frame_pixels=limits.max_source_pixels,
            max_source_pixels=cfg.max_source_pixels, decoded_cache_bytes=cfg.decoded_cache_bytes,
            sampler=type(video).__name__, processor=configured,
        )

    @property
    def key(self) -> str:
        """The settings that decide a clip's frames and their resize, as text: the sampling rule (the
        video processor's class) and its arguments, the pixel bounds."""
        how = f"fps{self.fps}" if self.num_frames is None else f"n{self.num_frames}"
        return (f"{self.sampler}-{how if self.do_sample else 'all'}-f{self.min_frames}-{self.max_frames}-"
                f"p{self.min_pixels}-{self.max_pixels}{'-cap' if self.cap_pixels_per_frame else ''}")

    def processor_kwargs(self) -> dict[str, Any]:
        """The video processor's arguments for already sampled frames: no sampling, these pixel bounds."""
        return {"do_sample_frames": False, "size": {"shortest_edge": self.min_pixels, "longest_edge": self.max_pixels},
                "cap_pixels_per_frame": self.cap_pixels_per_frame}

    def indices(self, metadata) -> np.ndarray:
        """The source frames to take, as transformers' `BaseVideoProcessor.preprocess` asks its
        `sample_frames` (every argument defaulted from the processor), or all of them."""
        if not self.do_sample:
            return np.arange(metadata.total_num_frames)
        video = self.processor
        kwargs = {k: getattr(video, k, None) for k in video.valid_kwargs.__annotations__}
        for popped in ("input_data_format", "do_convert_rgb", "do_sample_frames", "device", "video_metadata"):
            kwargs.pop(popped, None)
        chosen = video.sample_frames(metadata=metadata, **kwargs)
        return np.asarray(chosen.tolist() if isinstance(chosen, torch.Tensor) else chosen, dtype=np.int64)


def video_cache_key(content_hash: str, sampling: VideoSampling) -> str:
    """The embedding-cache key of a clip: its sampled frames' hash (`VideoClip.content_hash`), the
    sampling settings and the pixel limits (which change its grid). Every engine names cached
    clips this way; image keys never start with 'video-'."""
    return f"video-{content_hash}-{sampling.key}"


# --------------------------------------------------------------------------- the clip


@dataclass(frozen=True, eq=False)
class VideoClip:
    """A clip's sampled frames, decoded once, and what the processor needs to know of them."""

    frames: np.ndarray  # (frames, height, width, 3) uint8 RGB; shared (the decode cache): never write to it
    fps: float  # the source's frame rate (a list of frames: its given fps)
    total_frames: int  # frames in the source
    frame_indices: tuple[int, ...]  # which source frames these are, in order
    content_hash: str  # `clip_hash(frames)`

    @property
    def num_frames(self) -> int:
        return int(self.frames.shape[0])

    @property
    def size(self) -> tuple[int, int]:
        """(width, height) of every frame."""
        return int(self.frames.shape[2]), int(self.frames.shape[1])

    @property
    def nbytes(self) -> int:
        return int(self.frames.nbytes)

    def metadata(self) -> dict[str, Any]:
        """transformers' `VideoMetadata` fields: its processors read the timestamps (Qwen3-VL) and the
        sampled frame rate (Qwen2.5-VL's seconds per temporal patch) from them."""
        return {"total_num_frames": self.total_frames, "fps": self.fps, "width": self.size[0],
                "height": self.size[1], "duration": self.total_frames / self.fps, "video_backend": "opencv",
                "frames_indices": list(self.frame_indices)}

    def sampled_fps(self) -> float:
        """Frames a second after sampling (transformers' `VideoMetadata.sampled_fps`)."""
        return len(self.frame_indices) / self.total_frames * self.fps

    def media_io_kwargs(self) -> dict[str, Any]:
        """vLLM's per-request `media_io_kwargs["video"]` for `clip_frames_url(self)`: every frame sent
        taken, and the metadata its frame-sequence loader would otherwise make up (1 fps, frames
        0..n-1), which Qwen3-VL's timestamps and Qwen2.5-VL's seconds per temporal patch are read from."""
        return {"num_frames": -1, "fps": self.fps, "frames_indices": list(self.frame_indices),
                "total_num_frames": self.total_frames, "duration": self.total_frames / self.fps}


def clip_hash(frames: np.ndarray) -> str:
    """SHA-256 hex digest of a clip's decoded frames (their shape and RGB bytes): the same frames
    give the same hash whatever file or list they came from."""
    digest = hashlib.sha256()
    digest.update(("clip:" + "x".join(str(d) for d in frames.shape) + ":").encode())
    digest.update(np.ascontiguousarray(frames).tobytes())
    return digest.hexdigest()


def _clip(frames: np.ndarray, fps: float, total: int, indices: Sequence[int]) -> VideoClip:
    frames = np.ascontiguousarray(frames)  # shared by every reader of a cached clip: never written to
    return VideoClip(frames, float(fps), int(total), tuple(int(i) for i in indices), clip_hash(frames))


def blank_clip(clip: VideoClip, gray: int = 128) -> VideoClip:
    """The same clip with every frame a uniform gray: its tokens and timestamps stay, what it
    showed is gone (the visual-reliance counterfactual, as `blank_like` for images)."""
    return _clip(np.full_like(clip.frames, gray), clip.fps, clip.total_frames, clip.frame_indices)


@dataclass(frozen=True)
class BlankedClip:
    """A clip source read as `blank_clip` of the clip it holds: what a data set's control gives for
    each clip (`task.blank_images`), decoded and sampled when its prompt is, by the model's
    sampling, so its frames' count, size and timestamps are the real clip's."""

    source: Any


@dataclass
class ClipRefs:
    """A prompt's or a sample's clips, in order, as every stage after the processor knows them."""

    keys: list[str] = field(default_factory=list)  # embedding-cache keys (`video_cache_key`)
    # (n, 3) int64: (temporal patches, height patches, width patches), before the spatial merge
    grid_thw: torch.Tensor = field(default_factory=lambda: torch.zeros(0, 3, dtype=torch.long))
    # (n,) float32: the seconds one temporal patch spans (transformers' second_per_grid_ts)
    second_per_grid: torch.Tensor = field(default_factory=lambda: torch.zeros(0, dtype=torch.float32))

    def __post_init__(self):
        n = len(self.keys)
        if self.grid_thw.shape != (n, 3) or self.second_per_grid.shape != (n,):
            raise ValueError(f"{n} clip keys but grids {tuple(self.grid_thw.shape)} and seconds per grid "
                             f"{tuple(self.second_per_grid.shape)}")

    def __len__(self) -> int:
        return len(self.keys)

    def __add__(self, other: ClipRefs) -> ClipRefs:
        return ClipRefs(self.keys + other.keys, torch.cat([self.grid_thw, other.grid_thw.long()]),
                        torch.cat([self.second_per_grid, other.second_per_grid.float()]))

    def take(self, n: int) -> ClipRefs:
        """The first `n` clips."""
        return ClipRefs(self.keys[:n], self.grid_thw[:n], self.second_per_grid[:n])

    def same_as(self, other: ClipRefs) -> bool:
        return (self.keys == other.keys and torch.equal(self.grid_thw.long(), other.grid_thw.long())
                and torch.equal(self.second_per_grid.float(), other.second_per_grid.float()))

    def clone(self) -> ClipRefs:
        return ClipRefs(list(self.keys), self.grid_thw.clone(), self.second_per_grid.clone())


# --------------------------------------------------------------------------- the decode cache


class DecodedClips:
    """Decoded, sampled clips by (the source's content hash, the sampling settings): an LRU under
    a byte budget, shared by every caller in the process (`load_video`)."""

    def __init__(self, max_bytes: int = 512 << 20):
        self.max_bytes = max_bytes
        self._entries: OrderedDict[str, VideoClip] = OrderedDict()
        self._bytes = 0
        self._lock = threading.Lock()
        self.hits = self.misses = 0

    def get(self, key: str) -> VideoClip | None:
        with self._lock:
            clip = self._entries.get(key)
            if clip is None:
                self.misses += 1
                return None
            self._entries.move_to_end(key)
            self.hits += 1
            return clip

    def put(self, key: str, clip: VideoClip) -> None:
        with self._lock:
            if key in self._entries or clip.nbytes > self.max_bytes:
                return
            self._entries[key] = clip
            self._bytes += clip.nbytes
            while self._bytes > self.max_bytes:
                self._bytes -= self._entries.popitem(last=False)[1].nbytes


DECODED = DecodedClips()


# --------------------------------------------------------------------------- loading


def load_video(source: Any, *, sampling: VideoSampling, sample: str | None = None,
               fps: float | None = None, limits: ImagesConfig | None = None) -> VideoClip:
    """Decode (or take), sample and check one clip; see the module docstring for what `source` may
    be. `fps`: a list of frames' rate (its part's 'fps'). `limits`: the image limits (remote URLs,
    and each frame of a list of frames, which `load_image` reads)."""
    limits = limits or ImagesConfig()
    try:
        return _load(source, sampling, limits, fps, depth=0)
    except ImageError as err:
        if not isinstance(err, VideoError):  # a frame or a data URL: say it is a clip's
            err = VideoError(f"clip: {err.reason}")
        if sample is not None and err.sample is None:
            err._attach_sample(sample)
        raise err from None


def _load(source: Any, sampling: VideoSampling, limits: ImagesConfig, fps: float | None, depth: int) -> VideoClip:
    if source is None:
        raise MissingVideoError("the clip is None; the video is missing")
    if isinstance(source, VideoClip):  # already decoded and sampled (a blanked clip, a trajectory's)
        return source
    if isinstance(source, BlankedClip):  # the control's: read as what it holds, then grayed
        return blank_clip(_load(source.source, sampling, limits, fps, depth))
    if isinstance(source, dict):
        if depth >= _MAX_DICT_DEPTH:
            raise VideoError(f"video dict is nested more than {_MAX_DICT_DEPTH} levels deep")
        if source.get("bytes") is not None:
            return _load(bytes(source["bytes"]), sampling, limits, fps, depth + 1)
        for key in ("url", "path", "video_url", "video"):
            if source.get(key) is not None:
                return _load(source[key], sampling, limits, fps or source.get("fps"), depth + 1)
        raise VideoError(f"unsupported video dict with keys {sorted(map(str, source))}; expected 'url', 'path', "
                         "'bytes' or 'video'")
    if isinstance(source, np.ndarray | torch.Tensor) and source.ndim == 4:
        return _from_frames(list(np.asarray(source)), sampling, limits, fps)
    if isinstance(source, list | tuple):
        return _from_frames(list(source), sampling, limits, fps)
    if isinstance(source, bytes | bytearray | memoryview):
        return _cached(hashlib.sha256(bytes(source)).hexdigest(), sampling, lambda: _from_bytes(bytes(source), sampling))
    if isinstance(source, os.PathLike):
        return _from_path(Path(source), sampling)
    if isinstance(source, str):
        head = source[:16].lower()
        if head.startswith("data:"):
            data = _decode_data_url(source)
            return _cached(hashlib.sha256(data).hexdigest(), sampling, lambda: _from_bytes(data, sampling))
        if head.startswith(("http://", "https://")):
            if not limits.allow_remote:
                raise VideoError(f"remote video URLs are refused ({_shorten(source)}); download the clip and pass a "
                                 "local path, or set images.allow_remote = true")
            data = _fetch_remote(source, limits)
            return _cached(hashlib.sha256(data).hexdigest(), sampling, lambda: _from_bytes(data, sampling))
        if head.startswith("file:"):
            return _from_path(_file_url_to_path(source), sampling)
        if "://" in source:
            raise VideoError(f"unsupported URL scheme {source.split('://', 1)[0]!r} in {_shorten(source)}; pass a local "
                             "path, bytes or a data: URL")
        return _from_path(Path(source), sampling)
    raise VideoError(f"unsupported video source of type {type(source).__name__}; pass a path, a file:// or data: URL, "
                     "bytes, a list of frames or a (frames, height, width, 3) uint8 array")


def _cached(source_hash: str, sampling: VideoSampling, decode) -> VideoClip:
    key = f"{source_hash}-{sampling.key}-{sampling.max_frame_pixels}-{sampling.max_source_pixels}"
    if not sampling.decoded_cache_bytes:
        return decode()
    DECODED.max_bytes = sampling.decoded_cache_bytes  # the run's budget (one [images.video] per process)
    clip = DECODED.get(key)
    if clip is None:
        clip = decode()
        DECODED.put(key, clip)
    return clip


def _from_path(path: Path, sampling: VideoSampling) -> VideoClip:
    if not path.is_file():
        raise MissingVideoError(f"video file {str(path)[:200]!r} does not exist" if not path.exists()
                                else f"{str(path)[:200]!r} is not a file")
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(1 << 20):
            digest.update(chunk)
    return _cached(digest.hexdigest(), sampling, lambda: _decode_file(str(path), sampling))


def _from_bytes(data: bytes, sampling: VideoSampling) -> VideoClip:
    """OpenCV reads files only: the bytes go through a private temporary file."""
    with tempfile.NamedTemporaryFile(suffix=".video") as f:
        f.write(data)
        f.flush()
        return _decode_file(f.name, sampling)


def _decode_file(path: str, sampling: VideoSampling) -> VideoClip:
    """Open with OpenCV, check the header, pick the frames (`sampling.indices`), decode them with
    transformers' `read_video_opencv`, and check that every picked frame came out."""
    import cv2
    from transformers.video_utils import read_video_opencv

    capture = cv2.VideoCapture(path)
    try:
        if not capture.isOpened():
            raise VideoError("OpenCV cannot open it as a video (a corrupt file, or not a video)")
        total = int(capture.get(cv2.CAP_PROP_FRAME_COUNT))
        rate = float(capture.get(cv2.CAP_PROP_FPS))
        width, height = int(capture.get(cv2.CAP_PROP_FRAME_WIDTH)), int(capture.get(cv2.CAP_PROP_FRAME_HEIGHT))
    finally:
        capture.release()
    if total <= 0:
        raise VideoError("the video holds zero frames")
    if not rate > 0:
        raise VideoError("the video's frame rate is 0 or unknown: its frames have no timestamps")
    _check_frame_pixels(width, height, sampling)
    chosen: list[np.ndarray] = []

    def indices(metadata, **_):
        picked = sampling.indices(metadata)
        _check_count(len(picked), sampling, whole=not sampling.do_sample)
        _check_clip_pixels(len(picked), width, height, sampling)
        chosen.append(picked)
        return picked

    try:
        frames, _ = read_video_opencv(path, sample_indices_fn=indices)
    except VideoError:
        raise
    except ValueError as err:  # np.stack of no frame at all
        raise VideoError(f"no frame could be decoded ({err})") from err
    if frames.shape[0] != len(chosen[0]) or frames.shape[1:] != (height, width, 3):
        raise VideoError(f"{frames.shape[0]} of its {len(chosen[0])} sampled frames decoded (header: {total} frames "
                         f"of {width}x{height}): a truncated or corrupt file")
    return _clip(frames, rate, total, chosen[0])


def _from_frames(values: list, sampling: VideoSampling, limits: ImagesConfig, fps: float | None) -> VideoClip:
    if not values:
        raise VideoError("the clip is an empty list of frames: zero frames")
    _check_count(len(values), sampling, whole=True)
    frames = [_frame(v, limits, i) for i, v in enumerate(values)]
    sizes = {f.shape for f in frames}
    if len(sizes) > 1:
        raise VideoError(f"the clip's frames differ in size ({sorted(s[:2] for s in sizes)}); a clip's frames "
                         "share one size")
    height, width = frames[0].shape[:2]
    _check_frame_pixels(width, height, sampling)
    _check_clip_pixels(len(frames), width, height, sampling)
    rate = float(fps) if fps is not None else sampling.frame_list_fps
    if not rate > 0:
        raise VideoError(f"a clip's fps must be > 0, got {fps!r}")
    return _clip(np.stack(frames), rate, len(frames), range(len(frames)))


def _frame(value: Any, limits: ImagesConfig, i: int) -> np.ndarray:
    if isinstance(value, np.ndarray | torch.Tensor):
        array = np.asarray(value)
        if array.ndim != 3 or array.shape[2] != 3 or array.dtype != np.uint8:
            raise VideoError(f"frame {i} is an array of shape {array.shape} and type {array.dtype}; frames given "
                             "as arrays are (height, width, 3) uint8 RGB")
        value = Image.fromarray(array)
    image = load_image(value, limits=limits, sample=f"frame {i}")
    return np.asarray(image)


def _check_count(n: int, sampling: VideoSampling, *, whole: bool) -> None:
    if n > sampling.max_frames:
        how = ("a clip taken whole (a list of frames, or every frame: the processor samples none)" if whole
               else "the sampled clip")
        raise VideoError(f"{how} has {n} frames, more than images.video.max_frames = {sampling.max_frames}; "
                         "set images.video.fps or num_frames to sample fewer, or raise max_frames")


def _check_frame_pixels(width: int, height: int, sampling: VideoSampling) -> None:
    if width <= 0 or height <= 0:
        raise VideoError(f"the video's frames are {width}x{height}: zero size")
    if width * height > sampling.max_frame_pixels:
        raise VideoTooManyPixelsError(f"its frames are {width}x{height} = {width * height:,} pixels, more than "
                                      f"images.max_source_pixels = {sampling.max_frame_pixels:,}")


def _check_clip_pixels(n: int, width: int, height: int, sampling: VideoSampling) -> None:
    if n * width * height > sampling.max_source_pixels:
        raise VideoTooManyPixelsError(
            f"{n} sampled frames of {width}x{height} are {n * width * height:,} decoded pixels, more than "
            f"images.video.max_source_pixels = {sampling.max_source_pixels:,}; sample fewer frames (images.video.fps, "
            "num_frames, max_frames) or raise it")
