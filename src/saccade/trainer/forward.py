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
from saccade.models.lm import ban_bias, to_device, unwrap_policy
from saccade.models.sampling import SampledDistribution
from saccade.trainer.logprobs import PLAIN, token_logprobs_and_entropy
from saccade.trainer.samples import MicroBatch


def predecessors(mb: MicroBatch) -> torch.Tensor:
    """(N,) int64, on the host: the row index of the token each token is predicted from (its
    sample's previous token), -1 for a sample's first token. A segment that continues a shared
    prompt is predicted, at its first token, from the prompt's last token."""
    prev_N = torch.arange(-1, mb.num_tokens - 1)
    starts = mb.cu_seqlens[:-1].long().cpu()  # the boundaries never leave the host
    prev_N[starts] = -1
    for i, (a, b) in enumerate(mb.context or []):
        if b > a:
            prev_N[starts[i]] = b - 1
    return prev_N


def predicted_positions(mb: MicroBatch, only_loss_tokens: bool, prev_N: torch.Tensor | None = None) -> torch.Tensor:
    """(N,) bool, on the host: tokens whose logprob we compute. Never a sample's first token.
    Read from the micro-batch's host copy: no device tensor is read back."""
    prev_N = predecessors(mb) if prev_N is None else prev_N
    host = mb.on_host
    want = host.loss_mask.cpu().clone() if only_loss_tokens else torch.ones(mb.num_tokens, dtype=torch.bool)
    return want & (prev_N >= 0)


def forward_logprobs(
    model: nn.Module,
    mb: MicroBatch,
    *,
    distribution: SampledDistribution = PLAIN,
    only_loss_tokens: bool = False,
    chunk_size: int = 1024,
    banned_token_ids: list[int] | None = None,
    ban_bias_V: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """(logprobs_N, entropy_N), float32, zero where not computed.

    distribution: the temperature and truncation (top_k, top_p, min_p) the engine sampled
    with; each token's kept set is recomputed from these logits (`saccade.trainer.logprobs`).
    banned_token_ids: tokens the engine can never sample (the vision tokens). They are
    masked out of the softmax here too, so the trainer's distribution is exactly the one
    the engine sampled from. `ban_bias_V`: the same as a prebuilt bias row
    (`saccade.models.lm.ban_bias`), which a train step builds once for all its forwards.

    Nothing here reads a device tensor back: which tokens are scored, and from which rows, is
    worked out on the micro-batch's host copy and sent along (non_blocking).
    """
    policy = unwrap_policy(model)
    device = policy.lm_head.weight.device
    host = mb.on_host
    image_embeds = mb.image_embeds.to(device) if mb.image_embeds is not None else None
    deepstack = mb.deepstack.to(device) if mb.deepstack is not None else None
    # Where the image and video pads are, from the host copy: the device never has to say.
    positions_M = policy.visual_positions(host.input_ids.cpu())
    with timed("forward"):
        hidden_1NH = policy.hidden_states(
            mb.input_ids.to(device), mb.position_ids.to(device), image_embeds, deepstack, cu_seqlens=host.cu_seqlens,
            context=mb.context, image_positions_N=positions_M,
        )
    if ban_bias_V is None:
        ban_bias_V = ban_bias(policy.lm_head, banned_token_ids)
    with timed("logprobs"):
        return _logprobs_at(policy, mb, hidden_1NH, only_loss_tokens, distribution, chunk_size, ban_bias_V)


def _logprobs_at(policy, mb: MicroBatch, hidden_1NH: torch.Tensor, only_loss_tokens: bool,
                 distribution: SampledDistribution, chunk_size: int,
                 bias_V: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor]:
    """The lm_head on the predicted positions only, in chunks: (logprobs_N, entropy_N)."""
    device = hidden_1NH.device
    host = mb.on_host
    prev_N = predecessors(host)
    # Token t is predicted from the hidden state of its predecessor (t - 1, or a shared prompt's
    # last token). Rows and targets are picked on the host; the device gets index tensors.
    rows_T = predicted_positions(host, only_loss_tokens, prev_N).nonzero().squeeze(1)
    source_T = to_device(prev_N[rows_T], device)
    targets_T = to_device(host.input_ids[0].cpu()[rows_T], device)
    rows_T = to_device(rows_T, device)
    hidden_TH = hidden_1NH[0].index_select(0, source_T)
    logprobs_T, entropy_T = token_logprobs_and_entropy(
        hidden_TH, policy.lm_head.weight, targets_T, distribution=distribution, chunk_size=chunk_size, bias_V=bias_V
    )
    # index_put, not index_copy: autograd then keeps only the row index (index_copy keeps the values too).
    zeros_N = torch.zeros(mb.num_tokens, device=device, dtype=logprobs_T.dtype)
    return zeros_N.index_put((rows_T,), logprobs_T), zeros_N.index_put((rows_T,), entropy_T)
