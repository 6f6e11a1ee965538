"""One RL run for the distributed tests, alone or as one rank under torchrun.

    python tests/distributed/worker.py RUN_DIR [--stop-after N] [--resume] [--record F] [--weights F] [overrides]
    python -m torch.distributed.run --nproc-per-node 2 tests/distributed/worker.py RUN_DIR ...

Runs `train_rl` on configs/demo.toml from the demo's warm start (`tiny-warm`) with the
overrides given, as `saccade rl` does (same world set-up). Besides the run folder, rank 0
writes what the tests compare: with --record, every step's scored samples (id, token ids,
reward) as JSON, observed as the loop hands them to `score_groups`; with --weights, the final
trainable weights, gathered whole, as safetensors. --scored scores replies by a hash of their
text (tests/stub_tasks.py), for runs from the random model (the vLLM servers serve that one).
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("run_dir")
    parser.add_argument("--stop-after", type=int, default=None)
    parser.add_argument("--resume", action="store_true")
    parser.add_argument("--record")
    parser.add_argument("--weights")
    parser.add_argument("--scored", action="store_true", help="score replies by a hash of their text "
                        "(tests/stub_tasks.py): rewards vary even for a random model")
    args, overrides = parser.parse_known_args()

    import saccade.orchestrator.rollout as rollout
    from saccade.config import RunConfig, load_config
    from saccade.tools.demo import resolve_warm_start
    from saccade.distributed import close_world, exit_rank, init_world
    from saccade.loops.rl import train_rl

    torch.set_num_threads(1)  # two ranks share this machine's two cores
    cfg = load_config(RunConfig, "configs/demo.toml", [
        "--model.path", "tiny-warm", "--trainer.torch_threads", "1", "--log.dir", args.run_dir, *overrides])
    world = init_world("cpu", timeout_s=cfg.trainer.dist_timeout_s)
    cfg = resolve_warm_start(cfg, world)  # as `saccade rl` does

    steps: list = []
    score_groups = rollout.score_groups

    def recording(groups, config):
        steps.append([[r.sample.sample_id, r.sample.input_ids.tolist(), r.reward] for g in groups for r in g])
        return score_groups(groups, config)

    rollout.score_groups = recording
    task = None
    if args.scored:
        sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
        from stub_tasks import scored_task

        task = scored_task(cfg)
    result = train_rl(cfg, run_dir=Path(args.run_dir), resume=args.resume, stop_after=args.stop_after,
                      progress=False, world=world, task=task)
    weights = trainable_weights(result["setup"].model)
    if world.is_main:
        if args.record:
            Path(args.record).write_text(json.dumps(steps))
        if args.weights:
            from safetensors.torch import save_file

            save_file(weights, args.weights)
    close_world(world)
    exit_rank(0)  # as `saccade rl` does under torchrun: no gloo abort in the interpreter's teardown


def trainable_weights(model) -> dict[str, torch.Tensor]:
    """The trainable parameters, whole (gathered from the shards: a collective), by name."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

    names = {n for n, p in model.named_parameters() if p.requires_grad}
    state = get_model_state_dict(model, options=StateDictOptions(full_state_dict=True, cpu_offload=True))
    return {k: v.contiguous() for k, v in state.items() if k in names}


if __name__ == "__main__":
    sys.exit(main())
