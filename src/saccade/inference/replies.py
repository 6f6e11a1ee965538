"""What a vLLM server's reply must be before a run trains on it. A reply that is not (not
JSON, sampled ids outside the model's vocabulary, logprobs that are not finite or lie above 0,
a version header that is not a number or names a version this run never pushed) is the server's fault: `MalformedReply`, which the
client answers by asking again and then taking the server out (`saccade.inference.server_client`),
never a crash of the run or a silently skipped step.
"""

from __future__ import annotations

import math
from typing import Any

from saccade.inference.server_client import MalformedReply

# A sampled token's logprob is log p <= 0; float rounding of a log-softmax near p = 1 can land a
# hair above.
LOGPROB_SLACK = 1e-4


def reply_json(response) -> dict[str, Any]:
    """The reply's JSON object."""
    try:
        data = response.json()
    except ValueError as err:
        raise MalformedReply(f"not JSON ({err}): {response.text[:200]!r}") from None
    if not isinstance(data, dict):
        raise MalformedReply(f"a JSON {type(data).__name__}, not an object")
    return data


def reply_version(value: str | None, *, newest: int | None) -> int | None:
    """The policy version header's number (None when the server sent none). `newest` is the
    highest version this run has begun to push (None before its first push: a bench or a tool
    sampling from a server as it is): a server reporting a later one (or a negative one) holds
    weights this run never sent it (another run's, or a garbled header), and what it samples must
    not be trained on as this run's policy."""
    if value is None:
        return None
    try:
        version = int(value)
    except ValueError:
        raise MalformedReply(f"policy version header {value[:50]!r} is not a number") from None
    if newest is not None and not 0 <= version <= newest:
        raise MalformedReply(f"policy version header {version}: this run has pushed versions 0..{newest} only "
                             "(a server holding another run's weights?)")
    return version


def _ids(values: Any, what: str, vocab_size: int | None) -> list[int]:
    if not isinstance(values, list) or not all(isinstance(v, int) and not isinstance(v, bool) for v in values):
        raise MalformedReply(f"{what} is not a list of integers")
    bad = [v for v in values if v < 0 or (vocab_size is not None and v >= vocab_size)]
    if bad:
        raise MalformedReply(f"{what} holds ids outside the vocabulary of {vocab_size}: {bad[:5]}")
    return values


def check_completions(data: dict[str, Any], *, vocab_size: int | None) -> None:
    """A chat or generate reply's prompt ids, and each choice's sampled ids and logprobs."""
    _ids(data.get("prompt_token_ids"), "prompt_token_ids", vocab_size)
    choices = data.get("choices")
    if not isinstance(choices, list) or not choices:
        raise MalformedReply("no choices")
    for choice in choices:
        if not isinstance(choice, dict) or not isinstance(choice.get("index"), int):
            raise MalformedReply("a choice that is not an object with an index")
        ids = _ids(choice.get("token_ids"), f"choice {choice['index']}'s token_ids", vocab_size)
        content = (choice.get("logprobs") or {}).get("content") or []
        try:
            logprobs = [float(c["logprob"]) for c in content]
        except (TypeError, KeyError, ValueError):
            raise MalformedReply(f"choice {choice['index']}'s logprobs are not numbers") from None
        if len(logprobs) != len(ids):
            raise MalformedReply(f"choice {choice['index']}: {len(ids)} sampled ids but {len(logprobs)} logprobs")
        wrong = [v for v in logprobs if not math.isfinite(v) or v > LOGPROB_SLACK]
        if wrong:
            raise MalformedReply(f"choice {choice['index']}'s logprobs are not finite or lie above 0: {wrong[:5]}")
