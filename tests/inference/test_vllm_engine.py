"""The vLLM engine's own work without a server: its prepared prompts (SFT's) take their M-RoPE
positions from the model's family, as the embedded engine's do."""

from __future__ import annotations

import pytest
import torch

from saccade.inference.engine import ChatRequest
from saccade.inference.vllm import VLLMEngine

NO_SERVER = "http://127.0.0.1:9"  # nothing listens: a text-only prompt needs no /encode_images


def test_prepared_prompts_take_their_positions_from_the_family(tiny_path, processor):
    from saccade.models.loading import load_family

    family = load_family(tiny_path)
    request = ChatRequest("a", [{"role": "user", "content": "How many shapes?"}])
    [prompt] = VLLMEngine([NO_SERVER], processor, family=family).prepare_all([request])
    assert torch.equal(prompt.mrope_3L, family.positions(2).mrope(prompt.inputs.mm_token_type_ids, None))
    with pytest.raises(ValueError, match="family="):
        VLLMEngine([NO_SERVER], processor).prepare_all([request])


def test_encode_requests_stay_within_the_servers_image_and_pixel_limits():
    from saccade.data.images import image_to_data_url
    from saccade.inference.vllm import encode_chunks
    from saccade.serving.wire import MAX_IMAGES_PER_REQUEST, MAX_PIXELS_PER_REQUEST
    from PIL import Image

    side = 4096  # flat: a few KB each, so only the pixel limit cuts
    big = image_to_data_url(Image.new("RGB", (side, side)))
    small = image_to_data_url(Image.new("RGB", (8, 8)))
    urls = {f"b{i}": big for i in range(40)} | {f"s{i}": small for i in range(300)}
    chunks = encode_chunks(urls)
    assert [k for c in chunks for k in c] == list(urls)  # every image once, in order
    per_chunk = MAX_PIXELS_PER_REQUEST // side**2  # 16 images of 4096^2
    assert [len(c) for c in chunks[:2]] == [per_chunk, per_chunk]
    for chunk in chunks:
        assert len(chunk) <= MAX_IMAGES_PER_REQUEST
        assert sum(side**2 if k.startswith("b") else 64 for k in chunk) <= MAX_PIXELS_PER_REQUEST
