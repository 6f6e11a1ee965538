"""The trainer's forward: a packed micro-batch in, per-token logprobs and entropy out.

logprobs_N[t] is log p(input_ids[t] | input_ids[<t]) within t's own sample, so it lines
up with `loss_mask` and `inference_logprobs`. The first token of each sample has no
prediction and gets 0. Only the positions asked for go through the lm_head, in chunks:
the (tokens x vocab) logits never exist in full.
"""

from __future__ import annotations

import torch
from torch import nn

from saccade.timing import timed
from saccade.models.lm import BANNED_LOGIT, unwrap_policy
from saccade.models.sampling import SampledDistribution
from saccade.trainer.logprobs import PLAIN, token_logprobs_and_entropy
from saccade.trainer.samples import MicroBatch


def predecessors(mb: MicroBatch) -> torch.Tensor:
    """(N,) int64: the row index of the token each token is predicted from (its sample's
    previous token), -1 for a sample's first token. A segment that continues a shared prompt
    is predicted, at its first token, from the prompt's last token."""
    prev_N = torch.arange(-1, mb.num_tokens - 1)
    starts = mb.cu_seqlens[:-1].long().cpu()
    prev_N[starts] = -1
    for i, (a, b) in enumerate(mb.context or []):
        if b > a:
            prev_N[starts[i]] = b - 1
    return prev_N


def predicted_positions(mb: MicroBatch, only_loss_tokens: bool, prev_N: torch.Tensor | None = None) -> torch.Tensor:
    """(N,) bool: tokens whose logprob we compute. Never a sample's first token."""
    prev_N = predecessors(mb) if prev_N is None else prev_N
    want = mb.loss_mask.cpu().clone() if only_loss_tokens else torch.ones(mb.num_tokens, dtype=torch.bool)
    return want & (prev_N >= 0)


def ban_bias(head: nn.Linear, banned_token_ids: list[int] | None) -> torch.Tensor | None:
    """lm_head bias with the banned tokens pushed to probability 0 (None if nothing to add)."""
    if not banned_token_ids:
        return head.bias
    bias = torch.zeros(head.out_features, device=head.weight.device, dtype=torch.float32)
    bias[list(banned_token_ids)] = BANNED_LOGIT
    if head.bias is not None:
        bias = bias + head.bias.float()
    return bias


def forward_logprobs(
    model: nn.Module,
    mb: MicroBatch,
    *,
    distribution: SampledDistribution = PLAIN,
    only_loss_tokens: bool = False,
    chunk_size: int = 1024,
    banned_token_ids: list[int] | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """(logprobs_N, entropy_N), float32, zero where not computed.

    distribution: the temperature and truncation (top_k, top_p, min_p) the engine sampled
    with; each token's kept set is recomputed from these logits (`saccade.trainer.logprobs`).
    banned_token_ids: tokens the engine can never sample (the vision tokens). They are
    masked out of the softmax here too, so the trainer's distribution is exactly the one
    the engine sampled from.
    """
    policy = unwrap_policy(model)
    device = policy.lm_head.weight.device
    image_embeds = mb.image_embeds.to(device) if mb.image_embeds is not None else None
    deepstack = mb.deepstack.to(device) if mb.deepstack is not None else None
    with timed("forward"):
        hidden_1NH = policy.hidden_states(
            mb.input_ids.to(device), mb.position_ids.to(device), image_embeds, deepstack, cu_seqlens=mb.cu_seqlens,
            context=mb.context,
        )
    with timed("logprobs"):
        return _logprobs_at(policy, mb, hidden_1NH, only_loss_tokens, distribution, chunk_size, banned_token_ids)


def _logprobs_at(policy, mb: MicroBatch, hidden_1NH: torch.Tensor, only_loss_tokens: bool,
                 distribution: SampledDistribution, chunk_size: int, banned_token_ids: list[int] | None) -> tuple[torch.Tensor, torch.Tensor]:
    """The lm_head on the predicted positions only, in chunks: (logprobs_N, entropy_N)."""
    device = hidden_1NH.device
    prev_N = predecessors(mb)
    want_cpu_N = predicted_positions(mb, only_loss_tokens, prev_N)
    # Token t is predicted from the hidden state of its predecessor (t - 1, or a shared prompt's
    # last token); the indices are worked out on the host, so the device is never waited on.
    source_idx = prev_N[want_cpu_N].to(device, non_blocking=True)
    want_N = want_cpu_N.to(device, non_blocking=True)
    hidden_TH = hidden_1NH[0, source_idx]
    targets_T = mb.input_ids[0].to(device)[want_N]
    head = policy.lm_head
    bias_V = ban_bias(head, banned_token_ids)
    logprobs_T, entropy_T = token_logprobs_and_entropy(
        hidden_TH, head.weight, targets_T, distribution=distribution, chunk_size=chunk_size, bias_V=bias_V
    )
    logprobs_N = torch.zeros(mb.num_tokens, device=device, dtype=torch.float32)
    entropy_N = torch.zeros(mb.num_tokens, device=device, dtype=torch.float32)
    logprobs_N = logprobs_N.masked_scatter(want_N, logprobs_T)
    entropy_N = entropy_N.masked_scatter(want_N, entropy_T)
    return logprobs_N, entropy_N
