"""A real RL run (or engine-weights export) in a process of its own that SIGKILLs itself at a
chosen instant: what a `kill -9`, an OOM kill or a lost machine does to a run. Used by
tests/test_kills.py; the run's config is test_rl's small one, on the embedded engine.

    python tests/kill_worker.py rl RUN_DIR [--resume] [--die-at POINT:N]
    python tests/kill_worker.py export RUN_DIR VERSION [--die-at export:1]

POINT:N dies at the N-th time the run reaches POINT:
- `checkpoint`: inside a checkpoint write, every file written into its `.tmp-*` folder, before
  `COMPLETE` and the rename that publishes it;
- `metrics`: half-way through writing a metrics.jsonl line (the line is torn);
- `export`: inside an engine-weights export, the tensors written, before it is published.
"""

from __future__ import annotations

import os
import signal
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))  # stub_tasks

CONFIG = [
    "--trainer.steps", "6",
    "--trainer.seed", "3",
    "--rollout.prompts_per_step", "2",
    "--rollout.group_size", "4",
    "--rollout.filter_zero_variance", "false",
    "--sampling.max_tokens", "4",
    "--loss.max_completion_tokens", "4",
    "--eval.every_steps", "0",
    "--checkpoint.every_steps", "2",
    "--checkpoint.keep_last", "3",
]


def die() -> None:
    os.kill(os.getpid(), signal.SIGKILL)


def die_at(point: str, n: int) -> None:
    """Patch the place `point` so that its n-th call kills this process there."""
    import saccade.trainer.checkpoint.saving as ckpt
    import saccade.trainer.checkpoint.engine_weights as engine_weights
    from saccade.metrics import MetricsLogger

    calls = {"n": 0}

    def reached() -> bool:
        calls["n"] += 1
        return calls["n"] == n

    if point == "checkpoint":  # the name save_checkpoint calls (imported from checkpoint_folder)
        write_manifest = ckpt.write_manifest

        def dying_manifest(tmp, step):
            if reached():
                die()
            write_manifest(tmp, step)

        ckpt.write_manifest = dying_manifest
    elif point == "metrics":
        log = MetricsLogger.log

        def dying_log(self, step, metrics, *, phase="train"):
            if reached():
                with open(self.path, "ab") as f:
                    f.write(b'{"step": %d, "phase": "train", "loss": 0.' % step)  # a torn line
                    f.flush()
                    os.fsync(f.fileno())
                die()
            return log(self, step, metrics, phase=phase)

        MetricsLogger.log = dying_log
    elif point == "export":
        copy2 = engine_weights.shutil.copy2

        def dying_copy(*args, **kwargs):  # the first config file copied: the tensors are all written
            if reached():
                die()
            return copy2(*args, **kwargs)

        engine_weights.shutil.copy2 = dying_copy
    else:
        raise SystemExit(f"unknown point {point!r}")


def config(run_dir: str):
    from saccade.config import RunConfig, load_config

    return load_config(RunConfig, "configs/demo.toml", [*CONFIG, "--log.dir", run_dir])


def main(argv: list[str]) -> None:
    import torch

    torch.set_num_threads(1)
    if "--die-at" in argv:
        i = argv.index("--die-at")
        point, n = argv[i + 1].split(":")
        die_at(point, int(n))
        argv = argv[:i] + argv[i + 2:]
    what, run_dir = argv[0], argv[1]
    cfg = config(run_dir)
    if what == "rl":
        from stub_tasks import scored_task

        from saccade.loops.rl import train_rl

        train_rl(cfg, run_dir=cfg.run_dir, task=scored_task(cfg), resume="--resume" in argv, progress=False)
    elif what == "export":
        from saccade.run.setup import build_setup
        from saccade.transports.files import full_weights_exporter

        setup = build_setup(cfg, cfg.run_dir)
        version = int(argv[2])
        with torch.no_grad():  # weights that differ from the base's, and from one version to the next
            for p in setup.model.parameters():
                if p.requires_grad:
                    p.add_(0.01 * version)
        export = full_weights_exporter(setup.model, setup.model_path, cfg.run_dir / "engine-weights")
        print(export(version))
    else:
        raise SystemExit(f"unknown command {what!r}")


if __name__ == "__main__":
    main(sys.argv[1:])
