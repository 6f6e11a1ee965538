"""The recipes, configs/recipes/*.toml: each names the published run it mirrors and what differs,
dry-runs, carries `saccade memory`'s estimate in its header, builds its prompts and scorers the
way the published run does, and (-m long) trains 3 steps on its data set's fixture rows with the
tiny preset, evaluating on the eval sets it names (the OpenMMReasoner recipe: MathVista)."""

from __future__ import annotations

import importlib.util
import json
import re
import shlex
from pathlib import Path

import pytest
from PIL import Image

import saccade
from saccade.cli import build_parser, main
from saccade.config import RunConfig, load_config, split_overrides
from saccade.tools.memory import estimate_run, header_lines

RECIPES_DIR = Path(saccade.__file__).parent / "configs" / "recipes"
ROOT = Path(__file__).resolve().parents[1]
RECIPES = sorted(RECIPES_DIR.glob("*.toml"))
FIXTURES = Path(__file__).parent / "data" / "dataset_fixtures.py"
EASYR1_SENTENCE = ("You FIRST think about the reasoning process as an internal monologue and then provide the final "
                   "answer. The reasoning process MUST BE enclosed within <think> </think> tags. The final answer "
                   "MUST BE put in \\boxed{}.")
name = lambda p: p.name  # noqa: E731


def fixtures():
    spec = importlib.util.spec_from_file_location("dataset_fixtures", FIXTURES)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.fixture(scope="module")
def paths(tmp_path_factory):
    return fixtures().write_all(tmp_path_factory.mktemp("datasets"))


def header_of(path: Path) -> str:
    return path.read_text().split("\n[", 1)[0]


def test_the_recipes_are_shipped():
    assert {p.name for p in RECIPES} >= {"geo3k-easyr1-qwen2.5vl-7b-8gpu.toml", "geo3k-easyr1-qwen3vl-2b-1gpu.toml",
                                         "geo3k-easyr1-qwen3vl-30b-a3b-8gpu.toml",
                                         "openmmreasoner-qwen2.5vl-7b-8gpu.toml", "video-r1-qwen2.5vl-7b-8gpu.toml"}


@pytest.mark.parametrize("path", RECIPES, ids=name)
def test_recipe_dry_runs_and_names_what_it_mirrors(path, capsys, tmp_path):
    cfg = load_config(RunConfig, path)
    assert main(["rl", str(path), "--dry-run"]) == 0
    resolved = tmp_path / "resolved.toml"
    resolved.write_text(capsys.readouterr().out)
    assert load_config(RunConfig, resolved) == cfg
    header = header_of(path)
    assert header.startswith("# Recipe: ") and "What differs" in header
    text = " ".join(line.removeprefix("#").strip() for line in header.splitlines())
    assert re.search(r"(hiyouga/EasyR1|EvolvingLMMs-Lab/OpenMMReasoner|tulerfeng/Video-R1) \S+\.sh", text)


@pytest.mark.parametrize("path", RECIPES, ids=name)
def test_recipe_header_memory_lines_equal_the_estimator(path):
    header = header_of(path)
    reproduce = re.search(r"#   reproduce: (saccade memory .+)", header)
    assert reproduce and f"configs/recipes/{path.name}" in reproduce.group(1)
    argv = shlex.split(reproduce.group(1))
    known, overrides = split_overrides(argv[1:])
    args = build_parser().parse_args(known)
    cfg = load_config(RunConfig, RECIPES_DIR / Path(args.config).name, overrides)
    est = estimate_run(cfg, gpu_memory_utilization=args.gpu_memory_utilization, gpu_gib=args.gpu_gib,
                       shared_gpu=args.shared_gpu, world_size=args.world_size)
    for line in header_lines(est):
        assert line in header.splitlines(), f"{path.name}: header out of date; expected line:\n{line}"
    assert est.fits


def test_geo3k_recipe_prompts_and_scores_as_easyr1(paths):
    from saccade.run.tasks import task_from_config

    path = RECIPES_DIR / "geo3k-easyr1-qwen3vl-2b-1gpu.toml"
    cfg = load_config(RunConfig, path, ["--task.dataset", str(paths["geometry3k"])])
    assert cfg.rollout.reward_weights == {"correct": 0.9, "easyr1_format": 0.1}
    sample = task_from_config(cfg).eval_samples(1)[0]
    user = sample.prompt[-1]["content"]
    assert user.endswith(f" {EASYR1_SENTENCE}") and user.startswith("<image>")  # math.jinja: trimmed, then the sentence
    assert [m["role"] for m in sample.prompt] == ["user"]
    assert sample.scorer.extractor == "easyr1" and sample.scorer.grader == "mathruler"
    reply = f"<think>x</think> \\boxed{{{sample.answer}}}"
    env = task_from_config(cfg).make_env()
    env.reset(sample)
    import asyncio

    step = asyncio.run(env.step({"role": "assistant", "content": reply}))
    assert step.reward == pytest.approx(1.0) and step.info["correct"] == 1.0
    step = asyncio.run(env.step({"role": "assistant", "content": f"The answer is {sample.answer}."}))
    assert step.reward == 0.0  # no box: mathruler grades "None"; no think: no format credit


def test_openmmreasoner_recipe_adds_its_system_prompt_and_scores_mathvista_by_letters(paths):
    from saccade.run.tasks import eval_set_tasks, task_from_config
    from saccade.rewards import correct_reward

    path = RECIPES_DIR / "openmmreasoner-qwen2.5vl-7b-8gpu.toml"
    cfg = load_config(RunConfig, path, [
        "--task.dataset", str(paths["openmmreasoner"]), "--eval.sets.mathvista.dataset", str(paths["mathvista"]),
        "--eval.sets.mathvista_official.dataset", str(paths["mathvista"])])
    system = cfg.task.system_prompt
    assert system.startswith("You are a helpful assistant.") and "<answer>...</answer>" in system
    sample = task_from_config(cfg).eval_samples(1)[0]
    # The fixture's rows carry a system turn of their own: it stays, and no second one is added.
    assert [m for m in sample.prompt if m["role"] == "system"] == [{"role": "system", "content": fixtures().SYSTEM}]
    assert sample.scorer.extractor == "answer_tag" and cfg.rollout.reward_weights == {"correct": 0.9,
                                                                                      "think_answer": 0.1}
    sets = eval_set_tasks(cfg)
    assert set(sets) == {"mathvista", "mathvista_official"}
    rows = sets["mathvista"].eval_samples(100)
    choice = next(r for r in rows if r.choices)
    assert choice.prompt[0] == {"role": "system", "content": system}
    letter = "ABCDEFGH"[choice.choices.index(choice.answer)]
    assert correct_reward(f"<think>x</think><answer>{letter}</answer>", choice) == 1.0  # its letter golds
    official = next(r for r in sets["mathvista_official"].eval_samples(100) if r.choices)
    # The official protocol: a misspelt option is the nearest one; its letter alone, by the rules, too.
    assert correct_reward(choice.answer + "x", official) == 1.0
    assert correct_reward(letter, official) == 1.0


def test_prompt_parts_on_a_rows_chat():
    from saccade.data.row_formats.parts import with_prompt_parts

    chat = [{"role": "user", "content": "  <image>Find x. "}]
    assert with_prompt_parts(chat, "{prompt} Think.", "S") == [
        {"role": "system", "content": "S"}, {"role": "user", "content": "<image>Find x. Think."}]
    assert with_prompt_parts(chat, "{prompt}", None) == chat
    own = [{"role": "system", "content": "own"}, *chat]
    assert with_prompt_parts(own, "{prompt}", "S") == own  # a row's own system turn is kept
    assert with_prompt_parts(chat, "{prompt}\n{choices}", None, ["3", "4"])[0]["content"] == "<image>Find x.\nA. 3\nB. 4"


def test_eval_sets_from_the_command_line(paths):
    cfg = load_config(RunConfig, "configs/demo.toml", [
        "--eval.sets.geo.kind", "geometry3k", "--eval.sets.geo.dataset", str(paths["geometry3k"]),
        "--eval.sets.geo.scoring.extractor", "boxed", "--eval.sets.geo.scoring.grader", "mathruler"])
    assert cfg.eval.sets["geo"].scoring.grader == "mathruler"
    with pytest.raises(Exception, match="has no kind yet"):
        load_config(RunConfig, "configs/demo.toml", ["--eval.sets.geo.dataset", "x"])
    with pytest.raises(Exception, match="eval set name"):
        RunConfig.model_validate({"eval": {"sets": {"a-b": {"kind": "mathvista"}}}})
    with pytest.raises(Exception, match="judge_url is read by extractor 'mathvista' only"):
        RunConfig.model_validate({"task": {"kind": "geometry3k", "scoring": {"judge_url": "http://x/v1"}}})


def video_r1_fixture(folder: Path) -> Path:
    """Video-R1-260k's layout in little: a JSON array of three clip rows (mp4s written by OpenCV,
    under the folder) and an image row, split by scripts/video_r1_rows.py (the last clip row held
    out); the training JSONL's path."""
    import sys

    sys.path.insert(0, str(Path(__file__).parent))
    from video_helpers import write_mp4

    folder.mkdir(parents=True, exist_ok=True)
    (folder / "clips").mkdir(exist_ok=True)
    for k in range(3):
        write_mp4(folder / "clips" / f"c{k}.mp4", frames=12, fps=4.0, seed=k)
    (folder / "images").mkdir(exist_ok=True)
    Image.new("RGB", (64, 48), (220, 30, 30)).save(folder / "images" / "x.jpg")
    rows = [
        {"problem_id": 1, "problem": "How many squares are there?", "data_type": "video",
         "problem_type": "numerical", "options": [], "process": "", "solution": "<answer> 1 </answer>",
         "path": "./clips/c1.mp4", "data_source": "fixture"},
        {"problem_id": 2, "problem": "What color?", "data_type": "image", "problem_type": "free-form",
         "options": [], "process": "", "solution": "<answer>red</answer>", "path": "./images/x.jpg",
         "data_source": "fixture"},
        {"problem_id": 3, "problem": "Does it stop?", "data_type": "video", "problem_type": "free-form",
         "options": [], "process": "", "solution": "<answer>no</answer>", "path": "./clips/c2.mp4",
         "data_source": "fixture"},
        {"problem_id": 4, "problem": "Which way does the square move? ", "data_type": "video",
         "problem_type": "multiple choice", "options": ["A. left", "B. right"], "process": "",
         "solution": "<answer>B</answer>", "path": "./clips/c0.mp4", "data_source": "fixture"},
    ]
    (folder / "Video-R1-260k.json").write_text(json.dumps(rows))
    spec = importlib.util.spec_from_file_location("video_r1_rows", ROOT / "scripts" / "video_r1_rows.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    train, held, n_train, n_held = module.convert(folder / "Video-R1-260k.json", held_out=1)
    assert (n_train, n_held) == (3, 1) and json.loads(held.read_text()) == rows[3]  # rows as published
    assert [json.loads(line) for line in train.read_text().splitlines()] == rows[:3]
    return train


def test_video_r1_recipe_reads_its_picture_and_clip_rows_and_scores_as_video_r1(tmp_path):
    """Video-R1's rows as published through the recipe's task (format video_r1): grpo.py's prompt text
    (the options on a multiple-choice row, the type's answer sentence), the clip or the picture by
    data_type, placed first in the user turn, the gold without its tags; the rewards as Video-R1's
    accuracy and format on plain cases."""
    from saccade.rewards import correct_reward
    from saccade.rewards.builtin import think_answer_reward
    from saccade.run.tasks import task_from_config

    data = video_r1_fixture(tmp_path / "Video-R1-data")
    cfg = load_config(RunConfig, RECIPES_DIR / "video-r1-qwen2.5vl-7b-8gpu.toml",
                      ["--task.dataset", str(data), "--task.eval_dataset", str(data.parent / "video-r1-eval.jsonl")])
    assert (cfg.images.video.fps, cfg.images.video.max_frames, cfg.images.video.max_pixels) == (2.0, 16, 128 * 28 * 28)
    (mc,) = task_from_config(cfg).eval_samples(5)  # the held-out row
    assert mc.answer == "B"
    (user,) = [m for m in mc.prompt if m["role"] == "user"]
    text = user["content"] if isinstance(user["content"], str) else " ".join(
        p.get("text", "") for p in user["content"] if isinstance(p, dict))
    assert "Which way does the square move? Options:\nA. left\nB. right\n" in text
    assert text.endswith("Please provide only the single option letter (e.g., A, B, C, D, etc.) within the "
                         "<answer> </answer> tags.")
    assert len(mc.videos) == 1 and not mc.images
    reply = "<think>it moves right</think><answer>B</answer>"
    assert correct_reward(reply, mc) == 1.0 and think_answer_reward(reply) == 1.0
    assert correct_reward("<think>x</think><answer>A</answer>", mc) == 0.0
    assert think_answer_reward("B") == 0.0
    task = task_from_config(cfg)
    rows = [task.questions.train_rows.sample(i) for i in range(3)]  # a clip, a picture, a clip, in order
    assert [(len(r.videos), len(r.images)) for r in rows] == [(1, 0), (0, 1), (1, 0)]
    assert [r.answer for r in rows] == ["1", "red", "no"] and rows[1].metadata["category"] == "free-form"
    assert rows[1].question.endswith(" Please provide your text answer within the <answer> </answer> tags.")


def tiny_overrides(path: Path, paths: dict, run_dir: Path) -> list[str]:
    kind = "openmmreasoner" if path.name.startswith("openmmreasoner") else "geometry3k"
    if path.name.startswith("video-r1"):
        kind = "video-r1"
        paths = {**paths, kind: video_r1_fixture(run_dir.parent / "Video-R1-data")}
    out = ["--model.path", "tiny", "--model.dtype", "float32", "--engine.kind", "embedded", "--launch.nodes", "[]",
           "--task.dataset", str(paths[kind]), "--trainer.steps", "3", "--rollout.prompts_per_step", "2",
           "--rollout.group_size", "2", "--rollout.max_async_level", "0", "--sampling.max_tokens", "4",
           "--loss.max_completion_tokens", "4", "--trainer.max_tokens", "4096", "--eval.every_steps", "3",
           "--eval.prompts", "3", "--eval.visual_gain", "false", "--checkpoint.every_steps", "3",
           "--log.dir", str(run_dir)]
    if kind == "video-r1":
        out += ["--task.eval_dataset", str(paths[kind].parent / "video-r1-eval.jsonl")]
    for set_name in load_config(RunConfig, path).eval.sets:
        out += [f"--eval.sets.{set_name}.dataset", str(paths["mathvista"])]
    return out


@pytest.mark.long
@pytest.mark.parametrize("path", RECIPES, ids=name)
def test_recipe_trains_three_steps_on_its_fixture_with_the_tiny_preset(path, paths, tmp_path):
    """3 RL steps of the tiny preset on the recipe's data set fixture; the periodic eval reports
    each eval set's accuracy (MathVista's for the OpenMMReasoner recipe); `saccade eval` of the
    checkpoint scores each set by its own protocol, with pass@k and mean@k."""
    from saccade.loops.rl import train_rl
    from saccade.metrics import read_metrics

    overrides = tiny_overrides(path, paths, tmp_path / "run")
    cfg = load_config(RunConfig, path, overrides)
    out = train_rl(cfg, run_dir=cfg.run_dir, progress=False)
    assert out["step"] == 3
    rows = read_metrics(cfg.run_dir)
    assert [r["step"] for r in rows if r["phase"] == "train"] == [1, 2, 3]
    (evaluation,) = [r for r in rows if r["phase"] == "eval"]
    for set_name in cfg.eval.sets:
        assert 0.0 <= evaluation[f"{set_name}_accuracy"] <= 1.0 and evaluation[f"{set_name}_n"] == 3
    if path.name.startswith("openmmreasoner"):
        assert "mathvista_accuracy" in evaluation

    result_path = tmp_path / "eval.json"
    checkpoint = cfg.run_dir / "checkpoints" / "step_000003"
    assert main(["eval", str(path), *overrides, "--eval.samples_k", "2", "--checkpoint", str(checkpoint),
                 "--json", str(result_path)]) == 0
    result = json.loads(result_path.read_text())
    assert set(result.get("sets", {})) == set(cfg.eval.sets)
    for figures in [result, *result.get("sets", {}).values()]:
        assert set(figures["pass_at_k"]) == {"1", "2"} and set(figures["mean_at_k"]) == {"2"}
        assert figures["mean_at_k"]["2"] == pytest.approx(figures["pass_at_k"]["1"])  # both the mean of c / n
