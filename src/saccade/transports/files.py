"""Full weights through a folder (`engine.weight_sync.kind = "files"`): after each sync the trainer
writes an ordinary Hugging Face folder of its current weights (LoRA merged in:
`merge_full_weights_for_engine`), and every live server reloads it (`/update_weights`
{"path": ...}). The folder must be readable by every server (a shared filesystem for remote ones).
A server that answers again is given the last folder by the client's health check before it is
put back. `FolderTransport` is also the adapter's (`saccade.transports.adapter`).
"""

from __future__ import annotations

import shutil
import time
from collections.abc import Callable
from pathlib import Path

from torch import nn

from saccade.distributed import SINGLE, World, barrier
from saccade.inference.server_client import ServerClient


class FolderTransport:
    """Each sync: `export(version)` writes the folder (every rank: a sharded model's gathers),
    then rank 0 (`pushes`) has every live server load it."""

    rejoins_at_sync = False  # the health check gives a server that answers again the last folder

    def __init__(self, client: ServerClient, export: Callable[[int], str], *, adapter: bool = False,
                 pushes: bool = True):
        self.client, self.export, self.adapter, self.pushes = client, export, adapter, pushes

    def send(self, version: int) -> dict[str, float]:
        start = time.perf_counter()
        folder = self.export(version)
        exported = time.perf_counter()
        if self.pushes:
            self.client.run(self.client.push(folder, version))
        end = time.perf_counter()
        return {"seconds": end - start, "export_s": exported - start, "load_s": end - exported}


def folder_exporter(write: Callable[[Path], Path], folder: Path, *, world: World = SINGLE) -> Callable[[int], str]:
    """export(version) -> `folder/v{version}`, written by `write`. Older versions are removed (the
    servers have loaded them already). Sharded: every rank calls it, rank 0 writes, and no rank
    returns before the folder is there."""
    from saccade.atomic import remove_dead_tmp_dirs

    def export(version: int) -> str:
        out = write(folder / f"v{version}")
        if world.is_main:
            for old in folder.glob("v*"):
                if old != out and old.is_dir():
                    shutil.rmtree(old, ignore_errors=True)
            remove_dead_tmp_dirs(folder)  # an export killed mid-write (a SIGKILLed run) left its temp folder
        barrier(world)
        return str(out)

    return export


def full_weights_exporter(model: nn.Module, base_model_path: str, folder: Path, *,
                          world: World = SINGLE) -> Callable[[int], str]:
    """export(version): a full HF folder of the model's current weights, LoRA merged in."""
    from saccade.trainer.checkpoint.engine_weights import merge_full_weights_for_engine

    return folder_exporter(lambda out: merge_full_weights_for_engine(model, base_model_path, out), folder, world=world)


def files_transport(client: ServerClient, model: nn.Module, base_model_path: str, folder: Path, *,
                    world: World = SINGLE) -> FolderTransport:
    return FolderTransport(client, full_weights_exporter(model, base_model_path, folder, world=world),
                           pushes=world.is_main)
