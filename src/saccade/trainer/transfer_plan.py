"""What a weight sync sends, without files: the language model's tensors as the engine names,
shapes and types them, in layer groups (the trainer's part of every transport that streams; the
transports themselves: `saccade.transports`).

Only the language model is sent (the tower is frozen), in the engine's layout and dtypes: the
tensors, names and bytes `merge_full_weights_for_engine` would write to a folder
(`engine_file_plan` decides both). The groups are what vLLM's layerwise reload rebuilds one at a
time: the tensors outside the decoder layers first, then layer 0, 1, ...; one group is
materialized at a time (LoRA merged in, a sharded model's shards gathered).
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass
from pathlib import Path

import torch
from torch import nn

_LAYER = re.compile(r"\.layers\.(\d+)\.")


@dataclass(frozen=True)
class Outgoing:
    """One tensor as the engine gets it: its name there, the trained tensor's canonical name,
    dtype and shape in the engine's layout."""

    name: str
    trained: str
    dtype: torch.dtype
    shape: tuple[int, ...]

    @property
    def nbytes(self) -> int:
        return math.prod(self.shape) * self.dtype.itemsize


def layer_groups(items: list[Outgoing]) -> list[list[Outgoing]]:
    """The tensors outside the decoder layers (embeddings, final norm, lm_head) first, then one
    group per decoder layer in index order: what vLLM's layerwise reload rebuilds one at a time."""
    rest: list[Outgoing] = []
    layers: dict[int, list[Outgoing]] = {}
    for item in items:
        match = _LAYER.search(item.name)
        if match is None:
            rest.append(item)
        else:
            layers.setdefault(int(match.group(1)), []).append(item)
    return ([rest] if rest else []) + [layers[i] for i in sorted(layers)]


def transfer_plan(source, base_model_path: str | Path) -> list[list[Outgoing]]:
    """What a sync sends, grouped (`layer_groups`): every trained tensor of `source` (a
    `_LiveWeights`), named, shaped and typed as `engine_file_plan` writes it for the base model."""
    from saccade.models.loading import load_layout, resolve_model_path, safetensors_files
    from saccade.trainer.checkpoint.engine_weights import _ST_DTYPES, _safetensors_header, engine_file_plan

    base = resolve_model_path(base_model_path)
    headers = [(file, *_safetensors_header(file)) for file in safetensors_files(base)]
    plan = engine_file_plan(headers, load_layout(base), {k: tuple(source.shape(k)) for k in source.keys})
    items = [Outgoing(e.key, e.trained, _ST_DTYPES[e.dtype], tuple(e.shape))
             for _, entries in plan for e in entries if e.trained]
    return layer_groups(items)


class GroupMaterializer:
    """The trainer's model (PolicyLM or PeftModel; read, never changed) as the layer groups a sync
    sends, one group's bytes at a time. `computes`: False on the ranks other than 0 of a sharded
    trainer, which only take part in each tensor's gather (one all-gather per tensor), so no rank
    holds more than one group whole."""

    def __init__(self, model: nn.Module, base_model_path: str | Path, *, computes: bool = True):
        from saccade.models.loading import load_layout
        from saccade.trainer.checkpoint.engine_weights import _LiveWeights

        self.computes = computes
        self.source = _LiveWeights(model, compute=computes)
        self.groups = transfer_plan(self.source, base_model_path)
        checkpoint = load_layout(base_model_path).family.checkpoint
        self.to_hub = checkpoint.to_hub  # the family's engine layout
        self.transposed = tuple(checkpoint.transposed)  # names the engine holds transposed (MoE experts)

    @property
    def nbytes(self) -> int:
        return sum(item.nbytes for group in self.groups for item in group)

    def gather_only(self) -> None:
        """A rank other than 0's part of one sync: every tensor's gather, in the groups' order."""
        for group in self.groups:
            self.gather_group(group)

    def gather_group(self, group: list[Outgoing]) -> None:
        """A rank other than 0's part of one group: each tensor's gather, in order."""
        for item in group:
            self.source.get(item.trained)

    @torch.no_grad()
    def materialize(self, group: list[Outgoing]) -> torch.Tensor:
        """The group's tensors in the engine's layout and dtypes, back to back in one flat uint8 buffer
        on the CPU (what a gloo broadcast sends)."""
        return torch.cat([t.reshape(-1).view(torch.uint8) for t in self.tensors(group, torch.device("cpu"))])

    @torch.no_grad()
    def tensors(self, group: list[Outgoing], device: torch.device | None = None) -> list[torch.Tensor]:
        """The group's tensors in the engine's layout and dtypes, each contiguous, on `device` (None:
        where the trainer holds them; a GPU backend sends from the trainer's device)."""
        out = []
        for item in group:
            t = self._to_engine(item, self.source.get(item.trained))
            out.append(t.to(device=device if device is not None else t.device, dtype=item.dtype).contiguous())
        return out

    def _to_engine(self, item: Outgoing, t: torch.Tensor) -> torch.Tensor:
        out = self.to_hub(item.trained, t.detach())
        if tuple(out.shape) != item.shape:
            raise ValueError(f"{item.trained}: {tuple(out.shape)} in the engine's layout, the plan says {item.shape}")
        return out
