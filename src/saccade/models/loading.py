"""Load the pieces of a Qwen3-VL checkpoint separately: processor, vision tower, language model.

The trainer holds only the language model and lm_head; the engine holds the vision
tower. Both are read straight from the checkpoint's safetensors by key prefix, so the
other half is never materialised. Works with a local folder or a hub id (resolved with
`huggingface_hub.snapshot_download` on machines that can reach the hub).
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import torch
from torch import nn

VISION_PREFIX = "model.visual."
LM_PREFIX = "model.language_model."
LM_HEAD_KEY = "lm_head.weight"


def resolve_model_path(model: str | os.PathLike) -> Path:
    """A local folder as is; otherwise a hub id, downloaded (or found in the HF cache)."""
    path = Path(model)
    if path.exists():
        if not (path / "config.json").exists():
            raise ValueError(f"{path} has no config.json: it is not a Hugging Face model folder")
        return path
    if str(model).startswith((".", "/")) or str(model).count("/") != 1:
        raise ValueError(f"model {str(model)!r} is neither an existing folder nor a hub id like 'Qwen/Qwen3-VL-2B-Instruct'")
    from huggingface_hub import snapshot_download

    return Path(snapshot_download(str(model), allow_patterns=["*.json", "*.safetensors", "*.jinja", "*.txt", "*.model"]))


def load_config(model: str | os.PathLike):
    from transformers import AutoConfig

    config = AutoConfig.from_pretrained(resolve_model_path(model))
    if config.model_type != "qwen3_vl":
        raise ValueError(f"saccade supports Qwen3-VL (model_type 'qwen3_vl'); {model} is {config.model_type!r}")
    return config


def load_processor(model: str | os.PathLike):
    from transformers import AutoProcessor

    return AutoProcessor.from_pretrained(resolve_model_path(model))


def safetensors_files(path: Path) -> list[Path]:
    index = path / "model.safetensors.index.json"
    if index.exists():
        shards = sorted(set(json.loads(index.read_text())["weight_map"].values()))
        return [path / s for s in shards]
    files = sorted(path.glob("*.safetensors"))
    if not files:
        raise ValueError(f"no *.safetensors weights in {path}")
    return files


def read_state_dict(path: Path, prefix: str, *, dtype: torch.dtype | None = None) -> dict[str, torch.Tensor]:
    """All tensors whose key starts with `prefix`, with the prefix kept. Others are never read."""
    from safetensors import safe_open

    out: dict[str, torch.Tensor] = {}
    for file in safetensors_files(path):
        with safe_open(str(file), framework="pt") as f:
            for key in f.keys():
                if key.startswith(prefix):
                    t = f.get_tensor(key)
                    out[key] = t.to(dtype) if dtype is not None and t.is_floating_point() else t
    return out


# Rotary embeddings' inverse frequencies: non-persistent buffers that transformers computes in
# float32 and only upcasts at use. `module.to(dtype=bf16)` would round them first: an angle error of
# about 1e-3 x position radians at rope_theta 5e6, which grows with the context (docs/precision.md).
ROTARY_BUFFERS = ("inv_freq", "original_inv_freq")


def to_keeping_rotary_fp32(module: nn.Module, *, device, dtype: torch.dtype) -> nn.Module:
    """`module.to(device=device, dtype=dtype)`, except the rotary inverse frequencies: moved to
    `device`, never rounded. They must be float32 when this is called (built from the config)."""
    rotary = {name: buf for name, buf in module.named_buffers() if name.rpartition(".")[2] in ROTARY_BUFFERS}
    assert all(buf.dtype == torch.float32 for buf in rotary.values()), {n: b.dtype for n, b in rotary.items()}
    module.to(device=device, dtype=dtype)
    for name, buf in rotary.items():
        owner, _, leaf = name.rpartition(".")
        module.get_submodule(owner)._buffers[leaf] = buf.to(device=device)
    return module


def rotary_buffers_not_fp32(module: nn.Module) -> list[str]:
    """Names of rotary inverse-frequency buffers that are not float32 (empty: all is well)."""
    return [name for name, buf in module.named_buffers()
            if name.rpartition(".")[2] in ROTARY_BUFFERS and buf.dtype != torch.float32]


def load_vision_tower(model: str | os.PathLike, *, dtype: torch.dtype = torch.float32, device="cpu") -> nn.Module:
    """The frozen Qwen3-VL vision tower (patch embed, blocks, merger, DeepStack mergers), in eval mode."""
    from transformers.models.qwen3_vl.modeling_qwen3_vl import Qwen3VLVisionModel

    path = resolve_model_path(model)
    config = load_config(path)
    config.vision_config._attn_implementation = "sdpa"
    with torch.device("meta"):
        tower = Qwen3VLVisionModel._from_config(config.vision_config)
    state = {k[len(VISION_PREFIX):]: v for k, v in read_state_dict(path, VISION_PREFIX, dtype=dtype).items()}
    tower.load_state_dict(state, strict=True, assign=True)
    # Non-persistent buffers (rotary inverse frequencies) are not in the checkpoint: rebuild them.
    tower.rotary_pos_emb = type(tower.rotary_pos_emb)(config.vision_config)
    to_keeping_rotary_fp32(tower, device=device, dtype=dtype)
    tower.requires_grad_(False)
    return tower.eval()


def load_full_model(model: str | os.PathLike, *, dtype: torch.dtype = torch.float32, attn_implementation: str = "sdpa"):
    """The whole transformers Qwen3VLForConditionalGeneration: the reference for parity checks."""
    from transformers import Qwen3VLForConditionalGeneration

    return Qwen3VLForConditionalGeneration.from_pretrained(
        resolve_model_path(model), dtype=dtype, attn_implementation=attn_implementation
    ).eval()
