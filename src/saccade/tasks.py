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
the weighted reward functions (`reward_of`). The views environment and a verifiers env are
multi-turn tasks of their own. The rollout path (`saccade.orchestrator.rollout`) reads only
these members; it never asks what kind of task it holds.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any, Protocol

from saccade.config import RunConfig
from saccade.envs.base import Environment, Message, StepResult, message_text

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


def reward_of(text: str, sample: Any, weights: Mapping[str, float]) -> tuple[float, dict[str, float]]:
    """The weighted total of the named reward functions (`saccade.rewards.REWARD_FUNCTIONS`) on one
    answer, and each function's own value."""
    from saccade.rewards import REWARD_FUNCTIONS

    parts = {}
    for name in weights:
        if name not in REWARD_FUNCTIONS:
            raise ValueError(f"unknown reward function {name!r} in rollout.reward_weights; "
                             f"known: {', '.join(REWARD_FUNCTIONS)}")
        parts[name] = float(REWARD_FUNCTIONS[name](text, sample))
    return sum(weights[n] * v for n, v in parts.items()), parts


class QuestionEnv:
    """One visual question: reset gives its messages (images first, then the question and its
    options), step scores the answer. The info holds each reward function's value, and
    `correct` always (the accuracy metrics read it), weighted or not."""

    max_turns = 1

    def __init__(self, reward_weights: Mapping[str, float]):
        self.reward_weights = dict(reward_weights)
        self.sample = None

    def reset(self, sample: Any) -> list[Message]:
        from saccade.data.shapes import to_messages

        self.sample = sample
        return to_messages(sample)

    def step(self, assistant_message: Message) -> StepResult:
        text = message_text(assistant_message)
        total, parts = self.score(text)
        return StepResult([], total, True, parts)

    def score(self, text: str) -> tuple[float, dict[str, float]]:
        from saccade.rewards import correct_reward

        total, parts = reward_of(text, self.sample, self.reward_weights)
        if "correct" not in parts:
            parts["correct"] = float(correct_reward(text, self.sample))
        return total, parts


@dataclass
class QuestionTask:
    """Single-turn visual questions from `questions`, each answer scored by `reward_weights`."""

    questions: QuestionSource
    reward_weights: dict[str, float] = field(default_factory=lambda: {"correct": 1.0})
    max_turns: int = 1

    def train_sample(self, position: int, *, seed: int) -> Any:
        return self.questions.train_sample(position, seed=seed)

    def eval_samples(self, n: int) -> list[Any]:
        return self.questions.eval_samples(n)

    def make_env(self) -> QuestionEnv:
        return QuestionEnv(self.reward_weights)


def task_from_config(cfg: RunConfig, *, blank: bool | None = None) -> Task:
    """The run's task: shapes questions, a data set's (splits opened on first use), or the views
    environment. `blank` overrides data.blank_images (the demo's control)."""
    d = cfg.data
    blank_images = d.blank_images if blank is None else blank
    eval_seed = cfg.trainer.seed + EVAL_SEED_OFFSET
    if d.task == "views":
        from saccade.envs.views import ViewsTask

        e = cfg.env
        return ViewsTask(places=tuple(e.places), num_choices=d.num_choices, image_size=e.image_size,
                         max_turns=e.max_turns, turn_cost=e.turn_cost, eval_seed=eval_seed,
                         distractors=e.distractors, require_seen=e.require_seen,
                         look_reward=e.look_reward, colors=tuple(e.colors))
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
    return QuestionTask(questions, dict(cfg.rollout.reward_weights))
