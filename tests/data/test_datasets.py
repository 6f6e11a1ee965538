"""Tests for saccade.data.datasets and the known data sets' row formats (saccade.data.row_formats:
verl, mathvista, problem_answer), read by path from offline fixtures written the way the hub
stores them, through the same calls as a hub id."""

from __future__ import annotations

import json
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from dataset_fixtures import (
    GEOMETRY3K_ANSWERS,
    MATHVISTA_ROWS,
    OPENMMREASONER_TRAIN,
    picture,
    write_all,
    write_geometry3k,
)

from saccade.config import RunConfig, load_config
from saccade.data.datasets import DatasetRows, DatasetTask, shuffled_index
from saccade.data.images import ImageError, image_to_png_bytes
from saccade.data.rows import RowSkipped
from saccade.data.questions import IMAGE_PLACEHOLDER, to_messages
from saccade.data.row_formats import parts
from saccade.data.row_formats.parts import parse_options
from saccade.rewards import correct_reward, score


@pytest.fixture(scope="module")
def paths(tmp_path_factory):
    return {task: str(path) for task, path in write_all(tmp_path_factory.mktemp("datasets")).items()}


def image_parts(messages):
    return [p for m in messages if isinstance(m["content"], list) for p in m["content"] if p["type"] == "image"]


def texts(messages):
    out = []
    for m in messages:
        content = m["content"]
        out += [content] if isinstance(content, str) else [p["text"] for p in content if p["type"] == "text"]
    return out


# ------------------------------------------------------------------ OpenMMReasoner


def test_openmmreasoner_reads_the_seven_training_configs_and_the_validation_config(paths):
    task = DatasetTask.defaults("openmmreasoner", dataset=paths["openmmreasoner"])
    assert task.subsets == tuple(OPENMMREASONER_TRAIN) and (task.eval_subsets, task.eval_split) == (("validation",), "val")
    assert len(task.train_rows) == 7 * 3
    assert [name for name, _ in task.train_rows.parts] == list(OPENMMREASONER_TRAIN)
    held_out = task.eval_samples(100)  # more than there are: all 6, in order
    assert [s.sample_id for s in held_out] == [f"openmmreasoner-validation-val-{i}" for i in range(6)]
    last = task.train_rows.sample(20)
    assert last.sample_id == "openmmreasoner-wemath_standard-train-2"
    assert last.metadata["subset"] == "wemath_standard" and last.metadata["avg_reward"] == 0.5
    assert "avg_reward" not in held_out[0].metadata  # the validation config has no such column


def test_openmmreasoner_letter_answers_get_their_options_from_the_prompt(paths):
    sample = DatasetRows("openmmreasoner", paths["openmmreasoner"], subsets=("mmk12",), split="train").sample(0)
    assert sample.answer in "ABCD" and sample.answer_type == "multi_choice"
    assert sample.choices == ["red", "green", "blue", "white"]
    letter_index = "ABCD".index(sample.answer)
    # The reward accepts the letter and the option's text, and nothing else.
    assert correct_reward(f"\\boxed{{{sample.answer}}}", sample) == 1.0
    assert correct_reward(f"\\boxed{{{sample.choices[letter_index]}}}", sample) == 1.0
    assert correct_reward(f"\\boxed{{{sample.choices[letter_index - 1]}}}", sample) == 0.0
    numeric = DatasetRows("openmmreasoner", paths["openmmreasoner"], subsets=("mmk12",), split="train").sample(1)
    assert (numeric.answer, numeric.choices, numeric.answer_type) == ("2", None, "free_form")
    assert correct_reward("so \\boxed{2.0}", numeric) == 1.0


def test_openmmreasoner_messages_put_each_image_at_its_placeholder(paths):
    rows = DatasetRows("openmmreasoner", paths["openmmreasoner"], subsets=("algopuzzle",), split="train")
    sample = rows.sample(2)  # "Compare <image> and <image>. ..." with two images
    messages = to_messages(sample)
    assert messages[0] == {"role": "system", "content": sample.prompt[0]["content"]}
    user = messages[1]["content"]
    assert [p["type"] for p in user] == ["text", "image", "text", "image", "text"]
    assert user[1]["image"] is sample.images[0] and user[3]["image"] is sample.images[1]
    assert user[0]["text"] == "Compare " and user[2]["text"] == " and "
    assert all(IMAGE_PLACEHOLDER not in t for t in texts(messages))
    assert sample.question.startswith("Compare") and IMAGE_PLACEHOLDER not in sample.question
    # The same placement with data URLs, for an OpenAI-compatible server.
    as_urls = to_messages(sample, image_format="data_url")[1]["content"]
    assert [p["type"] for p in as_urls] == ["text", "image_url", "text", "image_url", "text"]


def test_images_decode_as_written(paths):
    sample = DatasetRows("openmmreasoner", paths["openmmreasoner"], subsets=("algopuzzle",), split="train").sample(2)
    assert [image_to_png_bytes(im) for im in sample.images] == [image_to_png_bytes(picture(2)),
                                                               image_to_png_bytes(picture(52))]


# ------------------------------------------------------------------------- MathVista


def test_mathvista_rows_map_to_samples(paths):
    task = DatasetTask.defaults("mathvista", dataset=paths["mathvista"])
    samples = task.eval_samples(1000)
    assert [s.sample_id for s in samples] == [f"mathvista-{i + 1}" for i in range(len(MATHVISTA_ROWS))]
    mc, yes_no, integer, float1, float2, as_list = samples
    assert (mc.answer, mc.choices, mc.answer_type, mc.precision) == ("135°", ["145°", "135°", "90°", "45°"],
                                                                     "multi_choice", None)
    assert (integer.answer_type, integer.choices, integer.precision) == ("integer", None, None)
    assert (float1.answer_type, float1.precision, float2.precision) == ("float", 1, 2)
    assert as_list.answer_type == "list"
    assert mc.metadata["task"] == "geometry problem solving" and mc.metadata["skills"] == [
        "geometry reasoning", "algebraic reasoning"]
    assert mc.metadata["grade"] == "high school" and mc.metadata["dataset"] == "mathvista"
    # The query is the prompt, after the image (it has no placeholder).
    messages = to_messages(mc)
    assert [p["type"] for p in messages[0]["content"]] == ["image", "text"]
    assert messages[0]["content"][1]["text"].startswith("Hint:") and "(B) 135°" in messages[0]["content"][1]["text"]


def test_mathvista_answers_score_by_the_official_rules(paths):
    mc, yes_no, integer, float1, float2, as_list = DatasetTask.defaults(
        "mathvista", dataset=paths["mathvista"]).eval_samples(1000)
    assert correct_reward("The answer is (B).", mc) == correct_reward("\\boxed{135°}", mc) == 1.0
    assert correct_reward("\\boxed{A}", mc) == 0.0
    assert correct_reward("Answer: Yes", yes_no) == 1.0 and correct_reward("Answer: B", yes_no) == 0.0
    assert correct_reward("\\boxed{1.0}", integer) == 1.0
    assert correct_reward("\\boxed{1.54}", float1) == 1.0 and correct_reward("\\boxed{1.56}", float1) == 0.0
    assert correct_reward("\\boxed{0.334}", float2) == 1.0 and correct_reward("\\boxed{0.3}", float2) == 0.0
    assert correct_reward("\\boxed{[2, 5]}", as_list) == 1.0 and correct_reward("\\boxed{[5, 2]}", as_list) == 0.0


# ------------------------------------------------------------------------ Geometry3K


def test_geometry3k_splits_and_samples(paths):
    task = DatasetTask.defaults("geometry3k", dataset=paths["geometry3k"])
    assert (task.split, task.eval_split, task.subsets) == ("train", "test", None)
    assert len(task.train_rows) == 4 and len(task.eval_rows) == 3
    assert len(DatasetRows("geometry3k", paths["geometry3k"], subsets=None, split="validation")) == 2
    sample = task.eval_samples(1)[0]
    assert sample.sample_id == "geometry3k-test-0" and sample.answer == GEOMETRY3K_ANSWERS[2]
    assert sample.question == "Find x in figure test-0." and sample.answer_type == "free_form"
    content = to_messages(sample)[0]["content"]
    assert [p["type"] for p in content] == ["image", "text"] and content[1]["text"] == "Find x in figure test-0."
    first = task.train_rows.sample(0)
    assert score("\\boxed{\\sqrt{27}}", first.answer) == 1.0  # 3\sqrt{3}


def test_a_parquet_file_is_a_source_too(paths):
    path = str(Path(paths["geometry3k"]) / "data" / "test-00000-of-00001.parquet")
    rows = DatasetRows("geometry3k", path, subsets=None, split="test")
    assert len(rows) == 3 and rows.sample(1).answer == GEOMETRY3K_ANSWERS[3]
    glob = str(Path(paths["openmmreasoner"]) / "*" / "train-*.parquet")
    assert len(DatasetRows("openmmreasoner", glob, subsets=OPENMMREASONER_TRAIN, split="train")) == 21


def test_plain_bytes_path_structs_load_like_image_features(tmp_path):
    # Parquet written without `datasets`' metadata: images are bare {bytes, path} structs.
    image_type = pa.struct([("bytes", pa.binary()), ("path", pa.string())])
    table = pa.table({
        "images": pa.array([[{"bytes": image_to_png_bytes(picture(7)), "path": None}]], pa.list_(image_type)),
        "problem": ["<image>Find y."], "answer": ["4"],
    })
    pq.write_table(table, tmp_path / "plain.parquet")
    sample = DatasetRows("geometry3k", str(tmp_path / "plain.parquet"), subsets=None, split="test").sample(0)
    assert image_to_png_bytes(sample.images[0]) == image_to_png_bytes(picture(7))


# -------------------------------------------------------------------------- laziness


def test_nothing_is_decoded_until_a_row_is_asked_for(paths, monkeypatch):
    calls = []
    real = parts.load_image
    monkeypatch.setattr(parts, "load_image", lambda *a, **k: calls.append(1) or real(*a, **k))
    rows = DatasetRows("openmmreasoner", paths["openmmreasoner"], subsets=OPENMMREASONER_TRAIN, split="train")
    assert len(rows) == 21 and calls == []
    assert all(table.format["type"] == "arrow" for _, table in rows.parts)  # rows stay Arrow until read
    rows.sample(5)  # a two-image row
    assert len(calls) == 2


# --------------------------------------------------------------------- the stream


def test_the_stream_visits_every_row_once_per_epoch_in_a_seeded_order():
    n = 7
    epochs = [[shuffled_index(e * n + i, n, seed=3) for i in range(n)] for e in range(3)]
    assert all(sorted(epoch) == list(range(n)) for epoch in epochs)
    # each epoch its own order: all three differ (a stream that repeated an epoch would fail here)
    assert epochs[0] != epochs[1] and epochs[1] != epochs[2] and epochs[0] != epochs[2]
    assert [shuffled_index(i, n, seed=3) for i in range(2 * n)] == epochs[0] + epochs[1]
    assert [shuffled_index(i, n, seed=4) for i in range(n)] != epochs[0]
    with pytest.raises(ValueError, match="no rows"):
        shuffled_index(0, 0, seed=0)


def test_train_sample_follows_the_stream(paths):
    task = DatasetTask.defaults("geometry3k", dataset=paths["geometry3k"])
    ids = [task.train_sample(i, seed=1).sample_id for i in range(8)]
    assert sorted(ids[:4]) == sorted(ids[4:]) == [f"geometry3k-train-{i}" for i in range(4)]
    assert ids == [task.train_sample(i, seed=1).sample_id for i in range(8)]


def test_blank_images_keep_sizes_and_lose_content(paths):
    task = DatasetTask.defaults("geometry3k", dataset=paths["geometry3k"], blank_images=True)
    image = task.eval_samples(1)[0].images[0]
    assert image.size == picture(0).size and len(image.getcolors()) == 1


# ---------------------------------------------------------------------------- errors


def test_unknown_config_names_the_ones_there_are(paths):
    with pytest.raises(ValueError, match=r"no config 'mmk13'.*algopuzzle.*task\.subsets"):
        DatasetRows("openmmreasoner", paths["openmmreasoner"], subsets=("mmk13",), split="train")


def test_missing_split_names_the_ones_there_are(paths):
    with pytest.raises(ValueError, match=r"no split 'train'; it has val.*task\.split"):
        DatasetRows("openmmreasoner", paths["openmmreasoner"], subsets=("validation",), split="train")
    with pytest.raises(ValueError, match=r"no split 'dev'; it has .*test"):
        DatasetRows("geometry3k", paths["geometry3k"], subsets=None, split="dev")


def test_missing_column_names_it_and_the_layout(tmp_path):
    import datasets

    datasets.Dataset.from_dict({"problem": ["<image>x?"], "answer": ["1"]}).to_parquet(str(tmp_path / "t.parquet"))
    with pytest.raises(ValueError, match=r"no column images; expected the layout images \(list of images\)"):
        DatasetRows("geometry3k", str(tmp_path / "t.parquet"), subsets=None, split="test")


def test_an_image_that_cannot_be_decoded_names_its_row(tmp_path):
    image_type = pa.struct([("bytes", pa.binary()), ("path", pa.string())])
    table = pa.table({
        "images": pa.array([[{"bytes": b"not a picture", "path": None}]], pa.list_(image_type)),
        "problem": ["<image>Find y."], "answer": ["4"],
    })
    pq.write_table(table, tmp_path / "bad.parquet")
    rows = DatasetRows("geometry3k", str(tmp_path / "bad.parquet"), subsets=None, split="test")
    with pytest.raises(RowSkipped, match=r"geometry3k-test-0 \(images\[0\]\)") as refused:
        rows.sample(0)
    # Refused as a broken row (the RL stream skips it), the image's own error kept as the cause.
    assert (refused.value.reason, refused.value.split, refused.value.index) == ("bad_image", "test", 0)
    assert isinstance(refused.value.__cause__, ImageError)


def test_placeholders_and_images_must_agree(tmp_path):
    write_geometry3k(tmp_path, {"test": 1})
    sample = DatasetRows("geometry3k", str(tmp_path), subsets=None, split="test").sample(0)
    sample.prompt = [{"role": "user", "content": "<image> and <image>?"}]
    with pytest.raises(ValueError, match="2 <image> placeholders but the sample has 1 images"):
        to_messages(sample)


def test_a_path_that_does_not_exist_says_so():
    with pytest.raises(ValueError, match="does not exist"):
        DatasetRows("geometry3k", "./no/such/folder", subsets=None, split="test")


# ----------------------------------------------------------------- option parsing


@pytest.mark.parametrize(
    ("text", "options"),
    [
        ("Which?\nA. red\nB. green\nC. blue", ["red", "green", "blue"]),
        ("Which?\n(A) 3 cm\n(B) 4 cm", ["3 cm", "4 cm"]),
        ("Which? Choices: (A) 30° (B) 45° (C) 60°", ["30°", "45°", "60°"]),
        ("Which?\nA: yes\nB: no", ["yes", "no"]),
        ("A. only one option", None),
        ("Options:\nA. x\nC. y", None),  # a gap is not an option list
        ("How many? Add 3.", None),
    ],
)
def test_parse_options(text, options):
    assert parse_options(text) == options


# ------------------------------------------------------------------------- config


def test_config_selects_a_data_set_task(paths):
    from saccade.run.tasks import QuestionTask, task_from_config

    cfg = load_config(RunConfig, None, ["--task.kind", "openmmreasoner", "--task.dataset", paths["openmmreasoner"],
                                        "--task.subsets", '["mmk12", "virl39k"]', "--eval.prompts", "2"])
    task = task_from_config(cfg)
    assert isinstance(task, QuestionTask) and task.max_turns == 1
    rows = task.questions
    assert isinstance(rows, DatasetTask) and rows.subsets == ("mmk12", "virl39k")
    assert len(rows.train_rows) == 6 and rows.eval_dataset == paths["openmmreasoner"]
    assert task.train_sample(0, seed=0).metadata["subset"] in ("mmk12", "virl39k")
    assert [s.sample_id for s in task.eval_samples(2)] == [
        "openmmreasoner-validation-val-0", "openmmreasoner-validation-val-1"]
    default = task_from_config(load_config(RunConfig, None, ["--task.kind", "mathvista"])).questions
    assert (default.dataset, default.eval_split) == ("AI4Math/MathVista", "testmini")


@pytest.mark.parametrize(
    ("override", "message"),
    [
        (["--task.kind", "mathvist"], "unknown kind 'mathvist'; did you mean 'mathvista'"),
        (["--task.kind", "openmmreasoner", "--task.subsets", '["a", "a"]'], "repeat an entry"),
        (["--task.kind", "openmmreasoner", "--task.subsets", "[]"], "at least 1 item"),
    ],
)
def test_config_refuses_bad_data_settings(override, message):
    from saccade.config import ConfigError

    with pytest.raises(ConfigError, match=message):
        load_config(RunConfig, None, override)


# ---------------------------------------------------------------- training on one


@pytest.mark.slow
def test_rl_trains_on_a_data_set_stream(paths, tmp_path):
    from saccade.metrics import read_metrics
    from saccade.loops.rl import train_rl

    cfg = load_config(RunConfig, "configs/demo.toml", [
        "--task.kind", "geometry3k", "--task.dataset", paths["geometry3k"], "--trainer.steps", "3",
        "--rollout.prompts_per_step", "3", "--rollout.group_size", "2", "--rollout.filter_zero_variance", "false",
        "--sampling.max_tokens", "4", "--loss.max_completion_tokens", "4", "--eval.every_steps", "3",
        "--eval.prompts", "2", "--log.dir", str(tmp_path / "run")])
    out = train_rl(cfg, run_dir=cfg.run_dir, progress=False)
    assert out["step"] == 3
    rows = read_metrics(cfg.run_dir)
    assert [r["step"] for r in rows if r["phase"] == "train"] == [1, 2, 3]
    assert [r["step"] for r in rows if r["phase"] == "eval"] == [3]
    # 9 prompts went through the stream: two epochs over the 4 rows and one more row.
    from saccade.trainer.checkpoint.folder import latest_checkpoint

    state = json.loads((latest_checkpoint(cfg.run_dir) / "state.json").read_text())
    assert state["data_position"] == 9
