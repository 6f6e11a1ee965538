"""`saccade bench distributed`: the sharded trainer at world 1 against world N, side by side.

Two torchrun launches of the same worker (this module, `python -m saccade.tools.bench.distributed
JOB.json`: the bench's `DistributedBenchConfig`, serialized), first `--nproc-per-node 1` (the
FSDP path on one rank), then `--nproc-per-node N`, on the same model and the same global batch.
Each reports, per rank:

- `state_bytes`: the parameters, gradients and AdamW moments this rank holds (its shards);
  world N against world 1 should be about 1/N;
- `step_s`: the median wall time of a `train_step` over the whole global batch (16 samples of
  `seq_len` tokens, packed into micro-batches of `max_tokens`, spread by `balance`);
- `export_s` and `export_peak_mb`: the engine-weights export (`merge_full_weights_for_engine`,
  gathered one tensor at a time, rank 0 writing) and the rise of this process's peak resident
  memory over it (Linux VmHWM, reset before the export);
- `decode_forward_ms`: one decode-sized forward (8 rows x 1 token) with the weights whole on
  every rank (`unsharded`: gathered once per rollout, what the embedded engine does) and
  sharded (FSDP all-gathers every layer at every forward: what ranks decoding in lockstep, as
  HF's synced_gpus, would pay at every token); `unshard_s`: the one all-gather.

Synthetic text samples (the trainer's work does not depend on what the tokens say); nothing
here samples or scores. On this CPU two ranks share two cores, so world N's step time says
what sharding costs here, not what N GPUs gain; the byte ratio holds anywhere.
"""

from __future__ import annotations

import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import torch
from pydantic import BaseModel

from saccade.tools.bench import read_job, write_job
from saccade.config.bench import DistributedBenchConfig
from saccade.parent_death import run_child
from saccade.serving.launch import free_port

SAMPLES = 16
LOSS_TOKENS = 32


class DistributedJob(BaseModel):
    """One torchrun launch's work: the bench's config, and where rank 0 writes."""

    bench: DistributedBenchConfig
    out: str  # the result file (JSON)
    export_dir: str  # where the engine-weights export goes


def run_distributed_bench(cfg: DistributedBenchConfig) -> dict[str, Any]:
    """World 1 then world `cfg.nproc`, each a torchrun launch; the figures and their ratios."""
    from saccade.models.presets import resolve_model

    nproc, preset, lora, device = cfg.nproc, cfg.preset, cfg.lora, cfg.device
    resolve_model(preset)  # built once here, not by every rank
    runs = {}
    for world in sorted({1, nproc}):  # --nproc 1: the FSDP path at world 1 alone, launched once
        with tempfile.TemporaryDirectory(prefix="saccade-bench-dist-") as tmp:
            out = Path(tmp) / "result.json"
            job = write_job(DistributedJob(bench=cfg, out=str(out), export_dir=str(Path(tmp) / "export")),
                            Path(tmp) / "job.json")
            cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", str(world),
                   "--rdzv-backend", "c10d", "--rdzv-endpoint", f"127.0.0.1:{free_port()}",
                   "-m", "saccade.tools.bench.distributed", str(job)]
            threads = max(1, (os.cpu_count() or 1) // world) if device == "cpu" else 1
            env = {**os.environ, "OMP_NUM_THREADS": str(threads)}
            done = run_child(cmd, env=env, capture_output=True, text=True)  # torchrun, ended with the bench
            if done.returncode != 0:
                raise RuntimeError(f"world {world} failed:\n{done.stdout[-2000:]}\n{done.stderr[-4000:]}")
            runs[world] = json.loads(out.read_text())
    one, many = runs[1], runs[nproc]
    result = {
        "preset": preset, "lora": lora, "nproc": nproc, "device": device, "seq_len": cfg.seq_len,
        "max_tokens": cfg.max_tokens, "samples": SAMPLES,
        "world1": one, f"world{nproc}": many,
    }
    if nproc == 1:
        return result
    return {
        **result,
        "state_bytes_ratio": max(many["state_bytes"]) / max(one["state_bytes"]),
        "step_time_ratio": many["step_s"] / one["step_s"],
        "export_time_ratio": many["export_s"] / one["export_s"],
        "export_peak_ratio": max(many["export_peak_mb"]) / max(max(one["export_peak_mb"]), 1e-9),
    }


def format_distributed_report(result: dict[str, Any]) -> str:
    n = result["nproc"]
    one, many = result["world1"], result[f"world{n}"]
    if n == 1:
        return "\n".join([
            f"{result['preset']} ({'LoRA' if result['lora'] else 'full fine-tuning'}), {result['samples']} samples x "
            f"{result['seq_len']} tokens, micro-batches of {result['max_tokens']}, {result['device']}, FSDP2 at world 1:",
            f"  params+grads+AdamW {max(one['state_bytes']) / 2**20:.1f} MB; train step {one['step_s']:.3f} s; "
            f"engine-weights export {one['export_s']:.3f} s (peak RSS rise {max(one['export_peak_mb']):.1f} MB)"
            + (f"; peak CUDA memory {one['cuda_peak_mb']:.0f} MB" if one.get("cuda_peak_mb") else ""),
            f"  decode forward: weights whole {one['decode_forward_ms']['unsharded']:.2f} ms, sharded "
            f"{one['decode_forward_ms']['sharded']:.2f} ms; one unshard {one['unshard_s']:.3f} s",
        ])
    lines = [
        f"{result['preset']} ({'LoRA' if result['lora'] else 'full fine-tuning'}), {result['samples']} samples x "
        f"{result['seq_len']} tokens, micro-batches of {result['max_tokens']}, {result['device']}:",
        f"  per-rank params+grads+AdamW  world 1 {max(one['state_bytes']) / 2**20:8.1f} MB   world {n} "
        f"{max(many['state_bytes']) / 2**20:8.1f} MB   ratio {result['state_bytes_ratio']:.3f}",
        f"  train step                   world 1 {one['step_s']:8.3f} s    world {n} {many['step_s']:8.3f} s    "
        f"ratio {result['step_time_ratio']:.2f}",
        f"  engine-weights export        world 1 {one['export_s']:8.3f} s    world {n} {many['export_s']:8.3f} s    "
        f"ratio {result['export_time_ratio']:.2f}",
        f"  export peak RSS rise (max)   world 1 {max(one['export_peak_mb']):8.1f} MB   world {n} "
        f"{max(many['export_peak_mb']):8.1f} MB",
        f"  decode forward at world {n}: weights whole {many['decode_forward_ms']['unsharded']:.2f} ms, sharded "
        f"(all-gather per forward) {many['decode_forward_ms']['sharded']:.2f} ms; one unshard {many['unshard_s']:.3f} s",
    ]
    return "\n".join(lines)


# ---------------------------------------------------------------------------- the worker


def _synthetic_micro_batches(vocab: int, seq_len: int, max_tokens: int, world, positions) -> list:
    """This rank's share of SAMPLES text samples (loss on their last LOSS_TOKENS), as `saccade rl`
    packs a step for it (`rank_micro_batches`: padded to as many as every other rank's)."""
    from saccade.models.vision import EmbeddingCache
    from saccade.trainer.packing import rank_micro_batches
    from saccade.trainer.samples import make_sample

    gen = torch.Generator().manual_seed(0)
    samples = []
    for i in range(SAMPLES):
        mask = torch.zeros(seq_len, dtype=torch.bool)
        mask[-LOSS_TOKENS:] = True
        samples.append(make_sample(
            f"s{i}", torch.randint(10, vocab, (seq_len,), generator=gen), torch.zeros(seq_len, dtype=torch.long),
            None, [], positions=positions, loss_mask=mask, inference_logprobs=torch.where(mask, -3.0, 0.0),
            advantage=float((-1) ** i)))
    # Text only: no image embeddings to look up or to share between the ranks.
    return rank_micro_batches(samples, EmbeddingCache(), max_tokens=max_tokens, image_token_id=-1,
                              spatial_merge_size=positions.merge, world=world)


def _state_bytes(model, optimizer) -> int:
    """Bytes of this rank's parameters, gradients and optimizer state (local shards)."""

    def local(t: torch.Tensor) -> torch.Tensor:
        return t.to_local() if hasattr(t, "to_local") else t

    total = sum(local(p).numel() * local(p).element_size() for p in model.parameters())
    total += sum(local(p.grad).numel() * local(p.grad).element_size() for p in model.parameters() if p.grad is not None)
    for state in optimizer.state.values():
        total += sum(local(v).numel() * local(v).element_size() for v in state.values()
                     if isinstance(v, torch.Tensor) and v.dim() > 0)
    return total


def _reset_peak_rss() -> None:
    try:
        Path("/proc/self/clear_refs").write_text("5")  # Linux: VmHWM back to the current RSS
    except OSError:
        pass


def worker(job: DistributedJob) -> None:
    from saccade.config import LoraConfig, PpoClipLossConfig, TrainerConfig
    from saccade.distributed import all_gather, barrier, close_world, exit_rank, init_world, unsharded
    from saccade.trainer.sharding import shard_model
    from saccade.process_stats import proc_status_kb
    from saccade.models.lm import apply_lora, load_policy_lm, set_full_finetune, unwrap_policy
    from saccade.models.sampling import SampledDistribution
    from saccade.models.presets import resolve_model
    from saccade.devices import resolve_device
    from saccade.trainer.checkpoint.engine_weights import merge_full_weights_for_engine, save_adapter_for_engine
    from saccade.timing import synchronize
    from saccade.trainer.step import build_optimizer, staged, train_step

    cfg = job.bench
    device = resolve_device(cfg.device)
    world = init_world(device, timeout_s=TrainerConfig().dist_timeout_s)  # on CUDA: sets the device first
    path = resolve_model(cfg.preset)
    policy = load_policy_lm(path, device=device)
    model = apply_lora(policy, LoraConfig(rank=16)) if cfg.lora else set_full_finetune(policy)
    shard_model(model, world, device=device, compute_dtype=torch.float32)
    optimizer, scheduler = build_optimizer(model, lr=1e-5, weight_decay=0.0, schedule=lambda s: 1.0)
    # Token ids below the vision tokens (Qwen's special tokens sit at the top of the vocabulary).
    config = policy.config
    vision_ids = [getattr(config, k, None) for k in ("image_token_id", "video_token_id", "vision_start_token_id",
                                                     "vision_end_token_id")]
    below = min([i for i in vision_ids if i is not None] + [config.text_config.vocab_size])
    micro_batches = staged(_synthetic_micro_batches(below, cfg.seq_len, cfg.max_tokens, world, policy.positions),
                           device)

    times = []
    for step in range(cfg.steps + 1):  # the first is a warm-up
        barrier(world)
        synchronize(device)
        start = time.perf_counter()
        train_step(model, optimizer, scheduler, micro_batches, loss=PpoClipLossConfig(), num_iterations=1,
                   grad_clip=1.0, distribution=SampledDistribution(), banned_token_ids=[], world=world)
        synchronize(device)
        if step:
            times.append(time.perf_counter() - start)
    state_bytes = _state_bytes(model, optimizer)  # gradients are kept until the next zero_grad

    barrier(world)
    _reset_peak_rss()
    before = proc_status_kb("VmRSS") or 0
    start = time.perf_counter()
    if cfg.lora:
        save_adapter_for_engine(model, path, Path(job.export_dir))
    else:
        merge_full_weights_for_engine(model, path, Path(job.export_dir))
    export_s = time.perf_counter() - start
    peak_mb = ((proc_status_kb("VmHWM") or 0) - before) / 1024

    # One decode-sized forward (8 rows x 1 token), weights whole against sharded.
    ids = torch.randint(10, 100, (1, 8), device=device)
    positions = torch.arange(8, device=device).view(1, 1, 8).expand(4, 1, 8)
    cu = torch.arange(9, dtype=torch.int32)  # 8 one-token sequences

    def forwards(n: int = 10) -> float:
        with torch.no_grad():
            policy.hidden_states(ids, positions, cu_seqlens=cu)
            synchronize(device)
            start = time.perf_counter()
            for _ in range(n):
                policy.hidden_states(ids, positions, cu_seqlens=cu)
            synchronize(device)
        return (time.perf_counter() - start) / n * 1000

    barrier(world)
    sharded_ms = forwards()
    barrier(world)
    start = time.perf_counter()
    with unsharded(model):
        unshard_s = time.perf_counter() - start
        whole_ms = forwards()
    barrier(world)

    mine = {"state_bytes": state_bytes, "export_peak_mb": peak_mb,
            "cuda_peak_mb": torch.cuda.max_memory_allocated(device) / 2**20 if device.type == "cuda" else None}
    gathered = all_gather(mine, world)
    if world.is_main:
        Path(job.out).write_text(json.dumps({
            "world_size": world.size,
            "state_bytes": [g["state_bytes"] for g in gathered],
            "export_peak_mb": [g["export_peak_mb"] for g in gathered],
            "cuda_peak_mb": max((g["cuda_peak_mb"] or 0.0) for g in gathered) or None,
            "step_s": statistics.median(times),
            "export_s": export_s,
            "unshard_s": unshard_s,
            "decode_forward_ms": {"unsharded": whole_ms, "sharded": sharded_ms},
            "parameters": sum(p.numel() for p in unwrap_policy(model).parameters()),
        }))
    close_world(world)
    exit_rank(0)  # see saccade.distributed.exit_rank


def main(argv: list[str] | None = None) -> None:
    """`python -m saccade.tools.bench.distributed JOB.json` under torchrun: one rank of a launch."""
    job = read_job(DistributedJob, argv)
    torch.set_num_threads(int(os.environ.get("OMP_NUM_THREADS", "1")))
    worker(job)


if __name__ == "__main__":
    main()
