"""Tasks: where a run's prompts come from, and what scores what the policy does with them.

Every task offers the same members (the `Task` protocol), whatever it is:

- `max_turns`: assistant turns per episode at most; 1 for single-turn questions;
- `train_sample(position, seed=...)`: prompt `position` of the training stream, a pure
  function of (position, seed), so a resumed run draws the same prompts; a data set's broken
  row raises `saccade.data.rows.RowSkipped` (the loop's `PromptStream` skips it);
- `eval_samples(n)`: the held-out prompts, the same every call;
- `make_env()`: a fresh environment for one episode (`saccade.envs.base.Environment`);
- and, if it holds processes or threads, `close()`: what the run calls when it ends
  (`close_task`): a `QuestionTask`'s reward workers, a verifiers env's loop.

Single-turn questions (the synthetic shapes, a data set) are `QuestionTask`: its
environment's reset gives the question's messages and its step scores the one answer with
the weighted reward functions (`saccade.rewards.weighted.Rewards`). The views environment and a
verifiers env are multi-turn tasks of their own. The rollout path
(`saccade.orchestrator.rollout`) reads only these members; it never asks what kind of task
it holds.

`task.kind` picks the task (`task_from_config`), and the `[task]` variant of that kind
(`saccade.config.task`) holds its fields: a built-in; "verifiers", an environment loaded by
verifiers' own `load_environment` (taskset `task.env_id`, its config `task.env_args`) and run
through `saccade.envs.verifiers_env`; or "plugin", a user's function `task.make_task` called as
`make_task(cfg)` with the whole `RunConfig` that returns a `Task` (docs/rewards.md).

`check_user_code` resolves everything a config names in user code before a run builds
anything; the entry points call it right after loading the config, `--dry-run` included
(nothing here imports torch).
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Protocol, TypeVar

from saccade.config import (
    HubDatasetTaskConfig, OwnDatasetTaskConfig, PluginTaskConfig, RunConfig, ScenesTaskConfig, ShapesTaskConfig,
    VerifiersTaskConfig, ViewsTaskConfig,
)
from saccade.envs.base import Environment, Message, StepResult, message_text
from saccade.plugins import load_callable
from saccade.rewards.weighted import Rewards, reward_functions

if TYPE_CHECKING:
    from saccade.data.questions import VQASample

# Held-out prompts come from another seed's stream than the training prompts.
EVAL_SEED_OFFSET = 10_000


class Prompt(Protocol):
    """What the rollout path reads of any task's prompt: its id, which names the prompt's
    requests, episodes and training samples (`<sample_id>/<i>`)."""

    @property
    def sample_id(self) -> str: ...


S = TypeVar("S", bound=Prompt)


class Task(Protocol[S]):
    """A task whose prompts are of type S: `QuestionTask` a `Task[VQASample]`, `ViewsTask` a
    `Task[ViewSample]`, `ScenesTask` a `Task[SceneSample]`, `VerifiersTask` a
    `Task[VerifiersSample]`. Its environments are reset with those same prompts."""

    @property
    def max_turns(self) -> int:
        """Assistant turns per episode at most (1: single-turn questions)."""
        ...

    def train_sample(self, position: int, *, seed: int) -> S:
        """Prompt `position` of the training stream (every epoch a new seeded order for data sets)."""
        ...

    def eval_samples(self, n: int) -> list[S]:
        """The first `n` held-out prompts (fewer when the split is smaller)."""
        ...

    def make_env(self) -> Environment[S]:
        """A fresh environment for one episode."""
        ...


class QuestionSource(Protocol):
    """Visual questions (`saccade.data.questions.VQASample`): the shapes generator or a data set."""

    def train_sample(self, position: int, *, seed: int) -> VQASample: ...

    def eval_samples(self, n: int) -> list[VQASample]: ...


class QuestionEnv:
    """One visual question: reset gives its messages (images first, then the question and its
    options), step scores the answer with the run's reward functions (`saccade.rewards.weighted.Rewards`:
    async ones concurrently with the other answers of the step). The info holds `correct`
    always (the accuracy metrics read it), weighted or not, and each function's value and
    parts as reward_<name>[_<part>] (the step's reward_* metrics)."""

    max_turns = 1

    def __init__(self, rewards: Rewards):
        self.rewards = rewards
        self.sample: VQASample | None = None
        self.messages: list[Message] = []

    def reset(self, sample: VQASample) -> list[Message]:
        from saccade.data.questions import to_messages

        self.sample = sample
        self.messages = to_messages(sample)
        return self.messages

    async def step(self, assistant_message: Message) -> StepResult:
        total, info = await self.score(message_text(assistant_message))
        return StepResult([], total, True, info)

    async def score(self, text: str) -> tuple[float, dict[str, Any]]:
        from saccade.rewards.bounded import correct

        total, values = await self.rewards.score(text, sample=self.sample, messages=self.messages)
        correct = values["reward_correct"] if "correct" in self.rewards.weights else \
            correct(text, self.sample)
        return total, {"correct": correct, "rewards": values}


@dataclass
class QuestionTask:
    """Single-turn visual questions from `questions`, each answer scored by `rewards`: a
    `Task[VQASample]`."""

    questions: QuestionSource
    rewards: Rewards = field(default_factory=lambda: Rewards({"correct": 1.0}))
    max_turns: int = 1

    def train_sample(self, position: int, *, seed: int) -> VQASample:
        return self.questions.train_sample(position, seed=seed)

    def eval_samples(self, n: int) -> list[VQASample]:
        return self.questions.eval_samples(n)

    def make_env(self) -> QuestionEnv:
        return QuestionEnv(self.rewards)

    def close(self) -> None:
        """End the worker processes of the user's reward functions."""
        self.rewards.close()


def rewards_from_config(cfg: RunConfig) -> Rewards:
    """The run's weighted reward functions (`rollout.reward_weights`, `rollout.reward_timeout_s`):
    what a user's own single-turn task passes to `QuestionTask` to score like the built-ins."""
    return Rewards(cfg.rollout.reward_weights, timeout_s=cfg.rollout.reward_timeout_s)


def close_task(task: Task[Any] | None) -> None:
    """Close `task` if it has a `close` (its reward workers, a verifiers env's loop)."""
    close = getattr(task, "close", None)
    if close is not None:
        close()


@contextmanager
def closing_task(task: Task[Any] | None) -> Iterator[None]:
    """`close_task` on leaving: the run's end, for a task the run built (None: nothing to close;
    a caller's task is the caller's to close)."""
    try:
        yield
    finally:
        close_task(task)


def check_user_code(cfg: RunConfig) -> None:
    """Resolve what the config names in user code: the reward functions (their modules are
    imported), a plugin task's make_task (imported), a verifiers environment (looked up, not
    imported: verifiers takes seconds); and what it names that the config cannot check, being
    below `saccade.data`: one's own data set's row format (`saccade.data.row_formats`), the run's
    and each eval set's. A ValueError naming the field and what to do; so a bad name fails before
    any model is built."""
    try:
        reward_functions(cfg.rollout.reward_weights)
    except ValueError as err:
        raise ValueError(f"rollout.reward_weights: {err}") from None
    if isinstance(cfg.task, PluginTaskConfig):
        load_callable(cfg.task.make_task, field="task.make_task")
    elif isinstance(cfg.task, VerifiersTaskConfig):
        from saccade.envs.verifiers_env import check_verifiers_env

        check_verifiers_env(cfg.task.env_id)
    owned = {"task": cfg.task, **{f"eval.sets.{name}": t for name, t in cfg.eval.sets.items()}}
    for where, t in owned.items():
        if isinstance(t, OwnDatasetTaskConfig):
            from saccade.data.row_formats import row_format

            try:
                row_format(t.format)
            except ValueError as err:
                raise ValueError(f"{where}.format: {err}") from None


def task_from_config(cfg: RunConfig, *, blank: bool | None = None) -> Task[Any]:
    """The run's task, built from its `[task]` variant: shapes questions, a data set's (splits
    opened on first use), the views environment, the mesh-scenes environment, a verifiers
    environment, or a user's own (`make_task(cfg)`). `blank` overrides the variant's
    blank_images (the demo's control) for the built-in question tasks."""
    t = cfg.task
    eval_seed = cfg.trainer.seed + EVAL_SEED_OFFSET
    if isinstance(t, VerifiersTaskConfig):
        from saccade.envs.verifiers_env import VerifiersTask

        # saccade bounds every episode: task.max_turns caps the seat's own max_turns.
        return VerifiersTask(t.env_id, t.env_args, max_turns=t.max_turns, correct_metric=t.correct_metric)
    if isinstance(t, PluginTaskConfig):
        task = load_callable(t.make_task, field="task.make_task")(cfg)
        missing = [m for m in ("max_turns", "train_sample", "eval_samples", "make_env") if not hasattr(task, m)]
        if missing:
            raise ValueError(f"task.make_task: {t.make_task!r} returned a {type(task).__name__}, which lacks "
                             f"{', '.join(missing)}: make_task(cfg) must return a Task (saccade.run.tasks.Task)")
        return task
    if isinstance(t, ViewsTaskConfig):
        from saccade.envs.views import ViewsTask

        return ViewsTask(**_kwargs(t, places=tuple(t.places), colors=tuple(t.colors)), eval_seed=eval_seed)
    if isinstance(t, ScenesTaskConfig):
        from saccade.envs.scenes import ScenesTask

        return ScenesTask(**_kwargs(t, leave_out=("question_kinds",), kinds=tuple(t.question_kinds),
                                    colors=tuple(t.colors)), eval_seed=eval_seed)
    if isinstance(t, ShapesTaskConfig):
        from saccade.data.shapes import ShapesTask

        questions: QuestionSource = ShapesTask(
            kinds=tuple(t.question_kinds), num_choices=t.num_choices, image_size=t.image_size,
            blank_images=t.blank_images if blank is None else blank, eval_seed=eval_seed,
        )
        return QuestionTask(questions, rewards_from_config(cfg))
    assert isinstance(t, HubDatasetTaskConfig), f"no task is built for {type(t).__name__}"
    return dataset_task(cfg, t, blank=blank)


def dataset_task(cfg: RunConfig, t: HubDatasetTaskConfig, *, blank: bool | None = None) -> QuestionTask:
    """A data set's questions, scored by the run's reward functions, `correct` by the data set's
    own `task.scoring` (each row carries its scorer): the run's task, or one of `eval.sets`."""
    from saccade.data.datasets import DatasetTask
    from saccade.data.row_formats import RowLayout
    from saccade.rewards.builtin import Scorer

    own = isinstance(t, OwnDatasetTaskConfig)
    s = t.scoring
    default = s.extractor == "saccade" and s.grader == "saccade"
    questions = DatasetTask.defaults(
        t.kind, dataset=t.dataset, split=t.split, subsets=t.subsets, eval_dataset=t.eval_dataset,
        eval_split=t.eval_split, eval_subsets=t.eval_subsets, blank_images=t.blank_images if blank is None else blank,
        limits=cfg.images,
        layout=RowLayout(t.columns, t.prompt_template, t.system_prompt, t.image_root, t.format) if own else None,
        prompt_template=t.prompt_template, system_prompt=t.system_prompt,
        scorer=None if default else Scorer(s.extractor, s.grader, s.judge_url, s.judge_model, s.judge_api_key_env),
    )
    return QuestionTask(questions, rewards_from_config(cfg))


def eval_set_tasks(cfg: RunConfig) -> dict[str, QuestionTask]:
    """`eval.sets`: name -> the held-out set's task (its eval split is what is read)."""
    return {name: dataset_task(cfg, t) for name, t in cfg.eval.sets.items()}


def _kwargs(t, *, leave_out: tuple[str, ...] = (), **changed) -> dict[str, Any]:
    """A variant's fields as keyword arguments of the task it builds (same names): `kind` and
    `leave_out` left out, `changed` given instead."""
    fields = {name: getattr(t, name) for name in type(t).model_fields if name not in ("kind", *leave_out)}
    return {**fields, **changed}
