"""The server's input checks (saccade.serving.validation) without a server: each rule refuses
what it should with a reason, and lets the requests saccade's own client sends through."""

from __future__ import annotations

import os

import pytest

from saccade.serving.validation import (
    MAX_IMAGES_PER_REQUEST, MAX_PIXELS_PER_REQUEST, MediaPolicy, RequestError, UpdateRequest, check_aspect_ratio,
    check_media_url, check_media_urls, check_total_pixels, media_urls, parse_image_list, parse_json_body,
    parse_update_request, resolve_weights_path, resolve_weights_root,
)

PNG = "data:image/png;base64,iVBORw0KGgo="


def test_json_body_too_big_empty_or_not_json_is_refused_with_the_reason():
    assert parse_json_body(b'{"a": 1}', 100) == {"a": 1}
    with pytest.raises(RequestError, match="exceeds the limit of 4") as big:
        parse_json_body(b'{"a": 1}', 4)
    assert big.value.status == 413
    for raw, reason in [(b"", "empty"), (b"  \n", "empty"), (b"{nope", "not valid JSON"), (b"\xff\xfe{", "not valid JSON"),
                        (b"[" * 100_000 + b"]" * 100_000, "not valid JSON")]:
        with pytest.raises(RequestError, match=reason) as err:
            parse_json_body(raw, 10**6)
        assert err.value.status == 400


def test_image_list_takes_only_a_bounded_list_of_base64_data_urls():
    assert parse_image_list({"images": [PNG, PNG]}) == [PNG, PNG]
    refused = [
        ([PNG], "must be a JSON object"),
        ({"pictures": [PNG]}, "unknown field"),
        ({}, 'needs "images"'),
        ({"images": []}, "non-empty"),
        ({"images": PNG}, "non-empty list"),
        ({"images": [PNG, 5]}, r"images\[1\] must be a string"),
        ({"images": ["/etc/passwd"]}, "inline only"),
        ({"images": ["file:///etc/passwd"]}, "inline only"),
        ({"images": ["http://127.0.0.1/x.png"]}, "inline only"),
        ({"images": ["data:image/png,abc"]}, "malformed data URL"),
        ({"images": ["data:image/png;base64"]}, "malformed data URL"),
        ({"images": [PNG] * (MAX_IMAGES_PER_REQUEST + 1)}, f"at most {MAX_IMAGES_PER_REQUEST}"),
    ]
    for body, reason in refused:
        with pytest.raises(RequestError, match=reason):
            parse_image_list(body)


def test_aspect_ratio_beyond_what_the_processor_resizes_is_refused():
    check_aspect_ratio((200, 1), "images[0]")  # exactly 200:1 is still resized
    with pytest.raises(RequestError, match=r"images\[3\]: image of 1x201 pixels"):
        check_aspect_ratio((1, 201), "images[3]")


def test_update_request_types_and_combinations():
    assert parse_update_request({"path": "w/v3", "version": 3, "lora": False}, 2) == UpdateRequest("w/v3", 3, False, False)
    assert parse_update_request({"path": "w"}, 7).version == 8  # the next version by default
    assert parse_update_request({"restore_base": True, "version": 4}, 0) == UpdateRequest(None, 4, False, True)
    refused = [
        ("nope", "must be a JSON object"),
        ({}, 'needs "path"'),
        ({"path": 3}, 'needs "path".*number'),
        ({"path": ""}, 'needs "path"'),
        ({"path": "w", "verison": 3}, r'unknown field\(s\) \["verison"\]; the fields are \["path", "version", "lora", "restore_base"\]'),
        ({"path": "w", "version": True}, '"version" must be an integer'),
        ({"path": "w", "version": 1.5}, '"version" must be an integer'),
        ({"path": "w", "version": -1}, '"version" must be an integer'),
        ({"path": "w", "version": 2**63}, '"version" must be an integer'),
        ({"path": "w", "lora": "yes"}, '"lora" must be true or false'),
        ({"path": "w", "restore_base": 1}, '"restore_base" must be true or false'),
        ({"path": "w", "lora": True, "restore_base": True}, "exclude each other"),
        ({"path": "w", "restore_base": True}, 'leave out "path"'),
        ({"path": "w\x00x"}, "NUL"),
        ({"path": "w" * 5000}, "at most 4096"),
    ]
    for body, reason in refused:
        with pytest.raises(RequestError, match=reason) as err:
            parse_update_request(body, 0)
        assert err.value.status == 400


def test_weights_paths_resolve_inside_the_root_or_are_refused(tmp_path, monkeypatch):
    root = tmp_path / "runs"
    (root / "run1" / "engine-weights" / "v1").mkdir(parents=True)
    outside = tmp_path / "elsewhere"
    outside.mkdir()
    served = tmp_path / "model"
    served.mkdir()
    (root / "escape").symlink_to(outside)  # a symlink inside the root that leaves it
    (root / "alias").symlink_to(root / "run1")  # one that stays inside
    real_root = resolve_weights_root(root)

    inside = root / "run1" / "engine-weights" / "v1"
    assert resolve_weights_path(str(inside), real_root) == inside.resolve()
    assert resolve_weights_path(str(root / "alias" / "engine-weights" / "v1"), real_root) == inside.resolve()
    assert resolve_weights_path(str(root / "not-written-yet"), real_root) == (root / "not-written-yet").resolve()
    assert resolve_weights_path(str(served), real_root, resolve_weights_root(served)) == served.resolve()
    monkeypatch.chdir(root)
    assert resolve_weights_path("run1/engine-weights/v1", real_root) == inside.resolve()  # relative: from the cwd

    for path in [str(outside), "/etc", str(root / ".." / "elsewhere"), "../elsewhere", str(root / "escape"),
                 str(root / "escape" / "v1"), str(served), str(tmp_path / "runs-sibling")]:
        with pytest.raises(RequestError, match="outside the server's weights root") as err:
            resolve_weights_path(path, real_root)
        assert err.value.status == 403 and "--weights-root" in str(err.value)
        # The message names what the client sent, never where it led or where the root is.
        message = str(err.value).replace(repr(path), "")
        assert str(tmp_path) not in message and str(outside.resolve()) not in message


def test_a_symlink_loop_is_refused_not_raised(tmp_path):
    (tmp_path / "a").symlink_to(tmp_path / "b")
    (tmp_path / "b").symlink_to(tmp_path / "a")
    root = resolve_weights_root(tmp_path)
    try:
        resolved = resolve_weights_path(str(tmp_path / "a"), root)
    except RequestError as err:
        assert "cannot be resolved" in str(err) or "outside" in str(err)
    else:  # Python < 3.13 resolves a loop non-strictly to a path inside the root
        assert resolved.is_relative_to(root)


def test_the_weights_root_need_not_exist_and_is_compared_by_its_real_path(tmp_path):
    (tmp_path / "real").mkdir()
    (tmp_path / "link").symlink_to(tmp_path / "real")
    assert resolve_weights_root(tmp_path / "link") == (tmp_path / "real").resolve()
    assert resolve_weights_root(tmp_path / "later") == (tmp_path / "later").resolve()
    assert resolve_weights_root("~") == resolve_weights_root(os.path.expanduser("~"))


def test_media_urls_are_found_in_every_route_format_at_any_depth():
    body = {"messages": [
        {"role": "system", "content": "plain text http://not-media.example"},
        {"role": "user", "content": [{"type": "text", "text": "https://a text, not media"},
                                     {"type": "image_url", "image_url": {"url": "data:a"}},
                                     {"type": "image_url", "image_url": "file:///x"},
                                     {"type": "video_url", "video_url": {"url": "http://h/v.mp4"}},
                                     "junk", {"type": "image_url", "image_url": {"url": 5}}]},
        "junk",
    ]}
    assert media_urls(body) == [("body.messages[1].content[1].image_url.url", "data:a"),
                                ("body.messages[1].content[2].image_url", "file:///x"),
                                ("body.messages[1].content[3].video_url.url", "http://h/v.mp4")]
    assert media_urls([1]) == media_urls({"messages": "x"}) == media_urls({"image": "not a url"}) == []
    # /v1/responses, /v1/messages (Anthropic's), structured decisions' lists, /invocations' nesting
    responses = {"input": [{"role": "user", "content": [{"type": "input_image", "image_url": "https://r/x.png"}]}]}
    anthropic = {"messages": [{"role": "user", "content": [{"type": "image", "source": {"type": "url",
                                                                                        "url": " HTTPS://a/x"}}]}]}
    decisions = {"media": {"image": ["http://d/1.png", "data:x"]}}
    for body, url in [(responses, "https://r/x.png"), (anthropic, " HTTPS://a/x"), (decisions, "http://d/1.png"),
                      ({"wrapped": {"deeper": [anthropic]}}, " HTTPS://a/x")]:
        assert url in [u for _, u in media_urls(body)], body
        with pytest.raises(RequestError, match="does not fetch"):
            check_media_urls(body, MediaPolicy())
    deep = current = {}
    for _ in range(5000):  # deeper than Python's recursion limit
        current["a"] = current = {}
    current["url"] = "http://deep/x"
    assert [u for _, u in media_urls(deep)] == ["http://deep/x"]


def test_media_urls_the_server_must_not_fetch_or_vllm_answers_with_a_5xx_are_refused():
    strict = MediaPolicy()
    check_media_url(PNG, "p", strict)
    check_media_url("data:", "p", strict)  # vLLM answers this one with a 400 itself
    check_media_url("ftp://h/x.png", "p", strict)  # so does it this one
    for url, reason in [("data:image/png,abc", "only base64"), ("FILE:///etc/passwd", "no local files"),
                        ("https://example.com/x.png", "does not fetch"), ("http://127.0.0.1:9/x", "does not fetch")]:
        with pytest.raises(RequestError, match=reason) as err:
            check_media_url(url, "p", strict)
        assert err.value.status == 400
    check_media_url("file:///data/x.png", "p", MediaPolicy(local_files=True))  # vLLM checks its own root
    allowed = MediaPolicy(domains=frozenset({"example.com"}))
    check_media_url("https://example.com/x.png", "p", allowed)
    for url in ["https://evil.example/x.png", "https://example.com.evil/x", "http://user@evil/x",
                "http://[::1/x", "https://EVIL/x"]:
        with pytest.raises(RequestError, match="only from --allowed-media-domains"):
            check_media_url(url, "p", allowed)


def test_the_images_of_one_request_are_bounded_in_decoded_pixels():
    check_total_pixels([(8192, 8192)] * 4)  # four of the largest images the trainer allows
    with pytest.raises(RequestError, match="split the batch") as err:
        check_total_pixels([(4096, 4096)] * 64)  # the request: 64 x 4096^2, 1.07e9 pixels
    assert err.value.status == 413 and MAX_PIXELS_PER_REQUEST < 64 * 4096**2


# ----------------------------------------------------------------------------- clips


def clip_body(**clip):
    video = {"frames": "data:video/jpeg;base64,AAAA,BBBB", "fps": 8.0, "frames_indices": [0, 5],
             "total_num_frames": 20, **clip}
    return {"videos": [video], "size": {"shortest_edge": 1024, "longest_edge": 262144}}


def test_encode_videos_takes_what_the_client_sends_and_refuses_the_rest():
    from saccade.serving.validation import parse_clip_list

    clips, settings = parse_clip_list(clip_body())
    assert clips[0].payloads == ["AAAA", "BBBB"] and clips[0].frames_indices == [0, 5]
    assert clips[0].metadata()["duration"] == 2.5 and settings == {"size": {"shortest_edge": 1024,
                                                                          "longest_edge": 262144}}
    for body, reason in [
        (clip_body(frames="/etc/passwd"), "data:video/jpeg"),
        (clip_body(frames="data:video/jpeg;base64,AAAA,,BBBB"), "empty"),
        (clip_body(frames_indices=[0]), "1 frame indices for 2 frames"),
        (clip_body(frames_indices=[0, 20]), "frames_indices"),
        (clip_body(fps=0), "fps"),
        (clip_body(extra=1), "exactly the fields"),
        ({**clip_body(), "do_sample_frames": True}, "do_sample_frames"),
        ({**clip_body(), "size": {"longest_edge": 2**40}}, "size"),
        ({"videos": []}, "non-empty"),
    ]:
        with pytest.raises(RequestError, match=reason):
            parse_clip_list(body)
    with pytest.raises(RequestError, match="more than 1 frames") as many:
        parse_clip_list(clip_body(), max_frames=1)
    assert many.value.status == 413


def test_per_request_clip_settings_pass_only_as_the_client_sends_them():
    """`saccade serve` trusts per-request multimodal settings (--trust-request-mm-kwargs); the guard
    lets through only a clip's metadata and the video processor's bounds."""
    from saccade.serving.validation import check_request_mm_kwargs

    sent = {"media_io_kwargs": {"video": {"num_frames": -1, "fps": 8.0, "frames_indices": [0, 5, 10],
                                          "total_num_frames": 20, "duration": 2.5}},
            "mm_processor_kwargs": {"do_sample_frames": False, "size": {"shortest_edge": 1024, "longest_edge": 9999},
                                    "cap_pixels_per_frame": False}}
    check_request_mm_kwargs(sent)
    check_request_mm_kwargs({"messages": []})  # none at all
    for body, reason in [
        ({"mm_processor_kwargs": {"do_sample_frames": True}}, "do_sample_frames"),
        ({"mm_processor_kwargs": {"max_pixels": 10**12}}, "processor settings"),
        ({"mm_processor_kwargs": {"size": {"longest_edge": 2**29}}}, "size"),
        ({"media_io_kwargs": {"image": {}}}, '"video"'),
        ({"media_io_kwargs": {"video": {"video_backend": "opencv_dynamic"}}}, "settings are among"),
        ({"media_io_kwargs": {"video": {"num_frames": 10**6}}}, "num_frames"),
        ({"media_io_kwargs": {"video": {"frames_indices": [5], "total_num_frames": 3}}}, "frames_indices"),
        ({"messages": [{"content": [{"type": "video_url", "video_url": {
            "url": "data:video/jpeg;base64," + ",".join(["AA"] * 1100)}}]}]}, "1100 frames"),
    ]:
        with pytest.raises(RequestError, match=reason):
            check_request_mm_kwargs(body)
