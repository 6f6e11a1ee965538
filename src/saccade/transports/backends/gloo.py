"""saccade's own backend, `saccade_gloo`: CPU tensors over torch.distributed's gloo, so it runs
anywhere, vLLM's CPU build included (vLLM's own backends are CUDA ones). Both sides are
saccade's and registered with vLLM's factories: the servers' engine (`saccade.serving.transfer`,
by `saccade.serving.worker`) and the trainer's (`gloo_engine.GlooTrainerWeightTransferEngine`, by
`Gloo.register`), so the trainer drives it exactly as it drives vLLM's.

One group per server: a server that dies breaks only its own, and `saccade.transports.collective`
streams every server's group from one pass over the weights (`saccade.transports.source.SharedGroups`).
- `trainer_init`: a TCPStore bound to the address the servers reach, on a port the OS picks; the
  server asked (through the control client) to join; the group formed; every worker proves it
  holds the run's token before any weight is sent (`saccade.serving.rendezvous`: bound and keyed).
- `send_weights`: `start_weight_update`; per layer group, `update_weights` with the group's names,
  dtypes and shapes while the trainer broadcasts the group's bytes in one buffer (the workers wait
  inside the call); `finish_weight_update`. A phase is never asked twice.
"""

from __future__ import annotations

from saccade.serving.wire import GLOO_BACKEND
from saccade.transports.backends.base import Backend, Party, Place


class GlooBackend(Backend):
    name = "gloo"
    server_backend = GLOO_BACKEND
    per_server = True
    ours = True
    needs_port = False  # listening_store binds a port the OS picks
    gpu = False
    where = ("anywhere (CPU tensors over TCP): vLLM's CPU build, or GPU servers NCCL cannot reach; a group per "
             "server, so the trainer sends the bytes once per server")

    def problem(self, place: Place) -> str | None:
        return None

    def init_info(self, party: Party):
        from saccade.transports.backends.gloo_engine import GlooTrainerInitInfo

        return GlooTrainerInitInfo(rank=party.rank, master_address=party.address, world_size=party.world_size,
                                   token=party.token, timeout_s=party.timeout_s)

    def register(self) -> None:
        from vllm.distributed.weight_transfer.factory import WeightTransferTrainerFactory

        if GLOO_BACKEND not in WeightTransferTrainerFactory._registry:
            WeightTransferTrainerFactory.register_engine(GLOO_BACKEND, "saccade.transports.backends.gloo_engine",
                                                         "GlooTrainerWeightTransferEngine")


GLOO = GlooBackend()
