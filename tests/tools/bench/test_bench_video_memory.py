"""`saccade bench video-memory` on the tiny preset: the trainer is handed clip tokens and their cached
embedding, never a pixel nor the tower, and its peak grows with the step's tokens."""

from __future__ import annotations

import pytest
import torch

from saccade.config.bench import VideoMemoryBenchConfig


def test_the_trainers_batch_holds_tokens_and_embeddings_not_pixels():
    """What the measuring process is handed: samples whose clip rows are video pads, and the clip's
    embedding (one row per pad, the language model's width); no pixel values; the model it trains
    holds no tower. Frames double: the pads double, the text stays."""
    from saccade.models.lm import load_policy_lm
    from saccade.models.loading import load_processor, load_vision_tower
    from saccade.models.presets import preset_path
    from saccade.tools.bench.video_memory import prepare_point
    from saccade.trainer.packing import pack

    cfg = VideoMemoryBenchConfig(frames=(4, 8), side=64, samples=2, answer_words=8)
    path = preset_path(cfg.preset)
    processor, tower = load_processor(path), load_vision_tower(path)
    policy = load_policy_lm(path)
    assert not any("visual" in name for name, _ in policy.named_parameters())
    hidden = policy.lm_head.weight.shape[1]
    points = {}
    for frames in cfg.frames:
        batch, info = prepare_point(cfg, processor, tower, frames)
        assert batch.pixel_values == {} and batch.video_token_id == processor.video_token_id
        assert all(s.num_videos == 1 and not s.num_images for s in batch.samples)
        (embedding,) = batch.embeddings.values()
        assert embedding.embeds.shape == (info["video_pads"], hidden)
        (mb,) = pack(batch.samples, batch.lookup, max_tokens=batch.max_tokens, image_token_id=batch.image_token_id,
                     spatial_merge_size=batch.merge, video_token_id=batch.video_token_id)
        assert mb.image_embeds.shape == (cfg.samples * info["video_pads"], hidden)
        assert mb.input_ids.shape[1] == info["step_tokens"]
        points[frames] = info
    assert points[8]["video_pads"] == 2 * points[4]["video_pads"]
    text = {f: p["tokens_per_sample"] - p["video_pads"] for f, p in points.items()}
    # the text is fixed but for the timestamps: one "<t seconds>" and vision_start/end per frame group
    assert 0 < text[8] - text[4] <= 16 * (8 - 4) // 2


# `pytest -m long` (230 s on a busy 2-core machine: a fresh process per frame count).
@pytest.mark.long
def test_the_peak_grows_with_tokens():
    from saccade.tools.bench.video_memory import format_video_memory_report, run_video_memory_bench

    torch.set_num_threads(1)
    result = run_video_memory_bench(VideoMemoryBenchConfig(frames=(4, 16, 32), samples=2, answer_words=8),
                                    progress=False)
    print(format_video_memory_report(result))
    points = result["points"]
    assert result["tower_params_in_trainer"] == 0
    assert [p["step_tokens"] for p in points] == sorted(p["step_tokens"] for p in points)
    assert [p["peak_mb"] for p in points] == sorted(p["peak_mb"] for p in points)
    assert result["slope_kib_per_token"] > 0
    assert result["max_residual_mb"] < 0.1 * (points[-1]["peak_mb"] - points[0]["peak_mb"])  # a line
