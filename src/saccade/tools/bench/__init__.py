"""The benchmarks behind `saccade bench ...` (their options: `saccade.config.bench`).

A bench that starts worker processes (torchrun ranks, a stage of `bench gpu` in a fresh
interpreter) hands each its job as one JSON file (`write_job`): a pydantic model holding the
bench's typed config, which the worker validates back (`read_job`), never a command line it
parses again. The benches that run `saccade rl` start it with `rl_command`, in one process or under
torchrun, tied to the bench with `rl_death_signal` (`saccade.parent_death`).
"""

from __future__ import annotations

import signal
import sys
from pathlib import Path
from typing import TypeVar

from pydantic import BaseModel

J = TypeVar("J", bound=BaseModel)


def write_job(job: BaseModel, path: Path) -> Path:
    """The job as JSON at `path`, for a worker's `read_job`."""
    path.write_text(job.model_dump_json())
    return path


def read_job(model: type[J], argv: list[str] | None = None) -> J:
    """A worker's job: its one argument, the JSON file its bench wrote (`write_job`), validated."""
    argv = sys.argv[1:] if argv is None else argv
    if len(argv) != 1:
        raise SystemExit(f"usage: python -m {model.__module__} JOB.json (a worker: its bench starts it)")
    return model.model_validate_json(Path(argv[0]).read_text())


def rl_command(config: str | Path, world: int) -> list[str]:
    """`saccade rl CONFIG` in one process, or under torchrun with `world` ranks on this machine."""
    if world == 1:
        return [sys.executable, "-m", "saccade", "rl", str(config)]
    from saccade.serving.launch import free_port

    return [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", str(world), "--rdzv-backend", "c10d",
            "--rdzv-endpoint", f"127.0.0.1:{free_port()}", "-m", "saccade", "rl", str(config)]


def rl_death_signal(command: list[str]) -> int:
    """What an `rl_command` gets when its bench dies (`saccade.parent_death.start_child`).
    `saccade rl` in one process: SIGKILL. SIGTERM would ask it to finish its step and save a
    checkpoint first, and with its server gone with the bench, that step waits out
    engine.no_server_wait_s; a bench's run has nothing to keep. torchrun: SIGTERM, which it
    forwards to its ranks (they run in sessions of their own, so a SIGKILL to torchrun would
    leave them running), killing those still there 30 s later."""
    return signal.SIGTERM if "torch.distributed.run" in command else signal.SIGKILL
