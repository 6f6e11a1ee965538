"""A clip column in one's own data set (`task.columns.videos`): a video file under the data set's
folder, or a list of frames; placed at `<video>`; counted, decoded and refused at the row check."""

from __future__ import annotations

import json

import pytest
from dataset_fixtures import disc
from video_helpers import write_mp4

from saccade.config import ColumnsConfig, ImagesConfig
from saccade.data.datasets import DatasetRows
from saccade.data.messages import messages_to_inputs
from saccade.data.questions import to_messages
from saccade.data.row_formats import RowLayout
from saccade.data.rows import RowSkipped, token_budget
from saccade.models.loading import load_processor
from saccade.models.presets import preset_path

LIMITS = ImagesConfig(min_pixels=32 * 32, max_pixels=256 * 256)
LAYOUT = RowLayout(ColumnsConfig(images="img", prompt="q", answer="a", id="uid", videos="clip"))


@pytest.fixture(scope="module")
def rows(tmp_path_factory):
    root = tmp_path_factory.mktemp("own") / "mine"
    (root / "pics").mkdir(parents=True)
    for color in ("red", "green", "blue"):
        disc(color).save(root / "pics" / f"{color}.png")
    (root / "clips").mkdir()
    write_mp4(root / "clips" / "square.mp4", frames=12, fps=6.0)
    (root / "clips" / "broken.mp4").write_bytes(b"not a video at all" * 64)
    write_mp4(root.parent / "outside.mp4", frames=8)
    # A column holds one kind (Arrow): files in one data set, frame lists in another.
    files = [
        {"uid": "v0", "clip": "clips/square.mp4", "img": [], "q": "<video> Which way does it move?", "a": "right"},
        {"uid": "v1", "clip": "clips/square.mp4", "img": ["pics/blue.png"], "q": "Which first?", "a": "red"},
        {"uid": "v2", "clip": "../../outside.mp4", "img": [], "q": "What moves?", "a": "x"},
        {"uid": "v3", "clip": None, "img": [], "q": "What moves?", "a": "x"},
        {"uid": "v4", "clip": "clips/broken.mp4", "img": [], "q": "What moves?", "a": "x"},
        {"uid": "v5", "clip": "clips/square.mp4", "img": [], "q": "<video> and <video>?", "a": "x"},
    ]
    frames = [{"uid": "f0", "clip": ["pics/red.png", "pics/green.png"], "img": ["pics/blue.png"],
               "q": "Which color came first?", "a": "red"},
              {"uid": "f1", "clip": ["pics/red.png", "/etc/passwd"], "img": [], "q": "?", "a": "x"}]
    out = []
    for name, table in (("files", files), ("frames", frames)):
        (root / name).mkdir()
        path = root / name / "data.jsonl"
        path.write_text("".join(json.dumps(r).replace("clips/", "../clips/").replace("pics/", "../pics/")
                                + "\n" for r in table))
        layout = RowLayout(LAYOUT.columns, image_root=str(root))  # the two data sets' parent holds the files
        out.append(DatasetRows("dataset", str(path), subsets=None, split="train", layout=layout))
    return out


def test_a_clip_column_reads_files_and_frames_and_places_them(rows):
    processor = load_processor(preset_path("tiny"))
    files, frames = rows
    first = files.sample(0)
    assert len(first.videos) == 1 and first.videos[0].endswith("clips/square.mp4")
    content = to_messages(first)[0]["content"]
    assert [p["type"] for p in content] == ["video", "text"]  # at its placeholder
    second = frames.sample(0)
    content = to_messages(second)[0]["content"]
    assert [p["type"] for p in content] == ["video", "image", "text"]  # no placeholder: first, before images
    assert len(content[0]["video"]) == 2  # a list of frames is one clip
    for sample in (first, second):
        inputs = messages_to_inputs(to_messages(sample), processor, limits=LIMITS, add_generation_prompt=True)
        assert inputs.num_videos == 1
        check = token_budget(processor, LIMITS, max_tokens=inputs.input_ids.numel() + 4, completion_tokens=4)
        check(sample)  # exactly the prompt's tokens: it fits
        with pytest.raises(RowSkipped, match="too_long|over trainer.max_tokens"):
            token_budget(processor, LIMITS, max_tokens=inputs.input_ids.numel() + 3, completion_tokens=4)(sample)


@pytest.mark.parametrize("which, index, reason", [(0, 2, "image_outside_dataset"), (0, 3, "missing_image"),
                                                  (0, 5, "image_count"), (1, 1, "image_outside_dataset")])
def test_a_bad_clip_row_is_skipped_with_its_reason(rows, which, index, reason):
    with pytest.raises(RowSkipped) as err:
        rows[which].sample(index)
    assert err.value.reason == reason and err.value.row_id == f"{'vf'[which]}{index}"


def test_a_clip_that_does_not_decode_is_refused_at_the_row_check(rows):
    """The row reads (a file under the folder); the check, which has the model's processor, decodes it."""
    processor = load_processor(preset_path("tiny"))
    sample = rows[0].sample(4)
    with pytest.raises(RowSkipped, match="cannot open|no frame") as err:
        token_budget(processor, LIMITS, max_tokens=4096, completion_tokens=4)(sample)
    assert err.value.reason == "bad_image" and err.value.row_id == "v4"
