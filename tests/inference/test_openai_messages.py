"""saccade's messages as `saccade serve` takes them (saccade.inference.openai_messages), no server:
images inline, clips as their sampled frames with the settings that say which frames they are."""

from __future__ import annotations

import base64
import io

import numpy as np
import pytest
from PIL import Image
from video_helpers import write_mp4

from saccade.data.videos import VideoError
from saccade.inference.openai_messages import clip_request_fields, encode_video_bodies, to_openai_messages
from saccade.serving.validation import check_request_mm_kwargs, frame_payloads, parse_clip_list


@pytest.fixture(scope="module")
def clip_files(tmp_path_factory):
    folder = tmp_path_factory.mktemp("clips")
    return write_mp4(folder / "a.mp4", frames=20, fps=8.0, seed=1), write_mp4(folder / "b.mp4", frames=9, fps=3.0)


def test_a_clip_goes_as_its_sampled_frames_losslessly(processor, limits, clip_files):
    from saccade.data.messages import messages_to_inputs

    messages = [{"role": "user", "content": [{"type": "video", "video": str(clip_files[0])},
                                             {"type": "text", "text": "What moves?"}]}]
    out = to_openai_messages(messages, limits, "s0", processor)
    part = out.messages[0]["content"][0]
    assert part["type"] == "video_url" and out.messages[0]["content"][1]["text"] == "What moves?"
    payloads = frame_payloads(part["video_url"]["url"], "url")
    (clip,) = out.clips
    assert len(payloads) == clip.num_frames
    for payload, frame in zip(payloads, clip.frames, strict=True):  # PNG: the very frames, not a lossy copy
        assert np.array_equal(np.asarray(Image.open(io.BytesIO(base64.b64decode(payload)))), frame)
    ours = messages_to_inputs(messages, processor, limits=limits)
    assert out.clip_keys() == ours.videos.keys  # the embedded engine's cache key
    fields = clip_request_fields(out.clips, out.sampling, "s0")
    assert fields["media_io_kwargs"]["video"]["frames_indices"] == list(clip.frame_indices)
    assert fields["mm_processor_kwargs"]["do_sample_frames"] is False
    check_request_mm_kwargs({**out.messages[0], **fields})  # what the client sends passes the guard


def test_clips_that_differ_in_rate_cannot_share_a_request(processor, limits, clip_files):
    messages = [{"role": "user", "content": [{"type": "video", "video": str(f)} for f in clip_files]}]
    out = to_openai_messages(messages, limits, "two", processor)
    with pytest.raises(VideoError, match="two.*one setting to every clip"):
        clip_request_fields(out.clips, out.sampling, "two")


def test_encode_bodies_keep_each_clip_whole_and_pass_the_servers_checks(processor, limits, clip_files):
    messages = [{"role": "user", "content": [{"type": "video", "video": str(f)} for f in clip_files]}]
    out = to_openai_messages(messages, limits, "two", processor)
    chunks = encode_video_bodies(dict(zip(out.clip_keys(), out.clips, strict=True)), out.sampling)
    assert [keys for keys, _ in chunks] == [out.clip_keys()]
    clips, settings = parse_clip_list(chunks[0][1])
    assert [c.frames_indices for c in clips] == [list(c.frame_indices) for c in out.clips]
    assert settings == out.sampling.processor_kwargs()
