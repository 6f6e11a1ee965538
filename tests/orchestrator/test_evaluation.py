"""`saccade eval`: pass@k against hand computations, and a checkpoint evaluated after loading
equals the trained model evaluated in memory."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from saccade.config import RunConfig, load_config
from saccade.orchestrator.evaluation import by_category, pass_at_k


@pytest.mark.parametrize(
    ("n", "c", "k", "expected"),
    [
        (5, 2, 1, 2 / 5),
        (5, 2, 2, 1 - 3 / 10),  # 1 - C(3,2)/C(5,2)
        (5, 0, 3, 0.0),
        (5, 5, 1, 1.0),
        (4, 1, 4, 1.0),  # every draw taken: the correct one is among them
        (8, 3, 4, 1 - 5 / 70),  # 1 - C(5,4)/C(8,4)
    ],
)
def test_pass_at_k_matches_hand_computation(n, c, k, expected):
    assert pass_at_k(n, c, k) == pytest.approx(expected)


@pytest.mark.parametrize(("n", "c", "k"), [(4, 5, 1), (4, 1, 0), (4, 1, 5), (3, -1, 1)])
def test_pass_at_k_refuses_impossible_counts(n, c, k):
    with pytest.raises(ValueError, match="pass_at_k"):
        pass_at_k(n, c, k)


def test_by_category_groups_greedy_correctness():
    rows = [
        {"correct": 1.0, "metadata": {"kind": "color"}},
        {"correct": 0.0, "metadata": {"kind": "color"}},
        {"correct": 1.0, "metadata": {"kind": "count"}},
        {"correct": 1.0, "metadata": {}},
    ]
    assert by_category(rows) == {
        "kind": {"color": {"n": 2, "accuracy": 0.5}, "count": {"n": 1, "accuracy": 1.0}}
    }


FAST = [
    "--trainer.steps", "2", "--rollout.prompts_per_step", "2", "--rollout.group_size", "4",
    "--rollout.filter_zero_variance", "false", "--trainer.lr", "5e-2",
    "--sampling.max_tokens", "3", "--loss.max_completion_tokens", "3",
    "--eval.prompts", "6", "--task.question_kinds", '["color", "count"]', "--eval.every_steps", "0",
    "--eval.samples_k", "4",
]


@pytest.mark.slow
def test_eval_of_the_saved_checkpoint_equals_the_trained_model(tmp_path):
    """Trained with a reward that moves the weights, so an eval that ignored the checkpoint
    (and scored the base model) would sample other completions and fail here."""
    from stub_tasks import scored_task

    from saccade.orchestrator.evaluation import evaluate, run_eval
    from saccade.loops.rl import train_rl
    from saccade.run.tasks import task_from_config

    cfg = load_config(RunConfig, "configs/demo.toml", [*FAST, "--log.dir", str(tmp_path / "run")])
    task = task_from_config(cfg)
    held_out = task.eval_samples(6)
    base = run_eval(cfg.model_copy(update={"log": cfg.log.model_copy(update={"dir": str(tmp_path / "none")})}))
    assert base["weights"].startswith("base model")

    # Rewards that vary within each group (a hash of the text): the weights move.
    trained = train_rl(cfg, run_dir=cfg.run_dir, task=scored_task(cfg), progress=False)["setup"]
    in_memory = evaluate(trained, task, held_out, max_tokens=cfg.sampling.max_tokens)
    greedy_texts = [g[0].text for g in trained.engine.generate(
        [rl_request(s) for s in held_out], greedy_params(cfg))]

    # A fresh setup (base weights), then the checkpoint loaded by `run_eval`.
    result = run_eval(cfg)
    assert result["weights"].endswith("step_000002")
    assert [r["completion"] for r in result["rows"]] == greedy_texts
    # The tiny random model's greedy answer is blank lines before and after two steps; the
    # pass@k samples (the same seeded stream in both evals) show whose weights were scored.
    base_samples, trained_samples = ([r["samples"] for r in e["rows"]] for e in (base, result))
    assert trained_samples != base_samples, "eval sampled the base model, not the checkpoint"
    assert result["accuracy"] == in_memory["accuracy"]
    # Hand count from the rows themselves, overall and per kind.
    rows = result["rows"]
    assert result["accuracy"] == sum(r["correct"] for r in rows) / len(rows)
    assert set(result["by_category"]["kind"]) == {"color", "count"}
    assert sum(g["n"] for g in result["by_category"]["kind"].values()) == 6
    assert set(result["pass_at_k"]) == {"1", "2", "4"}
    assert result["pass_at_k"]["1"] == pytest.approx(sum(r["samples_correct"] for r in rows) / (4 * len(rows)))


def rl_request(sample):
    from saccade.data.questions import to_messages
    from saccade.inference.engine import ChatRequest

    return ChatRequest(sample.sample_id, to_messages(sample))


def greedy_params(cfg):
    from saccade.inference.engine import SamplingParams

    return SamplingParams(temperature=0.0, max_tokens=cfg.sampling.max_tokens, n=1)


@pytest.mark.slow
def test_eval_command_prints_a_table_and_writes_json_and_samples(tmp_path):
    out, samples = tmp_path / "eval.json", tmp_path / "samples.jsonl"
    proc = subprocess.run(
        [sys.executable, "-m", "saccade.cli", "eval", "configs/demo.toml", "--log.dir", str(tmp_path / "none"),
         "--eval.prompts", "3", "--sampling.max_tokens", "3", "--json", str(out), "--samples", str(samples)],
        capture_output=True, text=True, timeout=300,
    )
    assert proc.returncode == 0, proc.stderr
    assert "greedy accuracy" in proc.stdout and "base model" in proc.stdout and "visual gain" in proc.stdout
    result = json.loads(out.read_text())
    assert result["n"] == 3 and "rows" not in result
    lines = samples.read_text().splitlines()
    rows = [json.loads(line) for line in lines]
    assert len(rows) == 3 and {"id", "answer", "completion", "correct", "completion_blank", "correct_blank"} <= set(rows[0])
    # eval.visual_gain (on by default): recounted from the rows.
    assert result["accuracy_blank"] == sum(r["correct_blank"] for r in rows) / 3
    assert result["visual_gain"] == result["accuracy"] - result["accuracy_blank"]


def test_eval_refuses_a_checkpoint_path_that_is_not_a_folder(tmp_path):
    from saccade.orchestrator.evaluation import load_weights

    cfg = load_config(RunConfig, None, ["--log.dir", str(tmp_path)])
    with pytest.raises(ValueError, match="not a folder"):
        load_weights(setup=None, cfg=cfg, checkpoint=str(tmp_path / "missing"))


# ------------------------------------------------------------------------ data sets

@pytest.mark.slow
def test_saccade_eval_on_mathvista_matches_a_hand_count(mathvista_run, dataset_fixtures, tmp_path):
    overrides, checkpoint = mathvista_run
    out, samples = tmp_path / "eval.json", tmp_path / "samples.jsonl"
    proc = subprocess.run(
        [sys.executable, "-m", "saccade.cli", "eval", "configs/demo.toml", *overrides,
         "--json", str(out), "--samples", str(samples)],
        capture_output=True, text=True, timeout=600,
    )
    assert proc.returncode == 0, proc.stderr
    assert "held-out evaluation on mathvista: 6 questions" in proc.stdout and "skills=algebraic reasoning" in proc.stdout
    result = json.loads(out.read_text())
    rows = [json.loads(line) for line in samples.read_text().splitlines()]
    assert result["weights"] == str(checkpoint) and result["task"] == "mathvista"
    assert [r["id"] for r in rows] == [f"mathvista-{i}" for i in range(1, 7)]
    assert {"id", "question", "answer", "completion", "extracted", "correct", "metadata"} <= set(rows[0])
    dataset_fixtures.check_eval_outputs(result, rows, ("task", "skills", "grade"), n=6, k=3)
    # The fine-tuned model gets some rows right: the count above is not a count of zeros.
    assert sum(r["correct"] for r in rows) >= 2
    # A row in two skills counts in both.
    assert sum(g["n"] for g in result["by_category"]["skills"].values()) == sum(
        len(r["metadata"]["skills"]) for r in rows) > len(rows)


@pytest.mark.slow
@pytest.mark.parametrize("task", ["openmmreasoner", "geometry3k"])
def test_run_eval_on_the_other_data_sets(task, dataset_fixtures, tmp_path):
    from saccade.orchestrator.evaluation import CATEGORY_FIELDS, run_eval

    paths = dataset_fixtures.write_all(tmp_path / "data")
    extra = ["--task.eval_subsets", '["mmk12", "virl39k"]', "--task.eval_split", "train"] if task == "openmmreasoner" else []
    cfg = load_config(RunConfig, "configs/demo.toml", [
        "--task.kind", task, "--task.dataset", str(paths[task]), "--eval.prompts", "5", "--eval.samples_k", "2",
        "--sampling.max_tokens", "6", "--log.dir", str(tmp_path / "run"), *extra])
    result = run_eval(cfg)
    rows = result["rows"]
    # Geometry3K's test split holds 3 rows: eval_size caps, it does not pad.
    dataset_fixtures.check_eval_outputs(result, rows, CATEGORY_FIELDS[task], n=5 if task == "openmmreasoner" else 3, k=2)
    if task == "openmmreasoner":
        # 3 rows of mmk12, then 2 of virl39k: the subset breakdown counts them so.
        assert {v: g["n"] for v, g in result["by_category"]["subset"].items()} == {"mmk12": 3, "virl39k": 2}
    else:
        assert result["by_category"] == {}


def test_by_category_counts_a_list_value_in_each_entry():
    rows = [
        {"correct": 1.0, "metadata": {"skills": ["a", "b"], "grade": "x"}},
        {"correct": 0.0, "metadata": {"skills": ["b"], "grade": "x"}},
        {"correct": 1.0, "metadata": {"grade": None}},
    ]
    assert by_category(rows, ("skills", "grade")) == {
        "skills": {"a": {"n": 1, "accuracy": 1.0}, "b": {"n": 2, "accuracy": 0.5}},
        "grade": {"x": {"n": 2, "accuracy": 0.5}},
    }


# ------------------------------------------------------------------------ episodes

# The views task (2 turns an episode) from a short warm start (random valid looks, then a random
# answer: episodes that look and answer), then two GRPO steps with a checkpoint after each.
VIEWS_FAST = [
    "--sft.steps", "30", "--sft.batch_size", "16", "--sft.lr", "3e-3",
    "--trainer.steps", "2", "--rollout.prompts_per_step", "2", "--rollout.group_size", "4",
    "--rollout.filter_zero_variance", "false", "--trainer.lr", "3e-3", "--loss.kl_coef", "0",
    "--eval.prompts", "6", "--eval.every_steps", "1", "--checkpoint.every_steps", "1",
    "--checkpoint.keep_last", "2",
]


@pytest.mark.slow
def test_saccade_eval_of_step_k_equals_the_loops_eval_at_step_k_on_episodes(tmp_path):
    """One evaluation core: `saccade eval CHECKPOINT` of a views run's checkpoint at step k prints
    and writes the figures the loop logged at step k (greedy success, turns, what the
    environment reported, the blank-image pass), episode by episode. The negative control:
    the two steps' episodes differ, so each eval scored its own step's weights."""
    import torch

    from saccade.tools.demo_views import load_views_config, warm_start
    from saccade.orchestrator.evaluation import run_eval
    from saccade.metrics import RESERVED_KEYS, read_metrics
    from saccade.loops.rl import train_rl
    from saccade.run.setup import build_setup
    from saccade.run.tasks import task_from_config

    cfg = load_views_config([*VIEWS_FAST, "--log.dir", str(tmp_path / "run")])
    setup, task = build_setup(cfg, cfg.run_dir), task_from_config(cfg)
    warm_start(cfg, setup, task, run_dir=tmp_path / "warm-start", progress=False)
    train_rl(cfg, run_dir=cfg.run_dir, setup=setup, task=task, progress=False)
    logged = {r["step"]: r for r in read_metrics(cfg.run_dir, phase="eval")}
    assert sorted(logged) == [1, 2]

    replies = {}
    for step in (1, 2):
        checkpoint = cfg.run_dir / "checkpoints" / f"step_{step:06d}"
        if step == 1:  # in this process, on a fresh setup (the base weights, then the checkpoint's)
            result = run_eval(load_views_config([*VIEWS_FAST, "--log.dir", str(tmp_path / "run")]),
                              checkpoint=str(checkpoint))
            rows = result.pop("rows")
        else:  # the command, given the checkpoint alone: its run's config.toml comes with it
            out, samples = tmp_path / "eval.json", tmp_path / "samples.jsonl"
            proc = subprocess.run(
                [sys.executable, "-m", "saccade.cli", "eval", str(checkpoint), "--json", str(out),
                 "--samples", str(samples)],
                capture_output=True, text=True, timeout=600,
                env={**os.environ, "OMP_NUM_THREADS": str(torch.get_num_threads())},  # the loop's float order
            )
            assert proc.returncode == 0, proc.stderr
            assert "held-out evaluation on views: 6 episodes" in proc.stdout, proc.stdout
            assert f"weights: {checkpoint}" in proc.stdout
            result = json.loads(out.read_text())
            rows = [json.loads(line) for line in samples.read_text().splitlines()]
        assert result["weights"] == str(checkpoint)
        figures = {k: v for k, v in logged[step].items() if k not in (*RESERVED_KEYS, "n")}
        assert {"accuracy", "turns", "env_seen", "env_answered", "accuracy_blank", "visual_gain"} <= set(figures)
        assert {k: result[k] for k in figures} == figures, step
        assert len(rows) == result["n"] == 6
        # Recounted from the rows: each episode's replies, turns and last report.
        assert result["accuracy"] == sum(r["correct"] for r in rows) / 6
        assert result["turns"] == sum(r["turns"] for r in rows) / 6 == sum(len(r["replies"]) for r in rows) / 6
        assert result["env_seen"] == sum(r["info"]["seen"] for r in rows) / 6
        assert set(result["by_category"]["place"]) <= {"left", "right"}
        replies[step] = [r["replies"] for r in rows]
    assert replies[1] != replies[2], "both evals scored the same weights"


def test_eval_target_reads_a_checkpoint_with_its_runs_config(tmp_path):
    from saccade.orchestrator.evaluation import EvalTarget, eval_target

    run = tmp_path / "run"
    step = run / "checkpoints" / "step_000003"
    step.mkdir(parents=True)
    (step / "COMPLETE").write_text("{}")
    assert eval_target("configs/demo.toml", "x") == EvalTarget("configs/demo.toml", [], "x")
    with pytest.raises(ValueError, match="no config.toml of the run"):
        eval_target(str(step))
    (run / "config.toml").write_text("")
    expected = EvalTarget(str(run / "config.toml"), ["--log.dir", str(run)], str(step))
    assert eval_target(str(step)) == expected
    assert eval_target(str(run)) == expected  # a run folder: its latest complete checkpoint
    with pytest.raises(ValueError, match="--checkpoint"):
        eval_target(str(step), str(step))
    with pytest.raises(ValueError, match="neither a config file"):
        eval_target(str(tmp_path))


# ------------------------------------------------------------------------ visual reliance

@pytest.mark.slow
def test_visual_gain_shows_a_model_that_reads_the_image_and_none_without_images(tmp_path):
    """SFT on the shapes' true colors teaches the tiny model to read the color off the image:
    blanking its images must cost it most of its accuracy (measured: 0.96 with them, 0.33
    blank, visual_gain 0.63 after 30 steps). `accuracy_blank` is recounted by hand from the
    shapes control task's own blank questions, answered one by one. The same model on that
    blank-image task has nothing to lose: its visual_gain is 0."""
    from saccade.inference.engine import ChatRequest
    from saccade.data.questions import to_messages
    from saccade.orchestrator.evaluation import evaluate
    from saccade.rewards import correct_reward
    from saccade.run.setup import build_setup
    from saccade.loops.sft import train_sft
    from saccade.run.tasks import task_from_config

    cfg = load_config(RunConfig, "configs/demo.toml", ["--sft.steps", "30", "--log.dir", str(tmp_path / "sft")])
    setup = build_setup(cfg, cfg.run_dir)
    train_sft(cfg, run_dir=cfg.run_dir, setup=setup, progress=False)
    task, blank_task = task_from_config(cfg, blank=False), task_from_config(cfg, blank=True)
    questions, blank_questions = task.eval_samples(24), blank_task.eval_samples(24)

    ev = evaluate(setup, task, questions, max_tokens=4, visual_gain=True)
    answers = setup.engine.generate([ChatRequest(s.sample_id, to_messages(s)) for s in blank_questions],
                                    greedy_params(cfg))
    right = [float(correct_reward(a.text, s)) for (a,), s in zip(answers, blank_questions, strict=True)]
    assert ev["accuracy_blank"] == sum(right) / 24
    assert ev["visual_gain"] == ev["accuracy"] - ev["accuracy_blank"]
    assert ev["accuracy"] >= 0.8 and ev["visual_gain"] >= 0.4, ev

    control = evaluate(setup, blank_task, blank_questions, max_tokens=4, visual_gain=True)
    assert control["accuracy"] == control["accuracy_blank"] == ev["accuracy_blank"] and control["visual_gain"] == 0.0
    assert abs(control["accuracy"] - 1 / 3) <= 0.15  # chance: nothing to read the color from
