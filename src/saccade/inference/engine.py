"""The inference-engine protocol: what the orchestrator needs from any engine.

An engine takes chat requests (OpenAI-format messages, images and clips included) and
returns, for each, n sampled completions with everything the trainer needs to reproduce them
exactly: the prompt token ids as the engine saw them (image and video pads expanded, a
clip's timestamps written), the sampled ids, their logprobs under the distribution actually
sampled from (temperature applied, truncated by top_k/top_p/min_p, vision tokens banned), the
images' cache keys and grids, and the clips' (`Completion.videos`, a `ClipRefs`: cache keys,
grids, seconds per temporal patch).
The embedded engine (`saccade.inference.local`) and the vLLM client implement it.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass, field
from typing import Any, Protocol

import torch

from saccade.config import SamplingConfig
from saccade.data.videos import ClipRefs
from saccade.models.sampling import SampledDistribution

# Tokens an engine must never sample: a sampled image pad would break the next forward.
VISION_TOKENS = ("<|image_pad|>", "<|video_pad|>", "<|vision_start|>", "<|vision_end|>", "<|vision_pad|>")


@dataclass(frozen=True)
class SamplingParams:
    temperature: float = 1.0  # 0 means greedy (argmax)
    top_p: float = 1.0  # the truncations apply to sampling only, never to greedy decoding
    top_k: int = 0  # 0: off
    min_p: float = 0.0  # 0: off
    max_tokens: int = 16
    n: int = 1  # completions per request (the group size G)
    seed: int | None = None

    def __post_init__(self):
        if self.temperature < 0:
            raise ValueError("temperature must be >= 0 (0 means greedy)")
        if not 0 < self.top_p <= 1:
            raise ValueError("top_p must be in (0, 1]")
        if self.top_k < 0:
            raise ValueError("top_k must be >= 0 (0: off)")
        if not 0 <= self.min_p < 1:
            raise ValueError("min_p must be in [0, 1)")
        if self.max_tokens < 1 or self.n < 1:
            raise ValueError("max_tokens and n must be >= 1")

    @classmethod
    def sampled(cls, sampling: SamplingConfig, *, n: int = 1, seed: int | None = None) -> SamplingParams:
        """The engine's request for the run's sampling (`[sampling]`), n completions per prompt."""
        return cls(temperature=sampling.temperature, top_p=sampling.top_p, top_k=sampling.top_k,
                   min_p=sampling.min_p, max_tokens=sampling.max_tokens, n=n, seed=seed)

    @property
    def distribution(self) -> SampledDistribution:
        """The distribution a sampled (temperature > 0) token is drawn from, as the trainer scores it."""
        assert self.temperature > 0, "greedy decoding has no sampled distribution"
        return SampledDistribution(temperature=self.temperature, top_k=self.top_k, top_p=self.top_p,
                                   min_p=self.min_p)


def stream_seed(*parts: int) -> int:
    """A 63-bit seed that is a function of `parts` alone (e.g. run seed, step, prompt index,
    sample index), the same in every process and on every machine (no Python hash salt)."""
    digest = hashlib.blake2b(",".join(str(int(p)) for p in parts).encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little") >> 1


@dataclass
class ChatRequest:
    request_id: str
    messages: list[dict[str, Any]]
    # The request's sampling stream: completion j of it draws from stream_seed(seed, j) alone,
    # whatever else is in the batch (so a rank samples the same completions as one process
    # would). None: the embedded engine draws a seed from its own generator.
    seed: int | None = None


@dataclass
class TokenPrompt:
    """A prompt given as token ids, never re-tokenized: how multi-turn rollouts continue.

    The ids are the trajectory so far, image and video pads expanded (one per merged patch),
    exactly as the trainer will see them; `images` are all the trajectory's images in order and
    `clips` its decoded clips (`VideoClip`) in order (an engine that has their embeddings cached
    by key does not look at the pixels).
    """

    request_id: str
    input_ids: torch.Tensor  # (L,) int64: image and video pads expanded
    mm_token_type_ids: torch.Tensor  # (L,) int64: 0 text, 1 image, 2 video
    image_keys: list[str]  # cache keys, in order
    image_grid_thw: torch.Tensor  # (n_images, 3) int64
    images: list[Any] = field(default_factory=list)  # PIL images, in order
    seed: int | None = None  # the sampling stream, as ChatRequest.seed
    videos: ClipRefs = field(default_factory=ClipRefs)  # the clips' cache keys, grids, seconds per temporal patch
    clips: list[Any] = field(default_factory=list)  # their decoded frames (`VideoClip`), in order

    def __post_init__(self):
        n = len(self.image_keys)
        if self.image_grid_thw.shape != (n, 3) or (self.images and len(self.images) != n):
            raise ValueError(
                f"{self.request_id}: {n} image keys, {len(self.images)} images and grids of shape "
                f"{tuple(self.image_grid_thw.shape)} do not agree"
            )
        if self.clips and len(self.clips) != len(self.videos):
            raise ValueError(f"{self.request_id}: {len(self.videos)} clip keys but {len(self.clips)} clips")
        if self.input_ids.shape != self.mm_token_type_ids.shape:
            raise ValueError(f"{self.request_id}: input_ids and mm_token_type_ids differ in shape")


@dataclass
class Completion:
    """One sampled completion of one request, exactly as the engine produced it."""

    request_id: str
    prompt_ids: torch.Tensor  # (L,) int64: image and video pads expanded
    mm_token_type_ids: torch.Tensor  # (L,) int64: 0 text, 1 image, 2 video
    completion_ids: torch.Tensor  # (T,) int64: includes the stop token when it stopped
    logprobs: torch.Tensor  # (T,) float32: under the distribution sampled from
    image_keys: list[str]  # cache keys of the prompt's images, in order
    image_grid_thw: torch.Tensor  # (n_images, 3)
    finish_reason: str  # "stop" | "length"
    text: str = ""
    policy_version: int = 0
    extra: dict[str, Any] = field(default_factory=dict)
    # A mixture of experts: per sampled token and MoE layer, the top_k experts the engine computed
    # its logits with (those its predecessor position was routed to), (T, Y, K) uint8 (int16 past
    # 256 experts). None: a dense model, or an engine that does not report them.
    routed_experts: torch.Tensor | None = None
    # The prompt's clips, in order: cache keys, grids, seconds per temporal patch (the positions need them).
    videos: ClipRefs = field(default_factory=ClipRefs)


class WeightTransport(Protocol):
    """How the trainer's weights reach vLLM servers (`saccade.transports`, one file each way):
    what `VLLMEngine.update_weights` calls on every rank."""

    adapter: bool  # the servers then sample with the trainer's LoRA adapter, which requests name
    rejoins_at_sync: bool  # a server that answers again is put back by the next sync (it sends it all)

    def send(self, version: int) -> dict[str, float]:
        """The trainer's current weights to every live server, as `version`; the figures it measured."""
        ...


class Engine(Protocol):
    """Every member the loops (RL, SFT, evaluation, the demos) use; both engines have them all."""

    policy_version: int  # the weights version the engine samples under
    banned_token_ids: list[int]  # never sampled (the vision tokens); the trainer bans them too
    shares_weights: bool  # True: samples from the trainer's own module, so a weight sync costs nothing

    def generate(self, requests: list[ChatRequest], params: SamplingParams) -> list[list[Completion]]:
        """For each chat request, params.n completions (the n share the prompt's prefill)."""
        ...

    def generate_tokens(self, prompts: list[TokenPrompt], params: SamplingParams) -> list[list[Completion]]:
        """For each token prompt, params.n completions; `prompt_ids` report the ids the engine ran."""
        ...

    def prepare_all(self, requests: list[ChatRequest]) -> list:
        """The requests' prompts as the engine would run them (`PreparedPrompt`), their images'
        embeddings put in the cache the trainer reads (SFT trains on these ids)."""
        ...

    def encode_images(self, images: list, keys: list[str]) -> None:
        """Put these images' embeddings in the cache the trainer reads."""
        ...

    def key_for_hash(self, content_hash: str) -> str:
        """The embedding-cache key of an image with this `image_hash` under the engine's limits."""
        ...

    def update_weights(self, version: int | None = None) -> float:
        """Make the engine sample from the trainer's current weights (reporting `version`, default
        the next one); returns seconds spent."""
        ...

    def confirm_weights(self, version: int) -> None:
        """Every rank has seen `update_weights(version)` return (only one rank of a sharded trainer
        tells the servers): from now on, what the engine samples comes from that version or a later one."""
        ...

    def reseed(self, seed: int) -> None:
        """Restart the sampling stream from `seed` (a no-op where sampling is not seeded)."""
        ...

    def rng_state(self) -> Any:
        """The sampler's state for a checkpoint (None where sampling is not seeded)."""
        ...

    def set_rng_state(self, state: Any) -> None:
        """Restore `rng_state()`'s value (None: leave the stream as it is)."""
        ...

    def stats(self) -> dict[str, float]:
        """Counters since the engine was made (the loop logs a step's differences of
        `saccade.loops.step_log.STEP_COUNTERS`, and `servers_alive` as it is); {} where there are none."""
        ...


def stop_token_ids(tokenizer) -> list[int]:
    """The tokens that end a completion: the Qwen chat template's end of turn and end of text."""
    return sorted({tokenizer.convert_tokens_to_ids(t) for t in ("<|im_end|>", "<|endoftext|>")})


def vision_token_ids(tokenizer) -> list[int]:
    ids = [tokenizer.convert_tokens_to_ids(t) for t in VISION_TOKENS]
    return sorted({i for i in ids if i is not None and i != tokenizer.unk_token_id})
