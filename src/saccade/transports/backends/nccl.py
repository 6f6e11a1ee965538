"""vLLM's dense NCCL backend (`nccl`, `vllm.distributed.weight_transfer.nccl_engine`): when the
trainer and the servers have GPUs of their own (the 8-GPU and multi-node layouts). One NCCL group
holds the trainer (rank 0) and every server's workers (each server's from its own `rank_offset`,
which the control client sets), so a broadcast leaves the trainer once whatever the number of
servers; vLLM packs the tensors into GPU buffers. A server that fails breaks the group for all:
`saccade.transports.collective` takes it out and sends the others the whole model again in a new
group.

vLLM's code: wired and dry-run here, never run (no GPU here). vLLM's rendezvous (a TCPStore that
`StatelessProcessGroup` binds to `master_address`, the address saccade gives) is bound but not
keyed: its workers prove no token (docs/security.md).
"""

from __future__ import annotations

from saccade.transports.backends.base import Backend, Party, Place, needs_gpus

SHARED_GPU = ("the trainer shares a GPU with a server, and NCCL takes one rank per GPU: with one server on the "
              'trainer\'s GPU use backend = "ipc"')


class NCCLBackend(Backend):
    name = server_backend = "nccl"
    where = ("the trainer and the servers on GPUs of their own (8-GPU and multi-node layouts): one NCCL group for "
             "every server, the bytes leave the trainer once")

    def problem(self, place: Place) -> str | None:
        return needs_gpus(place, self.name) or (SHARED_GPU if place.shares_gpu else None)

    def init_info(self, party: Party):
        from vllm.distributed.weight_transfer.nccl_engine import NCCLTrainerInitInfo

        return NCCLTrainerInitInfo(rank=party.rank, master_address=party.address, master_port=party.port,
                                   world_size=party.world_size)


NCCL = NCCLBackend()
