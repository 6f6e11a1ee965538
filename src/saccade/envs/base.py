"""The environment protocol: episodes over OpenAI-format messages.

An environment is one episode's state. `reset(sample)` gives the opening messages (a system
prompt, the first user turn with its images); after each sampled assistant turn,
`step(assistant_message)` answers with the next messages (new images allowed in any turn),
a reward for this turn, whether the episode is over, and free-form info. The episode's
return is the sum of its per-turn rewards, the last turn's included (the "final" reward).

Either method may be a coroutine (`async def`): the rollout loop awaits those, so many
environments that wait on I/O (a simulator, a web page) run concurrently. Single-turn VQA
is the one-turn case (`SingleTurnEnv`): reset gives the question, the first step scores
the answer and ends the episode.
"""

from __future__ import annotations

import inspect
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from typing import Any, Generic, Protocol, TypeVar

Message = dict[str, Any]
# The sample (a task's prompt) an environment is reset with: a VQASample, a ViewSample, ...
S = TypeVar("S")
S_contra = TypeVar("S_contra", contravariant=True)


@dataclass
class StepResult:
    messages: list[Message]  # what the environment says next (empty when done)
    reward: float = 0.0  # this turn's reward; the episode's return is the sum over turns
    done: bool = False
    info: dict[str, Any] = field(default_factory=dict)


# What `step` may return, or an async `step` resolve to (`as_step_result` reads either).
Stepped = StepResult | tuple[list[Message], float, bool, dict[str, Any]]


class Environment(Protocol[S_contra]):
    """One episode; `Environment[S]` is reset with samples of type S (its task's prompts)."""

    @property
    def max_turns(self) -> int:
        """Assistant turns at most; the episode ends after the last one."""
        ...

    def reset(self, sample: S_contra) -> list[Message] | Awaitable[list[Message]]: ...

    def step(self, assistant_message: Message) -> Stepped | Awaitable[Stepped]: ...


async def maybe_await(value):
    """The value itself, or what it resolves to when an environment method was async."""
    if inspect.isawaitable(value):
        return await value
    return value


def as_step_result(value: Any) -> StepResult:
    """Environments may return a StepResult or a (messages, reward, done, info) tuple."""
    if isinstance(value, StepResult):
        return value
    if isinstance(value, tuple) and len(value) == 4:
        messages, reward, done, info = value
        return StepResult(list(messages or []), float(reward), bool(done), dict(info or {}))
    raise TypeError(f"env.step must return a StepResult or (messages, reward, done, info), got {type(value).__name__}")


class SingleTurnEnv(Generic[S]):
    """Single-turn VQA: the question, one answer, scored by `reward_fn(text, sample)`."""

    max_turns = 1

    def __init__(self, to_messages: Callable[[S], list[Message]], reward_fn: Callable[[str, S], float]):
        self.to_messages = to_messages
        self.reward_fn = reward_fn
        self.sample: S | None = None

    def reset(self, sample: S) -> list[Message]:
        self.sample = sample
        return self.to_messages(sample)

    def step(self, assistant_message: Message) -> StepResult:
        assert self.sample is not None, "step before reset"
        reward = float(self.reward_fn(message_text(assistant_message), self.sample))
        return StepResult([], reward, True, {"correct": reward})


def message_text(message: Message) -> str:
    """The text of a message whose content is a string or a list of parts."""
    content = message.get("content")
    if isinstance(content, str) or content is None:
        return content or ""
    return "".join(p.get("text", "") for p in content if isinstance(p, dict) and p.get("type") == "text")
