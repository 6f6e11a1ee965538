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
    assert torch.equal(prompt.mrope_3L, family.mrope_positions(prompt.inputs.mm_token_type_ids, None, 2))
    with pytest.raises(ValueError, match="family="):
        VLLMEngine([NO_SERVER], processor).prepare_all([request])
