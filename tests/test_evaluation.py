"""`saccade eval`: pass@k against hand computations, and a checkpoint evaluated after loading
equals the trained model evaluated in memory."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from saccade.config import RunConfig, load_config
from saccade.evaluation import by_category, pass_at_k


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
    "--engine.max_tokens", "3", "--loss.max_completion_tokens", "3",
    "--data.eval_size", "6", "--data.question_kinds", '["color", "count"]', "--eval.every_steps", "0",
    "--eval.samples_k", "4",
]


@pytest.mark.slow
def test_eval_of_the_saved_checkpoint_equals_the_trained_model(tmp_path):
    import saccade.rl as rl
    from saccade.data.shapes import make_split
    from saccade.evaluation import run_eval

    cfg = load_config(RunConfig, "configs/demo.toml", [*FAST, "--log.dir", str(tmp_path / "run")])
    trained = rl.train_rl(cfg, run_dir=cfg.run_dir, progress=False)["setup"]
    held_out = make_split(rl.task_from_config(cfg), 6, seed=cfg.trainer.seed + rl.EVAL_SEED_OFFSET)
    in_memory = rl.evaluate(trained, held_out, max_tokens=cfg.engine.max_tokens)
    greedy_texts = [g[0].text for g in trained.engine.generate(
        [rl_request(s) for s in held_out], greedy_params(cfg))]

    # A fresh process-like setup (base weights), then the checkpoint loaded by `run_eval`.
    result = run_eval(cfg)
    assert result["weights"].endswith("step_000002")
    assert [r["completion"] for r in result["rows"]] == greedy_texts
    assert result["accuracy"] == in_memory["accuracy"]
    # Hand count from the rows themselves, overall and per kind.
    rows = result["rows"]
    assert result["accuracy"] == sum(r["correct"] for r in rows) / len(rows)
    assert set(result["by_category"]["kind"]) == {"color", "count"}
    assert sum(g["n"] for g in result["by_category"]["kind"].values()) == 6
    assert set(result["pass_at_k"]) == {"1", "2", "4"}
    assert result["pass_at_k"]["1"] == pytest.approx(sum(r["samples_correct"] for r in rows) / (4 * len(rows)))


def rl_request(sample):
    from saccade.data.shapes import to_messages
    from saccade.inference.engine import ChatRequest

    return ChatRequest(sample.sample_id, to_messages(sample))


def greedy_params(cfg):
    from saccade.inference.engine import SamplingParams

    return SamplingParams(temperature=0.0, max_tokens=cfg.engine.max_tokens, n=1)


@pytest.mark.slow
def test_eval_command_prints_a_table_and_writes_json_and_samples(tmp_path):
    out, samples = tmp_path / "eval.json", tmp_path / "samples.jsonl"
    proc = subprocess.run(
        [sys.executable, "-m", "saccade.cli", "eval", "configs/demo.toml", "--log.dir", str(tmp_path / "none"),
         "--data.eval_size", "3", "--engine.max_tokens", "3", "--json", str(out), "--samples", str(samples)],
        capture_output=True, text=True, timeout=300,
    )
    assert proc.returncode == 0, proc.stderr
    assert "greedy accuracy" in proc.stdout and "base model" in proc.stdout
    result = json.loads(out.read_text())
    assert result["n"] == 3 and "rows" not in result
    lines = samples.read_text().splitlines()
    assert len(lines) == 3 and {"id", "answer", "completion", "correct"} <= set(json.loads(lines[0]))


def test_eval_refuses_a_checkpoint_path_that_is_not_a_folder(tmp_path):
    from saccade.evaluation import load_weights

    cfg = load_config(RunConfig, None, ["--log.dir", str(tmp_path)])
    with pytest.raises(ValueError, match="not a folder"):
        load_weights(setup=None, cfg=cfg, checkpoint=str(tmp_path / "missing"))
