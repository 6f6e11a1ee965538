"""What a collective sync sends, as vLLM's trainer engines take it: a `WeightSource`
(`vllm.distributed.weight_transfer.base`) over the trainer's plan (`saccade.trainer.transfer_plan`).

- `PlanSource`: the language model in the engine's names, layout and dtypes, in saccade's layer
  groups (the tensors outside the decoder layers first, then layer 0, 1, ...), one group
  materialized at a time (LoRA merged in, a sharded model's shards gathered: every rank iterates
  it, rank 0 alone gets tensors). `metadata()` says it all without materializing anything. On the
  CPU (gloo) a group's tensors are views into one flat buffer, which `packed` sends without a copy.
- `SharedGroups`: one pass over a source shared by the engines that send it to several groups
  at once (gloo: a group per server), each in its own thread: a group is materialized once, when
  the first engine asks for it and every engine still sending is done with the one before, so one
  group is held at a time however many servers there are.

Imports vLLM's weight-transfer base (the trainer imports this only for a collective sync).
"""

from __future__ import annotations

import math
import threading
import time
from collections.abc import Iterator

import torch
from vllm.distributed.weight_transfer.base import ParamMeta, WeightSource

from saccade.trainer.transfer_plan import GroupMaterializer


def packed(tensors: list[torch.Tensor]) -> torch.Tensor:
    """The tensors' bytes back to back, one flat uint8 CPU tensor: the buffer they are views of when
    they lie in it in order (what `PlanSource` yields on the CPU), else a copy."""
    if not tensors:
        return torch.empty(0, dtype=torch.uint8)
    storage = tensors[0].untyped_storage()
    at = 0
    for t in tensors:
        if (t.device.type != "cpu" or not t.is_contiguous() or t.untyped_storage().data_ptr() != storage.data_ptr()
                or t.storage_offset() * t.element_size() != at):
            return torch.cat([x.contiguous().reshape(-1).view(torch.uint8).cpu() for x in tensors])
        at += t.numel() * t.element_size()
    whole = torch.empty(0, dtype=torch.uint8).set_(storage)
    return whole[:at]


def views_of(buffer: torch.Tensor, dtypes: list[torch.dtype], shapes: list[tuple[int, ...]]) -> list[torch.Tensor]:
    """The tensors `buffer` (flat uint8) holds back to back; a piece that starts off its dtype's
    alignment is copied."""
    out, at = [], 0
    for dtype, shape in zip(dtypes, shapes, strict=True):
        nbytes = math.prod(shape) * dtype.itemsize
        piece = buffer[at:at + nbytes]
        out.append((piece if at % dtype.itemsize == 0 else piece.clone()).view(dtype).view(shape))
        at += nbytes
    return out


class PlanSource(WeightSource):
    """The trainer's plan as vLLM's `WeightSource`. `device`: where the tensors go ("cpu": packed
    in one buffer per group, for gloo; a CUDA device for NCCL or IPC). On a rank that does not
    compute (`weights.computes` False: ranks other than 0 of a sharded trainer) iteration gathers
    and yields None for each tensor."""

    def __init__(self, weights: GroupMaterializer, *, device: torch.device | str = "cpu"):
        self.weights = weights
        self.device = torch.device(device)
        self.materialize_s = 0.0  # seconds spent materializing, all passes (the figures' "materialize")

    def metadata(self) -> list[ParamMeta]:
        return [ParamMeta(i.name, i.dtype, i.shape) for group in self.weights.groups for i in group]

    def groups(self) -> list[list[str]]:
        return [[i.name for i in group] for group in self.weights.groups]

    def iter_groups(self) -> Iterator[tuple[list[str], list[torch.Tensor]]]:
        for group in self.weights.groups:
            t0 = time.perf_counter()
            names = [i.name for i in group]
            if not self.weights.computes:
                self.weights.gather_group(group)
                tensors = [None] * len(group)
            elif self.device.type == "cpu":
                tensors = views_of(self.weights.materialize(group), [i.dtype for i in group], [i.shape for i in group])
            else:
                tensors = self.weights.tensors(group, self.device)
            self.materialize_s += time.perf_counter() - t0
            yield names, tensors

    def __iter__(self) -> Iterator[tuple[str, torch.Tensor]]:
        for names, tensors in self.iter_groups():
            yield from zip(names, tensors, strict=True)


class SharedGroups:
    """One pass over `source`'s groups for `consumers` engines in threads (the module note).
    `view(i)` is consumer i's `WeightSource`; `leave(i)` when its engine is done (or failed: the
    others no longer wait for it); `drain()` once every consumer left materializes the groups
    nobody asked for (the other ranks of a sharded trainer gather every group)."""

    def __init__(self, source: WeightSource, consumers: int):
        self.source = source
        self._groups = source.groups()
        self._it = source.iter_groups()
        self._cond = threading.Condition()
        self._index = -1  # the group held now
        self._current: tuple[list[str], list[torch.Tensor]] | None = None
        self._busy: set[int] = set()  # consumers not yet done with the group held
        self._active = set(range(consumers))
        self._producing = False
        self._error: BaseException | None = None

    def view(self, consumer: int) -> WeightSource:
        return _View(self, consumer)

    def get(self, consumer: int, index: int) -> tuple[list[str], list[torch.Tensor]]:
        """Group `index` for `consumer`, which is then done with group `index - 1`."""
        with self._cond:
            if index > self._index:  # asking for the next group: done with the one held
                self._busy.discard(consumer)
                self._cond.notify_all()
            while True:
                if self._error is not None:
                    raise RuntimeError(f"materializing the weights failed: {self._error}") from self._error
                if self._index == index:
                    return self._current
                if self._index == index - 1 and not self._busy and not self._producing:
                    self._producing = True
                    break
                self._cond.wait()
        try:
            current = next(self._it)
        except BaseException as err:  # noqa: BLE001 - every consumer hears of it
            with self._cond:
                self._error, self._producing = err, False
                self._cond.notify_all()
            raise
        with self._cond:
            self._index, self._current, self._producing = index, current, False
            self._busy = set(self._active)
            self._cond.notify_all()
            return current

    def leave(self, consumer: int) -> None:
        with self._cond:
            self._active.discard(consumer)
            self._busy.discard(consumer)
            self._cond.notify_all()

    def drain(self) -> None:
        """The groups nobody asked for, materialized and dropped (call once every consumer left)."""
        self._current = None
        if self._producing or self._error is not None:
            return  # the pass broke inside the source itself
        for _ in self._it:
            pass


class _View(WeightSource):
    def __init__(self, shared: SharedGroups, consumer: int):
        self.shared, self.consumer = shared, consumer

    def metadata(self) -> list[ParamMeta]:
        return self.shared.source.metadata()

    def groups(self) -> list[list[str]]:
        return self.shared._groups

    def iter_groups(self) -> Iterator[tuple[list[str], list[torch.Tensor]]]:
        for index in range(len(self.shared._groups)):
            yield self.shared.get(self.consumer, index)

    def __iter__(self) -> Iterator[tuple[str, torch.Tensor]]:
        for names, tensors in self.iter_groups():
            yield from zip(names, tensors, strict=True)
