"""Tests for saccade.data.row_formats: the registry of row formats by name, the known data sets'
formats (saccade.data.known_datasets), one's own data set naming a format in `task.format`, and
a format registered here reading its rows through the whole path (config, task, split, row)."""

from __future__ import annotations

import typing
from pathlib import Path
from typing import Any

import pytest

from saccade.config import ColumnsConfig, ConfigError, HubDatasetTaskConfig, RunConfig, load_config
from saccade.data.datasets import DatasetRows, DatasetTask
from saccade.data.known_datasets import KNOWN_DATASETS
from saccade.data.questions import VQASample
from saccade.data.row_formats import ROW_FORMATS, RowContext, RowFormat, RowLayout, parts, row_format
from saccade.data.rows import DATASET_TASKS
from saccade.run.tasks import check_user_code, task_from_config

FORMATS = Path(__file__).resolve().parents[3] / "src" / "saccade" / "data" / "row_formats"


def test_each_known_data_set_names_a_registered_format_in_one_table():
    assert {kind: known.format for kind, known in KNOWN_DATASETS.items()} == {
        "openmmreasoner": "verl", "mathvista": "mathvista", "geometry3k": "problem_answer"}
    assert all(row_format(known.format).name == known.format for known in KNOWN_DATASETS.values())
    # The table is what the config's known kinds, and the data set tasks, are.
    assert sorted(typing.get_args(HubDatasetTaskConfig.model_fields["kind"].annotation)) == sorted(KNOWN_DATASETS)
    assert DATASET_TASKS == (*KNOWN_DATASETS, "dataset")
    assert DatasetTask.defaults("mathvista").format is ROW_FORMATS["mathvista"]


def test_each_format_is_one_file_of_its_name():
    files = {p.stem for p in FORMATS.glob("*.py")} - {"__init__", "base", "parts"}
    assert files == set(ROW_FORMATS)
    assert all(type(f).__module__ == f"saccade.data.row_formats.{name}" for name, f in ROW_FORMATS.items())


def test_an_unknown_format_is_refused_naming_the_known_ones():
    known = "the known ones are verl, mathvista, problem_answer, video_r1, columns"
    with pytest.raises(ValueError, match=f"unknown row format 'csv'; {known}"):
        row_format("csv")
    # On one's own data set: by the task, before a split opens, and by --dry-run's check, naming the key.
    with pytest.raises(ValueError, match="unknown row format 'csv'"):
        DatasetTask.defaults("dataset", dataset="d", layout=RowLayout(ColumnsConfig(), format="csv"))
    cfg = load_config(RunConfig, None, ["--task.kind", "dataset", "--task.dataset", "d", "--task.format", "csv"])
    with pytest.raises(ValueError, match=f"task.format: unknown row format 'csv'; {known}"):
        check_user_code(cfg)
    sets = load_config(RunConfig, None, ["--eval.sets.mine.kind", "dataset", "--eval.sets.mine.dataset", "d",
                                         "--eval.sets.mine.format", "verl2"])
    with pytest.raises(ValueError, match="eval.sets.mine.format: unknown row format 'verl2'"):
        check_user_code(sets)


# ------------------------------------------------------------- a new format


class QuestionAnswer(RowFormat):
    """A layout of this test's own: uid, img (image paths), q, a."""

    name = "qa"
    columns = ("uid", "img", "q", "a")
    layout = "uid, img (list of image paths), q, a"

    def sample_id(self, row: dict[str, Any], at: RowContext) -> str:
        return f"qa-{row['uid']}"

    def read(self, row: dict[str, Any], at: RowContext) -> VQASample:
        answer = parts.answer(row["a"], column="a")
        return VQASample(
            sample_id=at.sample_id,
            images=at.images([parts.with_base(v, at.base) for v in row["img"]], "img"),
            question=row["q"], answer=answer, choices=None, answer_type="free_form",
            metadata={"dataset": at.dataset, "uid": row["uid"]}, prompt=[{"role": "user", "content": row["q"]}],
        )


def test_a_format_registered_here_reads_its_rows(dataset_fixtures, tmp_path, monkeypatch):
    monkeypatch.setitem(ROW_FORMATS, "qa", QuestionAnswer())
    path = str(dataset_fixtures.write_own_jsonl(tmp_path / "mine"))
    cfg = load_config(RunConfig, None, [
        "--task.kind", "dataset", "--task.dataset", path, "--task.format", "qa", "--task.eval_dataset", path,
        "--task.eval_split", "train", "--task.system_prompt", "Be brief."])
    check_user_code(cfg)
    questions = task_from_config(cfg).questions
    held_out = questions.eval_samples(10)
    # Row j2 names a picture that is not there: skipped like any broken row, under the format's id.
    assert [s.sample_id for s in held_out] == ["qa-j0", "qa-j1"]
    assert [(r["id"], r["reason"]) for r in held_out.skipped] == [("qa-j2", "missing_image")]
    first, second = held_out
    assert (first.answer, first.metadata) == ("red", {"dataset": path, "uid": "j0"})
    assert [im.getpixel((32, 32)) for im in second.images] == [(30, 170, 50), (30, 70, 225)]
    # The format does not write its prompt: the task puts its parts on the row's chat.
    assert first.prompt == [{"role": "system", "content": "Be brief."},
                            {"role": "user", "content": "What color is the disc?"}]
    # A split without the format's columns is refused when it opens, with the format's layout.
    other = dataset_fixtures.write_own_parquet(tmp_path / "other")
    with pytest.raises(ValueError, match=r"has no column uid, img, q, a; expected the layout uid, img \(list"):
        DatasetRows("dataset", str(other), subsets=None, split="train", layout=RowLayout(ColumnsConfig(), format="qa"))


# --------------------------------------------------- one's own, in a known layout


def test_own_data_in_verls_layout_reads_as_the_known_data_set_does(dataset_fixtures, tmp_path):
    folder = str(dataset_fixtures.write_openmmreasoner(tmp_path / "omr"))
    common = ["--task.dataset", folder, "--task.subsets", '["mmk12"]', "--task.eval_subsets", '["validation"]',
              "--task.eval_split", "val"]
    known = task_from_config(load_config(RunConfig, None, ["--task.kind", "openmmreasoner", *common])).questions
    own = task_from_config(load_config(RunConfig, None, ["--task.kind", "dataset", "--task.format", "verl",
                                                         *common])).questions
    assert own.format is known.format is ROW_FORMATS["verl"]
    for a, b in zip(known.eval_samples(6), own.eval_samples(6), strict=True):
        assert b.sample_id == a.sample_id.replace("openmmreasoner-", "dataset-")
        assert (b.question, b.answer, b.choices, b.answer_type, b.prompt) == (a.question, a.answer, a.choices,
                                                                                a.answer_type, a.prompt)
        assert b.metadata == {**a.metadata, "dataset": folder}  # one's own goes by its source
    # The prompts are equal with options among them: task.prompt_template unset is the format's own,
    # the row's text as it is, not format 'columns'' '{prompt}\n{choices}' (which would list them twice).
    assert any(s.choices for s in own.eval_samples(6))


def test_columns_go_with_format_columns_only(tmp_path):
    with pytest.raises(ConfigError, match="task.columns is read by format 'columns' only, and format is 'verl'"):
        load_config(RunConfig, None, ["--task.kind", "dataset", "--task.dataset", "d", "--task.format", "verl",
                                      "--task.columns.answer", "gold"])
    # A resolved config (--dry-run writes every field, task.columns included) loads back.
    from saccade.config.toml import describe

    cfg = load_config(RunConfig, None, ["--task.kind", "dataset", "--task.dataset", "d", "--task.format", "verl"])
    (tmp_path / "config.toml").write_text(describe(cfg))
    assert load_config(RunConfig, tmp_path / "config.toml").task == cfg.task



def test_video_r1_rows_of_another_kind_are_skipped_and_another_layout_stops_the_run():
    from saccade.data.row_formats.base import RowContext
    from saccade.data.rows import RowSkipped

    row = {"problem_id": 7, "problem": "Why?", "data_type": "video", "problem_type": "free-form", "options": [],
           "solution": "<answer>because</answer>", "path": "./clips/a.mp4"}
    at = RowContext(task="dataset", dataset="Video-R1", sample_id="7")
    fmt = ROW_FORMATS["video_r1"]
    with pytest.raises(RowSkipped, match="neither 'image' nor 'video'") as skipped:
        fmt.read({**row, "data_type": "audio"}, at)
    assert skipped.value.reason == "missing_image"
    with pytest.raises(ValueError, match="problem_type 'essay' is none of Video-R1's"):
        fmt.read({**row, "problem_type": "essay"}, at)
