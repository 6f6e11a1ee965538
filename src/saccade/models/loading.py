"""Load the pieces of a vision-language checkpoint separately: processor, vision tower, language model.

The trainer holds only the language model and lm_head; the engine holds the vision
tower. Each is read by transformers' own loader from the checkpoint's tensors of that part
alone (`saccade.models.checkpoint_layout`), so the other half is never materialised and every
layout transformers reads is read alike. What differs between architectures (the classes, the
tower's outputs) is asked of the model's family (`saccade.models.families`). Works with a local folder or a hub id (resolved with
`huggingface_hub.snapshot_download` on machines that can reach the hub).
"""

from __future__ import annotations

import os

import torch
from torch import nn

from saccade.models.checkpoint_layout import (
    ROTARY_BUFFERS, VISION_TOWER, CheckpointLayout, safetensors_files, to_keeping_rotary_fp32,
)
from saccade.models.families import LM_HEAD_KEY, LM_PREFIX, VISION_PREFIX, ModelFamily, family_of
from saccade.models.model_path import resolve_model_path

# The canonical names and the weight files' list, re-exported for callers.
__all__ = ["LM_HEAD_KEY", "LM_PREFIX", "VISION_PREFIX", "resolve_model_path", "safetensors_files"]


def load_config(model: str | os.PathLike):
    from transformers import AutoConfig

    config = AutoConfig.from_pretrained(resolve_model_path(model))
    try:
        family_of(config)
    except ValueError as e:
        raise ValueError(f"{model}: {e}") from e
    return config


def load_family(model: str | os.PathLike) -> ModelFamily:
    """The family of a model folder or hub id (its config.json alone is read)."""
    return family_of(load_config(model))


def load_processor(model: str | os.PathLike):
    from transformers import AutoProcessor

    return AutoProcessor.from_pretrained(resolve_model_path(model))


def load_layout(model: str | os.PathLike) -> CheckpointLayout:
    """The folder's checkpoint layout as transformers reads it (`saccade.models.checkpoint_layout`):
    config.json and the whole model on the meta device, nothing read from the weights yet."""
    path = resolve_model_path(model)
    return CheckpointLayout(path, load_config(path))


def rotary_buffers_not_fp32(module: nn.Module) -> list[str]:
    """Names of rotary inverse-frequency buffers that are not float32 (empty: all is well)."""
    return [name for name, buf in module.named_buffers()
            if name.rpartition(".")[2] in ROTARY_BUFFERS and buf.dtype != torch.float32]


def load_vision_tower(model: str | os.PathLike, *, dtype: torch.dtype = torch.float32, device="cpu") -> nn.Module:
    """The frozen vision tower (patch embed, blocks, merger, and DeepStack mergers where the family
    has them), in eval mode, read as transformers reads it; the language model's tensors are never
    read."""
    layout = load_layout(model)
    layout.config.vision_config._attn_implementation = "sdpa"
    layout.load(VISION_TOWER, dtype=dtype, device=device)
    tower = to_keeping_rotary_fp32(layout.vision_tower(), device=device, dtype=dtype)
    tower.requires_grad_(False)
    return tower.eval()


def load_full_model(model: str | os.PathLike, *, dtype: torch.dtype = torch.float32, attn_implementation: str = "sdpa"):
    """The family's whole transformers model (vision tower and all): the reference for parity checks."""
    path = resolve_model_path(model)
    return load_family(path).full_model_class().from_pretrained(
        path, dtype=dtype, attn_implementation=attn_implementation
    ).eval()
