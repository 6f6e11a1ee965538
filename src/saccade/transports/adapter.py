"""With LoRA, only the adapter (`engine.weight_sync.kind = "adapter"`): MBs instead of the GBs of
merged weights. After each sync the trainer writes its PEFT adapter folder; every live server
loads it in place under `saccade-policy` (`/update_weights` {"path", "lora": true}) and requests
then name it as their model. The servers need `--enable-lora --max-lora-rank R` (R >= lora.rank);
a server that loaded other full weights since it started first reloads its own checkpoint, since
an adapter only means something on the weights it was trained on (`ServerClient._load`).
"""

from __future__ import annotations

from pathlib import Path

from torch import nn

from saccade.distributed import SINGLE, World
from saccade.inference.server_client import ServerClient
from saccade.transports.files import FolderTransport, folder_exporter


def adapter_exporter(model: nn.Module, base_model_path: str, folder: Path, *, world: World = SINGLE):
    """export(version): the model's PEFT adapter folder."""
    from saccade.trainer.checkpoint.engine_weights import save_adapter_for_engine

    return folder_exporter(lambda out: save_adapter_for_engine(model, base_model_path, out), folder, world=world)


def adapter_transport(client: ServerClient, model: nn.Module, base_model_path: str, folder: Path, *,
                      world: World = SINGLE) -> FolderTransport:
    return FolderTransport(client, adapter_exporter(model, base_model_path, folder, world=world), adapter=True,
                           pushes=world.is_main)
