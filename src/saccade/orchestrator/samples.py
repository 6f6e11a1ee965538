"""Completions -> TrainingSamples: the token ids exactly as the engine saw and sampled them."""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from saccade.inference.engine import Completion
from saccade.trainer.samples import TrainingSample, make_sample

if TYPE_CHECKING:
    from saccade.models.families import Positions


def completion_to_sample(
    completion: Completion,
    *,
    sample_id: str,
    advantage: float,
    reward: float,
    positions: Positions,
) -> TrainingSample:
    """Prompt ids + sampled ids, never re-tokenized; the loss falls on the sampled tokens only
    (so the engine's experts per sampled token, when it reports them, are the loss tokens').
    `positions`: the model's M-RoPE rule (`Setup.positions`)."""
    L, T = completion.prompt_ids.shape[0], completion.completion_ids.shape[0]  # prompt, sampled tokens
    input_ids = torch.cat([completion.prompt_ids, completion.completion_ids])
    types = torch.cat([completion.mm_token_type_ids, torch.zeros(T, dtype=torch.long)])
    loss_mask = torch.cat([torch.zeros(L, dtype=torch.bool), torch.ones(T, dtype=torch.bool)])
    logprobs = torch.cat([torch.zeros(L), completion.logprobs.float()])
    return make_sample(
        sample_id,
        input_ids,
        types,
        completion.image_grid_thw if completion.image_keys else None,
        completion.image_keys,
        positions=positions,
        loss_mask=loss_mask,
        inference_logprobs=logprobs,
        advantage=advantage,
        reward=reward,
        policy_version=completion.policy_version,
        routed_experts=completion.routed_experts,
        videos=completion.videos,
    )
