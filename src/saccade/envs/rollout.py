"""Run many environments' episodes against one engine, turn by turn.

One loop over turns: every unfinished episode's trajectory goes to the engine as a token
prompt in one batch (one sample each: a group is G environments reset with the same
sample), each sampled turn is appended as sampled, then all environments step at once
(async ones concurrently), and their new messages are appended through the chat
template's incremental form. Episodes end when their environment says done, at its
max_turns, or when the next turn would not fit `max_total_tokens`.
"""

from __future__ import annotations

import asyncio
from dataclasses import replace
from typing import Any, TypeVar

from saccade.envs.base import Environment, StepResult, as_step_result, maybe_await
from saccade.envs.trajectory import ChatContinuation, Trajectory, add_completion, add_messages, start_trajectory
from saccade.inference.engine import SamplingParams

S = TypeVar("S")  # the samples the environments are reset with


async def reset_all(envs: list[Environment[S]], samples: list[S]) -> list:
    return list(await asyncio.gather(*(maybe_await(env.reset(s)) for env, s in zip(envs, samples, strict=True))))


async def step_all(envs: list[Environment], messages: list[dict[str, Any]]) -> list[StepResult]:
    results = await asyncio.gather(*(maybe_await(env.step(m)) for env, m in zip(envs, messages, strict=True)))
    return [as_step_result(r) for r in results]


def run_episodes(engine, envs: list[Environment[S]], samples: list[S], sample_ids: list[str], params: SamplingParams,
                 *, continuation: ChatContinuation, max_total_tokens: int = 8192,
                 seeds: list[int | None] | None = None) -> list[Trajectory]:
    """One episode per (environment, sample); returns their trajectories in order. `seeds`: each
    episode's sampling stream (turn k draws from stream_seed(seed, k)); None: the engine's."""
    processor, limits = continuation.processor, continuation.limits
    end_of_turn = continuation.end_of_turn_id
    one = replace(params, n=1)
    openings = asyncio.run(reset_all(envs, samples))
    seeds = seeds if seeds is not None else [None] * len(samples)
    trajectories = [
        start_trajectory(sid, messages, processor, limits=limits, key_for_hash=engine.key_for_hash, sample=s,
                         seed=seed)
        for sid, messages, s, seed in zip(sample_ids, openings, samples, seeds, strict=True)
    ]
    max_turns = max(env.max_turns for env in envs)
    for turn in range(max_turns):
        active = [i for i, t in enumerate(trajectories) if not t.done]
        if not active:
            break
        groups = engine.generate_tokens([trajectories[i].token_prompt() for i in active], one)
        for i, group in zip(active, groups, strict=True):
            add_completion(trajectories[i], group[0], end_of_turn_id=end_of_turn)
        replies = [{"role": "assistant", "content": trajectories[i].texts[-1]} for i in active]
        results = asyncio.run(step_all([envs[i] for i in active], replies))
        for i, result in zip(active, results, strict=True):
            t = trajectories[i]
            t.rewards.append(result.reward)
            t.infos.append(result.info)
            last_turn = turn + 1 >= envs[i].max_turns
            if result.done or last_turn or not result.messages:
                t.done = True
                continue
            add_messages(t, result.messages, continuation, key_for_hash=engine.key_for_hash)
            if t.num_tokens + params.max_tokens + 1 > max_total_tokens:
                t.done = True
                t.infos[-1] = {**t.infos[-1], "truncated": True}
    return trajectories
