"""Clips on the embedded engine: the tower once per clip, the engine's logprobs what the trainer computes
on cached clip embeddings, a clip in a later turn of an episode kept token for token.

The clips are mp4 files written by OpenCV (`tests/video_helpers.py`)."""

from __future__ import annotations

import pytest
import torch
from video_helpers import write_mp4

from saccade.data.synthetic import synthetic_image
from saccade.envs.trajectory import (
    ChatContinuation, ConsistencyError, add_completion, add_messages, check_consistency, start_trajectory,
    to_training_sample,
)
from saccade.inference.engine import ChatRequest, SamplingParams
from saccade.inference.local import LocalEngine
from saccade.models.families import FAMILIES
from saccade.models.lm import load_policy_lm, unwrap_policy
from saccade.models.presets import preset_path, tiny_preset
from saccade.models.sampling import SampledDistribution
from saccade.tools.bench.engine import sample_logprob_diffs, trainer_logprob_diffs

MISMATCH_MEAN = 1e-4  # fp32, as tests/inference/test_local.py
MISMATCH_MAX = 1e-3


@pytest.fixture(scope="module")
def clips(tmp_path_factory):
    folder = tmp_path_factory.mktemp("clips")
    return write_mp4(folder / "a.mp4", frames=20, fps=8.0, seed=1), write_mp4(folder / "b.mp4", frames=12, fps=6.0,
                                                                           size=(64, 64), seed=2)


@pytest.fixture(scope="module", params=FAMILIES, ids=lambda f: f.name)
def engine(request, limits):
    from saccade.models.loading import load_processor, load_vision_tower
    from saccade.models.vision import EmbeddingCache, VisionEncoder

    path = preset_path(tiny_preset(request.param))
    processor = load_processor(path)
    encoder = VisionEncoder(load_vision_tower(path), processor, limits=limits, cache=EmbeddingCache())
    return LocalEngine(load_policy_lm(path).eval(), processor, encoder, seed=0)


def video(path) -> dict:
    return {"type": "video_url", "video_url": {"url": f"file://{path}"}}


def text(t: str) -> dict:
    return {"type": "text", "text": t}


def diffs_of(engine, completions_or_samples, *, samples: bool = False) -> torch.Tensor:
    policy = unwrap_policy(engine.model)
    common = dict(cache_get=engine.encoder.cache.get, image_token_id=policy.image_token_id,
                  banned_token_ids=engine.banned_token_ids, distribution=SampledDistribution(),
                  video_token_id=policy.video_token_id)
    if samples:
        return sample_logprob_diffs(engine.model, completions_or_samples, merge=policy.positions.merge, **common)
    return trainer_logprob_diffs(engine.model, completions_or_samples, **common)


def test_a_mixed_batch_samples_what_the_trainer_computes(engine, clips):
    """Clips, images and text-only prompts in one batch, n = 3: every completion carries its clips
    (keys, grids, seconds per patch); packed together, the trainer's logprobs are the engine's; the
    tower ran once per distinct clip (the group's completions and a second request share it)."""
    a, b = clips
    requests = [
        ChatRequest("clip", [{"role": "user", "content": [video(a), text("What moves?")]}]),
        ChatRequest("image", [{"role": "user", "content": [{"type": "image", "image": synthetic_image(64, 48, 3)},
                                                             text("Color?")]}]),
        ChatRequest("text", [{"role": "user", "content": "Say hi."}]),
        ChatRequest("both", [{"role": "user", "content": [{"type": "image", "image": synthetic_image(48, 64, 4)},
                                                            video(b), text("Which first?"), video(a)]}]),
    ]
    misses = engine.encoder.cache.stats.misses
    groups = engine.generate(requests, SamplingParams(temperature=1.0, max_tokens=8, n=3))
    assert engine.encoder.cache.stats.misses - misses == 2 + 2  # two clips, two images: each through the tower once
    completions = [c for g in groups for c in g]
    assert [len(c.videos) for c in completions] == [1] * 3 + [0] * 6 + [2] * 3
    both = groups[3][0]
    assert both.videos.keys[1] == groups[0][0].videos.keys[0]  # the same clip, the same key
    diff = diffs_of(engine, completions)
    family = unwrap_policy(engine.model).family.name
    print(f"{family}: {diff.numel()} tokens, mismatch mean {float(diff.mean()):.2e} max {float(diff.max()):.2e}")
    assert diff.numel() == sum(c.completion_ids.numel() for c in completions)
    assert float(diff.mean()) <= MISMATCH_MEAN and float(diff.max()) <= MISMATCH_MAX


def test_a_clip_in_a_later_turn_is_kept_token_for_token(engine, clips):
    """An episode whose second user turn brings a clip (and the third another beside an image): every
    turn's ids, clips, grids and positions are a prefix of the training sample, and the trainer's
    logprobs of the sampled tokens are the engine's."""
    a, b = clips
    processor, limits = engine.processor, engine.limits
    continuation = ChatContinuation(processor, limits=limits)
    end = processor.tokenizer.convert_tokens_to_ids("<|im_end|>")
    params = SamplingParams(temperature=1.0, max_tokens=5)
    trajectory = start_trajectory("ep", [{"role": "user", "content": "I will show you clips."}], processor,
                                  limits=limits, key_for_hash=engine.key_for_hash, seed=5)
    replies = [[{"role": "user", "content": [video(a), text("What moved?")]}],
               [{"role": "user", "content": [{"type": "image", "image": synthetic_image(40, 40, 9)}, video(b)]}]]
    for turn in range(3):
        completion = engine.generate_tokens([trajectory.token_prompt()], params)[0][0]
        add_completion(trajectory, completion, end_of_turn_id=end)
        if turn < 2:
            add_messages(trajectory, replies[turn], continuation, key_for_hash=engine.key_for_hash)
    assert [len(t.videos) for t in trajectory.turns] == [0, 1, 2]
    positions = unwrap_policy(engine.model).positions
    sample = to_training_sample(trajectory, positions=positions)
    assert sample.num_videos == 2 and sample.num_images == 1
    check_consistency(sample, trajectory.turns, positions=positions)
    diff = diffs_of(engine, [sample], samples=True)
    assert diff.numel() == int(sample.loss_mask.sum())
    assert float(diff.max()) <= MISMATCH_MAX
    # The check sees a clip dropped from the training sample.
    from dataclasses import replace

    dropped = replace(sample, videos=sample.videos.take(1))
    with pytest.raises(ConsistencyError, match="clips"):
        check_consistency(dropped, trajectory.turns, positions=positions)
