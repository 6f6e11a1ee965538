"""FSDP2 over the policy: which modules are sharded, in what precision.

The trainer's half of running on several processes (`saccade.distributed` has the other
half, the processes and their collectives, which knows nothing of models): `shard_model`
wraps a `PolicyLM` once it is built (`saccade.run.setup.build_setup`), every decoder layer and
then the root; `mixed_precision` picks the dtypes so that each piece computes as it does on
one process.
"""

from __future__ import annotations

import torch
from torch import nn

from saccade.distributed import World, fsdp_modules
from saccade.models.lm import unwrap_policy


def shard_model(model: nn.Module, world: World, *, device: torch.device, compute_dtype: torch.dtype) -> None:
    """FSDP2 over the ranks, in place: `fully_shard` on every decoder layer, then on the PolicyLM
    (the root: embeddings, final norm, lm_head, and the LoRA adapters' wrappers all sit inside it).

    The trainer calls `PolicyLM.hidden_states`, not `forward`, so that method is registered as
    a forward method (the root's parameters are all-gathered around it). Gradients are summed
    over ranks, not averaged (divide factor 1): the loss already divides by the step-global
    counts. Precision: `mixed_precision` (each piece computes in the dtype it computes in on
    one process)."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard, register_fsdp_forward_method


    policy = unwrap_policy(model)
    mesh = init_device_mesh(device.type, (world.size,))
    mixed = mixed_precision(model, compute_dtype)
    for layer in policy.language_model.layers:
        fully_shard(layer, mesh=mesh, mp_policy=mixed)
    fully_shard(policy, mesh=mesh, mp_policy=mixed)
    register_fsdp_forward_method(policy, "hidden_states")
    # FSDP picks its root on the first forward through it. The embedded engine runs the decoder
    # layers directly (never through the root), which would make layer 0 the root: decide now.
    policy._get_fsdp_state()._lazy_init()
    for module in fsdp_modules(policy):
        # A plain SUM (gloo has no pre-multiplied sum; with factor 1 there is nothing to scale).
        module.set_gradient_divide_factor(1.0)
        module.set_force_sum_reduction_for_comms(True)


def mixed_precision(model: nn.Module, compute_dtype: torch.dtype):
    """FSDP2's `MixedPrecisionPolicy` for a model as `saccade.run.setup.build_setup` loads it when
    sharded, chosen so that every piece computes in the dtype it computes in on one process
    (docs/precision.md). FSDP2 applies one policy to a whole group (a decoder layer), and
    LoRA puts frozen and trainable parameters in the same group, so the choice follows them:

    - full fine-tuning (every parameter trains): float32 parameters, the shards AdamW steps,
      all-gathered in `compute_dtype`; gradients reduced in float32.
    - LoRA (a frozen base): the base is stored in `compute_dtype` and the adapters in float32
      (peft's `autocast_adapter_dtype`), exactly as on one process, and nothing is cast: each
      parameter is all-gathered in its own dtype. FSDP packs a group of mixed dtypes into one
      byte all-gather, so a layer still costs one collective. A `param_dtype` here would round
      the adapters to bf16 (peft then casts the input to the adapter's dtype, so LoRA would
      compute in bf16 under torchrun and in float32 on one process: docs/distributed.md has
      the measurement).

    Refuses a layout it was not made for (a frozen parameter not in `compute_dtype`, a
    trainable one not in float32): FSDP would then compute or step in the wrong dtype."""
    from torch.distributed.fsdp import MixedPrecisionPolicy

    named = list(model.named_parameters())
    frozen = [(n, p.dtype) for n, p in named if not p.requires_grad]
    wrong = [(n, d) for n, p in named if p.requires_grad and (d := p.dtype) != torch.float32]
    if wrong:
        raise ValueError(f"trainable parameter {wrong[0][0]} is {wrong[0][1]}: a sharded model's trainable "
                         "parameters must be float32 (AdamW steps the shards, no master copy): load the model "
                         "in float32 for full fine-tuning (saccade.run.setup.build_setup does)")
    if frozen:
        wrong = [(n, d) for n, d in frozen if d != compute_dtype]
        if wrong:
            raise ValueError(f"frozen parameter {wrong[0][0]} is {wrong[0][1]} but the model computes in "
                             f"{compute_dtype}: load the LoRA base in model.dtype (saccade.run.setup.build_setup "
                             "does), FSDP then gathers it as stored")
        return MixedPrecisionPolicy(reduce_dtype=torch.float32)
    if compute_dtype == torch.float32:
        return MixedPrecisionPolicy()
    return MixedPrecisionPolicy(param_dtype=compute_dtype, reduce_dtype=torch.float32)
