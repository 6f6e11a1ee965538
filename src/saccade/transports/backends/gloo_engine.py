"""saccade's gloo backend, the trainer's engine: a vLLM `TrainerWeightTransferEngine` registered with
vLLM's `WeightTransferTrainerFactory` under `saccade_gloo` (`saccade.transports.backends.gloo`
registers it; the module note there says what it does). Imports vLLM: imported only for a
collective sync over gloo.
"""

from __future__ import annotations

import datetime
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import ClassVar

from vllm.distributed.weight_transfer.base import TrainerInitInfo, TrainerWeightTransferEngine

from saccade.serving.wire import GLOO_BACKEND, TRANSFER_STORE_PREFIX


@dataclass
class GlooTrainerInitInfo(TrainerInitInfo):
    """Where the store listens (the address the servers reach), the group's size (the trainer
    and the server's workers) and the run's token."""

    backend: ClassVar[str] = GLOO_BACKEND
    master_address: str
    world_size: int
    token: str
    timeout_s: float = 600.0


class GlooTrainerWeightTransferEngine(TrainerWeightTransferEngine[GlooTrainerInitInfo]):
    init_info_cls = GlooTrainerInitInfo

    def __init__(self, *, client, source, is_sender: bool = True, init_info=None):
        super().__init__(client=client, source=source, is_sender=is_sender)
        self.info = init_info
        self.group = self.store = None

    @classmethod
    def trainer_init(cls, init_info, *, client, source=None):
        if source is None:
            raise ValueError("the gloo weight transfer sends a WeightSource: pass source=")
        engine = cls(client=client, source=source, is_sender=init_info.is_sender, init_info=init_info)
        if engine.is_sender:
            engine._rendezvous()
        return engine

    def _rendezvous(self) -> None:
        import torch.distributed as dist

        from saccade.serving.rendezvous import challenge_peers, listening_store

        info = self.info
        timeout = datetime.timedelta(seconds=info.timeout_s)
        store = listening_store(info.master_address, info.world_size, timeout)  # bound (rendezvous.py)
        exe = ThreadPoolExecutor(max_workers=1)
        try:
            asked = exe.submit(self.client.init_weight_transfer_engine, {
                "master_address": info.master_address, "master_port": store.port, "world_size": info.world_size,
                "timeout_s": info.timeout_s})
            try:  # returns once the server's workers have joined; then each proves it holds the token
                group = dist.ProcessGroupGloo(dist.PrefixStore(TRANSFER_STORE_PREFIX, store), 0, info.world_size,
                                              timeout)
                challenge_peers(group, info.token, info.world_size)  # keyed
            except Exception:
                if asked.done():
                    asked.result()  # the server's reason, if it gave one
                raise
            asked.result()
        finally:
            exe.shutdown(wait=False)  # a request left hanging by a failed rendezvous fails on its own
        self.group, self.store = group, store  # the store lives as long as the group

    def send_weights(self) -> None:
        if not self.is_sender:
            for _ in self.source.iter_groups():  # this rank's part of the gathers
                pass
            return
        self.client.start_weight_update()
        exe = ThreadPoolExecutor(max_workers=1)
        try:
            for names, tensors in self.source.iter_groups():
                self._send_group(exe, names, tensors)
        finally:
            exe.shutdown(wait=False)  # a broadcast that failed leaves its request to fail on its own
        self.client.finish_weight_update()

    def _send_group(self, exe, names, tensors) -> None:
        import torch.distributed as dist

        from saccade.transports.source import packed

        meta = {"names": list(names), "dtype_names": [str(t.dtype).removeprefix("torch.") for t in tensors],
                "shapes": [list(t.shape) for t in tensors]}
        asked = exe.submit(self.client.update_weights, meta)
        buffer = packed(tensors)
        if asked.done():
            asked.result()  # refused before the broadcast: say why instead of waiting for a peer
        self.group.broadcast([buffer], dist.BroadcastOptions()).wait()
        asked.result()  # the group loaded there

    def shutdown(self) -> None:
        self.group = self.store = None  # gloo's pairs close with the objects
