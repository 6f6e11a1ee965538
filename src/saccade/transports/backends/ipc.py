"""vLLM's CUDA IPC backend (`ipc`, `vllm.distributed.weight_transfer.ipc_engine`): when the
trainer and its one server share a GPU (the 1-GPU recipes). The trainer packs each layer group's
tensors into a GPU buffer and hands the server a CUDA IPC handle to it; the server's worker opens
the handle and loads from it: no copy through the host, no network.

The handles travel in the keyed `/update_weights` request, pickled (vLLM's HTTP client does so),
so the server must unpickle what a key holder sends: `saccade serve` allows it
(`VLLM_ALLOW_INSECURE_SERIALIZATION=1`) only for an ipc server on loopback (docs/security.md).

vLLM's code: wired and dry-run here, never run (no GPU here).
"""

from __future__ import annotations

from saccade.transports.backends.base import Backend, Party, Place, needs_gpus


class IPCBackend(Backend):
    name = server_backend = "ipc"
    needs_port = False  # no rendezvous: the handles go in the requests
    where = ("the trainer and its one server on one GPU (the 1-GPU recipes): CUDA IPC handles to the trainer's "
             "packed tensors, no copy through the host")

    def problem(self, place: Place) -> str | None:
        gpus = needs_gpus(place, self.name)
        if gpus:
            return gpus
        if not place.one_gpu:
            return ('backend "ipc" needs every worker of the server on the trainer\'s GPU (CUDA IPC stays on one '
                    'GPU): use "nccl"')
        if place.servers != 1 or place.trainer_ranks != 1:
            return (f'backend "ipc" takes one trainer process and one server on its GPU, here {place.trainer_ranks} '
                    f'rank(s) and {place.servers} server(s): use "nccl" with the servers on GPUs of their own')
        return None

    def init_info(self, party: Party):
        from vllm.distributed.weight_transfer.ipc_engine import IPCTrainerInitInfo

        return IPCTrainerInitInfo(rank=party.rank, packed=True)  # packed: a bounded GPU buffer, reused


IPC = IPCBackend()
