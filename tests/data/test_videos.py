"""Clips in messages: decoded, sampled and expanded exactly as transformers does, refused with reasons.

The clips are mp4 files written by OpenCV (`tests/video_helpers.py`), not by saccade. The
reference is transformers' own processor called on the file itself (`processor(videos=[path])`),
its decoder pointed at OpenCV (its default decoders, torchcodec and torchvision's, are not
installed here: `fetch_videos` is patched to transformers' own `load_video(backend="opencv")`).
"""

from __future__ import annotations

import base64
import copy

import numpy as np
import pytest
import torch
from PIL import Image

from saccade.config import ImagesConfig, VideoConfig
from saccade.data.images import MissingImageError, TooManyPixelsError
from saccade.data.messages import messages_to_inputs
from saccade.data.videos import DECODED, VideoError, VideoSampling, blank_clip, load_video, video_cache_key
from saccade.models.loading import load_processor
from saccade.models.presets import preset_path
from video_helpers import moving_square_frames, write_mp4

LIMITS = ImagesConfig(min_pixels=32 * 32, max_pixels=256 * 256)
# Qwen3-VL's video processor (Qwen3-VL, its MoE, Qwen3.5 and its MoE) and Qwen2-VL's (Qwen2.5-VL).
PROCESSOR_PRESETS = ("tiny", "qwen2.5vl-tiny", "qwen3.5-tiny")


@pytest.fixture(scope="module")
def clip_path(tmp_path_factory):
    return write_mp4(tmp_path_factory.mktemp("clips") / "square.mp4", frames=20, fps=8.0)


@pytest.fixture(scope="module", params=PROCESSOR_PRESETS)
def processor(request):
    return load_processor(preset_path(request.param))


def clip_messages(part: dict, text: str = "What moves?") -> list[dict]:
    return [{"role": "user", "content": [part, {"type": "text", "text": text}]}]


def transformers_on_file(processor, path, monkeypatch, **videos_kwargs):
    """transformers' processor on the file itself, decoding with its own OpenCV reader."""
    import transformers.video_processing_utils as vpu
    from transformers.video_utils import load_video as transformers_load_video

    def fetch(self, urls, sample_indices_fn=None):
        return list(zip(*[transformers_load_video(u, backend="opencv", sample_indices_fn=sample_indices_fn)
                          for u in urls]))

    monkeypatch.setattr(vpu.BaseVideoProcessor, "fetch_videos", fetch)
    text = processor.apply_chat_template(clip_messages({"type": "video"}), tokenize=False)
    return processor(text=[text], videos=[str(path)], return_tensors="pt",
                     videos_kwargs={"cap_pixels_per_frame": False, **videos_kwargs})


def assert_same_as_transformers(ours, ref):
    assert torch.equal(ours.input_ids, ref["input_ids"][0])
    assert torch.equal(ours.mm_token_type_ids, ref["mm_token_type_ids"][0])
    assert torch.equal(ours.pixel_values_videos, ref["pixel_values_videos"])
    assert torch.equal(ours.videos.grid_thw, ref["video_grid_thw"])
    if "second_per_grid_ts" in ref:  # Qwen2.5-VL's processor writes them; ours follow its rule for every family
        assert torch.equal(ours.videos.second_per_grid, ref["second_per_grid_ts"].float())


def test_a_file_is_sampled_and_expanded_as_transformers_does(processor, clip_path, monkeypatch):
    """The processor's own settings (Qwen3-VL's: 2 fps, at least 4 frames; Qwen2-VL's: every frame)."""
    part = {"type": "video_url", "video_url": {"url": f"file://{clip_path}"}}
    ours = messages_to_inputs(clip_messages(part), processor, limits=LIMITS)
    assert_same_as_transformers(ours, transformers_on_file(processor, clip_path, monkeypatch))
    assert ours.num_videos == 1 and ours.videos.keys[0].startswith("video-")
    clip = ours.clips[0]
    assert clip.total_frames == 20 and clip.fps == pytest.approx(8.0)
    every = not processor.video_processor.do_sample_frames  # Qwen2-VL's processor samples nothing
    assert clip.frame_indices == (tuple(range(20)) if every else (0, 5, 10, 14, 19))
    if not every:  # Qwen3-VL: each frame group after its timestamp (the mean of its two frames' times)
        assert "<0.3 seconds>" in processor.tokenizer.decode(ours.input_ids)


def test_the_configured_settings_sample_as_the_processor_configured_so(processor, clip_path, monkeypatch):
    """[images.video] fps, min/max frames and pixels = the processor with those attributes set."""
    limits = LIMITS.model_copy(update={"video": VideoConfig(fps=4.0, min_frames=2, max_frames=6, max_pixels=4 * 64 * 64)})
    ours = messages_to_inputs(clip_messages({"type": "video", "video": str(clip_path)}), processor, limits=limits)
    configured = copy.deepcopy(processor)
    video = configured.video_processor
    video.fps, video.min_frames, video.max_frames, video.do_sample_frames = 4.0, 2, 6, True
    size = {"shortest_edge": video.size.shortest_edge, "longest_edge": 4 * 64 * 64}
    assert_same_as_transformers(ours, transformers_on_file(configured, clip_path, monkeypatch, size=size))
    assert ours.clips[0].num_frames <= 6


def test_every_way_to_give_the_file_gives_the_same_clip(clip_path, tmp_path):
    processor = load_processor(preset_path("tiny"))
    data = clip_path.read_bytes()
    sources = [str(clip_path), clip_path, f"file://{clip_path}", data,
               "data:video/mp4;base64," + base64.b64encode(data).decode(), {"url": str(clip_path)},
               {"bytes": data, "path": "ignored.mp4"}]
    sampling = VideoSampling.from_processor(processor, LIMITS)
    hashes = {load_video(s, sampling=sampling).content_hash for s in sources}
    assert len(hashes) == 1
    parts = [{"type": "video_url", "video_url": {"url": "data:video/mp4;base64," + base64.b64encode(data).decode()}},
             {"type": "video", "video": str(clip_path)}, {"type": "video", "path": str(clip_path)}]
    ids = [messages_to_inputs(clip_messages(p), processor, limits=LIMITS).input_ids for p in parts]
    assert all(torch.equal(ids[0], x) for x in ids[1:])


def test_a_list_of_frames_is_a_sampled_clip_at_its_fps(processor):
    """Frames are taken whole, 1/fps seconds apart (the part's fps, else frame_list_fps = 2): the
    processor gets them with that metadata, as transformers would be given it."""
    frames = [Image.fromarray(f) for f in moving_square_frames(4, (64, 48))]
    for fps, default in ((1.0, False), (None, True)):
        part = {"type": "video", "video": frames} | ({} if default else {"fps": fps})
        ours = messages_to_inputs(clip_messages(part), processor, limits=LIMITS)
        clip = ours.clips[0]
        assert clip.frame_indices == (0, 1, 2, 3) and clip.fps == (2.0 if default else 1.0)
        text = processor.apply_chat_template(clip_messages({"type": "video"}), tokenize=False)
        ref = processor(text=[text], videos=[np.stack([np.asarray(f) for f in frames])], return_tensors="pt",
                        video_metadata=[clip.metadata()],
                        videos_kwargs={"do_sample_frames": False, "cap_pixels_per_frame": False,
                                       "size": {"shortest_edge": processor.video_processor.size.shortest_edge,
                                                "longest_edge": processor.video_processor.size.longest_edge}})
        assert_same_as_transformers(ours, ref)
        assert ours.videos.second_per_grid.tolist() == [2 / clip.fps]  # temporal patch of 2 frames
    array = np.stack([np.asarray(f) for f in frames])
    same = messages_to_inputs(clip_messages({"type": "video", "video": array}), processor, limits=LIMITS)
    assert same.clips[0].content_hash == ours.clips[0].content_hash


def test_clips_images_and_text_in_any_turn(clip_path):
    processor = load_processor(preset_path("tiny"))
    from saccade.data.synthetic import synthetic_image

    messages = [
        {"role": "user", "content": "Hello."},
        {"role": "assistant", "content": "Hi."},
        {"role": "user", "content": [{"type": "image", "image": synthetic_image(64, 48, 1)},
                                     {"type": "video", "video": str(clip_path)}, {"type": "text", "text": "Same?"}]},
        {"role": "assistant", "content": "No."},
        {"role": "user", "content": [{"type": "video", "video": [synthetic_image(48, 48, i) for i in range(2)]}]},
    ]
    inputs = messages_to_inputs(messages, processor, limits=LIMITS)
    assert inputs.num_images == 1 and inputs.num_videos == 2
    types = inputs.mm_token_type_ids
    assert int((types == 1).sum()) == int(inputs.image_grid_thw.prod(-1).sum()) // 4
    assert int((types == 2).sum()) == int(inputs.videos.grid_thw.prod(-1).sum()) // 4
    first_image, first_video = int((types == 1).nonzero()[0]), int((types == 2).nonzero()[0])
    assert first_image < first_video  # in the order the parts come


def test_cache_keys_follow_the_frames_and_the_settings(clip_path):
    processor = load_processor(preset_path("tiny"))
    a = VideoSampling.from_processor(processor, LIMITS)
    b = VideoSampling.from_processor(processor, LIMITS.model_copy(update={"video": VideoConfig(fps=4.0)}))
    c = VideoSampling.from_processor(processor, LIMITS.model_copy(update={"video": VideoConfig(max_pixels=1 << 16)}))
    clip = load_video(str(clip_path), sampling=a)
    assert len({video_cache_key(clip.content_hash, s) for s in (a, b, c)}) == 3
    assert load_video(str(clip_path), sampling=b).content_hash != clip.content_hash  # other frames
    assert video_cache_key(clip.content_hash, a) == video_cache_key(clip.content_hash, a)
    blank = blank_clip(clip)
    assert blank.content_hash != clip.content_hash and blank.metadata() == clip.metadata()


def test_a_clip_is_decoded_once(clip_path, monkeypatch):
    import transformers.video_utils as video_utils

    processor = load_processor(preset_path("tiny"))
    sampling = VideoSampling.from_processor(processor, LIMITS.model_copy(update={"video": VideoConfig(fps=3.0)}))
    decodes = []
    real = video_utils.read_video_opencv
    monkeypatch.setattr(video_utils, "read_video_opencv", lambda *a, **k: decodes.append(1) or real(*a, **k))
    first = load_video(str(clip_path), sampling=sampling)
    again = load_video(f"file://{clip_path}", sampling=sampling)
    assert again is first and len(decodes) == 1
    off = VideoSampling.from_processor(processor, LIMITS.model_copy(
        update={"video": VideoConfig(fps=3.0, decoded_cache_bytes=0)}))
    load_video(str(clip_path), sampling=off)
    assert len(decodes) == 2
    assert DECODED.hits >= 1


@pytest.mark.parametrize("case, error, match", [
    ("corrupt", VideoError, "cannot open|no frame|corrupt"),
    ("truncated", VideoError, "truncated|cannot open|no frame"),
    ("missing", MissingImageError, "does not exist"),
    ("remote", VideoError, "remote video URLs are refused"),
    ("frame_pixels", TooManyPixelsError, "images.max_source_pixels"),
    ("clip_pixels", TooManyPixelsError, "images.video.max_source_pixels"),
    ("too_many_frames", VideoError, "max_frames"),
    ("sizes_differ", VideoError, "differ in size"),
    ("no_frames", VideoError, "zero frames"),
    ("bad_array", VideoError, "uint8"),
])
def test_bad_clips_are_refused_with_a_reason(case, error, match, clip_path, tmp_path):
    processor = load_processor(preset_path("tiny"))
    limits, source = LIMITS, str(clip_path)
    if case == "corrupt":
        (tmp_path / "bad.mp4").write_bytes(b"\x00\x00\x00\x18ftypmp42" + bytes(range(256)) * 8)
        source = str(tmp_path / "bad.mp4")
    elif case == "truncated":
        (tmp_path / "cut.mp4").write_bytes(clip_path.read_bytes()[: clip_path.stat().st_size // 3])
        source = str(tmp_path / "cut.mp4")
    elif case == "missing":
        source = str(tmp_path / "nowhere.mp4")
    elif case == "remote":
        source = "https://example.com/clip.mp4"
    elif case == "frame_pixels":
        limits = LIMITS.model_copy(update={"max_source_pixels": 1000})
    elif case == "clip_pixels":
        limits = LIMITS.model_copy(update={"video": VideoConfig(max_source_pixels=96 * 64 * 3)})
    elif case == "too_many_frames":
        limits = LIMITS.model_copy(update={"video": VideoConfig(max_frames=3, min_frames=1)})
        source = [Image.new("RGB", (32, 32))] * 4
    elif case == "sizes_differ":
        source = [Image.new("RGB", (32, 32)), Image.new("RGB", (48, 32))]
    elif case == "no_frames":
        source = []
    elif case == "bad_array":
        source = np.zeros((2, 32, 32, 3), np.float32)
    with pytest.raises(error, match=match) as caught:
        messages_to_inputs(clip_messages({"type": "video", "video": source}), processor, limits=limits, sample="row-7")
    assert isinstance(caught.value, VideoError) and "row-7" in str(caught.value)


def test_a_processor_without_video_is_refused_and_video_pads_in_text_too(clip_path):
    processor = load_processor(preset_path("tiny"))
    with pytest.raises(ValueError, match="video_pad"):
        messages_to_inputs([{"role": "user", "content": "look <|video_pad|>"}], processor, limits=LIMITS)
    with pytest.raises(VideoError, match="no video processor"):
        VideoSampling.from_processor(object(), LIMITS)


def test_a_blanked_clip_keeps_its_tokens_and_shows_nothing(processor, clip_path):
    """The visual-reliance counterfactual (`with_blank_images`): gray frames, the same count, size and
    timestamps, so the same ids at the same places; another clip to the tower."""
    from saccade.data.messages import video_sampling, with_blank_images

    messages = clip_messages({"type": "video_url", "video_url": {"url": f"file://{clip_path}"}})
    real = messages_to_inputs(messages, processor, limits=LIMITS)
    blank = messages_to_inputs(with_blank_images(messages, limits=LIMITS, sampling=video_sampling(processor, LIMITS)),
                               processor, limits=LIMITS)
    assert torch.equal(real.input_ids, blank.input_ids) and torch.equal(real.videos.grid_thw, blank.videos.grid_thw)
    assert real.videos.keys != blank.videos.keys and int(blank.clips[0].frames.std()) == 0
    with pytest.raises(VideoError, match="needs the model's video sampling"):
        with_blank_images(messages, limits=LIMITS)


def test_a_data_sets_control_clip_is_read_blank_by_the_models_sampling(processor, clip_path):
    """`BlankedClip` (a data set's control, `task.blank_images`): decoded and sampled as the clip it
    holds, then gray: the real clip's tokens and grid, another clip to the tower; a list of frames too."""
    from saccade.data.videos import BlankedClip

    for source in (str(clip_path), [Image.fromarray(f) for f in moving_square_frames(6)]):
        real = messages_to_inputs(clip_messages({"type": "video", "video": source}), processor, limits=LIMITS)
        blank = messages_to_inputs(clip_messages({"type": "video", "video": BlankedClip(source)}), processor,
                                   limits=LIMITS)
        assert torch.equal(real.input_ids, blank.input_ids) and torch.equal(real.videos.grid_thw, blank.videos.grid_thw)
        assert blank.clips[0].frame_indices == real.clips[0].frame_indices
        assert int(blank.clips[0].frames.std()) == 0 < int(real.clips[0].frames.std())
