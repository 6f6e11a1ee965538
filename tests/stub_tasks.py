"""Tasks whose rewards the tests choose: real tasks, real environments, stub scores.

A random tiny model's replies earn no task reward, so every advantage would be 0 and no
weight could move. These tasks keep everything real (the prompts, the rollout path, the
environments' turns and images) and score the sampled text by a rule the test knows.
"""

from __future__ import annotations

import zlib
from collections.abc import Callable

from saccade.envs.base import StepResult
from saccade.envs.examples import LookAgainEnv
from saccade.run.tasks import QuestionEnv, QuestionTask, task_from_config


def hash_reward(text: str) -> float:
    """A reward in [0, 1] that depends on the sampled text only."""
    return (zlib.crc32(text.encode()) % 7) / 6.0


class ScoredQuestionEnv(QuestionEnv):
    """A question whose answer is scored by `score_fn(text, sample) -> reward`; `correct` is
    reward > 0.5."""

    def __init__(self, rewards, score_fn: Callable[[str, object], float]):
        super().__init__(rewards)
        self.score_fn = score_fn

    async def score(self, text: str) -> tuple[float, dict[str, float]]:
        value = float(self.score_fn(text, self.sample))
        return value, {"correct": float(value > 0.5)}


class ScoredQuestionTask(QuestionTask):
    def __init__(self, task: QuestionTask, score_fn: Callable[[str, object], float]):
        super().__init__(task.questions, task.rewards)
        self.score_fn = score_fn

    def make_env(self) -> ScoredQuestionEnv:
        return ScoredQuestionEnv(self.rewards, self.score_fn)


def scored_task(cfg, score_fn: Callable[[str, object], float] = lambda text, sample: hash_reward(text)):
    """The config's single-turn task (its prompts, its images), scored by `score_fn`."""
    return ScoredQuestionTask(task_from_config(cfg), score_fn)


class HashLookAgainEnv(LookAgainEnv):
    """LookAgainEnv (1-2 new images each turn, up to max_turns), each turn scored by its hash."""

    def step(self, assistant_message: dict) -> StepResult:
        result = super().step(assistant_message)
        reward = hash_reward(assistant_message["content"])
        info = {**result.info, "correct": float(reward > 0.5)} if result.done else result.info
        return StepResult(result.messages, reward, result.done, info)


class SampleId(str):
    """A prompt that is only its name."""

    @property
    def sample_id(self) -> str:
        return str(self)


class HashEpisodesTask:
    """Multi-turn episodes of HashLookAgainEnv."""

    max_turns = 3

    def train_sample(self, position: int, *, seed: int) -> SampleId:
        return SampleId(f"train-{seed}-{position}")

    def eval_samples(self, n: int) -> list[SampleId]:
        return [SampleId(f"eval-{i}") for i in range(n)]

    def make_env(self) -> HashLookAgainEnv:
        return HashLookAgainEnv(max_turns=self.max_turns, seed=1)
