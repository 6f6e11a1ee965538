"""saccade.orchestrator.visual: a task's environments with every image blank, every turn's, and nothing else
changed. (The eval's visual_gain on a model that reads the image: tests/orchestrator/test_evaluation.py; a
reply's logprob with and without its images: tests/loops/test_sample_log.py, on the short run.)"""

from __future__ import annotations

import asyncio

import pytest

from saccade.config import ImagesConfig
from saccade.data.images import BLANK_GRAY
from saccade.envs.examples import AsyncLookAgainEnv, LookAgainEnv
from saccade.envs.rollout import reset_all, step_all
from saccade.orchestrator.visual import BlankImagesTask


class LookAgainTask:
    """Episodes of `env_class`: a picture, then one or two new ones after each of 3 turns."""

    max_turns = 3

    def __init__(self, env_class):
        self.env_class = env_class

    def train_sample(self, position: int, *, seed: int) -> str:
        return f"train-{position}"

    def eval_samples(self, n: int) -> list[str]:
        return [f"eval-{i}" for i in range(n)]

    def make_env(self):
        return self.env_class(max_turns=self.max_turns, seed=2)


def images_of(messages: list[dict]) -> list:
    return [p["image"] for m in messages if isinstance(m["content"], list) for p in m["content"] if p["type"] == "image"]


def without_images(messages: list[dict]) -> list:
    return [{**m, "content": [p for p in m["content"] if p["type"] != "image"]} if isinstance(m["content"], list) else m
            for m in messages]


@pytest.mark.parametrize("env_class", [LookAgainEnv, AsyncLookAgainEnv])
def test_every_turns_images_are_blank_and_the_episode_is_scored_as_ever(env_class):
    task = LookAgainTask(env_class)
    blank_task = BlankImagesTask(task, ImagesConfig())
    assert blank_task.max_turns == 3 and blank_task.eval_samples(2) == task.eval_samples(2)
    envs = [task.make_env(), blank_task.make_env()]
    assert envs[1].max_turns == 3
    said = [asyncio.run(reset_all(envs, ["eval-0"] * 2))]
    results = []
    for reply in ("look", "again", "red"):
        results.append(asyncio.run(step_all(envs, [{"role": "assistant", "content": reply}] * 2)))
        said.append([r.messages for r in results[-1]])
    shown = 0
    for real, blank in said:
        assert without_images(blank) == without_images(real)  # the text, roles and order as they were
        for r, b in zip(images_of(real), images_of(blank), strict=True):
            assert b.size == r.size and b.getcolors() == [(b.width * b.height, BLANK_GRAY)]
            assert r.getcolors(r.width * r.height) != b.getcolors()
            shown += 1
    assert shown == 1 + 2 + 1  # the opening's picture, then two new ones and one (the last turn ends it)
    for real, blank in results:  # the environment scores as ever: blanking is only what the policy sees
        assert (real.reward, real.done, real.info) == (blank.reward, blank.done, blank.info)
    assert results[-1][1].done and results[-1][1].reward == pytest.approx(1.1)
