"""Offline stand-ins for the hub data sets: a few rows each, in the hubs' own layouts.

Each folder is what a download of the hub repository looks like: parquet files written by
`datasets` (images as Image features, stored as {bytes, path} structs, the features in the
parquet's "huggingface" metadata) and a README.md whose ``configs`` name each config's files.
The loaders read them by path through the same `datasets.load_dataset` call as a hub id.

Images are small synthetic PIL drawings, each a different color so rows can be told apart.
Also here, shared by the embedded and vLLM evaluation tests: a fine-tuned checkpoint that
knows some fixture answers, and the hand recount of an evaluation's figures from its rows.
Tests import this file by path (tests/ is not a package): see `load_fixtures_module`.
"""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest
from PIL import Image, ImageDraw

OPENMMREASONER_TRAIN = (
    "algopuzzle", "mmk12", "thinklite_vl_hard", "tqa_train", "virl39k", "wemath_pro", "wemath_standard",
)
SYSTEM = "You are a careful solver. Put the final answer in \\boxed{}."


def load_fixtures_module():
    """This module, importable from any test folder."""
    spec = importlib.util.spec_from_file_location("dataset_fixtures", Path(__file__))
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def picture(seed: int, size: tuple[int, int] = (56, 48)) -> Image.Image:
    """A small figure: a colored disc on white, distinct per seed."""
    image = Image.new("RGB", size, (255, 255, 255))
    color = ((seed * 67) % 256, (seed * 131 + 40) % 256, (seed * 29 + 90) % 256)
    ImageDraw.Draw(image).ellipse([8, 8, size[0] - 8, size[1] - 8], fill=color)
    return image


def _readme(configs: dict[str, dict[str, str]]) -> str:
    """A dataset card whose YAML header maps each config's splits to files, as on the hub."""
    lines = ["---", "configs:"]
    for name, splits in configs.items():
        lines += [f"- config_name: {name}", "  data_files:"]
        for split, path in splits.items():
            lines += [f"  - split: {split}", f"    path: {path}"]
    return "\n".join(lines + ["---", "", "Offline test fixture.", ""])


def _write(rows: dict[str, list], features, path: Path) -> None:
    import datasets

    path.parent.mkdir(parents=True, exist_ok=True)
    datasets.Dataset.from_dict(rows, features=features).to_parquet(str(path))


# ------------------------------------------------------------------- OpenMMReasoner


def openmmreasoner_rows(subset: str, n: int, *, train: bool, seed: int) -> dict[str, list]:
    """n rows alternating a multiple-choice question (letter gold, options in the text),
    a numeric one, and one with two images at two placeholders."""
    rows: dict[str, list] = {k: [] for k in ("prompt", "images", "data_source", "reward_model", "extra_info")}
    if train:
        rows["avg_reward"] = []
    for i in range(n):
        kind = i % 3
        if kind == 0:
            text = (f"<image>Which color fills the disc of figure {i}?\n"
                    "A. red\nB. green\nC. blue\nD. white")
            images, truth = [picture(seed + i)], "ABCD"[(seed + i) % 4]
        elif kind == 1:
            text = f"<image>How many discs are drawn? Add {i}."
            images, truth = [picture(seed + i)], str(1 + i)
        else:
            text = f"Compare <image> and <image>. What is the ratio of their areas in {subset}?"
            images, truth = [picture(seed + i), picture(seed + i + 50)], "\\frac{1}{2}"
        rows["prompt"].append([{"role": "system", "content": SYSTEM}, {"role": "user", "content": text}])
        rows["images"].append(images)
        rows["data_source"].append(subset)
        rows["reward_model"].append({"ground_truth": truth, "style": "rule"})
        rows["extra_info"].append({"index": i, "split": "train" if train else "val"})
        if train:
            rows["avg_reward"].append(0.25 * (i % 4))
    return rows


def openmmreasoner_features(train: bool):
    from datasets import Features, Image, List, Value

    features = {
        "prompt": List({"role": Value("string"), "content": Value("string")}),
        "images": List(Image()),
        "data_source": Value("string"),
        "reward_model": {"ground_truth": Value("string"), "style": Value("string")},
        "extra_info": {"index": Value("int64"), "split": Value("string")},
    }
    if train:
        features["avg_reward"] = Value("float64")
    return Features(features)


def write_openmmreasoner(root: Path, *, rows_per_subset: int = 3, val_rows: int = 6) -> Path:
    """Seven training configs (split ``train``) and ``validation`` (split ``val``)."""
    configs = {}
    for k, subset in enumerate(OPENMMREASONER_TRAIN):
        _write(openmmreasoner_rows(subset, rows_per_subset, train=True, seed=10 * k),
               openmmreasoner_features(True), root / subset / "train-00000-of-00001.parquet")
        configs[subset] = {"train": f"{subset}/train-*"}
    _write(openmmreasoner_rows("validation", val_rows, train=False, seed=500),
           openmmreasoner_features(False), root / "validation" / "val-00000-of-00001.parquet")
    configs["validation"] = {"val": "validation/val-*"}
    (root / "README.md").write_text(_readme(configs))
    return root


# ------------------------------------------------------------------------- MathVista

# (question, choices, answer, question_type, answer_type, precision, task, skills, grade)
MATHVISTA_ROWS = [
    ("What is the measure of angle A?", ["145°", "135°", "90°", "45°"], "135°", "multi_choice", "text", None,
     "geometry problem solving", ["geometry reasoning", "algebraic reasoning"], "high school"),
    ("Is the disc larger than half the image?", ["Yes", "No"], "Yes", "multi_choice", "text", None,
     "figure question answering", ["numeric commonsense"], "elementary school"),
    ("How many discs are there?", None, "1", "free_form", "integer", None,
     "visual question answering", ["arithmetic reasoning"], "elementary school"),
    ("What is the ratio of the two sides?", None, "1.5", "free_form", "float", 1.0,
     "math word problem", ["arithmetic reasoning", "algebraic reasoning"], "high school"),
    ("What is the slope of the line?", None, "0.33", "free_form", "float", 2.0,
     "geometry problem solving", ["algebraic reasoning"], "college"),
    ("List the two values shown.", None, "[2, 5]", "free_form", "list", None,
     "figure question answering", ["statistical reasoning"], "high school"),
]


def mathvista_query(question: str, choices: list[str] | None, answer_type: str, precision: float | None) -> str:
    """The ready prompt, worded like MathVista's ``query`` column."""
    if choices:
        hint = "Please answer the question and provide the correct option letter, e.g., A, B, C, D, at the end."
        options = "\n".join(f"({chr(65 + i)}) {c}" for i, c in enumerate(choices))
        return f"Hint: {hint}\nQuestion: {question}\nChoices:\n{options}"
    if answer_type == "integer":
        hint = "Please answer the question requiring an integer answer and provide the final value, e.g., 1, 2, 3, at the end."
    elif answer_type == "float":
        hint = (f"Please answer the question requiring a floating-point number with {int(precision)} decimal "
                "place and provide the final value, e.g., 1.2, 1.3, 1.4, at the end.")
    else:
        hint = "Please answer the question requiring a Python list as an answer and provide the final list, e.g., [1, 2, 3], at the end."
    return f"Hint: {hint}\nQuestion: {question}"


def write_mathvista(root: Path) -> Path:
    """The ``testmini`` split of the default config."""
    from datasets import Features, Image, List, Value

    features = Features({
        "pid": Value("string"), "question": Value("string"), "image": Value("string"),
        "decoded_image": Image(), "choices": List(Value("string")), "unit": Value("string"),
        "precision": Value("float64"), "answer": Value("string"), "question_type": Value("string"),
        "answer_type": Value("string"),
        "metadata": {
            "category": Value("string"), "context": Value("string"), "grade": Value("string"),
            "img_height": Value("int64"), "img_width": Value("int64"), "language": Value("string"),
            "skills": List(Value("string")), "source": Value("string"), "split": Value("string"),
            "task": Value("string"),
        },
        "query": Value("string"),
    })
    rows: dict[str, list] = {name: [] for name in features}
    for i, (question, choices, answer, qtype, atype, precision, task, skills, grade) in enumerate(MATHVISTA_ROWS):
        pid = str(i + 1)
        rows["pid"].append(pid)
        rows["question"].append(question)
        rows["image"].append(f"images/{pid}.jpg")
        rows["decoded_image"].append(picture(100 + i))
        rows["choices"].append(choices)
        rows["unit"].append(None)
        rows["precision"].append(precision)
        rows["answer"].append(answer)
        rows["question_type"].append(qtype)
        rows["answer_type"].append(atype)
        rows["metadata"].append({
            "category": "math-targeted-vqa", "context": "synthetic scene", "grade": grade, "img_height": 48,
            "img_width": 56, "language": "english", "skills": skills, "source": "fixture", "split": "testmini",
            "task": task,
        })
        rows["query"].append(mathvista_query(question, choices, atype, precision))
    _write(rows, features, root / "data" / "testmini-00000-of-00001.parquet")
    (root / "README.md").write_text(_readme({"default": {"testmini": "data/testmini-*"}}))
    return root


# ------------------------------------------------------------------------ Geometry3K

GEOMETRY3K_ANSWERS = ["3\\sqrt{3}", "12", "60", "\\frac{7}{2}", "8.5", "24"]


def write_geometry3k(root: Path, sizes: dict[str, int] | None = None) -> Path:
    """``train`` / ``validation`` / ``test`` splits of the default config."""
    from datasets import Features, Image, List, Value

    sizes = sizes or {"train": 4, "validation": 2, "test": 3}
    features = Features({"images": List(Image()), "problem": Value("string"), "answer": Value("string")})
    configs = {}
    for s, (split, n) in enumerate(sizes.items()):
        rows = {
            "images": [[picture(200 + 10 * s + i)] for i in range(n)],
            "problem": [f"<image>Find x in figure {split}-{i}." for i in range(n)],
            "answer": [GEOMETRY3K_ANSWERS[(s + i) % len(GEOMETRY3K_ANSWERS)] for i in range(n)],
        }
        _write(rows, features, root / "data" / f"{split}-00000-of-00001.parquet")
        configs.setdefault("default", {})[split] = f"data/{split}-*"
    (root / "README.md").write_text(_readme(configs))
    return root


def write_all(root: Path) -> dict[str, Path]:
    """All three data sets under ``root``; returns {task: folder}."""
    return {
        "openmmreasoner": write_openmmreasoner(root / "openmmreasoner"),
        "mathvista": write_mathvista(root / "mathvista"),
        "geometry3k": write_geometry3k(root / "geometry3k"),
    }


# ------------------------------------------------------------- a model that knows them


def fine_tune_and_checkpoint(cfg) -> Path:
    """SFT the configured model on cfg's training split and save it as the run's checkpoint, so
    `saccade eval` loads it. A tiny random model then memorises most of a few fixture rows:
    evaluations on them hold right and wrong answers, not only wrong ones."""
    from saccade.loops.sft import train_sft
    from saccade.trainer.checkpoint.saving import TrainState, save_checkpoint

    setup = train_sft(cfg, run_dir=cfg.run_dir, progress=False)["setup"]
    return save_checkpoint(
        cfg.run_dir, model=setup.model, optimizer=None, scheduler=None,
        state=TrainState(step=cfg.sft.steps, data_position=0, policy_version=0), keep_last=1,
        base_model_path=setup.model_path,
    )


# ------------------------------------------------------ checking an evaluation by hand


def mathvista_overrides(dataset: Path, run_dir: Path) -> list[str]:
    """Evaluate on the MathVista fixture's 6 rows; SFT trains on the same split (the point
    is a model that answers some rows right, not generalisation)."""
    return [
        "--task.kind", "mathvista", "--task.dataset", str(dataset), "--task.split", "testmini",
        "--eval.prompts", "1000", "--eval.samples_k", "3", "--sampling.max_tokens", "8",
        "--sft.steps", "30", "--sft.batch_size", "6", "--sft.lr", "1e-2", "--log.dir", str(run_dir),
    ]


def recount(rows: list[dict], fields: tuple[str, ...]) -> dict:
    """Accuracy and per-category counts recomputed from samples-file rows, by hand."""
    counts: dict[str, dict[str, list[int]]] = {}
    for row in rows:
        for name in fields:
            value = row["metadata"].get(name)
            if value is None:  # not in this category at all
                continue
            for v in value if isinstance(value, list) else [value]:
                tally = counts.setdefault(name, {}).setdefault(str(v), [0, 0])
                tally[0] += 1
                tally[1] += int(row["correct"])
    return {
        "accuracy": sum(r["correct"] for r in rows) / len(rows),
        "by_category": {name: {v: {"n": n, "accuracy": right / n} for v, (n, right) in groups.items()}
                        for name, groups in counts.items()},
    }


def check_rows_against_score(rows: list[dict]) -> None:
    """Every row's verdict is what `score` says of its completion, called directly."""
    from saccade.rewards import extract_answer, score

    for row in rows:
        assert row["extracted"] == extract_answer(row["completion"])
        verdict = score(row["completion"], row["answer"], choices=row["choices"], answer_type=row["answer_type"],
                        precision=row["precision"])
        assert verdict == row["correct"], row
        assert row["samples_correct"] == sum(
            score(t, row["answer"], choices=row["choices"], answer_type=row["answer_type"], precision=row["precision"])
            for t in row["samples"])


def check_eval_outputs(result: dict, rows: list[dict], fields: tuple[str, ...], n: int, k: int) -> None:
    """`saccade eval`'s figures (n questions, k samples each) equal a recount from its rows."""
    hand = recount(rows, fields)
    assert result["n"] == len(rows) == n
    assert result["accuracy"] == pytest.approx(hand["accuracy"])
    assert {f: set(g) for f, g in result["by_category"].items()} == {f: set(g) for f, g in hand["by_category"].items()}
    for name, groups in hand["by_category"].items():
        for value, g in groups.items():
            assert result["by_category"][name][value]["n"] == g["n"]
            assert result["by_category"][name][value]["accuracy"] == pytest.approx(g["accuracy"])
    assert result["pass_at_k"]["1"] == pytest.approx(sum(r["samples_correct"] for r in rows) / (k * len(rows)))
    assert result["pass_at_k"][str(k)] == pytest.approx(sum(r["samples_correct"] > 0 for r in rows) / len(rows))
    check_rows_against_score(rows)


# --------------------------------------------------------------------- broken rows

# One row of each kind saccade.data.rows skips, as `write_broken_geometry3k` writes them. The
# runs that read them set images.max_source_pixels = 4096 (the big picture is 80x80, the others
# 56x48) and trainer.max_tokens = 256 (the long problem is far over it, the others far under).
BROKEN_KINDS = ("missing_image", "bad_image", "image_count", "no_answer", "too_long", "too_many_pixels",
                "image_outside_dataset")
BROKEN_LIMITS = ["--images.max_source_pixels", "4096", "--trainer.max_tokens", "256"]


def broken_row(kind: str, i: int) -> tuple[list, str, str | None]:
    """(images, problem, answer) of a Geometry3K row broken in the way `kind` names."""
    good = ([picture(300 + i)], f"<image>Find x in figure {i}.", "12")
    if kind == "good":
        return good
    if kind == "missing_image":
        return [None], good[1], good[2]
    if kind == "bad_image":
        return [{"bytes": b"not a picture at all", "path": None}], good[1], good[2]
    if kind == "image_count":
        return good[0], f"Compare <image> with <image> in figure {i}.", good[2]
    if kind == "no_answer":
        return good[0], good[1], None
    if kind == "too_long":
        return good[0], good[1] + " Read this with care." * 200, good[2]
    if kind == "too_many_pixels":
        return [picture(300 + i, size=(80, 80))], good[1], good[2]
    if kind == "image_outside_dataset":  # a file of the trainer's machine, named by the row
        return [{"bytes": None, "path": "/etc/passwd"}], good[1], good[2]
    raise ValueError(f"unknown kind {kind!r}")


def write_broken_geometry3k(root: Path, kinds: list[str], splits: tuple[str, ...] = ("train", "test")) -> Path:
    """A Geometry3K folder in the hub's layout whose rows i are of `kinds[i]` ("good" or one of
    BROKEN_KINDS), the same rows in each split."""
    from datasets import Features, Image, List, Value

    features = Features({"images": List(Image()), "problem": Value("string"), "answer": Value("string")})
    rows = [broken_row(kind, i) for i, kind in enumerate(kinds)]
    for split in splits:
        _write({"images": [r[0] for r in rows], "problem": [r[1] for r in rows], "answer": [r[2] for r in rows]},
               features, root / "data" / f"{split}-00000-of-00001.parquet")
    (root / "README.md").write_text(_readme({"default": {split: f"data/{split}-*" for split in splits}}))
    return root


# ------------------------------------------------------------------- one's own data

# Pure colors: a random frozen vision tower keeps them apart (docs/demo.md), so a short SFT
# makes the tiny model answer some rows right.
DISC_COLORS = {"red": (220, 30, 30), "green": (30, 170, 50), "blue": (30, 70, 225)}
OWN_COLUMNS = ["--task.columns.images", "image", "--task.columns.prompt", "question", "--task.columns.answer",
               "solution", "--task.columns.choices", "options", "--task.columns.id", "pid",
               "--task.columns.category", "subject"]


def disc(color: str, size: tuple[int, int] = (64, 64)) -> Image.Image:
    """A disc of one of DISC_COLORS on white."""
    image = Image.new("RGB", size, (255, 255, 255))
    ImageDraw.Draw(image).ellipse([6, 6, size[0] - 6, size[1] - 6], fill=DISC_COLORS[color])
    return image


def own_rows(split: str, n: int) -> dict[str, list]:
    """n color questions in columns named unlike saccade's: pid, image, question, options,
    solution (the option's text; every fourth row its letter instead), subject."""
    names = list(DISC_COLORS)
    rows: dict[str, list] = {k: [] for k in ("pid", "image", "question", "options", "solution", "subject")}
    for i in range(n):
        color = names[i % len(names)]
        rows["pid"].append(f"{split}-q{i}")
        rows["image"].append(disc(color))
        rows["question"].append("What color is the disc?")
        rows["options"].append(names)
        rows["solution"].append("ABC"[names.index(color)] if i % 4 == 3 else color)
        rows["subject"].append("warm" if color == "red" else "cool")
    return rows


def write_own_parquet(root: Path, sizes: dict[str, int] | None = None) -> Path:
    """A folder in the hub's layout (README.md configs, data/<split>-*.parquet) of `own_rows`."""
    from datasets import Features, Image, List, Value

    sizes = sizes or {"train": 6, "test": 6}
    features = Features({"pid": Value("string"), "image": Image(), "question": Value("string"),
                         "options": List(Value("string")), "solution": Value("string"), "subject": Value("string")})
    for split, n in sizes.items():
        _write(own_rows(split, n), features, root / "data" / f"{split}-00000-of-00001.parquet")
    (root / "README.md").write_text(_readme({"default": {split: f"data/{split}-*" for split in sizes}}))
    return root


# (question, number of images): the last row's placeholders and images differ in number.
MULTI_IMAGE_ROWS = [
    ("Which is redder, <image> or <image>?", 2),
    ("Look at these.", 2),  # no placeholder: the images go first
    ("Compare <image> with <image>.", 1),
]


def write_multi_image_parquet(path: Path) -> Path:
    """One parquet file whose ``pictures`` column holds a list of images per row."""
    from datasets import Features, Image, List, Value

    features = Features({"pictures": List(Image()), "question": Value("string"), "answer": Value("string")})
    colors = list(DISC_COLORS)
    rows = {
        "pictures": [[disc(colors[(i + k) % 3]) for k in range(n)] for i, (_, n) in enumerate(MULTI_IMAGE_ROWS)],
        "question": [q for q, _ in MULTI_IMAGE_ROWS],
        "answer": ["red", "green", "blue"],
    }
    _write(rows, features, path)
    return path


def write_own_jsonl(root: Path) -> Path:
    """data.jsonl with image paths relative to its folder (pics/*.png), one row a list of two
    paths, one a path to no file; returns the file."""
    import json

    (root / "pics").mkdir(parents=True, exist_ok=True)
    for color in DISC_COLORS:
        disc(color).save(root / "pics" / f"{color}.png")
    rows = [
        {"uid": "j0", "img": ["pics/red.png"], "q": "What color is the disc?", "a": "red"},
        {"uid": "j1", "img": ["pics/green.png", "pics/blue.png"], "q": "<image> then <image>: which is first?",
         "a": "green"},
        {"uid": "j2", "img": ["pics/purple.png"], "q": "What color is the disc?", "a": "purple"},
    ]
    path = root / "data.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path
