"""Tasks: the question environment, a user's own task by import path, user code that cannot be
found refused before the run, each [task] variant building its task, and every kind of task
(shapes, views, scenes) offering the same members."""

from __future__ import annotations

import asyncio
import dataclasses
import importlib
import typing

import pytest

from saccade.config import ConfigError, RunConfig, ScenesTaskConfig, ViewsTaskConfig, load_config
from saccade.data.questions import VQASample
from saccade.data.shapes import ShapesTask
from saccade.rewards.weighted import Rewards
from saccade.run.tasks import QuestionEnv, QuestionTask, check_user_code, task_from_config


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
from saccade.run.tasks import QuestionTask, rewards_from_config


def make_task(cfg):
    size = cfg.task.args.get("image_size", 64)
    shapes = ShapesTask(kinds=("shape",), num_choices=3, image_size=size, eval_seed=99)
    return QuestionTask(shapes, rewards_from_config(cfg))


def not_a_task(cfg):
    return "shapes"
"""


def plugin(make_task: str, *more: str) -> RunConfig:
    return load_config(RunConfig, None, ["--task.kind", "plugin", "--task.make_task", make_task, *more])


def test_a_user_task_by_import_path(tmp_path, monkeypatch):
    (tmp_path / "my_tasks.py").write_text(MAKE_TASK)
    monkeypatch.syspath_prepend(str(tmp_path))
    cfg = plugin("my_tasks:make_task", "--task.args", '{"image_size": 32}', "--rollout.reward_weights", '{"format": 1}')
    check_user_code(cfg)
    task = task_from_config(cfg)
    assert isinstance(task, QuestionTask) and task.questions.kinds == ("shape",)
    sample = task.train_sample(0, seed=1)
    assert sample.images[0].size == (32, 32)  # task.args reached make_task through cfg
    env = task.make_env()
    env.reset(sample)
    assert asyncio.run(env.step({"role": "assistant", "content": sample.answer})).info["rewards"]["reward_format"] == 1

    with pytest.raises(ValueError, match="task.make_task: 'my_tasks:make_taks': 'my_tasks' has no attribute "
                                         "'make_taks'; it has .*make_task"):
        check_user_code(plugin("my_tasks:make_taks"))
    with pytest.raises(ValueError, match="returned a str, which lacks max_turns, .*must return a Task"):
        task_from_config(plugin("my_tasks:not_a_task"))


@pytest.mark.parametrize(("overrides", "message"), [
    (["--task.kind", "verifiers", "--task.env_id", "no-such-env"],
     "task.env_id: verifiers environment 'no-such-env': no module 'no_such_env' on sys.path"),
    (["--task.kind", "plugin", "--task.make_task", "no_such_module:make_task"],
     "task.make_task: 'no_such_module:make_task': no module named 'no_such_module'"),
    (["--rollout.reward_weights", '{"no_such_module:f": 1}'],
     "rollout.reward_weights: .*no module named 'no_such_module'"),
])
def test_user_code_that_cannot_be_found_is_refused_before_the_run(overrides, message):
    cfg = load_config(RunConfig, None, overrides)  # the config itself imports no user code
    with pytest.raises(ValueError, match=f"^{message}"):
        check_user_code(cfg)


def test_a_plugin_task_needs_an_import_path_and_arguments_go_where_they_are_read():
    with pytest.raises(ConfigError, match="'make_task' is not an import path"):
        plugin("make_task")
    with pytest.raises(ConfigError, match="unknown key 'task.args'.*task kind 'shapes'"):
        load_config(RunConfig, None, ["--task.args", '{"n": 1}'])


@pytest.mark.parametrize(("variant", "task"), [
    (ViewsTaskConfig, "saccade.envs.views:ViewsTask"), (ScenesTaskConfig, "saccade.envs.scenes:ScenesTask"),
])
def test_an_environment_variant_hands_its_task_every_field(variant, task):
    module, _, name = task.partition(":")
    made = dataclasses.fields(getattr(importlib.import_module(module), name))
    config_fields = {"kinds" if f == "question_kinds" else f for f in variant.model_fields} - {"kind"}
    assert config_fields <= {f.name for f in made}  # nothing copied by hand, so nothing forgotten
    cfg = load_config(RunConfig, None, ["--task.kind", variant().kind, "--task.max_turns", "5",
                                        "--task.turn_cost", "0.25", "--trainer.seed", "3"])
    built = task_from_config(cfg)
    assert (built.max_turns, built.turn_cost, built.eval_seed) == (5, 0.25, 3 + 10_000)


@pytest.mark.parametrize("overrides", [
    ["--task.kind", "shapes", "--task.num_choices", "3"],
    ["--task.kind", "views", "--task.num_choices", "3", "--task.colors", '["red", "green", "blue"]'],
    ["--task.kind", "scenes", "--task.num_choices", "3", "--task.colors", '["red", "green", "blue"]'],
], ids=["shapes", "views", "scenes"])
def test_every_task_offers_the_same_members(overrides):
    cfg = load_config(RunConfig, None, overrides)
    task = task_from_config(cfg)
    assert isinstance(task.max_turns, int) and task.max_turns >= 1
    first = task.train_sample(3, seed=7)
    assert task.train_sample(3, seed=7).sample_id == first.sample_id  # a pure function of (position, seed)
    held_out = task.eval_samples(2)
    assert [s.sample_id for s in held_out] == [s.sample_id for s in task.eval_samples(2)]
    assert first.sample_id not in {s.sample_id for s in held_out}
    env = task.make_env()
    assert env.max_turns == task.max_turns and env.reset(first)


@pytest.mark.parametrize("module, task, sample", [
    ("saccade.run.tasks", "QuestionTask", "saccade.data.questions:VQASample"),
    ("saccade.envs.views", "ViewsTask", "saccade.envs.views:ViewSample"),
    ("saccade.envs.scenes", "ScenesTask", "saccade.envs.scenes:SceneSample"),
    ("saccade.envs.verifiers_env", "VerifiersTask", "saccade.envs.verifiers_env:VerifiersSample"),
], ids=["questions", "views", "scenes", "verifiers"])
def test_every_task_names_its_prompt_type(module, task, sample):
    """A `Task[S]`: train_sample gives an S (which has the sample_id the rollout names things
    by), eval_samples a list of them, and its environments are reset with one."""
    sample_module, _, sample_name = sample.partition(":")
    S = getattr(importlib.import_module(sample_module), sample_name)
    cls = getattr(importlib.import_module(module), task)
    names = {**vars(importlib.import_module(module)), sample_name: S}

    def hints(fn) -> dict:
        return typing.get_type_hints(fn, globalns=names)

    assert hints(cls.train_sample)["return"] is S
    assert issubclass(typing.get_origin(hints(cls.eval_samples)["return"]), list)
    assert typing.get_args(hints(cls.eval_samples)["return"]) == (S,)
    accepted = hints(hints(cls.make_env)["return"].reset)["sample"]
    assert accepted is S or S in typing.get_args(accepted)
    assert "sample_id" in {f.name for f in dataclasses.fields(S)}


def test_shapes_questions_come_from_the_seeded_streams():
    cfg = load_config(RunConfig, None, ["--trainer.seed", "4"])
    task = task_from_config(cfg)
    assert isinstance(task, QuestionTask) and isinstance(task.questions, ShapesTask)
    assert task.questions.eval_seed == 4 + 10_000
    assert task.eval_samples(1)[0].sample_id.endswith("-s10004-0")
    assert task.train_sample(0, seed=4).sample_id.endswith("-s4-0")
    blank = task_from_config(cfg, blank=True)
    assert blank.eval_samples(1)[0].metadata["blank"] and not task.eval_samples(1)[0].metadata["blank"]
