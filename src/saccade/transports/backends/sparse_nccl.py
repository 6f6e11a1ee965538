"""vLLM's sparse NCCL backend (`sparse_nccl`, `vllm.distributed.weight_transfer.sparse_nccl_engine`):
as `nccl` (GPUs of their own, one group for every server), but each sync sends only the weights
whose value in the engine's dtype changed since the last sync: per tensor, the flat indices
(int32) and the new values. The servers patch their weights in place (no layerwise reload).

saccade's part: the patches (`patches`), from the tensors each layer group materializes against
the last values sent, which the trainer keeps (the whole language model in the engine's dtype, in
host memory: 16 GB at 8B). A new group (the first sync, a server back or gone) starts from nothing:
every weight is sent, as a patch of all indices (3x a dense sync's bytes in bf16, once).

Whether it pays (`pays`): a patch costs (4 + s) bytes per changed weight against s per weight
dense (s: the dtype's size, 2 in bf16), so sparse sends fewer bytes when fewer than s / (4 + s) of
the weights change (a third in bf16). How many change was measured on the CPU (`saccade bench
changed-weights`, `MEASURED`): full fine-tuning at the shipped learning rates. `auto` takes it
when the expected bytes are at most half a dense sync's.

vLLM's code: wired and dry-run here, never run (no GPU here).
"""

from __future__ import annotations

import torch

from saccade.transports.backends.base import Backend, Party, Place, needs_gpus
from saccade.transports.backends.nccl import SHARED_GPU

# The largest fraction of the language model's bf16 weights that changed in one optimizer step after
# the first, by learning rate, over the tiny and small presets, 50 RL steps each (full fine-tuning,
# AdamW from bf16 values, constant lr). 2026-12-06, `saccade bench changed-weights --torch-threads 1`,
# this 2-core CPU (docs/vllm.md has the table): tiny 1.60% / 3.24% / 14.52%, small 3.54% / 6.39% / 20.02%.
MEASURED: dict[float, float] = {1e-6: 0.0354, 2e-6: 0.0639, 1e-5: 0.2002}
PAYS_BELOW = 0.5  # auto takes sparse when its expected bytes are at most this share of a dense sync's
INDEX_BYTES = 4  # int32 flat indices


def sparse_share(fraction: float, itemsize: int = 2) -> float:
    """A sparse sync's bytes over a dense one's, with `fraction` of the weights changed."""
    return min(1.0, fraction) * (INDEX_BYTES + itemsize) / itemsize


def expected_fraction(lr: float, steps: int = 1) -> float | None:
    """The measured fraction at the smallest measured learning rate at or above `lr`, for `steps`
    optimizer steps between syncs (at most `steps` times one step's); None above every measured one."""
    above = [rate for rate in MEASURED if rate >= lr]
    return None if not above else min(1.0, steps * MEASURED[min(above)])


def pays(lr: float, steps: int = 1, itemsize: int = 2) -> tuple[bool, str]:
    """Whether sparse sends would pay at `lr` with a sync every `steps` steps, and why."""
    fraction = expected_fraction(lr, steps)
    if fraction is None:
        measured = ", ".join(f"{rate:g}" for rate in sorted(MEASURED)) or "none"
        return False, f"no measurement of the weights that change at lr {lr:g} (measured: {measured})"
    share = sparse_share(fraction, itemsize)
    verdict = "pays" if share <= PAYS_BELOW else "does not pay"
    return share <= PAYS_BELOW, (f"at lr {lr:g}, {steps} step(s) a sync, about {fraction:.1%} of the weights change: "
                                 f"a patch sends {fraction:.3f} x ({INDEX_BYTES} + {itemsize}) / {itemsize} = "
                                 f"{share:.2f} of a dense sync's bytes, {verdict} (the bar: {PAYS_BELOW})")


@torch.no_grad()
def patches(names: list[str], tensors: list[torch.Tensor], last: dict[str, torch.Tensor]) -> list:
    """vLLM's `SparseWeightPatch`es that bring the servers from `last` (name -> the values sent
    before, on the CPU; updated here) to `tensors`: per tensor the flat int32 indices whose values
    differ (every index for a tensor not sent before) and the new values."""
    from vllm.distributed.weight_transfer.sparse_nccl_engine import SparseWeightPatch

    out = []
    for name, tensor in zip(names, tensors, strict=True):
        flat = tensor.reshape(-1)
        if flat.numel() >= 2**31:
            raise ValueError(f"{name}: {flat.numel()} elements, past int32 indices: use backend = \"nccl\"")
        before = last.get(name)
        if before is None:
            indices = torch.arange(flat.numel(), dtype=torch.int32, device=flat.device)
        else:
            bits = _same_size_int(flat.dtype)  # compared bit for bit: a NaN that stays is no change
            changed = flat.view(bits) != before.to(flat.device).reshape(-1).view(bits)
            indices = changed.nonzero().reshape(-1).to(torch.int32)
        last[name] = flat.to("cpu", copy=True)
        out.append(SparseWeightPatch(name=name, indices=indices, values=flat[indices.long()].contiguous(),
                                     full_shape=tuple(tensor.shape)))
    return out


def _same_size_int(dtype: torch.dtype) -> torch.dtype:
    """An integer dtype of `dtype`'s size."""
    return {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}[dtype.itemsize]


class SparseNCCLBackend(Backend):
    name = server_backend = "sparse_nccl"
    takes_source = False
    where = ("as nccl, sending only the weights that changed since the last sync (indices and values): pays when "
             "few change (full fine-tuning at small learning rates)")

    def problem(self, place: Place) -> str | None:
        return needs_gpus(place, self.name) or (SHARED_GPU if place.shares_gpu else None)

    def init_info(self, party: Party):
        from vllm.distributed.weight_transfer.sparse_nccl_engine import SparseNCCLTrainerInitInfo

        return SparseNCCLTrainerInitInfo(rank=party.rank, master_address=party.address, master_port=party.port,
                                         world_size=party.world_size)

    def send(self, engine, source) -> None:
        """One round inside one start/finish: every rank materializes each layer group (a sharded
        model's gathers), rank 0 sends its patches (`patches`) with vLLM's `send_weight_chunk`."""
        last = engine.__dict__.setdefault("saccade_last_sent", {})  # per group: a new one starts from nothing
        if engine.is_sender:
            engine.client.start_weight_update()
        for names, tensors in source.iter_groups():
            if engine.is_sender:
                engine.send_weight_chunk(patches(names, tensors, last))
        if engine.is_sender:
            engine.client.finish_weight_update()


SPARSE_NCCL = SparseNCCLBackend()
