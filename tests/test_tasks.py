"""Tasks: the weighted reward of one answer by hand, the question environment, and every kind
of task (shapes, a data set, views) offering the same members."""

from __future__ import annotations

import pytest

from saccade.config import RunConfig, load_config
from saccade.data.shapes import ShapesTask, VQASample
from saccade.tasks import QuestionEnv, QuestionTask, reward_of, task_from_config


def _question(answer="red", choices=("red", "green", "blue")) -> VQASample:
    return VQASample(sample_id="q1", images=[], question="What color is the shape?", answer=answer,
                     choices=list(choices), answer_type="multi_choice")


@pytest.mark.parametrize(
    ("text", "weights", "total", "parts"),
    [
        ("red", {"correct": 1.0}, 1.0, {"correct": 1.0}),
        ("blue", {"correct": 1.0}, 0.0, {"correct": 0.0}),
        ("blue", {"correct": 1.0, "format": 0.25}, 0.25, {"correct": 0.0, "format": 1.0}),
        ("red", {"correct": 2.0, "format": 0.5}, 2.5, {"correct": 1.0, "format": 1.0}),
        ("purple", {"correct": 1.0, "format": 0.5}, 0.0, {"correct": 0.0, "format": 0.0}),  # not an option
        ("\\boxed{red}", {"boxed_format": 1.0}, 1.0, {"boxed_format": 1.0}),
    ],
)
def test_reward_of_weights_each_function_by_hand(text, weights, total, parts):
    assert reward_of(text, _question(), weights) == (total, parts)


def test_reward_of_refuses_an_unknown_function():
    with pytest.raises(ValueError, match="unknown reward function 'corect'.*known: correct, format"):
        reward_of("red", _question(), {"corect": 1.0})


def test_the_question_env_scores_one_answer_and_always_reports_correct():
    env = QuestionEnv({"format": 1.0})
    messages = env.reset(_question())
    assert messages[0]["role"] == "user" and "What color" in messages[0]["content"][-1]["text"]
    result = env.step({"role": "assistant", "content": "green"})
    assert result.done and result.messages == [] and result.reward == 1.0  # well formed...
    assert result.info == {"format": 1.0, "correct": 0.0}  # ...but wrong, and accuracy knows it


@pytest.mark.parametrize("task_name", ["shapes", "views"])
def test_every_task_offers_the_same_members(task_name):
    cfg = load_config(RunConfig, None, ["--data.task", task_name, "--data.num_choices", "3",
                                        "--env.colors", '["red", "green", "blue"]'])
    task = task_from_config(cfg)
    assert isinstance(task.max_turns, int) and task.max_turns >= 1
    first = task.train_sample(3, seed=7)
    assert task.train_sample(3, seed=7).sample_id == first.sample_id  # a pure function of (position, seed)
    held_out = task.eval_samples(2)
    assert [s.sample_id for s in held_out] == [s.sample_id for s in task.eval_samples(2)]
    assert first.sample_id not in {s.sample_id for s in held_out}
    env = task.make_env()
    assert env.max_turns == task.max_turns and env.reset(first)


def test_shapes_questions_come_from_the_seeded_streams():
    cfg = load_config(RunConfig, None, ["--trainer.seed", "4"])
    task = task_from_config(cfg)
    assert isinstance(task, QuestionTask) and isinstance(task.questions, ShapesTask)
    assert task.questions.eval_seed == 4 + 10_000
    assert task.eval_samples(1)[0].sample_id.endswith("-s10004-0")
    assert task.train_sample(0, seed=4).sample_id.endswith("-s4-0")
    blank = task_from_config(cfg, blank=True)
    assert blank.eval_samples(1)[0].metadata["blank"] and not task.eval_samples(1)[0].metadata["blank"]
