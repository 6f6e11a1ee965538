"""Jobs for tests/trainer/checkpoint/test_checkpoint_distributed.py, run under torchrun (sharded, FSDP2 over
gloo) or in the test's own process (a plain model, no process group).

    python -m torch.distributed.run --standalone --nproc-per-node N dist_checkpoint_worker.py JOBS.json

JOBS.json is a list of jobs, run in order in the same processes (one launch does several):
- {"do": "train", "kind": "lora"|"full", "base": ..., "run_dir": ..., "result": ..., "engine": ...}
  a save before the first step (`run_dir`-step0), 2 AdamW steps, save (step 2), the engine
  weights and the logits of the trained model, then steps 3 and 4 (a save of step 3 in between,
  and, sharded, a save of step 4 that rank 1 makes fail);
- {"do": "resume", "kind": ..., "base": ..., "checkpoint": ..., "result": ..., "engine": optional}
  a fresh model (another LoRA init, scrambled RNG), load_checkpoint, 2 more steps (or "steps").
Rank 0 writes each job's figures (torch.save) to its "result".

Every step trains on a global batch of GLOBAL_ROWS sequences drawn from the global torch RNG (so
the RNG restore matters); each rank takes its share of the rows, the loss is divided by the
global token count and FSDP sums the gradients: the single process's step, up to float order.
"""

from __future__ import annotations

import json
import random
import sys
from pathlib import Path

import numpy as np
import torch

L = 12  # tokens per sequence
GLOBAL_ROWS = 4  # sequences per step, over all ranks
LR, WEIGHT_DECAY = 1e-2, 0.01


def _schedule(step: int) -> float:
    return 1.0 / (1 + step)


def setup(kind: str, base: str, world, seed: int = 0):
    """Model (sharded when the world is), AdamW and LambdaLR. `seed` changes LoRA's random init."""
    from saccade.config import LoraConfig
    from saccade.trainer.sharding import shard_model
    from saccade.models.lm import apply_lora, load_policy_lm, set_full_finetune
    from saccade.trainer.step import build_optimizer

    torch.manual_seed(seed)  # the same on every rank: every rank shards the same full model
    policy = load_policy_lm(base)
    model = apply_lora(policy, LoraConfig(rank=4, alpha=8.0)) if kind == "lora" \
        else set_full_finetune(policy)
    if world.sharded:
        shard_model(model, world, device=torch.device("cpu"), compute_dtype=torch.float32)
    optimizer, scheduler = build_optimizer(model, lr=LR, weight_decay=WEIGHT_DECAY, schedule=_schedule)
    return model, optimizer, scheduler


def _positions(ids_BL: torch.Tensor) -> torch.Tensor:
    B, n = ids_BL.shape
    return torch.arange(n).expand(4, B, n)


def logits(model, ids_BL: torch.Tensor) -> torch.Tensor:
    from saccade.models.lm import unwrap_policy

    policy = unwrap_policy(model)
    h = policy.hidden_states(ids_BL, _positions(ids_BL))
    return h @ policy.lm_head.weight.T


def train_step(model, optimizer, scheduler, world) -> float:
    """One AdamW step on this rank's share of the global batch; returns the global loss."""
    from saccade.distributed import all_reduce_sum

    ids = torch.randint(0, 1000, (GLOBAL_ROWS, L))  # every rank draws the same global batch
    rows = world.share(GLOBAL_ROWS)
    mine = ids[rows.start:rows.stop]
    out = logits(model, mine)
    loss = torch.nn.functional.cross_entropy(
        out[:, :-1].reshape(-1, out.shape[-1]), mine[:, 1:].reshape(-1), reduction="sum") / (GLOBAL_ROWS * (L - 1))
    loss.backward()
    optimizer.step()
    optimizer.zero_grad()
    scheduler.step()
    return all_reduce_sum([loss.item()], world, torch.device("cpu"))[0]


def text_ids() -> torch.Tensor:
    return torch.randint(0, 1000, (1, L), generator=torch.Generator().manual_seed(7))


@torch.no_grad()
def snapshot(model, optimizer) -> dict:
    """Trainable weights and AdamW state, whole (gathered from the shards), by parameter name."""
    from saccade.trainer.checkpoint.model_state import full_tensor

    weights, moments = {}, {}
    for name, p in model.named_parameters():
        if not p.requires_grad:
            continue
        weights[name] = full_tensor(p).clone()
        s = optimizer.state.get(p)
        if s:  # none before the first step
            moments[name] = (full_tensor(s["exp_avg"]).clone(), full_tensor(s["exp_avg_sq"]).clone(), float(s["step"]))
    return {"weights": weights, "moments": moments}


def _state(step: int):
    from saccade.trainer.checkpoint.saving import TrainState

    return TrainState(step=step, data_position=GLOBAL_ROWS * step, policy_version=step, extra={"note": "dist"})


def _failing_save(model, optimizer, scheduler, world, run_dir: str, fail_rank: int) -> list[str]:
    """A save at step 4 in which `fail_rank` cannot write its RNG file: what each rank raised."""
    import saccade.trainer.checkpoint.saving as ckpt
    from saccade.distributed import all_gather

    real_save = ckpt.torch.save

    def save(obj, f, *args, **kwargs):
        if world.rank == fail_rank and isinstance(f, (str, Path)) and Path(f).name.startswith("rng_rank"):
            raise OSError("disk full")
        return real_save(obj, f, *args, **kwargs)

    ckpt.torch.save = save
    try:
        ckpt.save_checkpoint(run_dir, model=model, optimizer=optimizer, scheduler=scheduler, state=_state(4),
                             keep_last=2)
        raised = "nothing"
    except Exception as e:  # noqa: BLE001 - reported to the test
        raised = f"{type(e).__name__}: {e}"
    finally:
        ckpt.torch.save = real_save
    return all_gather(raised, world)


def run_job(job: dict, world) -> dict:
    from saccade.trainer.checkpoint.saving import load_checkpoint, save_checkpoint
    from saccade.trainer.checkpoint.engine_weights import merge_full_weights_for_engine, save_adapter_for_engine

    kind, base = job["kind"], job["base"]
    result: dict = {"world_size": world.size, "sharded": world.sharded}
    if job["do"] == "train":
        random.seed(0), np.random.seed(0)
        model, optimizer, scheduler = setup(kind, base, world)
        # Before the first step the optimizer has no state (a sharded save then writes optimizer.pt).
        save_checkpoint(job["run_dir"] + "-step0", model=model, optimizer=optimizer, scheduler=scheduler,
                        state=_state(0), keep_last=1, base_model_path=base)
        result["losses_before"] = [train_step(model, optimizer, scheduler, world) for _ in range(2)]
        path = save_checkpoint(job["run_dir"], model=model, optimizer=optimizer, scheduler=scheduler,
                               state=_state(2), keep_last=2, base_model_path=base)
        result["checkpoint"] = str(path)
        result["saved"] = snapshot(model, optimizer)
        result["logits"] = logits(model, text_ids()).detach().clone()
        if job.get("engine"):
            merge_full_weights_for_engine(model, base, Path(job["engine"]))
            if kind == "lora":
                save_adapter_for_engine(model, base, Path(job["engine"] + "-adapter"))
        losses = [train_step(model, optimizer, scheduler, world)]
        save_checkpoint(job["run_dir"], model=model, optimizer=optimizer, scheduler=scheduler, state=_state(3),
                        keep_last=2, base_model_path=base)
        losses.append(train_step(model, optimizer, scheduler, world))
        if world.sharded:
            result["failed_save"] = _failing_save(model, optimizer, scheduler, world, job["run_dir"], fail_rank=1)
    elif job["do"] == "resume":
        model, optimizer, scheduler = setup(kind, base, world, seed=123)
        random.seed(9), np.random.seed(9), torch.manual_seed(9)  # a resumed run's RNG comes from the checkpoint
        result["state"] = load_checkpoint(Path(job["checkpoint"]), model=model, optimizer=optimizer,
                                          scheduler=scheduler)
        result["lr"] = scheduler.get_last_lr()
        result["saved"] = snapshot(model, optimizer)
        result["logits"] = logits(model, text_ids()).detach().clone()
        if job.get("engine"):
            merge_full_weights_for_engine(model, base, Path(job["engine"]))
        losses = [train_step(model, optimizer, scheduler, world) for _ in range(job.get("steps", 2))]
    else:
        raise ValueError(f"unknown job {job['do']!r}")
    result["losses"] = losses
    result["final"] = snapshot(model, optimizer)["weights"]
    if world.is_main:
        torch.save(result, job["result"])
    return result


def main(jobs_file: str) -> None:
    torch.set_num_threads(1)
    from saccade.config import TrainerConfig
    from saccade.distributed import close_world, exit_rank, init_world

    world = init_world("cpu", timeout_s=TrainerConfig().dist_timeout_s)
    try:
        for job in json.loads(Path(jobs_file).read_text()):
            run_job(job, world)
    finally:
        close_world(world)
    if world.sharded:
        exit_rank(0)  # as `saccade rl` does under torchrun: no gloo abort in the interpreter's teardown


if __name__ == "__main__":
    main(sys.argv[1])
