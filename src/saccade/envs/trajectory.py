"""Multi-turn trajectories, token-in/token-out.

A trajectory is one growing token sequence. The first prompt is the opening messages through
the chat template (`messages_to_inputs`). After that nothing is ever re-tokenized:

- each assistant turn appends the engine's sampled ids exactly as sampled (a turn cut by
  max_tokens gets the template's end-of-turn token appended, outside the loss);
- each environment reply appends only the new messages' tokens, rendered with the chat
  template's incremental form (`ChatContinuation`), their images and clips expanded by the
  processor (a clip may arrive in any turn);
- images accumulate in order, with their cache keys and grids; clips likewise (`videos`, a
  `ClipRefs`, and their decoded frames, `clips`).

Re-rendering the whole conversation each turn is what broke peers: a decoded-then-encoded
completion is often not the sampled ids, and re-processed images can expand to other
placeholder counts. The training sample is the whole trajectory; the loss falls on the
sampled tokens, or only on those inside markers such as [ACTION]...[/ACTION].

`check_consistency` compares what the engine ran at each turn (its prompt ids, images,
clips, grids and positions, and the ids it sampled) with the training sample, and raises
`ConsistencyError` naming the first difference.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import torch

from saccade.config import ImagesConfig
from saccade.data.messages import (
    extract_visuals, has_clips, messages_to_inputs, render_chat, tokenize_rendered, video_sampling,
)
from saccade.data.videos import ClipRefs
from saccade.inference.engine import Completion, TokenPrompt, stream_seed
from saccade.trainer.samples import TrainingSample, make_sample

if TYPE_CHECKING:
    from saccade.models.families import Positions

END_OF_TURN = "<|im_end|>"
# Content for the stand-in assistant turn the continuation is cut after; any text would do.
_ANCHOR = "saccade-anchor-7f3a"


class ConsistencyError(AssertionError):
    """The training inputs differ from what the engine sampled from."""


class ChatContinuation:
    """The chat template's incremental form: the text that follows an assistant turn's
    end-of-turn token when new messages arrive, ending with the next generation prompt.

    Found once by rendering a stand-in conversation with and without the new messages, so it
    follows whatever the model's template writes between turns (Qwen: "\\n<|im_start|>user
    ...<|im_end|>\\n<|im_start|>assistant\\n"). Templates that re-write earlier turns when a
    later one is added cannot be continued this way and are refused.
    """

    def __init__(self, processor, *, limits: ImagesConfig):
        self.processor = processor
        self.limits = limits
        self.end_of_turn_id = processor.tokenizer.convert_tokens_to_ids(END_OF_TURN)
        base = self._base()
        closed = render_chat(processor, base, add_generation_prompt=False)
        cut = closed.find(_ANCHOR + END_OF_TURN)
        if cut < 0:
            raise ValueError(f"the chat template does not end assistant turns with {END_OF_TURN}; "
                             "multi-turn rollouts need a template that does")
        self._closing = closed[cut + len(_ANCHOR + END_OF_TURN):]  # e.g. "\n"

    @staticmethod
    def _base() -> list[dict[str, Any]]:
        return [{"role": "user", "content": "hi"}, {"role": "assistant", "content": _ANCHOR}]

    def text(self, normalized_messages: list[dict[str, Any]]) -> str:
        full = render_chat(self.processor, self._base() + normalized_messages, add_generation_prompt=True)
        cut = full.find(_ANCHOR + END_OF_TURN)
        rest = full[cut + len(_ANCHOR + END_OF_TURN):] if cut >= 0 else None
        if rest is None or not rest.startswith(self._closing):
            raise ValueError("the chat template renders earlier turns differently once new messages follow; "
                             "it has no incremental form, so multi-turn rollouts cannot keep token ids")
        return rest

    def encode(self, messages: list[dict[str, Any]], *, sample: str | None = None):
        """ModelInputs of the continuation after an assistant turn, for these new messages."""
        sampling = video_sampling(self.processor, self.limits) if has_clips(messages) else None
        normalized, images, clips = extract_visuals(messages, limits=self.limits, sample=sample, sampling=sampling)
        return tokenize_rendered(self.text(normalized), images, self.processor, limits=self.limits, sample=sample,
                                 clips=clips, sampling=sampling)


@dataclass
class TurnRecord:
    """What the engine ran and sampled at one assistant turn: the generation-time inputs."""

    prompt_ids: torch.Tensor  # (L,) as the engine reports running them
    mm_token_type_ids: torch.Tensor  # (L,) 0 text, 1 image, 2 video, as the engine saw them
    image_keys: list[str]
    image_grid_thw: torch.Tensor  # (n, 3)
    positions: torch.Tensor | None  # (3, L) M-RoPE positions the engine used, when it reports them
    completion_ids: torch.Tensor  # (T,)
    logprobs: torch.Tensor  # (T,)
    policy_version: int = 0
    routed_experts: torch.Tensor | None = None  # (T, Y, K): a MoE engine's experts per sampled token
    videos: ClipRefs = field(default_factory=ClipRefs)  # the prompt's clips as the engine ran them


@dataclass
class Trajectory:
    sample_id: str
    sample: Any = None
    seed: int | None = None  # the episode's sampling stream (`stream_seed`), or None
    input_ids: list[int] = field(default_factory=list)
    mm_types: list[int] = field(default_factory=list)
    sampled: list[bool] = field(default_factory=list)  # True on tokens the engine sampled
    logprobs: list[float] = field(default_factory=list)  # the engine's, 0 on other tokens
    image_keys: list[str] = field(default_factory=list)
    grids: list[torch.Tensor] = field(default_factory=list)  # (3,) per image
    images: list[Any] = field(default_factory=list)
    videos: ClipRefs = field(default_factory=ClipRefs)  # the clips so far: keys, grids, seconds per temporal patch
    clips: list[Any] = field(default_factory=list)  # their decoded frames (`VideoClip`), in order
    turns: list[TurnRecord] = field(default_factory=list)
    texts: list[str] = field(default_factory=list)  # each assistant turn's decoded text
    rewards: list[float] = field(default_factory=list)  # per assistant turn
    infos: list[dict[str, Any]] = field(default_factory=list)
    # The environment's messages before each assistant turn: the opening, then each reply.
    env_messages: list[list[dict[str, Any]]] = field(default_factory=list)
    done: bool = False
    finish_reasons: list[str] = field(default_factory=list)

    @property
    def num_tokens(self) -> int:
        return len(self.input_ids)

    @property
    def total_reward(self) -> float:
        return float(sum(self.rewards))

    @property
    def grid(self) -> torch.Tensor:
        return torch.stack(self.grids) if self.grids else torch.zeros(0, 3, dtype=torch.long)

    @property
    def policy_version(self) -> int:
        return min((t.policy_version for t in self.turns), default=0)

    def token_prompt(self) -> TokenPrompt:
        """The trajectory so far as the next turn's prompt; its sampling stream is the episode's
        seed and the turn's number (none when the episode has no seed)."""
        turn = len(self.turns)
        return TokenPrompt(
            request_id=f"{self.sample_id}/turn{len(self.turns)}",
            input_ids=torch.tensor(self.input_ids, dtype=torch.long),
            mm_token_type_ids=torch.tensor(self.mm_types, dtype=torch.long),
            image_keys=list(self.image_keys),
            image_grid_thw=self.grid,
            images=list(self.images),
            seed=None if self.seed is None else stream_seed(self.seed, turn),
            videos=self.videos.clone(),
            clips=list(self.clips),
        )

    def _append(self, ids: list[int], types: list[int], *, sampled: bool, logprobs: list[float] | None = None) -> None:
        self.input_ids += ids
        self.mm_types += types
        self.sampled += [sampled] * len(ids)
        self.logprobs += logprobs if logprobs is not None else [0.0] * len(ids)

    def _append_inputs(self, inputs, key_for_hash) -> None:
        self._append(inputs.input_ids.tolist(), inputs.mm_token_type_ids.tolist(), sampled=False)
        self.images += inputs.images
        self.image_keys += [key_for_hash(h) for h in inputs.image_hashes]
        if inputs.image_grid_thw is not None:
            self.grids += list(inputs.image_grid_thw.long())
        if inputs.clips:
            self.videos = self.videos + inputs.videos
            self.clips += inputs.clips


def start_trajectory(sample_id: str, messages: list[dict[str, Any]], processor, *, limits: ImagesConfig,
                     key_for_hash, sample: Any = None, seed: int | None = None) -> Trajectory:
    """The opening messages through the chat template, with the generation prompt."""
    inputs = messages_to_inputs(messages, processor, limits=limits, add_generation_prompt=True, sample=sample_id)
    trajectory = Trajectory(sample_id=sample_id, sample=sample, seed=seed, env_messages=[messages])
    trajectory._append_inputs(inputs, key_for_hash)
    return trajectory


def add_completion(trajectory: Trajectory, completion: Completion, *, end_of_turn_id: int,
                   positions: torch.Tensor | None = None) -> None:
    """Append the sampled ids as sampled; close a turn cut by max_tokens with the end-of-turn token."""
    ids = completion.completion_ids.tolist()
    positions = positions if positions is not None else completion.extra.get("mrope_positions")
    trajectory.turns.append(TurnRecord(
        prompt_ids=completion.prompt_ids.clone(), mm_token_type_ids=completion.mm_token_type_ids.clone(),
        image_keys=list(completion.image_keys),
        image_grid_thw=completion.image_grid_thw.clone(), positions=positions,
        completion_ids=completion.completion_ids.clone(), logprobs=completion.logprobs.clone(),
        policy_version=completion.policy_version, routed_experts=completion.routed_experts,
        videos=completion.videos.clone(),
    ))
    trajectory._append(ids, [0] * len(ids), sampled=True, logprobs=completion.logprobs.tolist())
    if not ids or ids[-1] != end_of_turn_id:
        # Not sampled, so not trained on: the turn must still be closed for the next one to follow.
        trajectory._append([end_of_turn_id], [0], sampled=False)
    trajectory.texts.append(completion.text)
    trajectory.finish_reasons.append(completion.finish_reason)


def add_forced_turn(trajectory: Trajectory, text: str, tokenizer, *, end_of_turn_id: int) -> None:
    """An assistant turn given as text (SFT warm starts): tokenized once, trained on, closed."""
    ids = tokenizer(text, add_special_tokens=False)["input_ids"] + [end_of_turn_id]
    trajectory._append(ids, [0] * len(ids), sampled=True)
    trajectory.texts.append(text)
    trajectory.finish_reasons.append("stop")


def add_messages(trajectory: Trajectory, messages: list[dict[str, Any]], continuation: ChatContinuation, *,
                 key_for_hash) -> None:
    """Append the environment's new messages (images included) through the template's incremental form."""
    inputs = continuation.encode(messages, sample=trajectory.sample_id)
    trajectory._append_inputs(inputs, key_for_hash)
    trajectory.env_messages.append(messages)


# ----------------------------------------------------------------------------- loss masks


def marker_mask(ids: list[int], tokenizer, open_marker: str, close_marker: str) -> list[bool]:
    """True on the tokens whose text overlaps an [open]...[close] span (markers included;
    an unclosed span runs to the end)."""
    ends, text = [], ""
    for i in range(len(ids)):
        text = tokenizer.decode(ids[: i + 1], skip_special_tokens=True)
        ends.append(len(text))
    pattern = re.compile(re.escape(open_marker) + r".*?(?:" + re.escape(close_marker) + r"|$)", re.DOTALL)
    spans = [m.span() for m in pattern.finditer(text)]
    mask, start = [], 0
    for end in ends:
        mask.append(end > start and any(s < end and start < e for s, e in spans))
        start = end
    return mask


def loss_mask_of(trajectory: Trajectory, tokenizer=None, *, markers: tuple[str, str] | None = None) -> torch.Tensor:
    """The sampled tokens; with `markers`, only the sampled tokens inside marker spans."""
    sampled = torch.tensor(trajectory.sampled, dtype=torch.bool)
    if markers is None:
        return sampled
    mask = torch.zeros_like(sampled)
    i = 0
    while i < len(trajectory.sampled):  # each maximal run of sampled tokens is one assistant turn
        if not trajectory.sampled[i]:
            i += 1
            continue
        j = i
        while j < len(trajectory.sampled) and trajectory.sampled[j]:
            j += 1
        mask[i:j] = torch.tensor(marker_mask(trajectory.input_ids[i:j], tokenizer, *markers), dtype=torch.bool)
        i = j
    return mask


def to_training_sample(trajectory: Trajectory, *, positions: Positions, advantage: float = 0.0,
                       reward: float | None = None, sample_id: str | None = None, tokenizer=None,
                       markers: tuple[str, str] | None = None) -> TrainingSample:
    """The whole trajectory as one sample; its M-RoPE positions computed over all of it by `positions`
    (the model's)."""
    loss_mask = loss_mask_of(trajectory, tokenizer, markers=markers)
    return make_sample(
        sample_id or trajectory.sample_id,
        torch.tensor(trajectory.input_ids, dtype=torch.long),
        torch.tensor(trajectory.mm_types, dtype=torch.long),
        trajectory.grid if trajectory.image_keys else None,
        trajectory.image_keys,
        positions=positions,
        loss_mask=loss_mask,
        inference_logprobs=torch.tensor(trajectory.logprobs, dtype=torch.float32),
        advantage=advantage,
        reward=trajectory.total_reward if reward is None else reward,
        policy_version=trajectory.policy_version,
        routed_experts=loss_token_experts(trajectory, loss_mask),
        videos=trajectory.videos,
    )


def loss_token_experts(trajectory: Trajectory, loss_mask: torch.Tensor) -> torch.Tensor | None:
    """The engine's experts for each loss token (`TrainingSample.routed_experts`), when every
    sampled token has them: the turns' sampled tokens, in order, are the trajectory's sampled
    ones, unless a turn came without them (a dense model, vLLM) or was forced (no engine ran)."""
    experts = [turn.routed_experts for turn in trajectory.turns]
    if not experts or any(e is None for e in experts):
        return None
    sampled = torch.tensor(trajectory.sampled, dtype=torch.bool)
    experts_TYK = torch.cat(experts)
    if experts_TYK.shape[0] != int(sampled.sum()):  # a forced turn: tokens no engine sampled
        return None
    return experts_TYK[loss_mask[sampled]]


# ----------------------------------------------------------------------------- the check


def check_consistency(sample: TrainingSample, turns: list[TurnRecord], *, positions: Positions) -> None:
    """Every turn's generation-time inputs must be exactly a prefix of the training inputs:
    the same ids, the same images in the same order with the same grids, the same positions,
    and the sampled ids and logprobs where the loss reads them. Raises ConsistencyError.
    `positions` (the model's) computes a turn's positions where the engine did not report them."""
    ids = sample.input_ids
    name = sample.sample_id
    sampled = torch.zeros_like(sample.loss_mask)
    for k, turn in enumerate(turns):
        P, C = turn.prompt_ids.numel(), turn.completion_ids.numel()
        where = f"sample {name!r}, turn {k}"
        if P + C > ids.numel():
            raise ConsistencyError(f"{where}: the engine ran {P} prompt + {C} sampled tokens, "
                                   f"but the training sample has only {ids.numel()}")
        _same_ids(turn.prompt_ids, ids[:P], f"{where}: prompt ids")
        _same_ids(turn.completion_ids, ids[P:P + C], f"{where}: sampled ids")
        n = len(turn.image_keys)
        if list(sample.image_keys[:n]) != list(turn.image_keys):
            raise ConsistencyError(f"{where}: images {turn.image_keys} at generation, {sample.image_keys[:n]} in training")
        if not torch.equal(sample.image_grid_thw[:n].long(), turn.image_grid_thw.long()):
            raise ConsistencyError(f"{where}: image grids {turn.image_grid_thw.tolist()} at generation, "
                                   f"{sample.image_grid_thw[:n].tolist()} in training")
        if not sample.videos.take(len(turn.videos)).same_as(turn.videos):
            raise ConsistencyError(f"{where}: clips {turn.videos.keys} (grids {turn.videos.grid_thw.tolist()}) at "
                                   f"generation, {sample.videos.keys[:len(turn.videos)]} in training")
        ran = turn.positions
        if ran is None:  # the engine did not report them: what its own inputs imply
            ran = positions.mrope(turn.mm_token_type_ids, turn.image_grid_thw if n else None, turn.videos)
        if not torch.equal(ran.long(), sample.position_ids[1:, :P]):
            bad = int((ran.long() != sample.position_ids[1:, :P]).any(0).nonzero()[0])
            raise ConsistencyError(f"{where}: M-RoPE positions differ first at token {bad}: {ran[:, bad].tolist()} "
                                   f"at generation, {sample.position_ids[1:, bad].tolist()} in training")
        if not torch.equal(sample.inference_logprobs[P:P + C], turn.logprobs.float()):
            raise ConsistencyError(f"{where}: the engine's logprobs are not where its sampled tokens are")
        sampled[P:P + C] = True
    outside = sample.loss_mask & ~sampled
    if bool(outside.any()):
        raise ConsistencyError(f"sample {name!r}: the loss falls on token {int(outside.nonzero()[0])}, "
                               "which the engine did not sample")


def _same_ids(expected: torch.Tensor, got: torch.Tensor, what: str) -> None:
    if torch.equal(expected.long(), got.long()):
        return
    n = min(expected.numel(), got.numel())
    diff = (expected[:n].long() != got[:n].long()).nonzero()
    first = int(diff[0]) if diff.numel() else n
    raise ConsistencyError(
        f"{what} differ first at index {first} (generation {expected[first:first + 8].tolist()}, "
        f"training {got[first:first + 8].tolist()}; lengths {expected.numel()} vs {got.numel()}): "
        "were the ids re-tokenized instead of kept as sampled?"
    )
