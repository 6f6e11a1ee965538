"""Tests for saccade.data.dataset_cache: a local data set is cached by its resolved path and its
files' state, never by its folder's name. Two folders named ``data`` (run1/data, run2/data) each
read their own rows, in one process and in fresh ones sharing the `datasets` cache; a file
rewritten in place is read again; a hub id's call is left as `datasets` has it."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from dataset_fixtures import disc

from saccade.config import ColumnsConfig
from saccade.data import datasets as ds
from saccade.data.dataset_cache import cache_options, local_cache_dir, source_key
from saccade.data.datasets import DatasetRows
from saccade.data.row_formats import ROW_FORMATS, RowLayout

LAYOUT = RowLayout(ColumnsConfig())  # question, answer, image
# A README.md naming the config's files: the layout `datasets` cached by name and patterns alone.
README = "---\nconfigs:\n- config_name: default\n  data_files:\n  - split: train\n    path: train.*\n---\n"


def write_rows(folder: Path, answers: list[str], kind: str, *, readme: bool = True) -> Path:
    """A data set folder of one `train` file (parquet written by pyarrow, or JSONL) whose rows'
    answers are `answers`, each row showing pic.png."""
    folder.mkdir(parents=True, exist_ok=True)
    disc("red").save(folder / "pic.png")
    rows = [{"question": f"What is row {i}?", "answer": a, "image": "pic.png"} for i, a in enumerate(answers)]
    if kind == "parquet":
        pq.write_table(pa.Table.from_pylist(rows), folder / "train.parquet")
    else:
        (folder / "train.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    if readme:
        (folder / "README.md").write_text(README)
    return folder


def answers(folder: Path) -> list[str]:
    rows = DatasetRows("dataset", str(folder), subsets=None, split="train", layout=LAYOUT)
    return [rows.sample(i).answer for i in range(len(rows))]


@pytest.fixture
def hf_cache(tmp_path, monkeypatch):
    """A `datasets` cache of the test's own (what HF_DATASETS_CACHE sets in a fresh process)."""
    import datasets

    cache = tmp_path / "hf-cache"
    monkeypatch.setattr(datasets.config, "HF_DATASETS_CACHE", str(cache))
    return cache


@pytest.mark.parametrize("readme", [True, False], ids=["readme-configs", "default-layout"])
@pytest.mark.parametrize("kind", ["parquet", "jsonl"])
def test_two_folders_of_one_name_read_their_own_rows_and_an_edit_is_read_again(tmp_path, hf_cache, kind, readme):
    run1 = write_rows(tmp_path / "run1" / "data", ["one", "two"], kind, readme=readme)
    run2 = write_rows(tmp_path / "run2" / "data", ["three", "four", "five"], kind, readme=readme)
    assert answers(run1) == ["one", "two"]
    assert answers(run2) == ["three", "four", "five"]  # before: run1's rows, under run1's cache entry
    write_rows(run1, ["six", "seven", "eight", "nine"], kind, readme=readme)  # rewritten in place
    assert answers(run1) == ["six", "seven", "eight", "nine"]
    assert answers(run2) == ["three", "four", "five"]


READ_IN_A_FRESH_PROCESS = """
import json, sys
from saccade.config import ColumnsConfig
from saccade.data.datasets import DatasetRows
from saccade.data.row_formats import RowLayout
for folder in sys.argv[1:]:
    rows = DatasetRows("dataset", folder, subsets=None, split="train", layout=RowLayout(ColumnsConfig()))
    print(json.dumps([rows.sample(i).answer for i in range(len(rows))]))
"""


def answers_in_a_fresh_process(folders: list[Path], cache: Path) -> list[list[str]]:
    """Each folder's answers, read one after the other by one new Python with `cache` as its
    HF_DATASETS_CACHE."""
    env = {**os.environ, "HF_DATASETS_CACHE": str(cache), "HF_HUB_OFFLINE": "1"}
    done = subprocess.run([sys.executable, "-c", READ_IN_A_FRESH_PROCESS, *map(str, folders)], env=env,
                          capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    return [json.loads(line) for line in done.stdout.strip().splitlines()[-len(folders):]]


def test_fresh_processes_sharing_the_cache_read_each_folders_own_rows(tmp_path):
    cache = tmp_path / "hf-cache"
    kinds = ("parquet", "jsonl")
    run1 = [write_rows(tmp_path / kind / "run1" / "data", ["one", "two"], kind) for kind in kinds]
    run2 = [write_rows(tmp_path / kind / "run2" / "data", ["three", "four", "five"], kind) for kind in kinds]
    assert answers_in_a_fresh_process(run1, cache) == [["one", "two"]] * 2
    for folder, kind in zip(run1, kinds, strict=True):
        write_rows(folder, ["six"], kind)  # rewritten in place after the first process cached it
    assert answers_in_a_fresh_process(run2 + run1, cache) == [["three", "four", "five"]] * 2 + [["six"]] * 2
    assert sorted(p.name.split("-")[0] for p in (cache / "saccade-local").iterdir()) == ["data"] * 6


def test_the_key_follows_the_resolved_path_and_each_files_state(tmp_path):
    run1 = write_rows(tmp_path / "run1" / "data", ["one"], "jsonl")
    run2 = write_rows(tmp_path / "run2" / "data", ["one"], "jsonl")  # the same bytes elsewhere
    key = source_key(str(run1))
    assert source_key(str(run1)) == key  # the same files in the same state: the cache is reused
    assert source_key(str(run2)) != key
    (tmp_path / "link").symlink_to(run1)
    assert source_key(str(tmp_path / "link")) == key  # one folder by two names: one entry
    assert source_key(str(tmp_path / "run1" / "." / "data")) == key

    stat = (run1 / "train.jsonl").stat()
    os.utime(run1 / "train.jsonl", ns=(stat.st_atime_ns, stat.st_mtime_ns + 1))  # same size, touched
    assert source_key(str(run1)) != key
    touched = source_key(str(run1))
    (run1 / "README.md").write_text(README.replace("train.*", "train.jsonl"))
    assert source_key(str(run1)) != touched  # the configs are part of the data set
    configs = source_key(str(run1))
    (run1 / ".notes").write_text("not data")  # hidden, as `datasets` skips it
    assert source_key(str(run1)) == configs
    (run1 / "more").mkdir()
    (run1 / "more" / "extra.jsonl").write_text("{}\n")
    assert source_key(str(run1)) != configs


def test_a_file_and_a_glob_are_keyed_by_the_files_they_name(tmp_path, hf_cache):
    folder = write_rows(tmp_path / "run1" / "data", ["one"], "jsonl", readme=False)
    file, glob = str(folder / "train.jsonl"), str(folder / "*.jsonl")
    before = source_key(file), source_key(glob)
    (folder / "train.jsonl").write_text((folder / "train.jsonl").read_text().replace("one", "a much longer answer"))
    assert source_key(file) != before[0] and source_key(glob) != before[1]
    rows = DatasetRows("dataset", glob, subsets=None, split="train", layout=LAYOUT)
    assert rows.sample(0).answer == "a much longer answer"
    assert local_cache_dir(file, hf_cache).parent == hf_cache / "saccade-local"


def test_a_hub_id_keeps_the_call_datasets_has_for_it(monkeypatch):
    """A hub id (no such folder or file here) gets no cache_dir: its load, split names and
    held-out split are asked exactly as before, and `datasets` keys it by repository and revision."""
    import datasets

    assert cache_options("AI4Math/MathVista") == {} and local_cache_dir("hiyouga/geometry3k", "/c") is None
    calls = []

    class Table:
        column_names = list(ROW_FORMATS["problem_answer"].columns)

        def with_format(self, kind):
            return self

    monkeypatch.setattr(datasets, "get_dataset_config_names", lambda *a, **k: calls.append(("configs", a, k))
                        or ["default"])
    monkeypatch.setattr(datasets, "get_dataset_split_names", lambda *a, **k: calls.append(("splits", a, k))
                        or ["train", "test"])
    monkeypatch.setattr(datasets, "load_dataset", lambda *a, **k: calls.append(("load", a, k)) or Table())
    ds.load_split("hiyouga/geometry3k", subset=None, split="train", task="geometry3k")
    assert ds.held_out_split("hiyouga/geometry3k", None, train="x") == "test"
    assert calls == [
        ("configs", ("hiyouga/geometry3k",), {}),
        ("splits", ("hiyouga/geometry3k",), {"config_name": None}),
        ("load", ("hiyouga/geometry3k",), {"name": None, "split": "train"}),
        ("splits", ("hiyouga/geometry3k",), {"config_name": None}),
    ]
