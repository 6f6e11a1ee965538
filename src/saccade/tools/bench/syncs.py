"""Host synchronisations per decoded token (embedded engine) and per trainer micro-batch.

A host sync stalls the CPU until the GPU has caught up: the launch queue drains and the
GPU idles while the host issues the next kernels. On CUDA they are counted for real, with
`torch.cuda.set_sync_debug_mode("warn")`: every synchronising call (a copy to or from
pageable host memory, `.item()`, `nonzero`, a stream or device synchronize) warns once, and
the warnings are counted. Everywhere, a `TorchDispatchMode` also counts, by op, what would
sync on a GPU: a tensor's value read on the host (`aten._local_scalar_dense`: `.item()`,
`int()`, `float()`, `bool()`), ops whose output shape depends on values (`nonzero`,
`masked_select`, `unique`, boolean indexing), tensors made from host data (`lift_fresh`:
`torch.tensor(list)`), and copies between the host and a device. On the CPU those counts
are the figure (nothing syncs there); on CUDA they say where the syncs come from. The
embedded engine reads its stop flags on the host every token on the CPU (free there) and
every 16 tokens on a GPU (`stop_check_every`), so per-token counts on the CPU are not a GPU's.

Per decoded token: the same prompts decoded to `long` and to `short` tokens (every row runs
to its limit: stop tokens off), (count(long) - count(short)) / (long - short), so the
prefill, the images and the per-call work cancel. Per micro-batch: one rollout packed into
small micro-batches, then `train_step` on 2k of them and on k, (count(2k) - count(k)) / k,
the micro-batches handed over in host memory as `saccade rl` hands them (`staged`), so the
count includes their copies to the device; those copies (`MicroBatch.to`) are also counted apart.
"""

from __future__ import annotations

import collections
import tempfile
import warnings
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import torch
from torch.utils._python_dispatch import TorchDispatchMode

# Ops whose output size depends on the values: the host must read a count back.
DYNAMIC_SHAPE_OPS = ("nonzero", "masked_select", "_unique", "unique_", "unique_consecutive", "unique_dim",
                     "repeat_interleave", "bincount")


def _kind(func, args, kwargs) -> str | None:
    """Which kind of would-be sync an op is, or None."""
    name = func.__name__.split(".")[0]  # "nonzero.default" -> "nonzero"
    if name == "_local_scalar_dense":
        return "host_reads"
    if name.startswith(DYNAMIC_SHAPE_OPS):
        return "dynamic_shapes"
    if name in ("index", "index_put", "index_put_") and any(
            isinstance(i, torch.Tensor) and i.dtype == torch.bool for i in args[1] if i is not None):
        return "dynamic_shapes"  # boolean indexing, read or written: a nonzero inside
    if name in ("lift_fresh", "lift_fresh_copy"):
        return "host_tensors"
    if name == "_to_copy" and kwargs.get("device") is not None:
        return "transfers" if torch.device(kwargs["device"]).type != args[0].device.type else None
    if name == "copy_" and isinstance(args[1], torch.Tensor) and args[0].device.type != args[1].device.type:
        return "transfers"
    return None


class OpCounter(TorchDispatchMode):
    """Counts the ops that would make (or, on CUDA, do make) the host wait, by kind and by op."""

    def __init__(self):
        super().__init__()
        self.kinds: collections.Counter[str] = collections.Counter()
        self.ops: collections.Counter[str] = collections.Counter()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        kind = _kind(func, args, kwargs)
        if kind is not None:
            self.kinds[kind] += 1
            self.ops[func.__name__] += 1
        return func(*args, **kwargs)


@contextmanager
def counting(device: torch.device):
    """Count inside the block: yields a dict filled on exit with `syncs` (CUDA: the real
    synchronisations; None elsewhere), the op kinds and the ops by name."""
    out: dict[str, Any] = {}
    counter = OpCounter()
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        if device.type == "cuda":
            torch.cuda.set_sync_debug_mode("warn")
        try:
            with counter:
                yield out
        finally:
            if device.type == "cuda":
                torch.cuda.set_sync_debug_mode("default")
    out["syncs"] = sum("synchroniz" in str(w.message) for w in caught) if device.type == "cuda" else None
    out["kinds"] = dict(counter.kinds)
    out["ops"] = dict(counter.ops)


def would_sync(counts: dict[str, Any]) -> int:
    """What would sync on a GPU, from the op counts (transfers to a device are async from pinned
    memory, so they are left out; reads, value-dependent shapes and host-made tensors are not)."""
    kinds = counts["kinds"]
    return sum(kinds.get(k, 0) for k in ("host_reads", "dynamic_shapes", "host_tensors"))


def _per_unit(long: dict, short: dict, units: int) -> dict[str, Any]:
    ops = {k: (long["ops"].get(k, 0) - short["ops"].get(k, 0)) / units
           for k in set(long["ops"]) | set(short["ops"])}
    return {
        "syncs": None if long["syncs"] is None else (long["syncs"] - short["syncs"]) / units,
        "would_sync": (would_sync(long) - would_sync(short)) / units,
        "ops": {k: v for k, v in sorted(ops.items(), key=lambda kv: -abs(kv[1])) if v},
    }


def run_sync_bench(*, device: str = "auto", short: int = 16, long: int = 48, prompts: int = 4,
                   micro_batches: int = 2, dtype: str | None = None, log=print) -> dict[str, Any]:
    """Syncs per decoded token and per trainer micro-batch on the demo config's tiny model."""
    from saccade.tools.bench.step import SaccadeStep
    from saccade.config import RunConfig, load_config
    from saccade.tools.demo import demo_config_path
    from saccade.devices import resolve_device
    from saccade.inference.engine import ChatRequest, SamplingParams
    from saccade.trainer.packing import pack
    from saccade.trainer.step import staged

    dev = resolve_device(device)
    dtype = dtype or ("bfloat16" if dev.type == "cuda" else "float32")
    with tempfile.TemporaryDirectory(prefix="saccade-syncs-") as tmp:
        cfg = load_config(RunConfig, demo_config_path(), [
            "--trainer.device", str(dev), "--model.dtype", dtype, "--rollout.prompts_per_step", str(prompts),
            "--rollout.filter_zero_variance", "false", "--eval.every_steps", "0", "--log.dir", tmp])
        step = SaccadeStep(cfg, Path(tmp))
        s = step.setup
        engine = s.engine
        log(f"syncs: demo config on {dev} {dtype}, {prompts} prompts x 2 samples, {short} and {long} tokens")

        # 1. Decoding: every row decodes to max_tokens.
        stops = engine.stop_token_ids
        engine.stop_token_ids = []
        requests = [ChatRequest(p.sample_id, step.messages([p])[0]) for p in step.rows(0).prompts]
        decode: dict[int, dict] = {}
        try:
            for n in (short, long):
                engine.generate(requests, SamplingParams(max_tokens=n, n=2))  # warm: images cached, kernels loaded
                with counting(dev) as counts:
                    engine.generate(requests, SamplingParams(max_tokens=n, n=2))
                decode[n] = counts
        finally:
            engine.stop_token_ids = stops

        # 2. Training: one step's rollouts, packed into micro-batches of a few samples each, and
        # the train step `saccade rl` runs on them (`RLStep.train_micro_batches`).
        rollouts = step.rl.sample(0, step.rows(1))  # step 0: the engine holds the weights it started with
        samples = rollouts.batch.samples
        longest = max(smp.num_tokens for smp in samples)
        mbs = pack(samples, s.cache.get, max_tokens=longest, image_token_id=s.image_token_id,
                   spatial_merge_size=s.merge)
        rollouts.pins.release()
        k = min(micro_batches, len(mbs) // 2)
        if k < 1:
            raise RuntimeError(f"the rollout packed into {len(mbs)} micro-batch(es); need at least 2")
        train: dict[int, dict] = {}
        moves: dict[int, dict] = {}
        for n in (k, 2 * k):
            host = staged(mbs[:n], dev)  # as saccade rl hands them over: train_step sends each one ahead
            step.rl.train_micro_batches(0, host)  # warm
            with counting(dev) as counts:  # the copies alone, which train_step's count includes
                [mb.to(dev) for mb in host]
            moves[n] = counts
            with counting(dev) as counts:
                step.rl.train_micro_batches(0, host)
            train[n] = counts
    per_token = _per_unit(decode[long], decode[short], long - short)
    per_mb = _per_unit(train[2 * k], train[k], k)
    per_move = _per_unit(moves[2 * k], moves[k], k)
    return {
        "device": str(dev), "dtype": dtype, "prompts": prompts, "samples_per_prompt": 2,
        "short_tokens": short, "long_tokens": long, "stop_check_every": engine.stop_check_every,
        "micro_batches": [k, 2 * k], "micro_batch_tokens": longest,
        "per_token": per_token, "per_micro_batch": per_mb, "per_micro_batch_to_device": per_move,
        "decode_counts": {str(n): c for n, c in decode.items()},
        "train_counts": {str(n): c for n, c in train.items()},
    }


def format_sync_report(r: dict[str, Any]) -> str:
    def line(name: str, d: dict) -> str:
        real = "n/a (no CUDA)" if d["syncs"] is None else f"{d['syncs']:.2f}"
        top = ", ".join(f"{op} {v:.2f}" for op, v in list(d["ops"].items())[:4]) or "none"
        return f"  {name:<28} syncs {real:<14} would sync on a GPU {d['would_sync']:.2f}   ({top})"

    return "\n".join([
        f"host syncs on {r['device']} {r['dtype']}: {r['prompts']} prompts x {r['samples_per_prompt']}, decoded to "
        f"{r['short_tokens']} and {r['long_tokens']} tokens; train_step on {r['micro_batches'][0]} and "
        f"{r['micro_batches'][1]} micro-batches",
        line("per decoded token", r["per_token"]),
        line("per trainer micro-batch", r["per_micro_batch"]),
        line("per micro-batch to device", r["per_micro_batch_to_device"]),
    ])
