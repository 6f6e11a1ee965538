"""Tests for task.kind = "dataset" (saccade.data.row_formats.columns and the loading around it):
one's own data set, in a hub-like folder, a parquet file or JSONL, with its own column names."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from dataset_fixtures import (
    MULTI_IMAGE_ROWS,
    OWN_COLUMNS,
    check_rows_against_score,
    disc,
    recount,
    write_multi_image_parquet,
    write_own_jsonl,
    write_own_parquet,
)

import saccade
from saccade.config import ColumnsConfig, ConfigError, RunConfig, load_config
from saccade.data import datasets as ds
from saccade.data.datasets import DatasetRows
from saccade.data.image_paths import check_image_location
from saccade.data.row_formats import RowContext, RowLayout, parts, row_format
from saccade.data.row_formats.parts import format_choices
from saccade.data.rows import RowSkipped
from saccade.data.questions import to_messages
from saccade.rewards import correct_reward
from saccade.run.tasks import task_from_config

EXAMPLE = Path(saccade.__file__).parent / "configs" / "own-data.toml"


@pytest.fixture(scope="module")
def own(tmp_path_factory):
    return write_own_parquet(tmp_path_factory.mktemp("own") / "colors")


def own_config(dataset, *more):
    return load_config(RunConfig, None, ["--task.kind", "dataset", "--task.dataset", str(dataset), *OWN_COLUMNS,
                                         *more])


def image_parts(messages):
    return [(i, p) for m in messages if isinstance(m["content"], list) for i, p in enumerate(m["content"])
            if p["type"] == "image"]


def user_text(messages):
    return "".join(p["text"] for p in messages[-1]["content"] if p["type"] == "text")


# ------------------------------------------------------------ a hub-like folder


def test_a_folder_with_other_column_names_maps_onto_questions(own):
    task = task_from_config(own_config(own, "--task.system_prompt", "Answer in one word."))
    rows = task.questions
    assert len(rows.train_rows) == 6 and rows.eval_dataset == str(own)
    sample = rows.train_rows.sample(3)
    assert sample.sample_id == "train-q3" and sample.origin == {"split": "train", "config": None, "index": 3}
    assert sample.choices == ["red", "green", "blue"] and sample.answer_type == "multi_choice"
    assert sample.answer == "A"  # every fourth row's gold is the option's letter: scored as the option
    assert correct_reward("red", sample) == correct_reward("A", sample) == 1.0
    assert correct_reward("blue", sample) == 0.0
    assert sample.metadata == {"dataset": str(own), "id": "train-q3", "category": "warm"}
    # The default template: the prompt, then the options one a line; the system turn first.
    assert sample.prompt == [
        {"role": "system", "content": "Answer in one word."},
        {"role": "user", "content": "What color is the disc?\nA. red\nB. green\nC. blue"},
    ]
    messages = to_messages(sample)
    assert [m["role"] for m in messages] == ["system", "user"]
    assert [i for i, _ in image_parts(messages)] == [0]  # no placeholder: the image goes first
    assert messages[1]["content"][0]["image"].getpixel((32, 32)) == (220, 30, 30)
    # No eval_split set: the folder's "test" split is the held-out one.
    assert [s.sample_id for s in task.eval_samples(2)] == ["test-q0", "test-q1"]
    assert rows.eval_rows.split == "test"


def test_the_prompt_template_writes_the_user_turn(own):
    template = "Question: {prompt}\nOptions:\n{choices}\nReply with the option's text. {{one word}}"
    sample = task_from_config(own_config(own, "--task.prompt_template", template)).questions.train_rows.sample(0)
    assert sample.prompt == [{"role": "user", "content": "Question: What color is the disc?\nOptions:\nA. red\n"
                                                         "B. green\nC. blue\nReply with the option's text. {one word}"}]
    assert sample.question == sample.prompt[0]["content"]
    assert format_choices(None) == "" and format_choices(["x", "y"]) == "A. x\nB. y"


def test_rows_stay_memory_mapped_until_asked_for(own, monkeypatch):
    calls = []
    real = parts.load_image
    monkeypatch.setattr(parts, "load_image", lambda *a, **k: calls.append(1) or real(*a, **k))
    rows = DatasetRows("dataset", str(own), subsets=None, split="train",
                       layout=RowLayout(ColumnsConfig(prompt="question", answer="solution")))
    assert len(rows) == 6 and calls == []
    assert all(table.format["type"] == "arrow" for _, table in rows.parts)
    rows.sample(4)
    assert len(calls) == 1


def test_a_missing_column_is_refused_naming_the_columns_there_are(own):
    task = task_from_config(own_config(own, "--task.columns.answer", "answer"))
    with pytest.raises(ValueError, match=r"no column for task.columns.answer = 'answer'; its columns are pid, image, "
                                         r"question, options, solution, subject. Set task.columns.answer"):
        task.train_sample(0, seed=0)
    # The defaults (image, question, answer): two of them missing, both named.
    bare = task_from_config(load_config(RunConfig, None, ["--task.kind", "dataset", "--task.dataset", str(own)]))
    with pytest.raises(ValueError, match=r"task.columns.answer = 'answer'.*its columns are pid, image"):
        bare.eval_samples(1)


# --------------------------------------------------------------------- images


def test_a_list_of_images_goes_to_its_placeholders(tmp_path):
    path = write_multi_image_parquet(tmp_path / "multi.parquet")
    layout = RowLayout(ColumnsConfig(images="pictures"))
    rows = DatasetRows("dataset", str(path), subsets=None, split="train", layout=layout)
    placed = to_messages(rows.sample(0))[0]["content"]
    assert [p["type"] for p in placed] == ["text", "image", "text", "image", "text"]
    assert [p["image"].getpixel((32, 32)) for p in placed if p["type"] == "image"] == [(220, 30, 30), (30, 170, 50)]
    first = to_messages(rows.sample(1))[0]["content"]
    assert [p["type"] for p in first] == ["image", "image", "text"]  # no placeholder: the images first
    assert MULTI_IMAGE_ROWS[2][1] == 1
    with pytest.raises(RowSkipped, match="2 <image> placeholders but the row has 1 images") as err:
        rows.sample(2)
    assert (err.value.reason, err.value.row_id, err.value.index) == ("image_count", "dataset-train-2", 2)


def test_jsonl_rows_read_image_paths_relative_to_their_file(tmp_path):
    path = write_own_jsonl(tmp_path / "mine")
    layout = RowLayout(ColumnsConfig(images="img", prompt="q", answer="a", id="uid"))
    for source in (str(path), str(tmp_path / "mine" / "*.jsonl")):  # a file or a glob
        rows = DatasetRows("dataset", source, subsets=None, split="train", layout=layout)
        sample = rows.sample(1)
        assert sample.sample_id == "j1" and sample.answer_type == "free_form" and sample.choices is None
        assert [im.getpixel((32, 32)) for im in sample.images] == [(30, 170, 50), (30, 70, 225)]
        assert correct_reward("Green.", sample) == 1.0
        with pytest.raises(RowSkipped, match="image file not found") as err:
            rows.sample(2)
        assert (err.value.reason, err.value.row_id) == ("missing_image", "j2")


def test_image_files_are_read_only_from_below_the_data_sets_folder_or_the_image_root(tmp_path):
    import json

    path = write_own_jsonl(tmp_path / "mine")
    outside = tmp_path / "elsewhere"
    outside.mkdir()
    disc("blue").save(outside / "blue.png")
    (tmp_path / "mine" / "pics" / "escape.png").symlink_to(outside / "blue.png")  # inside, pointing out
    named = ["/etc/passwd", "file:///etc/passwd", "../elsewhere/blue.png", "pics/escape.png",
             str(outside / "blue.png")]
    rows = [{"uid": f"o{i}", "img": [image], "q": "What color?", "a": "blue"} for i, image in enumerate(named)]
    path.write_text(path.read_text() + "".join(json.dumps(r) + "\n" for r in rows))
    layout = RowLayout(ColumnsConfig(images="img", prompt="q", answer="a", id="uid"))
    data = DatasetRows("dataset", str(path), subsets=None, split="train", layout=layout)
    assert data.sample(0).images  # pics/red.png: inside, read
    for i in range(3, 3 + len(named)):
        with pytest.raises(RowSkipped, match="outside the data set's folder") as err:
            data.sample(i)
        assert err.value.reason == "image_outside_dataset" and "root:" not in str(err.value)
    # task.image_root widens the folder to a parent of both: the outside picture is read, /etc is still not.
    wider = DatasetRows("dataset", str(path), subsets=None, split="train",
                        layout=RowLayout(layout.columns, image_root=str(tmp_path)))
    assert [im.getpixel((32, 32)) for im in wider.sample(5).images] == [(30, 70, 225)]
    with pytest.raises(RowSkipped, match="outside"):
        wider.sample(3)
    # A hub data set has no folder of its own: its rows may name no local file at all.
    with pytest.raises(RowSkipped, match="hub data set's row names a local file") as err:
        check_image_location("pics/red.png", None, "images[0]")
    with pytest.raises(RowSkipped, match="outside"):  # a datasets Image dict without bytes names a file
        check_image_location({"bytes": None, "path": "/etc/passwd"}, tmp_path, "images[0]")
    check_image_location({"bytes": b"png", "path": "/etc/passwd"}, None, "images[0]")  # bytes win: no file read
    check_image_location("data:image/png;base64,AAAA", None, "images[0]")
    with pytest.raises(RowSkipped, match="outside"):  # nested as OpenAI's image_url is
        check_image_location({"image_url": {"url": "file:///etc/passwd"}}, tmp_path, "images[0]")


def test_an_image_that_is_none_is_a_missing_image():
    at = RowContext(task="dataset", dataset="d", sample_id="x", layout=RowLayout(ColumnsConfig()))
    columns = row_format("columns")
    row = {"image": None, "question": "What color?", "answer": "red"}
    with pytest.raises(RowSkipped, match="image is None") as err:
        columns.read(row, at)
    assert err.value.reason == "missing_image"
    # An empty list is a row without images; a blank answer is no answer.
    assert columns.read({**row, "image": []}, at).images == []
    with pytest.raises(RowSkipped) as err:
        columns.read({**row, "image": [disc("red")], "answer": " "}, at)
    assert err.value.reason == "no_answer"


# ------------------------------------------------------------- held-out split


def test_the_held_out_split_is_test_else_validation_else_refused(tmp_path):
    with_validation = write_own_parquet(tmp_path / "v", {"train": 2, "validation": 2})
    assert ds.held_out_split(str(with_validation), None, train=str(with_validation)) == "validation"
    only_train = write_own_parquet(tmp_path / "t", {"train": 2})
    with pytest.raises(ValueError, match="no split 'test' or 'validation' to evaluate on; it has train. Set "
                                         "task.eval_split"):
        ds.held_out_split(str(only_train), None, train=str(only_train))
    jsonl = write_own_jsonl(tmp_path / "j")
    with pytest.raises(ValueError, match="one file, with no held-out split: set task.eval_dataset to another file "
                                         r"\(or task.eval_split to 'train' to evaluate on the training rows\)"):
        ds.held_out_split(str(jsonl), None, train=str(jsonl))
    assert ds.held_out_split(str(jsonl), None, train="other.jsonl") == "test"
    # The way out the refusal names works: the training file's rows, held out.
    layout = RowLayout(ColumnsConfig(images="img", prompt="q", answer="a", id="uid"))
    own = ds.DatasetTask.defaults("dataset", dataset=str(jsonl), eval_split="train", layout=layout)
    assert [s.sample_id for s in own.eval_samples(3)] == ["j0", "j1"]  # j2's picture is missing: skipped


# --------------------------------------------------------------------- config


@pytest.mark.parametrize(
    ("override", "message"),
    [
        (["--task.kind", "dataset"], "--task.kind: task.dataset: field required"),
        (["--task.kind", "dataset", "--task.dataset", "d", "--task.prompt_template", "{question}"],
         r"names \{question\}; it may name only \{prompt\} and \{choices\}"),
        (["--task.kind", "dataset", "--task.dataset", "d", "--task.prompt_template", "Answer: {choices}"],
         r"does not name \{prompt\}"),
        (["--task.kind", "dataset", "--task.dataset", "d", "--task.prompt_template", "{prompt"], "literal braces"),
        (["--task.kind", "dataset", "--task.dataset", "d", "--task.system_prompt", "See <image>"], "user turn"),
        (["--task.columns.prompt", "q"], "unknown key 'task.columns'.*task kind 'shapes'; set task.kind first"),
        (["--task.kind", "dataset", "--task.dataset", "d", "--task.columns.pictures", "x"],
         "Valid keys in \\[task.columns\\]: prompt, answer, images"),
    ],
)
def test_config_refuses_bad_own_data_settings(override, message):
    with pytest.raises(ConfigError, match=message):
        load_config(RunConfig, None, override)


def test_the_quick_start_config_is_short_and_loads():
    lines = EXAMPLE.read_text().splitlines()
    assert len(lines) < 15
    cfg = load_config(RunConfig, EXAMPLE)
    assert cfg.task.kind == "dataset" and cfg.task.columns.answer == "solution"


# ------------------------------------------------------ the proof: train, then eval


@pytest.mark.slow
def test_rl_on_own_data_then_saccade_eval_recounts(own, tmp_path, capsys):
    """The quick-start config on the fixture folder: a short SFT (so that some answers are
    right: 5 steps teach the tiny model a color word), 3 RL steps, then `saccade eval` on the
    checkpoint, whose figures a hand recount of its samples file must equal."""
    from saccade.cli import main
    from saccade.metrics import read_metrics
    from saccade.loops.rl import train_rl
    from saccade.run.setup import build_setup
    from saccade.loops.sft import train_sft

    overrides = [
        "--model.path", "tiny", "--task.dataset", str(own), "--log.dir", str(tmp_path / "run"),
        "--eval.prompts", "100", "--sampling.max_tokens", "4", "--loss.max_completion_tokens", "4",
        "--trainer.steps", "3", "--rollout.prompts_per_step", "3", "--rollout.group_size", "2",
        "--rollout.filter_zero_variance", "false", "--eval.every_steps", "0",
        "--sft.steps", "5", "--sft.batch_size", "6", "--sft.lr", "1e-2",
    ]
    cfg = load_config(RunConfig, EXAMPLE, overrides)
    setup = build_setup(cfg, cfg.run_dir)
    train_sft(cfg, run_dir=tmp_path / "sft", setup=setup, progress=False)
    out = train_rl(cfg, run_dir=cfg.run_dir, setup=setup, progress=False)
    assert out["step"] == 3
    assert [r["step"] for r in read_metrics(cfg.run_dir) if r["phase"] == "train"] == [1, 2, 3]
    checkpoint = cfg.run_dir / "checkpoints" / "step_000003"
    assert checkpoint.is_dir()

    # The command itself, in this process (torch is imported already): `saccade eval CONFIG ...`.
    result_path, samples_path = tmp_path / "eval.json", tmp_path / "samples.jsonl"
    assert main(["eval", str(EXAMPLE), *overrides, "--checkpoint", str(checkpoint), "--json", str(result_path),
                 "--samples", str(samples_path)]) == 0
    assert "held-out evaluation on dataset: 6 questions" in " ".join(capsys.readouterr().out.split())
    result = json.loads(result_path.read_text())
    rows = [json.loads(line) for line in samples_path.read_text().splitlines()]
    assert result["weights"] == str(checkpoint)
    assert [r["id"] for r in rows] == [f"test-q{i}" for i in range(6)]  # the test split, by default
    hand = recount(rows, ("category",))
    assert result["n"] == len(rows) == 6
    assert result["accuracy"] == pytest.approx(hand["accuracy"])
    assert result["by_category"] == hand["by_category"]
    assert {v: g["n"] for v, g in result["by_category"]["category"].items()} == {"warm": 2, "cool": 4}
    for row in rows:  # check_rows_against_score wants pass@k samples: give it the greedy one
        row["samples"], row["samples_correct"] = [row["completion"]], row["correct"]
    check_rows_against_score(rows)
    # The warm-started model answers some rows right: the count above is not a count of zeros.
    assert sum(r["correct"] for r in rows) >= 1
