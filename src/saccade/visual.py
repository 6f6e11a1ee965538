"""Visual reliance: how much the policy's success and its replies depend on its images.

RL on a VLM can raise accuracy through text priors while the policy stops looking at the
image; accuracy alone does not show it. Scoring the same input again with every image
replaced by a blank one (`saccade.data.images.blank_like`: uniform gray, the image's own size,
so the same image tokens at the same positions, showing nothing) does:

- per evaluation (`eval.visual_gain`, `saccade.evaluation.evaluate` and `run_eval`): the
  held-out prompts decoded again through `BlankImagesTask`, giving `eval_accuracy_blank` and
  `visual_gain` = eval_accuracy - eval_accuracy_blank;

Blank means every image the policy is shown: in a multi-turn environment the views it brings
after each action too (a views or scenes episode decides what to look at from what it sees,
so its later views are as much visual evidence as the first). The environment itself runs and
scores unchanged: only the policy's view is blanked.

A blank image's embedding is computed once per image size: the embedding cache keys by
content, and all blank images of one size have the same pixels.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Any

from saccade.config import ImagesConfig
from saccade.envs.base import Environment, Message, StepResult, as_step_result, maybe_await

__all__ = ["BlankImagesEnv", "BlankImagesTask"]


class BlankImagesEnv:
    """`env` with every image it shows the policy blanked: its opening and every later turn's
    messages, each image replaced by a blank one of its size
    (`saccade.data.messages.with_blank_images`). `env` runs and scores as ever (its reward
    functions read the real sample). Async, so that a sync or an async `env` fits."""

    def __init__(self, env: Environment, limits: ImagesConfig):
        self.env, self.limits = env, limits

    @property
    def max_turns(self) -> int:
        return self.env.max_turns

    async def reset(self, sample: Any) -> list[Message]:
        from saccade.data.messages import with_blank_images

        return with_blank_images(await maybe_await(self.env.reset(sample)), limits=self.limits,
                                 sample=getattr(sample, "sample_id", None))

    async def step(self, assistant_message: Message) -> StepResult:
        from saccade.data.messages import with_blank_images

        result = as_step_result(await maybe_await(self.env.step(assistant_message)))
        return replace(result, messages=with_blank_images(result.messages, limits=self.limits))


@dataclass
class BlankImagesTask:
    """`task` (any `saccade.tasks.Task`) with every image its environments show blanked
    (`BlankImagesEnv`): the same prompts, answers and scoring, nothing to see."""

    task: Any
    limits: ImagesConfig

    @property
    def max_turns(self) -> int:
        return self.task.max_turns

    def train_sample(self, position: int, *, seed: int) -> Any:
        return self.task.train_sample(position, seed=seed)

    def eval_samples(self, n: int) -> list[Any]:
        return self.task.eval_samples(n)

    def make_env(self) -> BlankImagesEnv:
        return BlankImagesEnv(self.task.make_env(), self.limits)
