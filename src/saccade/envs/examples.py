"""Small example environments: a template for new ones, and what the multi-turn tests run."""

from __future__ import annotations

from saccade.envs.base import StepResult
from saccade.data.synthetic import synthetic_image


def image_part(seed: int, width: int = 64, height: int = 64) -> dict:
    return {"type": "image", "image": synthetic_image(width, height, seed)}


class LookAgainEnv:
    """Shows a picture, then answers every turn with one or two new pictures; the episode
    lasts `max_turns` assistant turns. Reward: 0.1 per turn plus 1 at the end if the last
    answer mentions 'red' (a per-turn and a final reward)."""

    def __init__(self, max_turns: int = 3, seed: int = 0):
        self.max_turns = max_turns
        self.seed = seed
        self.turn = 0

    def reset(self, sample) -> list[dict]:
        self.turn = 0
        return [{"role": "system", "content": "Look carefully."},
                {"role": "user", "content": [image_part(self.seed), {"type": "text", "text": f"Question {sample}?"}]}]

    def step(self, assistant_message: dict) -> StepResult:
        self.turn += 1
        if self.turn >= self.max_turns:
            final = 1.0 if "red" in assistant_message["content"] else 0.0
            return StepResult([], 0.1 + final, True, {"turns": self.turn})
        n_images = 1 + (self.turn + self.seed) % 2  # 1 or 2 new images, varying sizes
        parts = [image_part(100 * self.seed + 10 * self.turn + j, 64 + 32 * j, 64) for j in range(n_images)]
        text = {"type": "text", "text": f"Turn {self.turn}: look again."}
        return StepResult([{"role": "user", "content": [*parts, text]}], 0.1, False, {})


class AsyncLookAgainEnv(LookAgainEnv):
    async def reset(self, sample):
        return super().reset(sample)

    async def step(self, assistant_message):
        return super().step(assistant_message)
