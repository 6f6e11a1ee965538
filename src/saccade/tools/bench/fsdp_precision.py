"""FSDP2 mixed precision against fp32: the same RL steps, sharded, in bfloat16 and in float32.

`run_precision_bench` starts one torchrun launch (`python -m saccade.tools.bench.fsdp_precision
JOB.json`: its `PrecisionBenchConfig`, serialized; NCCL on CUDA, gloo on the CPU) whose ranks run `saccade rl`'s loop (`train_rl`) twice from
the demo's warm start (`tiny-warm`, where groups carry reward variance): with
`model.dtype = bfloat16` (FSDP2's mixed precision: bf16 compute, fp32 shards and gradient
reduction) and with float32, same seed, same prompts. Rank 0 reads both runs' metrics.

What it shows: both train (steps whose groups carry signal, reward and loss of each step),
the train/inference mismatch of each precision (the engine samples from the same sharded
module, so bf16's figure is the rounding of one model seen twice), and seconds per step.
The two runs sample their own rollouts from their own precision's policy, so their rewards
are not expected to agree token for token: the comparison is of trends and magnitudes.
"""

from __future__ import annotations

import json
import os
import sys
import tempfile
from pathlib import Path
from typing import Any

from pydantic import BaseModel

from saccade.tools.bench import read_job, write_job
from saccade.config.bench import PrecisionBenchConfig
from saccade.parent_death import run_child

DTYPES = ("bfloat16", "float32")
# Per-step figures read back from each run's metrics.jsonl.
FIGURES = ("reward_mean", "groups_kept_frac", "loss", "mismatch_abs", "step_s", "grad_norm")


class PrecisionJob(BaseModel):
    """The torchrun launch's work: the bench's config, the model's folder, where it writes."""

    bench: PrecisionBenchConfig
    model_path: str  # cfg.model resolved to a folder, once, before the ranks start
    out: str  # the result file rank 0 writes (JSON)
    run_dir: str  # the two runs' folders go under it


def run_precision_bench(cfg: PrecisionBenchConfig) -> dict[str, Any]:
    """One torchrun launch at `cfg.nproc` ranks; per dtype the per-step figures and their means."""
    from saccade.serving.launch import free_port
    from saccade.tools.demo import resolve_model_name

    path = resolve_model_name(cfg.model)  # built once here, not by every rank
    with tempfile.TemporaryDirectory(prefix="saccade-bench-precision-") as tmp:
        out = Path(tmp) / "result.json"
        job = write_job(PrecisionJob(bench=cfg, model_path=path, out=str(out), run_dir=str(Path(tmp) / "runs")),
                        Path(tmp) / "job.json")
        cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", str(cfg.nproc),
               "--rdzv-backend", "c10d", "--rdzv-endpoint", f"127.0.0.1:{free_port()}",
               "-m", "saccade.tools.bench.fsdp_precision", str(job)]
        threads = max(1, (os.cpu_count() or 1) // cfg.nproc) if cfg.device == "cpu" else 1
        env = {**os.environ, "OMP_NUM_THREADS": str(threads)}
        done = run_child(cmd, env=env, capture_output=True, text=True, timeout=cfg.timeout_s)  # ends with the bench
        if done.returncode != 0:
            raise RuntimeError(f"torchrun failed:\n{done.stdout[-2000:]}\n{done.stderr[-4000:]}")
        runs = json.loads(out.read_text())
    summary = {d: _summary(runs[d]) for d in DTYPES}
    return {"device": cfg.device, "nproc": cfg.nproc, "steps": cfg.steps, "prompts": cfg.prompts, "model": cfg.model,
            "runs": runs, **{f"{d}_{k}": v for d in DTYPES for k, v in summary[d].items()}}


def _summary(rows: list[dict[str, float]]) -> dict[str, float | None]:
    def mean(key: str, part: slice = slice(None)) -> float | None:
        values = [r[key] for r in rows[part] if r.get(key) is not None]
        return sum(values) / len(values) if values else None

    half = max(1, len(rows) // 2)
    return {
        "steps_with_signal": sum(1 for r in rows if (r.get("groups_kept_frac") or 0) > 0),
        "reward_first_half": mean("reward_mean", slice(None, half)),
        "reward_second_half": mean("reward_mean", slice(half, None)),
        "mismatch_abs": mean("mismatch_abs"),
        "step_s": mean("step_s", slice(1, None)) if len(rows) > 1 else mean("step_s"),
    }


def format_precision_report(r: dict[str, Any]) -> str:
    lines = [f"FSDP2 at world {r['nproc']} on {r['device']}, {r['model']}, {r['steps']} RL steps of {r['prompts']} "
             "prompts per dtype:"]
    for d in DTYPES:
        fmt = lambda v: "-" if v is None else f"{v:.3g}"  # noqa: E731
        lines.append(
            f"  {d:<9} steps with signal {r[f'{d}_steps_with_signal']}/{r['steps']}, reward "
            f"{fmt(r[f'{d}_reward_first_half'])} -> {fmt(r[f'{d}_reward_second_half'])} (first/second half), "
            f"mismatch {fmt(r[f'{d}_mismatch_abs'])}, {fmt(r[f'{d}_step_s'])} s/step")
    return "\n".join(lines)


# ---------------------------------------------------------------------------- the worker


def worker(job: PrecisionJob) -> None:
    from saccade.config import RunConfig, load_config
    from saccade.tools.demo import demo_config_path
    from saccade.distributed import close_world, exit_rank, init_world
    from saccade.metrics import read_metrics
    from saccade.loops.rl import train_rl
    from saccade.devices import resolve_device

    cfg = job.bench
    configs = {dtype: load_config(RunConfig, demo_config_path(), [
        "--model.path", job.model_path, "--model.dtype", dtype, "--trainer.device", cfg.device,
        "--trainer.steps", str(cfg.steps), "--rollout.prompts_per_step", str(cfg.prompts),
        "--eval.every_steps", "0", "--checkpoint.every_steps", "0", "--log.dir", str(Path(job.run_dir) / dtype)])
        for dtype in DTYPES}
    t = configs[DTYPES[0]].trainer
    world = init_world(resolve_device(t.device), timeout_s=t.dist_timeout_s)  # as `saccade rl` joins it
    runs = {}
    for dtype, cfg in configs.items():
        train_rl(cfg, run_dir=cfg.run_dir, world=world, progress=False)
        if world.is_main:
            rows = read_metrics(cfg.run_dir, phase="train")
            runs[dtype] = [{k: r.get(k) for k in ("step", *FIGURES)} for r in rows]
    if world.is_main:
        Path(job.out).write_text(json.dumps(runs))
    close_world(world)
    exit_rank(0)  # see saccade.distributed.exit_rank


def main(argv: list[str] | None = None) -> None:
    """`python -m saccade.tools.bench.fsdp_precision JOB.json` under torchrun: one rank of the launch."""
    import torch

    job = read_job(PrecisionJob, argv)
    torch.set_num_threads(int(os.environ.get("OMP_NUM_THREADS", "1")))
    worker(job)


if __name__ == "__main__":
    main()
