"""vLLM's M2N backend (`nccl_m2n`, `vllm.distributed.weight_transfer.m2n_trainer`): for a sharded
trainer (torchrun, FSDP2) on GPUs. Every trainer rank joins one NCCL communicator with every
server's workers and sends its own shard of each tensor (`nccl.m2n.reshard` moves it to the
workers' layout): no rank gathers the whole model, as the other backends make rank 0 do.

Where it fits: full fine-tuning (no LoRA to merge), a family whose engine layout is the trained
one (no tensor transposed on the way: Qwen3-VL's and Qwen3.5's MoE experts are, so those go over
`nccl` with rank 0 gathering), the model's dtype cast shard by shard, and NVIDIA's
`nccl-extensions` installed (vLLM does not install it). `ShardSource` is what it sends: each
tensor's local shard under the engine's name and dtype, with its FSDP2 placement.

vLLM's code: wired and dry-run here, never run (no GPU and no nccl-extensions here).
"""

from __future__ import annotations

from saccade.transports.backends.base import Backend, Party, Place, has_module, needs_gpus
from saccade.transports.backends.nccl import SHARED_GPU

NEEDS = ("nccl_m2n needs NVIDIA's nccl-extensions (the `nccl.m2n` module, https://github.com/NVIDIA/nccl-extensions; "
         "vLLM does not install it)")


class NCCLM2NBackend(Backend):
    name = server_backend = "nccl_m2n"
    all_ranks_join = True
    where = ("a sharded trainer (torchrun, FSDP2) on GPUs: each rank sends its own shards, none gathers the whole "
             "model (NVIDIA's nccl-extensions; full fine-tuning, an engine layout the trainer's)")

    def problem(self, place: Place) -> str | None:
        gpus = needs_gpus(place, self.name)
        if gpus:
            return gpus
        if place.shares_gpu:
            return SHARED_GPU
        if place.trainer_ranks < 2:
            return 'nccl_m2n sends a sharded trainer\'s shards, and this trainer is one process: use "nccl"'
        if not place.full_weights:
            return "nccl_m2n sends the trained tensors' shards, and LoRA must be merged first (rank 0 gathers): use \"nccl\""
        if not place.keeps_layout:
            return "nccl_m2n sends shards as the trainer holds them, and the engine holds the MoE experts transposed"
        if not has_module("nccl.m2n"):
            return NEEDS
        return None

    def init_info(self, party: Party):
        from vllm.distributed.weight_transfer.m2n_trainer import M2NTrainerInitInfo

        return M2NTrainerInitInfo(rank=party.rank, master_address=party.address, master_port=party.port,
                                  world_size=party.world_size, num_trainer_ranks=party.trainer_ranks)

    def source(self, weights, model):
        return shard_source(weights)


NCCL_M2N = NCCLM2NBackend()


def shard_source(weights):
    """vLLM's `M2NWeightSource` over the trainer's plan (`weights`: a `GroupMaterializer`): each
    tensor's local shard (FSDP2's `to_local()`) under the engine's name, cast to its dtype, with
    its placement; ValueError when the plan cannot go shard by shard (LoRA, a tensor transposed)."""
    from vllm.distributed.weight_transfer.m2n_common import M2NParamMeta
    from vllm.distributed.weight_transfer.m2n_source import M2NWeightSource, mesh_from_tensor, placements_from_tensor

    live = weights.source
    if live.lora:
        raise ValueError("nccl_m2n sends shards of the trained tensors; LoRA must be merged first: use \"nccl\"")
    items = [item for group in weights.groups for item in group]
    transposed = [i.trained for i in items if i.trained.endswith(weights.transposed)]
    if transposed:
        raise ValueError(f"nccl_m2n cannot send {transposed[0]} shard by shard: the engine holds it transposed; "
                         'use "nccl"')
    params = {i.trained: live.plain[i.trained] for i in items}

    class ShardSource(M2NWeightSource):
        def mesh(self):
            import torch.distributed as dist

            sharded = [p for p in params.values() if placements_from_tensor(p) is not None]
            ranks = dist.get_world_size() if dist.is_initialized() else 1
            return mesh_from_tensor(sharded[0] if sharded else next(iter(params.values())), ranks)

        def metadata(self):
            return [M2NParamMeta(i.name, i.dtype, i.shape, placements_from_tensor(params[i.trained])) for i in items]

        def groups(self):
            return [[i.name for i in group] for group in weights.groups]

        def __iter__(self):
            for item in items:
                param = params[item.trained].detach()
                local = param.to_local() if hasattr(param, "to_local") else param
                yield item.name, local.to(item.dtype).contiguous()

    return ShardSource()
