"""Visual reliance: how much the policy's success and its replies depend on its images.

RL on a VLM can raise accuracy through text priors while the policy stops looking at the
image; accuracy alone does not show it. Two figures do, each against the same input with
every image replaced by a blank one (`saccade.data.images.blank_like`: uniform gray, the
image's own size, so the same image tokens at the same positions, showing nothing):

- per evaluation (`eval.visual_gain`, `saccade.orchestrator.evaluation.evaluate` and `run_eval`): the
  held-out prompts decoded again through `BlankImagesTask`, giving `eval_accuracy_blank` and
  `visual_gain` = eval_accuracy - eval_accuracy_blank;
- per logged sample (samples.jsonl, `reply_logprobs`): the teacher-forced log-probability of
  the sampled reply with its images and with blank ones, and their difference
  `image_logprob_gain`: how much more likely the images make that very reply.

Blank means every image the policy is shown: in a multi-turn environment the views it brings
after each action too (a views or scenes episode decides what to look at from what it sees,
so its later views are as much visual evidence as the first). The environment itself runs and
scores unchanged: only the policy's view is blanked.

A blank image's embedding is computed once per image size: the embedding cache keys by
content, and all blank images of one size have the same pixels.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Any, Generic, TypeVar

import torch

from saccade.config import ImagesConfig
from saccade.envs.base import Environment, Message, StepResult, as_step_result, maybe_await
from saccade.run.tasks import Prompt, Task

__all__ = ["BlankImagesEnv", "BlankImagesTask", "episode_images", "reply_logprobs"]

S = TypeVar("S", bound=Prompt)  # the task's prompts


class BlankImagesEnv(Generic[S]):
    """`env` with every image it shows the policy blanked: its opening and every later turn's
    messages, each image replaced by a blank one of its size
    (`saccade.data.messages.with_blank_images`), and each clip by gray frames of its count, size
    and timestamps (with `processor`, whose video sampling decodes it). `env` runs and scores as
    ever (its reward functions read the real sample). Async, so that a sync or an async `env` fits."""

    def __init__(self, env: Environment[S], limits: ImagesConfig, processor=None):
        self.env, self.limits, self.processor = env, limits, processor

    @property
    def max_turns(self) -> int:
        return self.env.max_turns

    def _blank(self, messages: list[Message], sample: str | None = None) -> list[Message]:
        from saccade.data.messages import has_clips, video_sampling, with_blank_images

        sampling = (video_sampling(self.processor, self.limits)
                    if self.processor is not None and has_clips(messages) else None)
        return with_blank_images(messages, limits=self.limits, sample=sample, sampling=sampling)

    async def reset(self, sample: S) -> list[Message]:
        return self._blank(await maybe_await(self.env.reset(sample)), getattr(sample, "sample_id", None))

    async def step(self, assistant_message: Message) -> StepResult:
        result = as_step_result(await maybe_await(self.env.step(assistant_message)))
        return replace(result, messages=self._blank(result.messages))


@dataclass
class BlankImagesTask(Generic[S]):
    """`task` (any `saccade.run.tasks.Task`) with every image its environments show blanked
    (`BlankImagesEnv`): the same prompts, answers and scoring, nothing to see."""

    task: Task[S]
    limits: ImagesConfig
    processor: Any = None  # the model's: clips are blanked with its video sampling

    @property
    def max_turns(self) -> int:
        return self.task.max_turns

    def train_sample(self, position: int, *, seed: int) -> S:
        return self.task.train_sample(position, seed=seed)

    def eval_samples(self, n: int) -> list[S]:
        return self.task.eval_samples(n)

    def make_env(self) -> BlankImagesEnv[S]:
        return BlankImagesEnv(self.task.make_env(), self.limits, self.processor)


def episode_images(env_messages: list[list[dict]], limits: ImagesConfig) -> list | None:
    """Every image the environment showed in an episode (`Rollout.env_messages`: the opening,
    then its reply to each turn), loaded as the engine loads them, in order: the order of the
    training sample's `image_keys`. None when one cannot be loaded (a remote image, say)."""
    from saccade.data.images import ImageError, load_image
    from saccade.data.messages import IMAGE_PART_TYPES, image_source

    images = []
    for message in (m for messages in env_messages for m in messages):
        content = message.get("content")
        for part in content if isinstance(content, list) else []:
            kind = part.get("type") if isinstance(part, dict) else None
            if kind in IMAGE_PART_TYPES:
                try:
                    images.append(load_image(image_source(part, kind), limits=limits))
                except ImageError:
                    return None
    return images


def blank_counterpart(sample, images: list, engine):
    """`sample` (a TrainingSample) with each image's cache key replaced by that of a blank image
    of its size, and the blank images' embeddings put in the cache (`engine.encode_images`: one
    tower call for the blank sizes not encoded yet). Same ids and positions: a blank image of
    the same size has the same grid, which `collate` checks."""
    from saccade.data.images import blank_like, image_hash

    blanks = [blank_like(im) for im in images]
    keys = [engine.key_for_hash(image_hash(b)) for b in blanks]
    engine.encode_images(blanks, keys)
    return replace(sample, sample_id=f"{sample.sample_id}/blank", image_keys=keys)


@torch.no_grad()
def reply_logprobs(setup, rollouts: list, *, distribution, banned_token_ids: list[int],
                   max_tokens: int) -> list[dict[str, float | None]]:
    """For each rollout: `reply_logprob`, the log-probability of its sampled reply under the
    policy's current weights, teacher-forced and summed over the tokens the loss trains on
    (every assistant turn's), with the distribution the engine sampled from (`distribution`,
    `banned_token_ids`); `reply_logprob_blank`, the same with every image blank;
    `image_logprob_gain`, their difference. Each rollout and its blank counterpart are scored
    once, packed like text at most `max_tokens` to a row, one forward a row. All three are None
    for a rollout whose images cannot be loaded again, and for one with clips; a rollout without
    images has a gain of 0.

    `rollouts` must still hold their environments' messages (`Rollout.env_messages`: the rank
    that sampled them). Their images' embeddings are pinned in the cache while they are read."""
    from saccade.trainer.forward import forward_logprobs
    from saccade.trainer.packing import collate, first_fit_decreasing

    samples: list = []
    position: dict[int, int] = {}  # rollout -> where its sample is in `samples`
    blank_position: dict[int, int] = {}  # rollout -> where its blank counterpart is
    pins = setup.cache.pins("samples log")
    try:
        with pins:
            for i, r in enumerate(rollouts):
                images = episode_images(r.env_messages, setup.images)
                # A rollout with clips is left out (None): its clips' embeddings may be gone since its
                # step trained, and blanking them is the clip counterfactual's job (docs/video.md).
                if images is None or len(images) != r.sample.num_images or r.sample.num_videos:
                    continue
                position[i] = len(samples)
                samples.append(r.sample)
                if images:
                    # Evicted since its step trained (a small cache budget)? Encoded again.
                    setup.engine.encode_images(images, r.sample.image_keys)
                    blank_position[i] = len(samples)
                    samples.append(blank_counterpart(r.sample, images, setup.engine))
            sums = [0.0] * len(samples)
            lengths = [s.num_tokens for s in samples]
            for members in first_fit_decreasing(lengths, max_tokens, names=[s.sample_id for s in samples]):
                mb = collate([samples[k] for k in members], setup.cache.get, image_token_id=setup.image_token_id,
                             spatial_merge_size=setup.merge, video_token_id=setup.video_token_id)
                logprobs_N, _ = forward_logprobs(setup.model, mb.to(setup.device), distribution=distribution,
                                                 only_loss_tokens=True, banned_token_ids=banned_token_ids)
                logprobs_N = logprobs_N.cpu()  # 0 at every token not scored: a segment's sum is its reply's
                for k, rows in zip(members, mb.sample_slices(), strict=True):
                    sums[k] = float(logprobs_N[rows].sum())
    finally:
        pins.release()
    out: list[dict[str, float | None]] = []
    for i in range(len(rollouts)):
        if i not in position:
            out.append({"reply_logprob": None, "reply_logprob_blank": None, "image_logprob_gain": None})
            continue
        reply = sums[position[i]]
        blank = sums[blank_position[i]] if i in blank_position else reply
        out.append({"reply_logprob": reply, "reply_logprob_blank": blank, "image_logprob_gain": reply - blank})
    return out
