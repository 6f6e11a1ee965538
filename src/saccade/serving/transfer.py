"""The receiving end of saccade's weight transfer over torch.distributed's gloo: a vLLM
`WeightTransferEngine` registered with vLLM's factory as GLOO_BACKEND.

vLLM 0.32 drives weight transfer through four phases, each a `collective_rpc` into every worker
(`vllm/v1/worker/gpu_worker.py`): `init_weight_transfer_engine` (join a process group with the
trainer), `start_weight_update` (layerwise reload begins: each layer's tensors go to the meta
device and its weight loaders buffer what arrives), `update_weights` (receive one chunk and hand
it to `model.load_weights`; a layer is rebuilt and re-packed once all its weights are in) and
`finish_weight_update` (layers that received nothing get their old tensors back). vLLM's own
backends are CUDA ones (nccl, ipc); its CPU worker inherits the four methods from the GPU worker
and runs them, but the base `update_weights` ends with `torch.accelerator.synchronize()`, which
fails on a machine without a GPU driver. This engine carries the tensors over gloo (CPU tensors)
and overrides `update_weights` without that synchronize, so the whole protocol runs on vLLM's
CPU build; on a GPU server it works too (the tensors land on the CPU, `load_weights` copies them).

Wire format of one chunk (`update_weights`): the update info names the tensors, their dtypes and
shapes; the trainer (rank 0) broadcasts their bytes back to back in one uint8 buffer; the worker
cuts it into tensors and loads them. The trainer's side is `saccade.transports.collective`.

This module imports vLLM: it is imported only in a vLLM worker (by name, through the factory's
lazy registry, `saccade.serving.worker.register_weight_transfer`).
"""

from __future__ import annotations

import datetime
import math
from dataclasses import dataclass

import torch
from vllm.distributed.weight_transfer.base import (
    WeightTransferEngine,
    WeightTransferInitInfo,
    WeightTransferUpdateInfo,
)

from saccade.serving.rendezvous import answer_challenge
from saccade.serving.wire import TRANSFER_STORE_PREFIX


@dataclass
class GlooInitInfo(WeightTransferInitInfo):
    """Where the trainer's TCPStore listens, this server's first rank in the group, the group's size
    (1 trainer rank + this server's workers), and the run's token, which each worker proves it holds
    once the group forms (`saccade.serving.rendezvous`)."""

    master_address: str
    master_port: int
    world_size: int
    token: str
    rank_offset: int = 1
    timeout_s: float = 600.0


@dataclass
class GlooUpdateInfo(WeightTransferUpdateInfo):
    """One chunk: the tensors' names (as the engine's checkpoint names them), dtypes and shapes,
    in the order their bytes are broadcast."""

    names: list[str]
    dtype_names: list[str]
    shapes: list[list[int]]

    def __post_init__(self):
        if not (len(self.names) == len(self.dtype_names) == len(self.shapes)):
            raise ValueError(f"names, dtype_names and shapes differ in length: {len(self.names)}, "
                             f"{len(self.dtype_names)}, {len(self.shapes)}")


def chunk_views(buffer: torch.Tensor, dtype_names: list[str], shapes: list[list[int]]) -> list[torch.Tensor]:
    """The tensors a chunk's bytes hold, back to back (views into `buffer`, a flat uint8 tensor;
    a copy for one whose bytes start off its dtype's alignment)."""
    if chunk_nbytes(dtype_names, shapes) != buffer.numel():
        raise ValueError(f"the chunk holds {buffer.numel()} bytes, its tensors {chunk_nbytes(dtype_names, shapes)}")
    out, at = [], 0
    for dtype_name, shape in zip(dtype_names, shapes, strict=True):
        dtype = getattr(torch, dtype_name)
        itemsize = dtype.itemsize
        nbytes = itemsize * math.prod(shape)
        piece = buffer[at:at + nbytes]
        out.append((piece if at % itemsize == 0 else piece.clone()).view(dtype).view(shape))
        at += nbytes
    return out


def chunk_nbytes(dtype_names: list[str], shapes: list[list[int]]) -> int:
    return sum(math.prod(shape) * getattr(torch, dtype_name).itemsize
               for dtype_name, shape in zip(dtype_names, shapes, strict=True))


class GlooWeightTransferEngine(WeightTransferEngine[GlooInitInfo, GlooUpdateInfo]):
    init_info_cls = GlooInitInfo
    update_info_cls = GlooUpdateInfo
    supports_draft_weight_update = False

    def __init__(self, config, vllm_config, device, model) -> None:
        super().__init__(config, vllm_config, device, model)
        self.group = None

    def init_transfer_engine(self, init_info: GlooInitInfo) -> None:
        import torch.distributed as dist

        self.shutdown()
        parallel = self.parallel_config
        # Unique across data-parallel replicas, as vLLM's nccl backend numbers its workers.
        rank = parallel.data_parallel_index * parallel.world_size + parallel.rank + init_info.rank_offset
        timeout = datetime.timedelta(seconds=init_info.timeout_s)
        store = dist.TCPStore(init_info.master_address, init_info.master_port, init_info.world_size,
                              is_master=False, timeout=timeout)
        group = dist.ProcessGroupGloo(dist.PrefixStore(TRANSFER_STORE_PREFIX, store), rank,
                                      init_info.world_size, timeout)
        answer_challenge(group, init_info.token, rank, init_info.world_size)
        self.group = group

    def start_weight_update(self) -> None:
        from vllm.model_executor.model_loader.reload import initialize_layerwise_reload

        initialize_layerwise_reload(self.model)

    def finish_weight_update(self) -> None:
        from vllm.model_executor.model_loader.reload import finalize_layerwise_reload

        finalize_layerwise_reload(self.model, self.model_config)

    def update_weights(self, update_info: dict) -> None:
        # The base class ends with torch.accelerator.synchronize(), which fails without a GPU
        # driver; gloo's broadcast has completed when wait() returns.
        self.receive_weights(self.parse_update_info(update_info))

    def receive_weights(self, update_info: GlooUpdateInfo) -> None:
        import torch.distributed as dist
        from vllm.model_executor.model_loader.mtp_validation import disable_mtp_completeness_check

        if self.group is None:
            raise RuntimeError("the gloo weight transfer is not initialized: call /init_weight_transfer_engine first")
        buffer = torch.empty(chunk_nbytes(update_info.dtype_names, update_info.shapes), dtype=torch.uint8)
        self.group.broadcast([buffer], dist.BroadcastOptions()).wait()  # root 0: the trainer
        tensors = chunk_views(buffer, update_info.dtype_names, update_info.shapes)
        with disable_mtp_completeness_check():
            self.model.load_weights(list(zip(update_info.names, tensors, strict=True)))

    def shutdown(self) -> None:
        self.group = None  # gloo's pairs close with the object
