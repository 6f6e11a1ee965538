"""What every weight-transfer backend is (`Backend`), where the processes are (`Place`) and one
group a trainer engine joins (`Party`). The backends: one file each beside this one; the table:
`saccade.transports.backends.BACKENDS`."""

from __future__ import annotations

import importlib.util
from dataclasses import dataclass
from typing import Any, ClassVar

import torch
from torch import nn


@dataclass(frozen=True)
class Place:
    """Where the processes are, as a backend needs to know it (from the servers' /saccade/info and
    this process at a run's start; from the `[launch]` layout for `saccade launch --dry-run`)."""

    trainer_gpu: bool  # the trainer holds its model on a CUDA device
    trainer_ranks: int  # 1, or a sharded trainer's world size
    servers_gpu: bool  # every server's workers are on GPUs
    shares_gpu: bool  # some server has a worker on the trainer's GPU
    one_gpu: bool  # every server's every worker is on the trainer's GPU
    servers: int
    full_weights: bool = True  # full fine-tuning (LoRA merged sends every targeted matrix, changed)
    keeps_layout: bool = True  # the engine holds every trained tensor as the trainer does (no MoE transpose)


@dataclass(frozen=True)
class Party:
    """One group a trainer engine joins: this rank, the address its rendezvous listens on, the
    servers' worker counts (one per server), the run's token."""

    rank: int
    trainer_ranks: int  # the trainer ranks in the group: 1 (rank 0 sends), or every rank (nccl_m2n)
    address: str
    workers: tuple[int, ...]
    token: str
    timeout_s: float
    port: int = 0  # the rendezvous' port, for vLLM's backends (gloo binds its own)

    @property
    def world_size(self) -> int:
        return self.trainer_ranks + sum(self.workers)


def free_port(address: str) -> int:
    """A port free on `address` now (vLLM's NCCL rendezvous binds it itself, a moment later)."""
    import socket

    with socket.create_server((address, 0)) as sock:
        return sock.getsockname()[1]


class Backend:
    """One way the bytes travel. Subclasses set the names and say where they run (`problem`),
    what their trainer engine's init info is (`init_info`), what they send (`source`) and how a
    round is driven (`send`, default `engine.send_weights()`)."""

    name: ClassVar[str]  # engine.weight_sync.backend
    server_backend: ClassVar[str]  # the servers' --weight-transfer-config backend; the factories' key
    per_server: ClassVar[bool] = False  # a group per server (one that fails breaks only its own), else one for all
    all_ranks_join: ClassVar[bool] = False  # every rank of a sharded trainer is in the group (sends its shards)
    ours: ClassVar[bool] = False  # saccade's code, run here; else vLLM's, untested here
    needs_port: ClassVar[bool] = True  # the trainer picks the rendezvous' port (vLLM's backends)
    takes_source: ClassVar[bool] = True  # its engine is built over the source (sparse takes patches per round)
    where: ClassVar[str]  # where it runs, one line
    gpu: ClassVar[bool] = True  # the bytes leave from the trainer's GPU

    def problem(self, place: Place) -> str | None:
        """Why this backend cannot run where the processes are (None: it can)."""
        return None

    def init_info(self, party: Party) -> Any:
        """vLLM's `TrainerInitInfo` for this backend and `party` (its `backend` picks the engine)."""
        raise NotImplementedError

    def source(self, weights, model: nn.Module):
        """The `WeightSource` its engine sends (`weights`: the trainer's `GroupMaterializer`)."""
        from saccade.transports.source import PlanSource

        return PlanSource(weights, device="cpu" if not self.gpu else trainer_device(model))

    def send(self, engine, source) -> None:
        """One round (start, the chunks, finish) on every rank, of `source` (the transport's, or one
        consumer's view of it when several groups are sent at once)."""
        engine.source = source
        engine.send_weights()

    def register(self) -> None:
        """Put its trainer engine in vLLM's trainer factory where vLLM does not (saccade's own)."""


def trainer_device(model: nn.Module) -> torch.device:
    """Where the trainer holds its weights (a sharded model: this rank's device)."""
    return next(model.parameters()).device


def needs_gpus(place: Place, backend: str) -> str | None:
    """Why a GPU backend cannot run here: the trainer or a server on the CPU (None: both on GPUs)."""
    if not place.trainer_gpu:
        return (f'backend "{backend}" needs GPUs, and the trainer runs on the CPU (no CUDA device): on the CPU use '
                'backend = "gloo" (or "auto")')
    if not place.servers_gpu:
        return (f'backend "{backend}" needs GPUs, and the servers run on the CPU (vLLM\'s CPU build): use backend = '
                '"gloo" (or "auto")')
    return None


def has_module(name: str) -> bool:
    try:
        return importlib.util.find_spec(name) is not None
    except (ImportError, ValueError):
        return False
