"""Counting, on the CPU, the operations that make a GPU wait for the host or the host for the GPU.

On a CPU every tensor is already "on the host", so nothing can be timed; but the operations
that would sync on CUDA are visible to a `TorchDispatchMode` all the same:
- `lift_fresh`: a tensor made from Python data (`torch.tensor(list)`, indexing with a list),
  which on a GPU is a copy from the host before the kernel can run;
- `_local_scalar_dense`: a tensor read back as a Python number (`int()`, `float()`, `bool()`,
  `.item()`, `.tolist()`), which on a GPU waits for every queued kernel;
- `nonzero`, and indexing with a boolean mask: the result's size depends on the data, so on a
  GPU the host must wait to learn it.
A hot loop that makes none of these per iteration makes no host sync per iteration on a GPU
(`torch.cuda.set_sync_debug_mode` checks the same on one: `saccade bench gpu`)."""

from __future__ import annotations

from collections import Counter

import torch
from torch.utils._python_dispatch import TorchDispatchMode

HOST_DATA = "tensor from host data"
DEVICE_READ = "device value read on the host"
DATA_DEPENDENT = "data-dependent size"

_BOOL_INDEX_OPS = {torch.ops.aten.index.Tensor, torch.ops.aten.index_put_.default, torch.ops.aten.index_put.default}


class HostSyncCounter(TorchDispatchMode):
    """`with HostSyncCounter() as count:` ... `count.total`, `count.by_kind`, `count.ops`."""

    def __init__(self):
        super().__init__()
        self.by_kind: Counter[str] = Counter()
        self.ops: Counter[str] = Counter()

    def _note(self, kind: str, func) -> None:
        self.by_kind[kind] += 1
        self.ops[f"{kind}: {func}"] += 1

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func is torch.ops.aten.lift_fresh.default:
            self._note(HOST_DATA, func)
        elif func is torch.ops.aten._local_scalar_dense.default:
            self._note(DEVICE_READ, func)
        elif func in (torch.ops.aten.nonzero.default, torch.ops.aten.masked_select.default):
            self._note(DATA_DEPENDENT, func)
        elif func in _BOOL_INDEX_OPS:
            indices = args[1] if len(args) > 1 else kwargs.get("indices", [])
            if any(isinstance(i, torch.Tensor) and i.dtype == torch.bool for i in indices or []):
                self._note(DATA_DEPENDENT, func)
        return func(*args, **kwargs)

    @property
    def total(self) -> int:
        return sum(self.by_kind.values())
