"""Tests for saccade.data.messages: OpenAI-format chat messages -> model inputs."""

from __future__ import annotations

import pytest
import torch

from saccade.data.images import ImageError, ImagesConfig, image_hash, image_to_data_url
from saccade.data.messages import messages_to_inputs
from saccade.data.synthetic import synthetic_image

PATCH_PIXELS = 3 * 2 * 16 * 16  # channels * temporal patch * patch * patch


def user(*parts) -> list[dict]:
    return [{"role": "user", "content": list(parts)}]


def text(t: str) -> dict:
    return {"type": "text", "text": t}


def image_part(source) -> dict:
    return {"type": "image", "image": source}


@pytest.fixture(scope="module")
def ids(processor):
    tok = processor.tokenizer
    return {
        name: tok.convert_tokens_to_ids(f"<|{name}|>")
        for name in ("im_start", "im_end", "vision_start", "vision_end", "image_pad")
    }


@pytest.fixture(scope="module")
def picture():
    return synthetic_image(96, 64, 3)


# ------------------------------------------------------------------ one image layout


def test_one_image_expands_to_one_pad_per_merged_patch(processor, limits, ids, picture):
    inp = messages_to_inputs(user(image_part(picture), text("What is it?")), processor, limits=limits)
    grid = inp.image_grid_thw
    assert grid.shape == (1, 3) and grid.dtype == torch.int64
    n = int(grid.prod()) // 4
    assert n > 1
    seq = inp.input_ids.tolist()
    start = seq.index(ids["vision_start"])
    end = seq.index(ids["vision_end"])
    assert seq[start + 1 : end] == [ids["image_pad"]] * n
    assert seq.count(ids["image_pad"]) == n
    assert seq.count(ids["vision_start"]) == seq.count(ids["vision_end"]) == 1
    assert inp.pixel_values.shape == (int(grid.prod()), PATCH_PIXELS)
    assert inp.pixel_values.dtype == torch.float32
    assert inp.input_ids.dtype == inp.mm_token_type_ids.dtype == torch.int64
    assert inp.num_images == 1 and inp.images[0].mode == "RGB"
    assert inp.image_hashes == [image_hash(picture)]
    # The rendered text keeps one unexpanded placeholder.
    assert inp.text.count("<|image_pad|>") == 1
    assert inp.text.startswith("<|im_start|>user\n<|vision_start|><|image_pad|><|vision_end|>What is it?<|im_end|>\n")


def test_mm_token_type_ids_mark_exactly_the_image_pads(processor, limits, ids):
    messages = [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": [image_part(synthetic_image(64, 64, 1)), text("and"), image_part(synthetic_image(48, 160, 2))]},
        {"role": "assistant", "content": "Two pictures."},
    ]
    inp = messages_to_inputs(messages, processor, limits=limits)
    assert set(inp.mm_token_type_ids.unique().tolist()) == {0, 1}
    assert torch.equal(inp.mm_token_type_ids == 1, inp.input_ids == ids["image_pad"])
    expected = int((inp.image_grid_thw.prod(-1) // 4).sum())
    assert int((inp.mm_token_type_ids == 1).sum()) == expected
    assert inp.pixel_values.shape[0] == int(inp.image_grid_thw.prod(-1).sum())
    assert len(inp.image_hashes) == 2 and inp.image_hashes[0] != inp.image_hashes[1]


def test_text_only_has_no_pixels(processor, limits):
    inp = messages_to_inputs(
        [{"role": "user", "content": "Count the shapes."}, {"role": "assistant", "content": [text("Three.")]}],
        processor,
        limits=limits,
    )
    assert inp.pixel_values is None
    assert inp.image_grid_thw is None
    assert inp.images == [] and inp.image_hashes == [] and inp.num_images == 0
    assert inp.mm_token_type_ids.shape == inp.input_ids.shape
    assert not inp.mm_token_type_ids.any()
    assert inp.text == "<|im_start|>user\nCount the shapes.<|im_end|>\n<|im_start|>assistant\nThree.<|im_end|>\n"
    assert processor.tokenizer.decode(inp.input_ids) == inp.text


def test_add_generation_prompt(processor, limits, ids):
    messages = [{"role": "user", "content": "Hi"}]
    plain = messages_to_inputs(messages, processor, limits=limits)
    prompt = messages_to_inputs(messages, processor, limits=limits, add_generation_prompt=True)
    assert plain.text.endswith("<|im_end|>\n")
    assert prompt.text == plain.text + "<|im_start|>assistant\n"
    tail = processor.tokenizer.encode("<|im_start|>assistant\n", add_special_tokens=False)
    assert tail[0] == ids["im_start"]
    assert prompt.input_ids.tolist() == plain.input_ids.tolist() + tail


# ------------------------------------------------------------- image source forms


def test_every_image_form_gives_identical_inputs(processor, limits, picture, tmp_path):
    path = tmp_path / "picture.png"
    picture.save(path)
    url = image_to_data_url(picture)
    forms = {
        "pil": image_part(picture),
        "data_url": image_part(url),
        "path_str": image_part(str(path)),
        "path_obj": image_part(path),
        "file_url": image_part(path.as_uri()),
        "image_url_dict": {"type": "image_url", "image_url": {"url": url}},
        "image_url_str": {"type": "image_url", "image_url": url},
        "image_url_file": {"type": "image_url", "image_url": {"url": path.as_uri()}},
    }
    results = {
        name: messages_to_inputs(user(text("Look:"), part, text("What?")), processor, limits=limits, sample=name)
        for name, part in forms.items()
    }
    ref = results["pil"]
    assert ref.image_hashes == [image_hash(picture)]
    for name, inp in results.items():
        assert torch.equal(inp.input_ids, ref.input_ids), name
        assert torch.equal(inp.mm_token_type_ids, ref.mm_token_type_ids), name
        assert torch.equal(inp.image_grid_thw, ref.image_grid_thw), name
        assert torch.equal(inp.pixel_values, ref.pixel_values), name
        assert inp.image_hashes == ref.image_hashes, name
        assert inp.text == ref.text, name


def test_rgba_and_grayscale_are_normalised(processor, limits, picture):
    rgba = picture.convert("RGBA")  # fully opaque: same pixels as the RGB original
    inp = messages_to_inputs(user(image_part(rgba)), processor, limits=limits)
    ref = messages_to_inputs(user(image_part(picture)), processor, limits=limits)
    assert inp.images[0].mode == "RGB"
    assert torch.equal(inp.pixel_values, ref.pixel_values)
    gray = messages_to_inputs(user(image_part(picture.convert("L"))), processor, limits=limits)
    assert gray.images[0].mode == "RGB"
    assert torch.equal(gray.image_grid_thw, ref.image_grid_thw)


# ----------------------------------------------------------------------- limits


def test_image_limits_change_the_grid(processor, ids):
    big = synthetic_image(256, 256, 5)
    small_limits = ImagesConfig(min_pixels=32 * 32, max_pixels=64 * 64)
    large_limits = ImagesConfig(min_pixels=32 * 32, max_pixels=256 * 256)
    small = messages_to_inputs(user(image_part(big)), processor, limits=small_limits)
    large = messages_to_inputs(user(image_part(big)), processor, limits=large_limits)
    assert small.image_grid_thw.tolist() == [[1, 4, 4]]
    assert large.image_grid_thw.tolist() == [[1, 16, 16]]
    assert int((small.input_ids == ids["image_pad"]).sum()) == 4
    assert int((large.input_ids == ids["image_pad"]).sum()) == 64
    assert small.pixel_values.shape[0] == 16 and large.pixel_values.shape[0] == 256
    # Same image, same hash: the limits are not part of the content hash.
    assert small.image_hashes == large.image_hashes


def test_min_pixels_upscales_a_tiny_image(processor):
    tiny = synthetic_image(16, 16, 6)
    inp = messages_to_inputs(user(image_part(tiny)), processor, limits=ImagesConfig(min_pixels=64 * 64, max_pixels=256 * 256))
    t, h, w = inp.image_grid_thw[0].tolist()
    assert h * w * 16 * 16 >= 64 * 64


# ----------------------------------------------------------------------- errors


def test_unknown_part_type_names_the_sample(processor, limits):
    with pytest.raises(ValueError, match="audio") as err:
        messages_to_inputs(user({"type": "audio", "audio": b"x"}), processor, limits=limits, sample="row-17")
    assert "row-17" in str(err.value)


def test_message_without_content(processor, limits):
    with pytest.raises(ValueError, match="content") as err:
        messages_to_inputs([{"role": "user"}], processor, limits=limits, sample="row-3")
    assert "row-3" in str(err.value)
    with pytest.raises(ValueError):
        messages_to_inputs([{"content": "hi"}], processor, limits=limits)
    with pytest.raises(ValueError):
        messages_to_inputs([], processor, limits=limits)
    with pytest.raises(ValueError):
        messages_to_inputs([{"role": "user", "content": 42}], processor, limits=limits)


@pytest.mark.parametrize(
    "part",
    [
        {"type": "image_url", "image_url": {"url": "data:image/png;base64,AAAA"}},
        {"type": "image", "image": "/nonexistent/dir/picture.png"},
        {"type": "image", "image": b"not an image at all"},
        {"type": "image_url", "image_url": {"url": "https://example.com/a.png"}},  # remote refused by default
    ],
    ids=["corrupt_data_url", "missing_file", "garbage_bytes", "remote"],
)
def test_bad_image_raises_image_error_naming_the_sample(processor, limits, part):
    with pytest.raises(ImageError) as err:
        messages_to_inputs(user(text("see"), part), processor, limits=limits, sample="sample-0042")
    assert err.value.sample == "sample-0042"
    assert "sample-0042" in str(err.value)


def test_literal_image_pad_in_text_only_message_is_refused(processor, limits):
    with pytest.raises(ValueError, match="image_pad") as err:
        messages_to_inputs([{"role": "user", "content": "look <|image_pad|> here"}], processor, limits=limits, sample="s9")
    assert "s9" in str(err.value)


def test_literal_image_pad_beside_an_image_is_refused(processor, limits, picture):
    with pytest.raises(ValueError, match="image_pad"):
        messages_to_inputs(
            user(image_part(picture), text("what is <|image_pad|>?")), processor, limits=limits, sample="s10"
        )


def test_openai_input_image_part(processor, limits, picture):
    url = image_to_data_url(picture)
    inp = messages_to_inputs(user({"type": "input_image", "image_url": url}), processor, limits=limits)
    ref = messages_to_inputs(user(image_part(picture)), processor, limits=limits)
    assert torch.equal(inp.input_ids, ref.input_ids)


# ------------------------------------------------------------- blank images


def test_blank_images_keep_every_token_and_lose_every_pixel(processor, limits, picture):
    """Each image, whatever its form, becomes a uniform gray one of its size: the same ids and
    grids (the same tokens at the same positions), other pixels; text, roles and order kept.
    Two images of one size blank to the same pixels (one embedding in the content-keyed cache)."""
    from saccade.data.images import BLANK_GRAY
    from saccade.data.messages import with_blank_images

    other = synthetic_image(96, 64, 7)
    messages = [{"role": "system", "content": "Be brief."},
                *user(text("Look:"), image_part(picture), {"type": "image_url", "image_url": image_to_data_url(other)},
                      text("What?"))]
    blanked = with_blank_images(messages, limits=limits)
    assert blanked[0] == messages[0] and messages[1]["content"][1]["image"] is picture  # the input is left alone
    parts = blanked[1]["content"]
    assert [p["type"] for p in parts] == ["text", "image", "image", "text"] and parts[0] == text("Look:")
    for part in parts[1:3]:
        assert part["image"].size == picture.size and part["image"].getcolors() == [(96 * 64, BLANK_GRAY)]
    real, blank = (messages_to_inputs(m, processor, limits=limits) for m in (messages, blanked))
    assert torch.equal(blank.input_ids, real.input_ids) and torch.equal(blank.image_grid_thw, real.image_grid_thw)
    assert not torch.equal(blank.pixel_values, real.pixel_values)
    assert blank.image_hashes[0] == blank.image_hashes[1] != real.image_hashes[0]
