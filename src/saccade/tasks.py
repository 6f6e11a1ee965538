"""Tasks: where a run's prompts come from, and what scores what the policy does with them.

Every task offers the same members (the `Task` protocol), whatever it is:

- `max_turns`: assistant turns per episode at most; 1 for single-turn questions;
- `train_sample(position, seed=...)`: prompt `position` of the training stream, a pure
  function of (position, seed), so a resumed run draws the same prompts; a data set's broken
  row raises `saccade.data.rows.RowSkipped` (the loop's `PromptStream` skips it);
- `eval_samples(n)`: the held-out prompts, the same every call;
- `make_env()`: a fresh environment for one episode (`saccade.envs.base.Environment`).

Single-turn questions (the synthetic shapes, a data set) are `QuestionTask`: its
environment's reset gives the question's messages and its step scores the one answer with
the weighted reward functions (`saccade.scoring.Rewards`). The views environment and a
verifiers env are multi-turn tasks of their own. The rollout path
(`saccade.orchestrator.rollout`) reads only these members; it never asks what kind of task
it holds.

`data.task` picks the task (`task_from_config`): a built-in name; "verifiers:ENV_ID", a
verifiers environment loaded by verifiers' own `load_environment(ENV_ID, **data.task_args)`
and run through `saccade.envs.verifiers_env`; or "package.module:make_task", a user's
function called as `make_task(cfg)` with the whole `RunConfig` that returns a `Task`
(docs/rewards.md).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Protocol

from saccade.config import RunConfig
from saccade.envs.base import Environment, Message, StepResult, message_text
from saccade.plugins import VERIFIERS_PREFIX, is_import_path, load_callable
from saccade.scoring import Rewards

# Held-out prompts come from another seed's stream than the training prompts.
EVAL_SEED_OFFSET = 10_000


class Task(Protocol):
    max_turns: int

    def train_sample(self, position: int, *, seed: int) -> Any:
        """Prompt `position` of the training stream (every epoch a new seeded order for data sets)."""
        ...

    def eval_samples(self, n: int) -> list[Any]:
        """The first `n` held-out prompts (fewer when the split is smaller)."""
        ...

    def make_env(self) -> Environment:
        """A fresh environment for one episode."""
        ...


class QuestionSource(Protocol):
    """Visual questions (`saccade.data.shapes.VQASample`): the shapes generator or a data set."""

    def train_sample(self, position: int, *, seed: int) -> Any: ...

    def eval_samples(self, n: int) -> list[Any]: ...


class QuestionEnv:
    """One visual question: reset gives its messages (images first, then the question and its
    options), step scores the answer with the run's reward functions (`saccade.scoring.Rewards`:
    async ones concurrently with the other answers of the step). The info holds `correct`
    always (the accuracy metrics read it), weighted or not, and each function's value and
    parts as reward_<name>[_<part>] (the step's reward_* metrics)."""

    max_turns = 1

    def __init__(self, rewards: Rewards):
        self.rewards = rewards
        self.sample = None
        self.messages: list[Message] = []

    def reset(self, sample: Any) -> list[Message]:
        from saccade.data.shapes import to_messages

        self.sample = sample
        self.messages = to_messages(sample)
        return self.messages

    async def step(self, assistant_message: Message) -> StepResult:
        total, info = await self.score(message_text(assistant_message))
        return StepResult([], total, True, info)

    async def score(self, text: str) -> tuple[float, dict[str, Any]]:
        from saccade.rewards import correct_reward

        total, values = await self.rewards.score(text, sample=self.sample, messages=self.messages)
        correct = values["reward_correct"] if "correct" in self.rewards.weights else \
            float(correct_reward(text, self.sample))
        return total, {"correct": correct, "rewards": values}


@dataclass
class QuestionTask:
    """Single-turn visual questions from `questions`, each answer scored by `rewards`."""

    questions: QuestionSource
    rewards: Rewards = field(default_factory=lambda: Rewards({"correct": 1.0}))
    max_turns: int = 1

    def train_sample(self, position: int, *, seed: int) -> Any:
        return self.questions.train_sample(position, seed=seed)

    def eval_samples(self, n: int) -> list[Any]:
        return self.questions.eval_samples(n)

    def make_env(self) -> QuestionEnv:
        return QuestionEnv(self.rewards)


def rewards_from_config(cfg: RunConfig) -> Rewards:
    """The run's weighted reward functions (`rollout.reward_weights`, `rollout.reward_timeout_s`):
    what a user's own single-turn task passes to `QuestionTask` to score like the built-ins."""
    return Rewards(cfg.rollout.reward_weights, timeout_s=cfg.rollout.reward_timeout_s)


def task_from_config(cfg: RunConfig, *, blank: bool | None = None) -> Task:
    """The run's task: shapes questions, a data set's (splits opened on first use), the views
    environment, the mesh-scenes environment, a verifiers environment, or a user's own (`make_task(cfg)`). `blank`
    overrides data.blank_images (the demo's control) for the built-in question tasks."""
    d = cfg.data
    if d.task.startswith(VERIFIERS_PREFIX):
        from saccade.envs.verifiers_env import VerifiersTask, load_verifiers_env

        env = load_verifiers_env(d.task[len(VERIFIERS_PREFIX):], d.task_args)
        # saccade bounds every episode: env.max_turns caps the env's own max_turns.
        return VerifiersTask(env, max_turns=cfg.env.max_turns, correct_metric=cfg.env.correct_metric)
    if is_import_path(d.task):
        task = load_callable(d.task, field="data.task")(cfg)
        missing = [m for m in ("max_turns", "train_sample", "eval_samples", "make_env") if not hasattr(task, m)]
        if missing:
            raise ValueError(f"data.task: {d.task!r} returned a {type(task).__name__}, which lacks "
                             f"{', '.join(missing)}: make_task(cfg) must return a Task (saccade.tasks.Task)")
        return task
    blank_images = d.blank_images if blank is None else blank
    eval_seed = cfg.trainer.seed + EVAL_SEED_OFFSET
    if d.task == "views":
        from saccade.envs.views import ViewsTask

        e = cfg.env
        return ViewsTask(places=tuple(e.places), num_choices=d.num_choices, image_size=e.image_size,
                         max_turns=e.max_turns, turn_cost=e.turn_cost, eval_seed=eval_seed,
                         distractors=e.distractors, require_seen=e.require_seen,
                         look_reward=e.look_reward, colors=tuple(e.colors))
    if d.task == "scenes":
        from saccade.envs.scenes import ScenesTask

        e = cfg.env
        return ScenesTask(scene_dir=e.scene_dir, kinds=tuple(d.question_kinds), num_choices=d.num_choices,
                          colors=tuple(e.colors), render_size=e.render_size, fov_deg=e.fov_deg,
                          start_poses=e.start_poses, start_turn=e.start_turn, say_side=e.say_side,
                          view_fill=e.view_fill, start_clear=e.start_clear,
                          max_turns=e.max_turns, turn_cost=e.turn_cost, view_reward=e.view_reward,
                          require_seen=e.require_seen, seen_fraction=e.seen_fraction,
                          describe_actions=e.describe_actions, eval_seed=eval_seed, eval_scenes=e.eval_scenes)
    if d.task == "shapes":
        from saccade.data.shapes import ShapesTask

        questions: QuestionSource = ShapesTask(
            kinds=tuple(d.question_kinds), num_choices=d.num_choices, image_size=d.image_size,
            blank_images=blank_images, eval_seed=eval_seed,
        )
    else:
        from saccade.data.datasets import DatasetTask, RowLayout

        layout = RowLayout(d.columns, d.prompt_template, d.system_prompt) if d.task == "dataset" else None
        questions = DatasetTask.defaults(
            d.task, dataset=d.dataset, split=d.split, subsets=d.subsets, eval_dataset=d.eval_dataset,
            eval_split=d.eval_split, eval_subsets=d.eval_subsets, blank_images=blank_images, limits=cfg.images,
            layout=layout,
        )
    return QuestionTask(questions, rewards_from_config(cfg))
