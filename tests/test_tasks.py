"""Tasks: the question environment, a user's own task by import path, names refused when the
config loads, and every kind of task (shapes, a data set, views) offering the same members."""

from __future__ import annotations

import asyncio

import pytest

from saccade.config import ConfigError, RunConfig, load_config
from saccade.data.shapes import ShapesTask, VQASample
from saccade.scoring import Rewards
from saccade.tasks import QuestionEnv, QuestionTask, task_from_config


def _question(answer="red", choices=("red", "green", "blue")) -> VQASample:
    return VQASample(sample_id="q1", images=[], question="What color is the shape?", answer=answer,
                     choices=list(choices), answer_type="multi_choice")


def test_the_question_env_scores_one_answer_and_always_reports_correct():
    env = QuestionEnv(Rewards({"format": 1.0}))
    messages = env.reset(_question())
    assert messages[0]["role"] == "user" and "What color" in messages[0]["content"][-1]["text"]
    result = asyncio.run(env.step({"role": "assistant", "content": "green"}))
    assert result.done and result.messages == [] and result.reward == 1.0  # well formed...
    assert result.info["correct"] == 0.0  # ...but wrong, and accuracy knows it
    assert result.info["rewards"] == {"reward_format": 1.0, "reward_errors": 0.0, "reward_timeouts": 0.0}


MAKE_TASK = """
from saccade.data.shapes import ShapesTask
from saccade.tasks import QuestionTask, rewards_from_config


def make_task(cfg):
    size = cfg.data.task_args.get("image_size", 64)
    shapes = ShapesTask(kinds=("shape",), num_choices=3, image_size=size, eval_seed=99)
    return QuestionTask(shapes, rewards_from_config(cfg))


def not_a_task(cfg):
    return "shapes"
"""


def test_a_user_task_by_import_path(tmp_path, monkeypatch):
    (tmp_path / "my_tasks.py").write_text(MAKE_TASK)
    monkeypatch.syspath_prepend(str(tmp_path))
    cfg = load_config(RunConfig, None, ["--data.task", "my_tasks:make_task", "--data.task_args", '{"image_size": 32}',
                                        "--rollout.reward_weights", '{"format": 1}'])
    task = task_from_config(cfg)
    assert isinstance(task, QuestionTask) and task.questions.kinds == ("shape",)
    sample = task.train_sample(0, seed=1)
    assert sample.images[0].size == (32, 32)  # task_args reached make_task through cfg
    env = task.make_env()
    env.reset(sample)
    assert asyncio.run(env.step({"role": "assistant", "content": sample.answer})).info["rewards"]["reward_format"] == 1

    with pytest.raises(ConfigError, match="--data.task: 'my_tasks:make_taks': 'my_tasks' has no attribute "
                                          "'make_taks'; it has .*make_task"):
        load_config(RunConfig, None, ["--data.task", "my_tasks:make_taks"])
    bad = load_config(RunConfig, None, ["--data.task", "my_tasks:not_a_task"])
    with pytest.raises(ValueError, match="returned a str, which lacks max_turns, .*must return a Task"):
        task_from_config(bad)


@pytest.mark.parametrize(("task", "message"), [
    ("shape", "unknown task 'shape'; did you mean 'shapes'\\? built-in: shapes, views, .*dataset"),
    ("verifiers:no-such-env", "verifiers environment 'no-such-env': no module 'no_such_env' on sys.path"),
    ("no_such_module:make_task", "'no_such_module:make_task': no module named 'no_such_module'"),
])
def test_bad_task_names_are_refused_at_load(task, message):
    with pytest.raises(ConfigError, match=f"^--data.task: {message}"):
        load_config(RunConfig, None, ["--data.task", task])


def test_task_args_only_for_tasks_that_read_them():
    with pytest.raises(ConfigError, match="task_args are read only by 'verifiers:ENV_ID' and "
                                          "'package.module:make_task' tasks, not by 'shapes'"):
        load_config(RunConfig, None, ["--data.task_args", '{"n": 1}'])


@pytest.mark.parametrize("task_name", ["shapes", "views", "scenes"])
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
