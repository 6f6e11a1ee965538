"""The KL term's reference policy: a packed micro-batch in, the reference's logprob of each of
its loss tokens out (`Reference`), which `train_step` hands to the loss as `ref_logprobs_N`.

Two kinds; `saccade.loops.rl_step.RLStep.build` picks by the run's training mode:
- LoRA: the base model with the adapters switched off (`adapter_free_reference`). No second
  copy: the base is frozen, so it is the start weights for the whole run.
- Full fine-tuning: a frozen copy of the language model and lm_head (`frozen_copy`), scored
  by `frozen_reference`. Every weight trains, so the start has to be kept apart.

Both score the distribution the engine sampled from: the same temperature and truncation
rule (top_k, top_p, min_p) recomputed from the reference's own logits, and the same banned
tokens, exactly as the policy's logprobs are scored. Both take the policy's micro-batch as it
is: its cached image embeddings (the trainer never holds the vision tower) serve both forwards.

Which weights the frozen copy holds: the policy's as they stand when the run's step is built,
before its first step and before `--resume` loads a checkpoint into the policy. That is the
weights at `model.path` (or, in the demos, the warm start trained in the same process just
before), for a fresh run and for a resumed one alike. The reference is the run's anchor: a
resumed run must train as the uninterrupted one did, so resuming must not move it to the
checkpoint's weights. A checkpoint does not hold it; it is rebuilt from `model.path`, which the
resumed run's config names as the original's did (a resumed run whose start was an in-process
warm start would get `model.path`'s weights instead: the demos never resume).

Precision and placement: the copy is stored in the policy's compute dtype (`model.dtype`), on
the policy's device, which is what the policy computes with: in one process its bf16 weights
(the float32 masters are the optimizer's); under FSDP2 its float32 shards all-gathered in bf16.
Under torchrun the copy is sharded like the policy (`shard_model`: each decoder layer, then the
root) and all-gathered as stored. So at the first step the two forwards are the same
computation and the KL is exactly 0.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import nn

from saccade.distributed import SINGLE, World, fsdp_modules
from saccade.models.lm import PolicyLM, ban_bias, load_policy_lm, unwrap_policy
from saccade.models.sampling import SampledDistribution
from saccade.trainer.forward import forward_logprobs
from saccade.trainer.samples import MicroBatch
from saccade.trainer.sharding import shard_model

# A reference policy: a micro-batch in, the reference's logprob of each of its tokens out
# (its loss tokens'; 0 elsewhere), float32, on the micro-batch's device.
Reference = Callable[[MicroBatch], torch.Tensor]


def adapter_free_reference(model: nn.Module, *, distribution: SampledDistribution,
                           banned_token_ids: list[int]) -> Reference:
    """The base model, LoRA adapters switched off, as the reference policy (no second copy held).
    It scores the same shaped distribution as the policy: its own logits, truncated by the same rule."""
    if not hasattr(model, "disable_adapter"):
        raise ValueError(f"the adapter-free reference needs a LoRA (peft) model, got {type(model).__name__}: for "
                         "full fine-tuning the reference is a frozen copy (saccade.trainer.reference.frozen_copy)")

    ban_bias_V = ban_bias(unwrap_policy(model).lm_head, banned_token_ids)  # built once, as the engine's

    @torch.no_grad()
    def reference(mb: MicroBatch) -> torch.Tensor:
        with model.disable_adapter():
            logprobs, _ = forward_logprobs(model, mb, distribution=distribution, only_loss_tokens=True,
                                           ban_bias_V=ban_bias_V)
        return logprobs

    return reference


def frozen_copy(model: nn.Module, model_path: str, *, compute_dtype: torch.dtype, world: World = SINGLE) -> PolicyLM:
    """A frozen copy of the policy's language model and lm_head, holding the policy's current
    weights: in `compute_dtype`, on the policy's device, in eval mode, no parameter requiring a
    gradient (so no optimizer ever holds it). Under torchrun (`world.sharded`) it is sharded as
    the policy is, and each rank copies its own shard.

    `model_path` (the policy's checkpoint) gives the copy its structure: it is read once, in
    `compute_dtype`, as the policy was; the policy's weights are then copied over it, so that a
    policy trained in this process before (the demos' warm start) is what the copy holds."""
    policy = unwrap_policy(model)
    if policy is not model:
        raise ValueError(f"a frozen reference copy is for full fine-tuning; {type(model).__name__} wraps the "
                         "policy (LoRA): use adapter_free_reference, whose reference is the base with adapters off")
    device = policy.lm_head.weight.device
    attention = policy.config.text_config._attn_implementation  # resolved already ("auto" -> packed_sdpa)
    reference = load_policy_lm(model_path, dtype=compute_dtype, attn_implementation=attention, device=device)
    reference.requires_grad_(False)
    reference.eval()
    if world.sharded:
        shard_model(reference, world, device=device, compute_dtype=compute_dtype)
    copy_weights(policy, reference)
    return reference


@torch.no_grad()
def copy_weights(source: nn.Module, target: nn.Module) -> None:
    """Each of `target`'s parameters set to `source`'s of the same name, cast to its dtype. Two
    models sharded alike (the same world, each decoder layer and the root) copy shard for shard:
    each rank its own piece, no collective."""
    sources = dict(source.named_parameters())
    targets = dict(target.named_parameters())
    assert sources.keys() == targets.keys(), sorted(sources.keys() ^ targets.keys())[:5]
    for name, param in targets.items():
        into, src = _local(param), _local(sources[name])
        # A policy left all-gathered (whole tensors where the copy holds shards) would mismatch here.
        assert into.shape == src.shape, (name, tuple(into.shape), tuple(src.shape))
        into.copy_(src)


def _local(t: torch.Tensor) -> torch.Tensor:
    """This rank's piece of a sharded (DTensor) parameter, the tensor itself otherwise."""
    return t.to_local() if hasattr(t, "to_local") else t


def frozen_reference(reference: PolicyLM, *, distribution: SampledDistribution,
                     banned_token_ids: list[int]) -> Reference:
    """`reference` (a `frozen_copy`) as the reference policy: the same shaped distribution as the
    policy's, its own logits truncated by the same rule, the banned tokens banned.

    Sharded, the copy's root (embedding, final norm, lm_head) is sharded again after each
    micro-batch: FSDP keeps a root whole after its forward, waiting for a backward that never
    comes here, and the policy's root is whole during the training pass."""
    ban_bias_V = ban_bias(reference.lm_head, banned_token_ids)  # built once, as the engine's
    root = fsdp_modules(reference)[:1]  # the PolicyLM, when sharded

    @torch.no_grad()
    def score(mb: MicroBatch) -> torch.Tensor:
        logprobs, _ = forward_logprobs(reference, mb, distribution=distribution, only_loss_tokens=True,
                                       ban_bias_V=ban_bias_V)
        for module in root:
            module.reshard()
        return logprobs

    return score
