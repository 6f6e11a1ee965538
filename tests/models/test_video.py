"""Clips through every family that reads video: positions, the tower, and the LM-only path on cached
clip embeddings against the full transformers model, fp32, packed and unpacked.

The clip is an mp4 written by OpenCV (`tests/video_helpers.py`), not by saccade. Each family's
tiny preset (`saccade.models.presets`) stands for it; `family_model_path` builds it once.
"""

from __future__ import annotations

import pytest
import torch
from video_helpers import write_mp4

from saccade.config import ImagesConfig
from saccade.data.messages import messages_to_inputs
from saccade.data.videos import ClipRefs
from saccade.models.families import FAMILIES, ModelFamily
from saccade.models.presets import preset_path, tiny_preset
from saccade.tools.parity import TOLERANCE, grouped_samples, run_parity, video_conversations

MISTAKE_FLOOR = 1e-2  # what a real mistake moves the logprobs by, at least (as tests/models/test_families.py)
GRAD_FLOOR = 1.0  # gradients within TOLERANCE x max(1, |g|), as tests/models/test_families.py
LIMITS = ImagesConfig(min_pixels=32 * 32, max_pixels=256 * 256)


@pytest.fixture(scope="module")
def clip_path(tmp_path_factory):
    """12 frames at 8 fps: on Qwen2.5-VL (6 temporal patches, half a position apart) its last temporal
    position stays inside its spatial extent, where transformers 5.19's rule and the published one
    agree (saccade.models.positions, "After a long clip"); `long_clip_path` is past it."""
    return write_mp4(tmp_path_factory.mktemp("clips") / "square.mp4", frames=12, fps=8.0)


@pytest.fixture(scope="module")
def long_clip_path(tmp_path_factory):
    return write_mp4(tmp_path_factory.mktemp("clips") / "long.mp4", frames=20, fps=8.0)


@pytest.fixture(scope="module", params=FAMILIES, ids=lambda f: f.name)
def family_models(request):
    """(family, path, processor, full model, encoder on the family's tower) of its tiny preset."""
    from saccade.models.loading import load_full_model, load_processor, load_vision_tower
    from saccade.models.vision import EmbeddingCache, VisionEncoder

    family: ModelFamily = request.param
    path = preset_path(tiny_preset(family))
    processor = load_processor(path)
    encoder = VisionEncoder(load_vision_tower(path), processor, limits=LIMITS, cache=EmbeddingCache())
    return family, path, processor, load_full_model(path), encoder


def reference_positions(full, inputs) -> torch.Tensor:
    """transformers' own get_rope_index on the whole model, images and clips, as (3, L)."""
    kwargs = dict(input_ids=inputs.input_ids[None], mm_token_type_ids=inputs.mm_token_type_ids[None],
                  image_grid_thw=inputs.image_grid_thw, video_grid_thw=inputs.videos.grid_thw)
    if "second_per_grid_ts" in full.model.get_rope_index.__code__.co_varnames:  # Qwen2.5-VL
        kwargs["second_per_grid_ts"] = inputs.videos.second_per_grid
    with torch.no_grad():
        return full.model.get_rope_index(**kwargs)[0][:, 0].long()


def test_positions_with_clips_equal_get_rope_index(family_models, clip_path):
    """Clips, images and text mixed, a clip in a later turn, a list of frames: the family's rule (the
    engine's `VisionEncoder.positions`, the trainer's `PolicyLM.positions`) equals transformers',
    except Qwen2.5-VL's after a clip whose temporal span outruns it (the list of frames here, a
    position step of 4): there the published rule, equal to vLLM's
    (`test_qwen2_5_vl_positions_after_a_long_clip_are_the_published_rule`)."""
    from saccade.models.lm import load_policy_lm

    family, path, processor, full, encoder = family_models
    assert encoder.positions == family.positions_of(full.config) == load_policy_lm(path).positions
    for name, messages in video_conversations(str(clip_path)).items():
        inputs = messages_to_inputs(messages, processor, limits=LIMITS, sample=name)
        assert inputs.num_videos, name
        ours = encoder.positions.mrope(inputs.mm_token_type_ids, inputs.image_grid_thw, inputs.videos)
        if family.transformers_clip_positions or name != "clip_later_turn":
            assert torch.equal(ours, reference_positions(full, inputs)), name
        else:
            assert not torch.equal(ours, reference_positions(full, inputs)), name


def test_the_clip_rule_is_the_familys_and_it_matters(family_models, clip_path):
    """Negative controls. Qwen2.5-VL: the clip's rate (seconds per temporal patch x tokens_per_second)
    moves the positions though the ids stay. The Qwen3 generations: a clip's pads come in one frame
    group per temporal patch, so the rule that reads a clip as one run (Qwen2.5-VL's) cannot place them."""
    from saccade.models.families import qwen2_5_vl

    family, _, processor, full, encoder = family_models
    inputs = messages_to_inputs(video_conversations(str(clip_path))["clip"], processor, limits=LIMITS)
    right = encoder.positions.mrope(inputs.mm_token_type_ids, inputs.image_grid_thw, inputs.videos)
    videos = inputs.videos
    if family is qwen2_5_vl.FAMILY:
        twice = ClipRefs(videos.keys, videos.grid_thw, videos.second_per_grid * 2)
        assert not torch.equal(encoder.positions.mrope(inputs.mm_token_type_ids, None, twice), right)
    else:
        one_run = qwen2_5_vl.FAMILY.positions(encoder.merge)
        with pytest.raises(ValueError, match="placeholder tokens"):
            one_run.mrope(inputs.mm_token_type_ids, None, videos)


def vllm_positions(inputs, config, processor) -> torch.Tensor:
    """vLLM's own Qwen2.5-VL M-RoPE positions (`get_mrope_input_positions`, the engine's), called
    in-process on this prompt: the model class's functions on its config, the images and clips as
    vLLM's multimodal features hold them (offset, grid, a clip's seconds per temporal patch)."""
    import types

    from vllm.model_executor.models.qwen2_5_vl import Qwen2_5_VLForConditionalGeneration as Served

    field = types.SimpleNamespace
    ids = inputs.input_ids.tolist()

    def runs(token):  # where each run of this pad starts (a run is one image or one clip)
        return [i for i, t in enumerate(ids) if t == token and (i == 0 or ids[i - 1] != token)]

    features = [field(modality="image", mm_position=field(offset=off),
                      data={"image_grid_thw": field(data=inputs.image_grid_thw[k])})
                for k, off in enumerate(runs(processor.image_token_id))]
    features += [field(modality="video", mm_position=field(offset=off),
                       data={"video_grid_thw": field(data=inputs.videos.grid_thw[k]),
                             "second_per_grid_ts": field(data=inputs.videos.second_per_grid[k:k + 1])})
                 for k, off in enumerate(runs(processor.video_token_id))]
    model = field(config=config)
    model.iter_mm_grid_thw = types.MethodType(Served.iter_mm_grid_thw, model)
    positions, _ = Served.get_mrope_input_positions(model, ids, features)
    return torch.as_tensor(positions).long()


def test_qwen2_5_vl_positions_after_a_long_clip_are_the_published_rule(long_clip_path):
    """After a clip whose temporal positions outrun its spatial extent, the text resumes where vLLM's
    (and Qwen's published) rule puts it; transformers 5.19 puts it inside the clip's temporal span.
    Both pinned: if transformers comes back to the published rule, the second assert says so."""
    pytest.importorskip("vllm", reason="vLLM's own positions are the reference here")
    from saccade.models.families import qwen2_5_vl
    from saccade.models.loading import load_full_model, load_processor

    path = preset_path(tiny_preset(qwen2_5_vl.FAMILY))
    processor, full = load_processor(path), load_full_model(path)
    positions = qwen2_5_vl.FAMILY.positions_of(full.config)
    for name, messages in video_conversations(str(long_clip_path)).items():
        inputs = messages_to_inputs(messages, processor, limits=LIMITS, sample=name)
        ours = positions.mrope(inputs.mm_token_type_ids, inputs.image_grid_thw, inputs.videos)
        assert torch.equal(ours, vllm_positions(inputs, full.config, processor)), name
    inputs = messages_to_inputs(video_conversations(str(long_clip_path))["clip"], processor, limits=LIMITS)
    ours = positions.mrope(inputs.mm_token_type_ids, None, inputs.videos)
    theirs = reference_positions(full, inputs)
    after = int((inputs.mm_token_type_ids == 2).nonzero().max()) + 1  # the first text token after the clip
    assert torch.equal(ours[:, :after], theirs[:, :after])
    assert (ours[:, after:] > theirs[:, after:]).all(), "transformers now resumes after the clip as vLLM does"


def test_the_tower_on_a_clip_equals_the_full_models_video_features(family_models, clip_path):
    """`encode_videos` (the tower once per clip, cached) equals the full model's `get_video_features`:
    main features and DeepStack levels alike; a second ask is a cache hit."""
    family, _, processor, full, encoder = family_models
    inputs = messages_to_inputs(video_conversations(str(clip_path))["clip_later_turn"], processor, limits=LIMITS)
    misses = encoder.cache.stats.misses
    ours = encoder.encode_videos(inputs.clips, inputs.videos.keys)  # from the frames: preprocessed again
    with torch.no_grad():
        ref = full.model.get_video_features(inputs.pixel_values_videos, inputs.videos.grid_thw)
    for i, emb in enumerate(ours):
        assert torch.equal(emb.embeds, ref.pooler_output[i])
        assert torch.equal(emb.grid_thw, inputs.videos.grid_thw[i])
        levels = getattr(ref, "deepstack_features", None) or []
        assert emb.deepstack.shape[0] == len(levels) == family.deepstack_levels(full.config)
        for z, level in enumerate(levels):
            assert torch.equal(emb.deepstack[z], level[i])
    assert encoder.cache.stats.misses == misses + len(ours)
    encoder.encode_videos(inputs.clips, inputs.videos.keys)
    assert encoder.cache.stats.misses == misses + len(ours)  # the tower does not run again


@pytest.fixture(scope="module")
def clip_parity(family_models, clip_path):
    family, path, *_ = family_models
    figures = run_parity(path, video=str(clip_path))
    print(family.name, {k: v for k, v in figures.items() if k.endswith("_max_abs")})
    return figures


def test_the_lm_only_path_on_cached_clips_matches_the_full_model(family_models, clip_parity):
    """Invariant 2 with clips, each family, fp32: the LM-only path on cached clip embeddings against
    the full model on the clip's pixels, alone and packed with the image and text-only cases in one
    row; DeepStack dropped (where the family has it) and 1-D positions are caught on the clips."""
    family, _, _, full, _ = family_models
    figures = clip_parity
    for name in ("clip", "clip_image_text", "clip_later_turn"):
        case = figures["cases"][name]
        assert case["clips"] >= 1
        assert case["lm_only_vs_full_max_abs"] <= TOLERANCE, name
        assert case["packed_vs_full_max_abs"] <= TOLERANCE, name
    assert figures["clip_lm_only_vs_full_max_abs"] <= TOLERANCE
    assert figures["clip_packed_vs_full_max_abs"] <= TOLERANCE
    assert figures["packed_vs_unpacked_max_abs"] <= TOLERANCE  # clips, images and text only, one row
    assert figures["clip_positions_1d_max_abs"] > MISTAKE_FLOOR
    if family.deepstack_levels(full.config):
        assert figures["clip_deepstack_dropped_max_abs"] > MISTAKE_FLOOR


def test_shared_prompts_with_clips_give_the_packed_logprobs_and_gradients(family_models, clip_path):
    """A GRPO group whose prompt holds a clip, its prompt computed once: the logprobs and gradients of
    every sample packed whole (mixed rows: clips, images, text only)."""
    from saccade.models.lm import load_policy_lm, set_full_finetune
    from saccade.trainer.forward import forward_logprobs
    from saccade.trainer.packing import pack

    family, path, processor, _, encoder = family_models
    samples = grouped_samples(processor, encoder, (3, 5), torch.Generator().manual_seed(0), video=str(clip_path))
    assert any(s.num_videos for s in samples) and any(not s.num_videos and s.num_images for s in samples)
    results = {}
    for share in (False, True):
        model = set_full_finetune(load_policy_lm(path))
        logprobs = {}
        for mb in pack(samples, encoder.cache.get, max_tokens=8192, image_token_id=model.image_token_id,
                       spatial_merge_size=encoder.merge, share_prompts=share, video_token_id=model.video_token_id):
            lp, _ = forward_logprobs(model, mb, only_loss_tokens=True)
            for k, sid in enumerate(mb.sample_ids):
                lo, hi = int(mb.cu_seqlens[k]), int(mb.cu_seqlens[k + 1])
                logprobs[sid] = lp[lo:hi][mb.loss_mask[lo:hi]]
        sum((lp * (i % 2 - 0.5)).sum() for i, lp in enumerate(logprobs[s.sample_id] for s in samples)).backward()
        results[share] = logprobs, {n: p.grad.clone() for n, p in model.named_parameters()}
    (whole, whole_grads), (shared, shared_grads) = results[False], results[True]
    assert max(float((whole[k] - shared[k]).detach().abs().max()) for k in whole) <= TOLERANCE
    for name, grad in whole_grads.items():
        assert (shared_grads[name] - grad).abs().max() <= TOLERANCE * max(float(grad.abs().max()), GRAD_FLOOR), name
