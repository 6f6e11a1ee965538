"""Running the trainer on several processes: torchrun, FSDP2 and the collectives the loop needs.

Nothing here is home-made in place of PyTorch's own stack: the processes are started by
`torchrun` (one per GPU, or per CPU slot with gloo), the model is sharded with FSDP2's
`fully_shard` (`saccade.trainer.sharding`, the one part that knows the model), and the loop exchanges
plain Python objects with `all_gather_object`. A run that torchrun did not start is
`World()`: rank 0 of 1, no process group, and every function here is then a no-op, so the
single-process path is exactly what it was.

How the loop uses a World (saccade.loops.rl):
- each rank samples its share of the step's prompts (`share`), contiguous, in prompt order;
- the scored groups are gathered (`all_gather`), so every rank holds the whole step's batch
  and computes the same advantages, metrics and packing plan as a single process would;
- the plan's micro-batches are spread over the ranks (`balance`): about the same tokens per
  rank and exactly the same number of forward/backward calls (padding micro-batches fill
  in), because FSDP's collectives hang when ranks call them a different number of times;
- the loss takes the step-global token and sequence counts (all-reduced in `train_step`)
  and FSDP sums the ranks' gradients (divide factor 1), so the gradient is the single
  process's, up to float reduction order.

The embedded engine samples from the sharded module: `unsharded(model)` all-gathers every
parameter once before a rollout and keeps them until it ends, so each rank decodes its own
prompts on its own, for as many tokens as they need, without a collective per token
(docs/distributed.md has the measurement behind that choice).
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field, replace
from typing import Any

import torch
from torch import nn


@dataclass(frozen=True)
class World:
    """This process's place among the trainer's processes. `World()` is a single process."""

    rank: int = 0
    size: int = 1
    local_rank: int = 0
    sharded: bool = False  # the model is FSDP2-sharded over the ranks (torchrun started the run)
    # The process group this World's collectives use; None: the default one. The rollout
    # thread that samples ahead has a gloo group of its own (`with_own_group`): collectives of
    # two threads on one group would interleave in different orders on different ranks.
    group: Any = field(default=None, compare=False, repr=False)

    @property
    def is_main(self) -> bool:
        """Rank 0: the one that writes metrics, shared checkpoint files and engine weights."""
        return self.rank == 0

    def share(self, n: int) -> range:
        """This rank's contiguous part of n items (prompts): the first n % size ranks take one more."""
        base, extra = divmod(n, self.size)
        start = self.rank * base + min(self.rank, extra)
        return range(start, start + base + (self.rank < extra))


    def with_own_group(self, timeout_s: float) -> World:
        """The same ranks over a new gloo group, for collectives on another thread than the
        trainer's (the rollout thread). Every rank must call it, in the same order. A single
        process is returned as it is."""
        if self.size == 1:
            return self
        from datetime import timedelta

        import torch.distributed as dist

        return replace(self, group=dist.new_group(backend="gloo", timeout=timedelta(seconds=timeout_s)))


SINGLE = World()


def launched_by_torchrun() -> bool:
    return "TORCHELASTIC_RUN_ID" in os.environ or ("RANK" in os.environ and "WORLD_SIZE" in os.environ)


def init_world(device: torch.device | str, *, timeout_s: float) -> World:
    """Join the process group torchrun set up (NCCL on CUDA, gloo on the CPU), or `World()`
    when torchrun did not start this process. torchrun with one process is still sharded
    (the FSDP path at world size 1), so it can be compared with the plain one.

    `device` is where this rank's model goes ('cuda' without an index: cuda:LOCAL_RANK). On
    CUDA that device is made current before the group exists and bound to it (`device_id`), so
    NCCL's communicator, and every barrier, uses this rank's GPU rather than guessing one from
    the rank. `timeout_s` (`trainer.dist_timeout_s`) bounds every collective, barriers included:
    it must outlast the longest wait one rank makes for another (docs/distributed.md)."""
    if not launched_by_torchrun():
        return SINGLE
    import torch.distributed as dist

    local_rank = int(os.environ.get("LOCAL_RANK", 0))
    args = process_group_args(torch.device(device), local_rank, timeout_s)
    if "device_id" in args:
        torch.cuda.set_device(args["device_id"])  # first: the group and its communicator are built on it
    if not dist.is_initialized():
        dist.init_process_group(**args)
    return World(rank=dist.get_rank(), size=dist.get_world_size(), local_rank=local_rank, sharded=True)


def process_group_args(device: torch.device, local_rank: int, timeout_s: float) -> dict[str, Any]:
    """`init_process_group`'s arguments for a rank whose model lives on `device`: NCCL bound to
    this rank's GPU on CUDA, gloo on the CPU; `timeout_s` for every collective."""
    from datetime import timedelta

    if timeout_s <= 0:
        raise ValueError(f"the process group's timeout must be > 0 seconds, got {timeout_s}")
    timeout = timedelta(seconds=timeout_s)
    if device.type == "cuda":
        index = local_rank if device.index is None else device.index
        return dict(backend="nccl", device_id=torch.device("cuda", index), timeout=timeout)
    if device.type != "cpu":
        raise ValueError(f"no process group for device {device}: saccade shards on CUDA (NCCL) or the CPU (gloo)")
    return dict(backend="gloo", timeout=timeout)


def close_world(world: World) -> None:
    if world.sharded:
        import torch.distributed as dist

        if dist.is_initialized():
            dist.destroy_process_group()


def exit_rank(code: int = 0) -> None:
    """End a torchrun rank whose work is done (process group closed, files written): flush and
    leave without the interpreter's finalization. On gloo, a rank intermittently died there
    with SIGABRT ("terminate called without an active exception": a C++ thread torn down
    while joinable) after a run that had finished, and torchrun then failed the whole job; it
    hit about one test suite run in two (tests/trainer/checkpoint/test_checkpoint_distributed.py,
    tests/serving/test_vllm_distributed.py). Nothing of the run is left to tear down."""
    import sys

    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


# ---------------------------------------------------------------------------- FSDP2 modules


def fsdp_modules(model: nn.Module) -> list[nn.Module]:
    from torch.distributed.fsdp import FSDPModule

    return [m for m in model.modules() if isinstance(m, FSDPModule)]


def is_sharded(model: nn.Module) -> bool:
    return bool(fsdp_modules(model))


@contextmanager
def unsharded(model: nn.Module) -> Iterator[None]:
    """Every parameter all-gathered once, kept whole until the block ends, then sharded again.

    Inside, forwards issue no collective, so ranks can run different numbers of them (each
    rank decodes its own prompts until they stop). A no-op for a model that is not sharded."""
    modules = fsdp_modules(model)  # the root (the PolicyLM) first
    if not modules:
        yield
        return
    for m in modules:
        m.unshard()
        m.set_reshard_after_forward(False, recurse=False)
    try:
        yield
    finally:
        # As fully_shard set them: the layers reshard after forward; the root does not (its
        # parameters would be all-gathered again straight away for backward).
        for m in modules:
            m.set_reshard_after_forward(m is not modules[0], recurse=False)
            m.reshard()


# ---------------------------------------------------------------------------- collectives


def all_gather(obj: Any, world: World) -> list[Any]:
    """Every rank's `obj`, in rank order (pickled; for small objects and CPU tensors)."""
    if world.size == 1:
        return [obj]
    import torch.distributed as dist

    out: list[Any] = [None] * world.size
    dist.all_gather_object(out, obj, group=world.group)
    return out


def first_error(error: BaseException | None, world: World) -> BaseException | None:
    """The lowest rank's error, on every rank (None: no rank had one), so that all ranks
    decide alike after a step that may fail on some of them (a push only rank 0 makes).
    Also a barrier: no rank returns before every rank has come here."""
    if world.size == 1:
        return error
    return next((e for e in all_gather(error, world) if e is not None), None)


def broadcast(obj: Any, world: World, src: int = 0) -> Any:
    if world.size == 1:
        return obj
    import torch.distributed as dist

    box = [obj]
    dist.broadcast_object_list(box, src=src, group=world.group)
    return box[0]


def all_reduce_sum(values: list[float], world: World, device: torch.device) -> list[float]:
    """Element-wise sums over ranks, in float64 (one collective for the whole list)."""
    if world.size == 1:
        return list(values)
    import torch.distributed as dist

    t = torch.tensor(values, dtype=torch.float64, device=device)
    dist.all_reduce(t, group=world.group)
    return t.tolist()


def barrier(world: World) -> None:
    if world.size > 1:
        import torch.distributed as dist

        dist.barrier(group=world.group)


# ---------------------------------------------------------------------------- balancing


def balance(sizes: list[int], world_size: int) -> list[list[int]]:
    """Micro-batch indices per rank: every rank gets ceil(n / world_size) slots (the same number
    of forward/backward calls; the callers pad the slots left empty), and the tokens are spread
    greedily, the largest micro-batch first to the rank with the fewest tokens and a free slot.
    Deterministic (ties go to the lower index and rank), so every rank computes the same answer."""
    slots = -(-len(sizes) // world_size) if sizes else 0
    ranks: list[list[int]] = [[] for _ in range(world_size)]
    load = [0] * world_size
    for i in sorted(range(len(sizes)), key=lambda i: (-sizes[i], i)):
        r = min((r for r in range(world_size) if len(ranks[r]) < slots), key=lambda r: (load[r], r))
        ranks[r].append(i)
        load[r] += sizes[i]
    return [sorted(r) for r in ranks]


def share_embeddings(needed: list[str], cache, world: World) -> int:
    """Put in this rank's cache the image embeddings its micro-batches need but another rank
    encoded (each rank encodes only the images of the prompts it sampled). Two gathers: who
    lacks which keys, then whoever has them sends them. Returns how many arrived here."""
    if world.size == 1:
        return 0
    missing = sorted({k for k in needed if k not in cache})
    wanted = {k for rank_missing in all_gather(missing, world) for k in rank_missing}
    offer = {}
    for key in sorted(wanted):
        if key in cache:
            entry = cache.get(key)  # pickled from the host: a CUDA tensor would land on this rank's GPU id
            offer[key] = type(entry)(entry.embeds.cpu(), entry.deepstack.cpu(), entry.grid_thw.cpu())
    arrived = 0
    for rank_offer in all_gather(offer, world):
        for key, entry in rank_offer.items():
            if key in missing and key not in cache:
                cache.put(key, entry)
                arrived += 1
    still = [k for k in missing if k not in cache]
    if still:
        raise RuntimeError(f"rank {world.rank}: no rank holds the embeddings of images {still[:3]}")
    return arrived
