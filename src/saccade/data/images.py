"""The single entry point for images entering saccade.

Every image that saccade touches -- in OpenAI-format chat messages, in datasets, in
evaluation sets -- goes through :func:`load_image`. It accepts the usual ways of
referring to an image (PIL image, raw bytes, ``data:`` URL, local path, ``file://``
URL, ``http(s)://`` URL, OpenAI / Hugging Face dict layouts), refuses anything
broken or dangerous with an :class:`ImageError` that names the sample, and returns a
fully loaded, EXIF-oriented, 8-bit ``RGB`` :class:`PIL.Image.Image` that no longer
references any file handle. Normalising once, here, means the rest of the code (and
the vision-tower cache keyed by :func:`image_hash`) never sees alpha channels,
16-bit data or half-decoded files.
"""

from __future__ import annotations

import base64
import binascii
import contextlib
import hashlib
import io
import os
import struct
import time
import urllib.error
import urllib.parse
import urllib.request
import warnings
import zlib
from collections.abc import Iterator, Mapping
from http.client import HTTPException
from pathlib import Path
from typing import IO, Any, TypeAlias

import numpy as np
from PIL import Image, ImageOps, UnidentifiedImageError

from saccade.config import ImagesConfig

__all__ = [
    "ImageError",
    "ImageSource",
    "MissingImageError",
    "BLANK_GRAY",
    "TooManyPixelsError",
    "blank_like",
    "image_hash",
    "image_to_data_url",
    "image_to_png_bytes",
    "load_image",
]

ImageSource: TypeAlias = Image.Image | bytes | str | os.PathLike | dict

# Formats PIL can open only by running an external program (EPS runs Ghostscript on
# the file); untrusted dataset files must never reach a subprocess.
_EXTERNAL_PROGRAM_FORMATS = frozenset({"EPS"})

# Nested dicts ({"image": {"url": ...}}) are resolved recursively; this bounds it.
_MAX_DICT_DEPTH = 4

# Long sources (data URLs, huge paths) are cut to this many characters in messages.
_MAX_SHOWN_CHARS = 80

# What stands in for an image where the image must say nothing: the demo's control run and
# the visual-reliance figures (`eval_accuracy_blank`, `reply_logprob_blank`). Mid gray, never
# an answer color of the synthetic tasks.
BLANK_GRAY: tuple[int, int, int] = (128, 128, 128)

_REMOTE_CHUNK_BYTES = 64 * 1024


_DEFAULT_LIMITS = ImagesConfig()


class ImageError(ValueError):
    """A bad image: the message says which sample, what is wrong and what to do."""

    def __init__(self, reason: str, *, sample: str | None = None) -> None:
        self.reason = reason
        self.sample = sample
        super().__init__(self._message())

    def _message(self) -> str:
        if self.sample is None:
            return self.reason
        return f"sample {self.sample!r}: {self.reason}"

    def __str__(self) -> str:
        return self._message()

    def _attach_sample(self, sample: str) -> None:
        # Helpers deep in the call tree do not know the sample; load_image fills it in
        # on the way out and re-raises the same exception, so the traceback is kept.
        self.sample = sample
        self.args = (self._message(),)

    def __reduce__(self) -> tuple[Any, ...]:
        # The default pickling calls cls(*args), which would lose `sample` (it is
        # keyword-only) and double the prefix; errors cross DataLoader worker processes.
        return (_rebuild_image_error, (type(self), self.reason, self.sample))


class MissingImageError(ImageError):
    """There is no image where one was expected: a None reference, a file that is not there."""


class TooManyPixelsError(ImageError):
    """The image has more pixels than `ImagesConfig.max_source_pixels` allows (or PIL decodes safely)."""


def _rebuild_image_error(cls: type[ImageError], reason: str, sample: str | None) -> ImageError:
    return cls(reason, sample=sample)


# --------------------------------------------------------------------------- loading


def load_image(
    source: ImageSource,
    *,
    limits: ImagesConfig = _DEFAULT_LIMITS,
    sample: str | None = None,
) -> Image.Image:
    """Load, validate and normalise one image.

    ``source`` may be a PIL image; raw bytes; a ``data:image/...;base64,...`` URL; a
    local path (``str`` or ``os.PathLike``) or ``file://`` URL; an ``http(s)://`` URL
    (only with ``limits.allow_remote``); or a dict ``{"url": ...}`` (OpenAI
    image_url), ``{"bytes": ..., "path": ...}`` (Hugging Face datasets ``Image``
    feature: bytes win when not None), ``{"image_url": ...}`` or ``{"image": ...}``.

    Returns a new, fully loaded ``RGB`` image with EXIF orientation applied and any
    transparency composited onto white. Raises :class:`ImageError` (naming
    ``sample`` when given) for anything that cannot be used.
    """
    try:
        return _load(source, limits, depth=0)
    except ImageError as err:
        if sample is not None and err.sample is None:
            err._attach_sample(sample)
        raise


def _load(source: object, limits: ImagesConfig, depth: int) -> Image.Image:
    if isinstance(source, Image.Image):
        return _from_pil(source, limits)
    if isinstance(source, bytes | bytearray | memoryview):
        return _from_bytes(bytes(source), limits)
    if isinstance(source, str):
        return _from_string(source, limits)
    if isinstance(source, os.PathLike):
        return _from_path(Path(source), limits)
    if isinstance(source, Mapping):
        if depth >= _MAX_DICT_DEPTH:
            raise ImageError(f"image dict is nested more than {_MAX_DICT_DEPTH} levels deep")
        return _load(_unwrap_dict(source), limits, depth + 1)
    raise ImageError(
        f"unsupported image source of type {_type_name(source)}; pass a PIL image, bytes, "
        "a data:/file:// URL, a path, or a dict with 'url', 'bytes'/'path' or 'image'"
        + (" (convert arrays with PIL.Image.fromarray first)" if isinstance(source, np.ndarray) else "")
    )


def _unwrap_dict(source: Mapping[str, Any]) -> object:
    """Pick the image reference out of the dict layouts used by OpenAI and HF datasets."""
    if "bytes" in source or "path" in source:
        # HF datasets' Image feature: `path` is only the original file name when the
        # bytes are embedded, so bytes take precedence.
        if source.get("bytes") is not None:
            return source["bytes"]
        if source.get("path") is not None:
            return source["path"]
        raise MissingImageError("image dict has both 'bytes' and 'path' set to None; the image is missing")
    for key in ("url", "image_url", "image"):
        if key in source:
            if source[key] is None:
                raise MissingImageError(f"image dict has {key!r} set to None; the image is missing")
            return source[key]
    raise ImageError(
        f"unsupported image dict with keys {sorted(map(str, source))}; expected "
        "{'url': ...}, {'bytes': ..., 'path': ...}, {'image_url': ...} or {'image': ...}"
    )


def _from_string(source: str, limits: ImagesConfig) -> Image.Image:
    lowered = source[:16].lower()
    if lowered.startswith("data:"):
        return _from_bytes(_decode_data_url(source), limits)
    if lowered.startswith(("http://", "https://")):
        return _from_bytes(_fetch_remote(source, limits), limits)
    if lowered.startswith("file:"):
        return _from_path(_file_url_to_path(source), limits)
    if "://" in source:
        scheme = source.split("://", 1)[0]
        raise ImageError(
            f"unsupported URL scheme {scheme!r} in {_shorten(source)}; "
            "download the image and pass a local path, bytes or a data: URL"
        )
    return _from_path(Path(source), limits)


def _decode_data_url(url: str) -> bytes:
    header, sep, payload = url.partition(",")
    if not sep:
        raise ImageError(f"malformed data URL {_shorten(url)}: there is no ',' before the payload")
    # Only base64 payloads are accepted: percent-encoded data URLs are for text (SVG),
    # which is not a raster image anyway. The media type is not trusted: PIL identifies
    # the format from the bytes themselves.
    if not header.lower().endswith(";base64"):
        raise ImageError(
            f"malformed data URL {_shorten(url)}: expected 'data:image/<format>;base64,<payload>'"
        )
    compact = "".join(payload.split())  # encoders sometimes wrap lines
    # Tolerate the URL-safe alphabet and missing padding, both common in the wild.
    compact = compact.replace("-", "+").replace("_", "/")
    compact += "=" * (-len(compact) % 4)
    try:
        data = base64.b64decode(compact, validate=True)
    except (binascii.Error, ValueError) as err:
        raise ImageError(
            f"malformed data URL {_shorten(url)}: the payload is not valid base64 ({err})"
        ) from err
    if not data:
        raise ImageError(f"malformed data URL {_shorten(url)}: the payload is empty")
    return data


def data_url_size(url: str) -> tuple[int, int]:
    """(width, height) of a data URL's image from its header alone: no pixel is decoded. What a
    server checks a request's total pixels with before it decodes any (and a client sizes its
    requests with)."""
    stream = io.BytesIO(_decode_data_url(url))
    with _pil_errors(stream):
        Image.init()
        formats = [name for name in Image.ID if name not in _EXTERNAL_PROGRAM_FORMATS]
        with Image.open(stream, formats=formats) as opened:
            return opened.size


def _file_url_to_path(url: str) -> Path:
    parsed = urllib.parse.urlparse(url)
    if parsed.netloc not in ("", "localhost"):
        raise ImageError(
            f"file URL {_shorten(url)} names host {parsed.netloc!r}; only local files "
            "(file:///absolute/path) are supported"
        )
    if not parsed.path:
        raise ImageError(f"file URL {_shorten(url)} has no path")
    return Path(urllib.request.url2pathname(parsed.path))


class _HttpOnlyRedirects(urllib.request.HTTPRedirectHandler):
    # A remote server must not be able to bounce us to ftp:// or other schemes.
    def redirect_request(self, req, fp, code, msg, headers, newurl):  # type: ignore[no-untyped-def]
        if urllib.parse.urlparse(newurl).scheme.lower() not in ("http", "https"):
            raise ImageError(f"remote image redirected to a non-http(s) URL {_shorten(newurl)}")
        return super().redirect_request(req, fp, code, msg, headers, newurl)


def _fetch_remote(url: str, limits: ImagesConfig) -> bytes:
    if not limits.allow_remote:
        raise ImageError(
            f"remote image URLs are refused ({_shorten(url)}); download the image and pass "
            "a local path, or set ImagesConfig(allow_remote=True)"
        )
    opener = urllib.request.build_opener(_HttpOnlyRedirects())
    request = urllib.request.Request(url, headers={"User-Agent": "saccade"})
    # urllib's timeout applies to each socket operation, so a server that trickles
    # bytes could hold us forever; the deadline bounds the whole download.
    deadline = time.monotonic() + limits.remote_timeout_s
    cap = limits.max_remote_bytes
    too_big = (
        f"remote image {_shorten(url)} is larger than ImagesConfig.max_remote_bytes={cap:,}; "
        "download it yourself or raise max_remote_bytes"
    )
    try:
        with opener.open(request, timeout=limits.remote_timeout_s) as response:
            declared = response.headers.get("Content-Length")
            if declared is not None and declared.strip().isdigit() and int(declared) > cap:
                raise ImageError(too_big)
            chunks: list[bytes] = []
            received = 0
            while chunk := response.read(_REMOTE_CHUNK_BYTES):
                received += len(chunk)
                if received > cap:
                    raise ImageError(too_big)
                if time.monotonic() > deadline:
                    raise ImageError(
                        f"remote image {_shorten(url)} took longer than "
                        f"ImagesConfig.remote_timeout_s={limits.remote_timeout_s}s to download"
                    )
                chunks.append(chunk)
    except ImageError:
        raise
    except urllib.error.HTTPError as err:
        raise ImageError(
            f"could not fetch remote image {_shorten(url)}: HTTP {err.code} {err.reason}"
        ) from err
    except urllib.error.URLError as err:
        raise ImageError(f"could not fetch remote image {_shorten(url)}: {err.reason}") from err
    except (OSError, HTTPException, ValueError) as err:  # timeouts are OSErrors
        raise ImageError(f"could not fetch remote image {_shorten(url)}: {err!r}") from err
    return b"".join(chunks)


def _from_path(path: Path, limits: ImagesConfig) -> Image.Image:
    try:
        handle = path.open("rb")
    except FileNotFoundError as err:
        hint = "" if path.is_absolute() else f" (relative to the working directory {os.getcwd()!r})"
        raise MissingImageError(f"image file not found: {_shorten(str(path))}{hint}") from err
    except IsADirectoryError as err:
        raise ImageError(f"image path is a directory, not a file: {_shorten(str(path))}") from err
    except OSError as err:
        raise ImageError(f"cannot read image file {_shorten(str(path))}: {err.strerror or err}") from err
    with handle:
        return _decode(handle, limits)


def _from_bytes(data: bytes, limits: ImagesConfig) -> Image.Image:
    if not data:
        raise ImageError("image is empty (0 bytes)")
    return _decode(io.BytesIO(data), limits)


def _decode(stream: IO[bytes], limits: ImagesConfig) -> Image.Image:
    with _pil_errors(stream):
        Image.init()  # so that the format list below includes every registered plugin
        formats = [name for name in Image.ID if name not in _EXTERNAL_PROGRAM_FORMATS]
        with Image.open(stream, formats=formats) as opened:
            # Image.open only reads the header: check the size before decoding pixels.
            _check_dimensions(opened.size, limits)
            # Leaving the `with` closes `opened` and frees its pixels, so take the
            # oriented copy while it is still open.
            oriented = _loaded_and_oriented(opened, limits)
    return _to_rgb(oriented)


def _from_pil(image: Image.Image, limits: ImagesConfig) -> Image.Image:
    # A caller may pass a lazily opened (not yet decoded) image: same checks as a file.
    with _pil_errors(None):
        _check_dimensions(image.size, limits)
        oriented = _loaded_and_oriented(image, limits)
    return _to_rgb(oriented)


def _loaded_and_oriented(image: Image.Image, limits: ImagesConfig) -> Image.Image:
    """Decode the pixels (truncation errors surface here) and return an oriented copy."""
    image.load()
    # Some formats (e.g. ICO, multi-resolution files) only know their final size
    # after decoding.
    _check_dimensions(image.size, limits)
    try:
        return ImageOps.exif_transpose(image)
    except Exception:  # noqa: BLE001 - orientation is optional metadata
        # A malformed EXIF block must not make an otherwise good image unusable.
        return image.copy()


def _check_dimensions(size: tuple[int, int], limits: ImagesConfig) -> None:
    width, height = size
    if width <= 0 or height <= 0:
        raise ImageError(f"image has zero size ({width}x{height}); the image is empty")
    pixels = width * height
    if pixels > limits.max_source_pixels:
        raise TooManyPixelsError(
            f"image is {width}x{height} = {pixels:,} pixels, more than "
            f"ImagesConfig.max_source_pixels={limits.max_source_pixels:,} (possible decompression "
            "bomb); downscale it beforehand, or raise max_source_pixels if the image is trusted"
        )


@contextlib.contextmanager
def _pil_errors(stream: IO[bytes] | None) -> Iterator[None]:
    """Turn PIL's many failure modes into ImageError with a readable reason."""
    try:
        with warnings.catch_warnings():
            # PIL warns past its global Image.MAX_IMAGE_PIXELS; our own limit, checked
            # from the header right after opening, is the one that decides.
            warnings.simplefilter("ignore", Image.DecompressionBombWarning)
            yield
    except ImageError:
        raise
    except (Image.DecompressionBombError, Image.DecompressionBombWarning) as err:
        # Raised inside Image.open for sizes over 2 * Image.MAX_IMAGE_PIXELS, before
        # our own check can run (the warning only if someone escalated it to an error).
        raise TooManyPixelsError(
            f"image is too large to decode safely ({err}); downscale it beforehand"
        ) from err
    except UnidentifiedImageError as err:
        raise ImageError(
            "image bytes do not decode as an image (unrecognised format"
            f"{_leading_bytes(stream)}); check that the file is a PNG/JPEG/WebP/... image"
        ) from err
    except (OSError, SyntaxError, ValueError, EOFError, IndexError, struct.error, zlib.error) as err:
        # Truncated or corrupt data: PIL reports these with a zoo of exception types.
        raise ImageError(
            f"image bytes do not decode as an image ({err}); the file is corrupt or "
            "truncated: re-download or re-export it"
        ) from err


def _leading_bytes(stream: IO[bytes] | None) -> str:
    if stream is None:
        return ""
    try:
        stream.seek(0)
        head = stream.read(12)
    except (OSError, ValueError):
        return ""
    return f"; it starts with {head!r}"


# ------------------------------------------------------------------ mode conversion


def _to_rgb(image: Image.Image) -> Image.Image:
    """Convert any PIL mode to 8-bit RGB; transparency is composited onto white."""
    mode = image.mode
    try:
        if mode == "I" or mode.startswith("I;16") or mode == "F":
            image = _high_depth_to_8bit(image)
        elif mode == "La":
            image = image.convert("LA")  # PIL cannot go from premultiplied La to RGB(A)
        if image.has_transparency_data:
            # Dropping alpha would expose whatever colour the encoder left under
            # transparent pixels (often black); a white page is what viewers show.
            rgba = image.convert("RGBA")
            white = Image.new("RGBA", rgba.size, (255, 255, 255, 255))
            return Image.alpha_composite(white, rgba).convert("RGB")
        # convert() returns a copy even when the mode is already RGB.
        return image.convert("RGB")
    except (ValueError, OSError) as err:
        raise ImageError(f"cannot convert image mode {mode!r} to RGB ({err})") from err


def _high_depth_to_8bit(image: Image.Image) -> Image.Image:
    """Scale 16/32-bit integer and float images to 8-bit L (or LA with transparency).

    PIL's own convert("L") clips such data at 255 instead of scaling it, turning
    most 16-bit images pure white.
    """
    values = np.asarray(image)
    if image.mode == "F":
        gray = _float_to_8bit(values.astype(np.float64))
    else:
        # "I" is treated as 16-bit data too: that is what it holds when it comes from
        # a 16-bit PNG/PGM/TIFF, the only common source of it.
        wide = np.clip(values.astype(np.int64), 0, 65535)
        gray = ((wide * 255 + 32767) // 65535).astype(np.uint8)  # round(v / 257)
    result = Image.fromarray(gray)
    transparent_value = image.info.get("transparency")
    if isinstance(transparent_value, int | float) and not isinstance(transparent_value, bool):
        # PNG tRNS on a 16-bit grayscale image names one opaque-excluded value; PIL's
        # RGBA conversion ignores it for these modes, so build the alpha ourselves.
        alpha = np.where(values == transparent_value, 0, 255).astype(np.uint8)
        result = Image.merge("LA", (result, Image.fromarray(alpha)))
    return result


def _float_to_8bit(values: np.ndarray) -> np.ndarray:
    # Float images carry no range convention: [0, 1] is the usual one (numpy, HDR
    # tools), anything beyond it is taken as already on the 0..255 scale.
    finite = np.nan_to_num(values, nan=0.0, posinf=0.0, neginf=0.0)
    scale = 255.0 if finite.size and finite.max() <= 1.0 else 1.0
    return np.clip(np.rint(finite * scale), 0, 255).astype(np.uint8)


# ------------------------------------------------------------------------ utilities


def image_hash(image: Image.Image) -> str:
    """SHA-256 hex digest of an image's decoded RGB pixels (plus mode and size).

    Identical pixels give identical hashes whatever the file encoding was (PNG, BMP,
    data URL...), so this is a stable cache key. Non-RGB images are first normalised
    the way :func:`load_image` does (without EXIF orientation).
    """
    rgb = image if image.mode == "RGB" else _to_rgb(image)
    digest = hashlib.sha256()
    digest.update(f"{rgb.mode}:{rgb.width}x{rgb.height}:".encode())
    digest.update(rgb.tobytes())
    return digest.hexdigest()


def blank_like(image: Image.Image) -> Image.Image:
    """A uniform BLANK_GRAY RGB image of `image`'s size. Same size, so the processor resizes it
    to the same grid: the same image tokens at the same positions, showing nothing. Every
    image of one size gets the same pixels, so the embedding cache (keyed by content) encodes
    it once."""
    return Image.new("RGB", image.size, BLANK_GRAY)


def image_to_png_bytes(image: Image.Image) -> bytes:
    """Encode an image as PNG (lossless)."""
    return _encode(image, "PNG")


def image_to_data_url(image: Image.Image, format: str = "PNG") -> str:
    """Encode an image as a ``data:image/<format>;base64,...`` URL (OpenAI image_url)."""
    fmt = format.upper()
    Image.init()
    mime = Image.MIME.get(fmt)
    if mime is None:
        raise ValueError(f"unknown image format {format!r}; use e.g. 'PNG', 'JPEG' or 'WEBP'")
    payload = base64.b64encode(_encode(image, fmt)).decode("ascii")
    return f"data:{mime};base64,{payload}"


def _encode(image: Image.Image, fmt: str) -> bytes:
    buffer = io.BytesIO()
    # These bytes are for transport and caching, not archiving: PNG level 1 is several
    # times faster than the default and only slightly larger.
    options: dict[str, Any] = {"compress_level": 1} if fmt == "PNG" else {}
    image.save(buffer, format=fmt, **options)
    return buffer.getvalue()


def _shorten(text: str) -> str:
    if len(text) <= _MAX_SHOWN_CHARS:
        return repr(text)
    return f"{text[:_MAX_SHOWN_CHARS]!r}... ({len(text):,} chars)"


def _type_name(value: object) -> str:
    cls = type(value)
    return cls.__qualname__ if cls.__module__ == "builtins" else f"{cls.__module__}.{cls.__qualname__}"
