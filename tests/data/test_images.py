"""Tests for saccade.data.images: the one loader every image goes through."""

from __future__ import annotations

import base64
import io
import pickle
import struct
import threading
import warnings
import zlib
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import numpy as np
import pytest
from PIL import Image

from saccade.config import ImagesConfig
from saccade.data.images import (
    ImageError,
    TooManyPixelsError,
    image_hash,
    image_to_data_url,
    image_to_png_bytes,
    load_image,
)

SAMPLE = "sample-42"


# ------------------------------------------------------------------------- helpers


def encode(image: Image.Image, fmt: str = "PNG", **options: object) -> bytes:
    buffer = io.BytesIO()
    image.save(buffer, format=fmt, **options)
    return buffer.getvalue()


def pattern_image(width: int = 8, height: int = 6, seed: int = 0) -> Image.Image:
    rng = np.random.default_rng(seed)
    return Image.fromarray(rng.integers(0, 256, (height, width, 3), dtype=np.uint8))


def patch_png_size(png: bytes, width: int, height: int) -> bytes:
    """Rewrite the IHDR width/height of a PNG (and its CRC) without touching the pixels."""
    assert png[12:16] == b"IHDR"
    ihdr = struct.pack(">II", width, height) + png[24:29]
    crc = struct.pack(">I", zlib.crc32(b"IHDR" + ihdr))
    return png[:16] + ihdr + crc + png[33:]


def pixels(image: Image.Image) -> np.ndarray:
    assert image.mode == "RGB"
    return np.asarray(image)


def assert_names_sample(err: pytest.ExceptionInfo[ImageError]) -> None:
    assert err.value.sample == SAMPLE
    assert str(err.value).startswith(f"sample {SAMPLE!r}: ")


def load_bad(source: object, **kwargs: object) -> pytest.ExceptionInfo[ImageError]:
    with pytest.raises(ImageError) as err:
        load_image(source, sample=SAMPLE, **kwargs)  # type: ignore[arg-type]
    assert_names_sample(err)
    return err


# ------------------------------------------------------------------------ bad cases


def test_corrupt_bytes() -> None:
    err = load_bad(b"this is not an image at all")
    assert "do not decode as an image" in str(err.value)
    assert "unrecognised format" in str(err.value)


def test_truncated_png() -> None:
    png = encode(pattern_image(64, 64))
    err = load_bad(png[: len(png) // 2])
    assert "do not decode as an image" in str(err.value)
    assert "truncated" in str(err.value)


def test_truncated_png_file(tmp_path: Path) -> None:
    path = tmp_path / "cut.png"
    png = encode(pattern_image(64, 64))
    path.write_bytes(png[: len(png) - 40])
    err = load_bad(path)
    assert "do not decode as an image" in str(err.value)


def test_empty_bytes() -> None:
    err = load_bad(b"")
    assert "empty" in str(err.value)


def test_zero_size_pil_image() -> None:
    err = load_bad(Image.new("RGB", (0, 5)))
    assert "zero size" in str(err.value)


def test_zero_size_png_header() -> None:
    # PIL itself refuses a PNG whose header declares a zero width.
    err = load_bad(patch_png_size(encode(Image.new("RGB", (1, 1))), 0, 5))
    assert "do not decode as an image" in str(err.value)


def test_decompression_bomb_header_beyond_pil_hard_limit() -> None:
    # 10^10 pixels: PIL raises DecompressionBombError inside Image.open.
    bomb = patch_png_size(encode(Image.new("RGB", (1, 1))), 100_000, 100_000)
    err = load_bad(bomb)
    assert "too large" in str(err.value)


def test_decompression_bomb_header_over_our_limit_without_warning() -> None:
    # 10^8 pixels: over our default limit and over PIL's warning threshold; the warning
    # must not escape (here it would be an error) and our own message must win.
    bomb = patch_png_size(encode(Image.new("RGB", (1, 1))), 10_000, 10_000)
    before = Image.MAX_IMAGE_PIXELS
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        err = load_bad(bomb)
    assert "max_source_pixels" in str(err.value)
    assert "10000x10000" in str(err.value)
    assert Image.MAX_IMAGE_PIXELS == before  # no global tampering


def test_real_image_over_low_pixel_limit() -> None:
    err = load_bad(encode(pattern_image(64, 64)), limits=ImagesConfig(max_source_pixels=1000))
    assert "64x64" in str(err.value)
    assert "max_source_pixels" in str(err.value)


@pytest.mark.parametrize("lazy", [False, True], ids=["decoded", "lazily-opened"])
def test_pil_image_over_low_pixel_limit(lazy: bool) -> None:
    """A PIL image over max_source_pixels is refused for its size, naming it and the knob; one
    opened lazily (not yet decoded) before it is decoded: its header claims 5000x5000 over one
    pixel's data, so decoding it first would fail as truncated instead."""
    limits = ImagesConfig(max_source_pixels=1000)
    if lazy:
        image, size = Image.open(io.BytesIO(patch_png_size(encode(Image.new("RGB", (1, 1))), 5000, 5000))), "5000x5000"
    else:
        image, size = pattern_image(64, 64), "64x64"
    err = load_bad(image, limits=limits)
    assert isinstance(err.value, TooManyPixelsError)
    assert size in str(err.value) and "max_source_pixels=1,000" in str(err.value)
    assert load_image(pattern_image(30, 30), limits=limits).size == (30, 30)  # under the limit: loaded


@pytest.mark.parametrize("url", ["http://example.com/cat.png", "HTTPS://example.com/cat.png"])
def test_remote_url_refused_by_default(url: str) -> None:
    err = load_bad(url)
    assert "allow_remote=True" in str(err.value)


def test_remote_url_in_openai_dict_refused(http_server: str) -> None:
    """OpenAI's {"type": "image_url", "image_url": {"url": ...}} is unwrapped to its URL and
    refused as a remote URL (not as a dict it cannot read); allowed, the same dict is fetched."""
    message = {"type": "image_url", "image_url": {"url": f"{http_server}/ref.png"}}
    err = load_bad(message)
    assert "remote image URLs are refused" in str(err.value) and "allow_remote=True" in str(err.value)
    assert "/ref.png" in str(err.value)
    out = load_image(message, limits=ImagesConfig(allow_remote=True))
    assert out.tobytes() == pattern_image(5, 3, seed=7).tobytes()


def test_missing_file(tmp_path: Path) -> None:
    err = load_bad(tmp_path / "nope.png")
    assert "not found" in str(err.value)
    assert "nope.png" in str(err.value)


def test_missing_file_url(tmp_path: Path) -> None:
    err = load_bad((tmp_path / "nope.png").as_uri())
    assert "not found" in str(err.value)


def test_directory_is_not_an_image(tmp_path: Path) -> None:
    err = load_bad(str(tmp_path))
    assert "directory" in str(err.value)


@pytest.mark.parametrize(
    ("url", "expected"),
    [
        ("data:image/png;base64,@@@not-base64@@@", "not valid base64"),
        ("data:image/png;base64,iVBORw0KGgoA=A", "not valid base64"),
        ("data:image/png,rawbytes", "base64"),
        ("data:image/png;base64", "no ','"),
        ("data:image/png;base64,", "empty"),
    ],
)
def test_bad_data_url(url: str, expected: str) -> None:
    err = load_bad(url)
    assert "malformed data URL" in str(err.value)
    assert expected in str(err.value)


def test_data_url_with_non_image_payload() -> None:
    url = "data:image/png;base64," + base64.b64encode(b"hello world").decode()
    err = load_bad(url)
    assert "do not decode as an image" in str(err.value)


@pytest.mark.parametrize(
    ("source", "type_name"),
    [(12, "int"), ([b"x"], "list"), (np.zeros((2, 2, 3), np.uint8), "numpy.ndarray")],
)
def test_unsupported_type(source: object, type_name: str) -> None:
    err = load_bad(source)
    assert type_name in str(err.value)


def test_unsupported_dict() -> None:
    err = load_bad({"src": "x.png"})
    assert "'src'" in str(err.value)


def test_dict_with_no_image() -> None:
    err = load_bad({"bytes": None, "path": None})
    assert "missing" in str(err.value)


def test_unsupported_url_scheme() -> None:
    err = load_bad("s3://bucket/cat.png")
    assert "'s3'" in str(err.value)


def test_file_url_with_remote_host() -> None:
    err = load_bad("file://fileserver/share/cat.png")
    assert "fileserver" in str(err.value)


def test_long_sources_are_shortened_in_messages() -> None:
    url = "data:image/png;base64," + "!" * 100_000
    err = load_bad(url)
    assert len(str(err.value)) < 500


def test_error_without_sample_has_no_prefix() -> None:
    with pytest.raises(ImageError) as err:
        load_image(b"junk")
    assert err.value.sample is None
    assert str(err.value).startswith("image bytes do not decode")


def test_image_error_is_value_error_and_pickles() -> None:
    err = ImageError("image is broken", sample="abc")
    assert isinstance(err, ValueError)
    assert str(err) == "sample 'abc': image is broken"
    copy = pickle.loads(pickle.dumps(err))
    assert (type(copy), copy.reason, copy.sample, str(copy)) == (
        ImageError,
        "image is broken",
        "abc",
        "sample 'abc': image is broken",
    )


# ----------------------------------------------------------------------- conversion


def test_rgba_composited_on_white() -> None:
    rgba = Image.new("RGBA", (3, 1), (0, 0, 0, 0))
    rgba.putpixel((1, 0), (255, 0, 0, 255))
    rgba.putpixel((2, 0), (0, 0, 0, 128))
    out = pixels(load_image(encode(rgba)))
    assert out[0, 0].tolist() == [255, 255, 255]  # transparent -> white, not black
    assert out[0, 1].tolist() == [255, 0, 0]
    assert all(126 <= v <= 128 for v in out[0, 2])  # half-transparent black over white


def test_la_composited_on_white() -> None:
    la = Image.new("LA", (2, 1), (0, 0))
    la.putpixel((1, 0), (10, 255))
    out = pixels(load_image(encode(la)))
    assert out[0, 0].tolist() == [255, 255, 255]
    assert out[0, 1].tolist() == [10, 10, 10]


def test_premultiplied_la() -> None:
    out = pixels(load_image(Image.new("La", (1, 1), (0, 0))))
    assert out[0, 0].tolist() == [255, 255, 255]


def test_palette_with_transparency() -> None:
    palette = Image.new("P", (2, 1), 0)
    palette.putpalette([0, 0, 0, 0, 0, 255])
    palette.putpixel((1, 0), 1)
    loaded_from = encode(palette, transparency=0)
    assert Image.open(io.BytesIO(loaded_from)).info["transparency"] == 0
    out = pixels(load_image(loaded_from))
    assert out[0, 0].tolist() == [255, 255, 255]
    assert out[0, 1].tolist() == [0, 0, 255]


def test_palette_without_transparency() -> None:
    palette = Image.new("P", (1, 1), 0)
    palette.putpalette([12, 34, 56])
    assert pixels(load_image(encode(palette)))[0, 0].tolist() == [12, 34, 56]


def test_grayscale_with_trns_chunk() -> None:
    gray = Image.new("L", (2, 1), 50)
    gray.putpixel((1, 0), 70)
    out = pixels(load_image(encode(gray, transparency=50)))
    assert out[0, 0].tolist() == [255, 255, 255]
    assert out[0, 1].tolist() == [70, 70, 70]


def test_grayscale_l() -> None:
    gray = Image.fromarray(np.array([[0, 100, 255]], dtype=np.uint8))
    assert gray.mode == "L"
    assert pixels(load_image(encode(gray)))[0].tolist() == [[0] * 3, [100] * 3, [255] * 3]


def test_bilevel_1() -> None:
    bilevel = Image.new("1", (2, 1), 0)
    bilevel.putpixel((1, 0), 1)
    out = pixels(load_image(encode(bilevel)))
    assert out[0].tolist() == [[0, 0, 0], [255, 255, 255]]


def test_cmyk() -> None:
    cmyk = Image.new("CMYK", (3, 1), (0, 0, 0, 0))
    cmyk.putpixel((1, 0), (0, 0, 0, 255))
    cmyk.putpixel((2, 0), (0, 255, 255, 0))
    out = pixels(load_image(cmyk))
    assert out[0].tolist() == [[255, 255, 255], [0, 0, 0], [255, 0, 0]]


def test_cmyk_jpeg_file(tmp_path: Path) -> None:
    path = tmp_path / "cmyk.jpg"
    Image.new("CMYK", (8, 8), (0, 255, 255, 0)).save(path, quality=95)
    out = pixels(load_image(path))
    assert np.abs(out.astype(int) - [255, 0, 0]).max() <= 3


def test_ycbcr() -> None:
    out = pixels(load_image(Image.new("YCbCr", (1, 1), (255, 128, 128))))
    assert out[0, 0].tolist() == [255, 255, 255]


@pytest.mark.parametrize("dtype", ["<u2", ">u2"])
def test_16bit_scaled_not_clipped(dtype: str) -> None:
    values = np.array([[0, 257, 32768, 65535]], dtype=dtype)
    image = Image.fromarray(values)
    assert image.mode.startswith("I;16")
    expected = [0, 1, 128, 255]
    assert pixels(load_image(image))[0, :, 0].tolist() == expected
    if dtype == "<u2":  # and through a real 16-bit PNG file
        reloaded = load_image(encode(image))
        assert pixels(reloaded)[0].tolist() == [[v] * 3 for v in expected]


def test_16bit_png_with_trns_chunk() -> None:
    image = Image.fromarray(np.array([[1000, 65535]], dtype=np.uint16))
    out = pixels(load_image(encode(image, transparency=1000)))
    assert out[0].tolist() == [[255, 255, 255], [255, 255, 255]]
    out = pixels(load_image(encode(Image.fromarray(np.array([[1000, 0]], dtype=np.uint16)), transparency=1000)))
    assert out[0].tolist() == [[255, 255, 255], [0, 0, 0]]


def test_32bit_integer_mode_i_is_16bit_range() -> None:
    image = Image.fromarray(np.array([[-5, 32768, 65535, 100_000]], dtype=np.int32))
    assert image.mode == "I"
    assert pixels(load_image(image))[0, :, 0].tolist() == [0, 128, 255, 255]


def test_float_unit_range() -> None:
    image = Image.fromarray(np.array([[0.0, 0.5, 1.0, np.nan]], dtype=np.float32))
    assert image.mode == "F"
    assert pixels(load_image(image))[0, :, 0].tolist() == [0, 128, 255, 0]


def test_float_0_255_range() -> None:
    image = Image.fromarray(np.array([[0.0, 100.0, 300.0]], dtype=np.float32))
    assert pixels(load_image(image))[0, :, 0].tolist() == [0, 100, 255]


def test_exif_orientation_applied() -> None:
    wide = Image.new("RGB", (4, 2), (0, 0, 0))
    wide.putpixel((0, 0), (255, 255, 255))
    exif = Image.Exif()
    exif[0x0112] = 6  # "rotate 90 CW to display"
    out = load_image(encode(wide, exif=exif))
    assert out.size == (2, 4)
    assert pixels(out)[0, 1].tolist() == [255, 255, 255]  # top-left moved to top-right


def test_result_is_loaded_detached_rgb(tmp_path: Path) -> None:
    path = tmp_path / "x.png"
    pattern_image().save(path)
    out = load_image(path)
    assert type(out) is Image.Image  # not a PngImageFile holding a file handle
    assert out.mode == "RGB"
    path.unlink()
    assert out.tobytes() == pattern_image().tobytes()


def test_pil_input_is_copied_not_aliased() -> None:
    source = Image.new("RGB", (2, 2), (9, 9, 9))
    out = load_image(source)
    assert out is not source
    out.putpixel((0, 0), (1, 2, 3))
    assert source.getpixel((0, 0)) == (9, 9, 9)


def test_lazily_opened_pil_image(tmp_path: Path) -> None:
    path = tmp_path / "x.png"
    pattern_image().save(path)
    with Image.open(path) as lazy:
        assert pixels(load_image(lazy)).tolist() == np.asarray(pattern_image()).tolist()


# ---------------------------------------------------------------------- source forms


@pytest.fixture
def reference() -> Image.Image:
    return pattern_image(5, 3, seed=7)


@pytest.fixture
def png_path(tmp_path: Path, reference: Image.Image) -> Path:
    path = tmp_path / "dir with space" / "ref.png"
    path.parent.mkdir()
    reference.save(path)
    return path


SOURCE_FORMS = {
    "pil": lambda ref, path: ref,
    "bytes": lambda ref, path: path.read_bytes(),
    "bytearray": lambda ref, path: bytearray(path.read_bytes()),
    "data_url": lambda ref, path: "data:image/png;base64," + base64.b64encode(path.read_bytes()).decode(),
    "data_url_urlsafe_unpadded": lambda ref, path: "data:image/png;base64,"
    + base64.urlsafe_b64encode(path.read_bytes()).decode().rstrip("="),
    "path_str": lambda ref, path: str(path),
    "path": lambda ref, path: path,
    "file_url": lambda ref, path: path.as_uri(),
    "openai_url_dict": lambda ref, path: {"url": path.as_uri()},
    "openai_content_part": lambda ref, path: {
        "type": "image_url",
        "image_url": {"url": "data:image/png;base64," + base64.b64encode(path.read_bytes()).decode()},
    },
    "hf_bytes_dict": lambda ref, path: {"bytes": path.read_bytes(), "path": "ignored-name.png"},
    "hf_path_dict": lambda ref, path: {"bytes": None, "path": str(path)},
    "image_dict": lambda ref, path: {"type": "image", "image": str(path)},
}


@pytest.mark.parametrize("form", sorted(SOURCE_FORMS))
def test_source_forms(form: str, reference: Image.Image, png_path: Path) -> None:
    out = load_image(SOURCE_FORMS[form](reference, png_path))
    assert out.mode == "RGB"
    assert out.size == reference.size
    assert out.tobytes() == reference.tobytes()


# -------------------------------------------------------------------- remote (local)


class _Handler(BaseHTTPRequestHandler):
    body = b""

    def do_GET(self) -> None:  # noqa: N802 - http.server API
        if self.path == "/missing.png":
            self.send_error(404)
            return
        self.send_response(200)
        self.send_header("Content-Type", "image/png")
        self.send_header("Content-Length", str(len(self.body)))
        self.end_headers()
        self.wfile.write(self.body)

    def log_message(self, *args: object) -> None:
        pass


@pytest.fixture
def http_server(monkeypatch: pytest.MonkeyPatch) -> Iterator[str]:
    monkeypatch.setenv("no_proxy", "*")
    monkeypatch.setenv("NO_PROXY", "*")
    _Handler.body = encode(pattern_image(5, 3, seed=7))
    server = ThreadingHTTPServer(("127.0.0.1", 0), _Handler)
    thread = threading.Thread(target=server.serve_forever, kwargs={"poll_interval": 0.02}, daemon=True)
    thread.start()
    try:
        yield f"http://127.0.0.1:{server.server_port}"
    finally:
        server.shutdown()
        server.server_close()


def test_remote_url_allowed(http_server: str) -> None:
    out = load_image(f"{http_server}/ref.png", limits=ImagesConfig(allow_remote=True))
    assert out.tobytes() == pattern_image(5, 3, seed=7).tobytes()


def test_remote_url_byte_cap(http_server: str) -> None:
    err = load_bad(f"{http_server}/ref.png", limits=ImagesConfig(allow_remote=True, max_remote_bytes=10))
    assert "max_remote_bytes" in str(err.value)


def test_remote_url_http_error(http_server: str) -> None:
    err = load_bad(f"{http_server}/missing.png", limits=ImagesConfig(allow_remote=True))
    assert "404" in str(err.value)


# ------------------------------------------------------------------------- utilities


def test_image_hash_same_pixels_png_vs_bmp() -> None:
    image = pattern_image(7, 5)
    from_png = load_image(encode(image, "PNG"))
    from_bmp = load_image(encode(image, "BMP"))
    assert encode(image, "PNG") != encode(image, "BMP")
    assert image_hash(from_png) == image_hash(from_bmp) == image_hash(image)
    assert len(image_hash(image)) == 64


def test_image_hash_differs_for_different_pixels_and_sizes() -> None:
    image = pattern_image(4, 4)
    changed = image.copy()
    changed.putpixel((0, 0), tuple((v + 1) % 256 for v in image.getpixel((0, 0))))
    assert image_hash(image) != image_hash(changed)
    # Same bytes, different shape.
    flat = Image.frombytes("RGB", (16, 1), image.tobytes())
    assert image_hash(image) != image_hash(flat)


def test_image_hash_normalises_non_rgb() -> None:
    rgba = Image.new("RGBA", (2, 2), (0, 0, 0, 0))
    assert image_hash(rgba) == image_hash(Image.new("RGB", (2, 2), (255, 255, 255)))


def test_png_bytes_and_data_url_round_trip() -> None:
    image = pattern_image()
    png = image_to_png_bytes(image)
    assert png.startswith(b"\x89PNG")
    assert load_image(png).tobytes() == image.tobytes()
    url = image_to_data_url(image)
    assert url.startswith("data:image/png;base64,")
    assert load_image(url).tobytes() == image.tobytes()


def test_jpeg_data_url() -> None:
    url = image_to_data_url(Image.new("RGB", (8, 8), (200, 10, 10)), format="jpeg")
    assert url.startswith("data:image/jpeg;base64,")
    assert load_image(url).size == (8, 8)


def test_data_url_unknown_format() -> None:
    with pytest.raises(ValueError, match="unknown image format"):
        image_to_data_url(pattern_image(), format="NOPE")


# ---------------------------------------------------------------------- ImagesConfig (the limits)


def test_limits_defaults() -> None:
    limits = ImagesConfig()
    assert (limits.min_pixels, limits.max_pixels) == (32 * 32, 256 * 256)
    assert limits.max_source_pixels == 8192 * 8192
    assert limits.allow_remote is False


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"min_pixels": 0}, "min_pixels"),
        ({"max_pixels": -1}, "max_pixels"),
        ({"max_pixels": 1.5}, "max_pixels"),
        ({"max_source_pixels": 0}, "max_source_pixels"),
        ({"max_remote_bytes": 0}, "max_remote_bytes"),
        ({"min_pixels": 1000, "max_pixels": 999}, "min_pixels (1000) must be <= max_pixels (999)"),
        ({"remote_timeout_s": 0}, "remote_timeout_s"),
        ({"remote_timeout_s": float("inf")}, "remote_timeout_s"),
        ({"allow_remote": "maybe"}, "allow_remote"),
    ],
)
def test_limits_validation(kwargs: dict[str, object], message: str) -> None:
    with pytest.raises(ValueError) as err:
        ImagesConfig(**kwargs)  # type: ignore[arg-type]
    assert message in str(err.value)


def test_limits_assignment_is_validated() -> None:
    with pytest.raises(ValueError, match="min_pixels"):
        ImagesConfig().max_pixels = 1
