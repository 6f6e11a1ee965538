"""Load the pieces of a vision-language checkpoint separately: processor, vision tower, language model.

The trainer holds only the language model and lm_head; the engine holds the vision
tower. Both are read straight from the checkpoint's safetensors by key prefix, so the
other half is never materialised. What differs between architectures (the classes, the
checkpoint's key layout, the tower's outputs) is asked of the model's family
(`saccade.models.families`). Works with a local folder or a hub id (resolved with
`huggingface_hub.snapshot_download` on machines that can reach the hub).
"""

from __future__ import annotations

import contextlib
import json
import os
from pathlib import Path

import torch
from torch import nn

from saccade.models.families import LM_HEAD_KEY, LM_PREFIX, VISION_PREFIX, ModelFamily, family_of
from saccade.models.families.interface import as_stored, same_key

__all__ = ["LM_HEAD_KEY", "LM_PREFIX", "VISION_PREFIX"]  # the canonical names, re-exported for callers


def resolve_model_path(model: str | os.PathLike) -> Path:
    """A local folder as is; otherwise a hub id, downloaded (or found in the HF cache)."""
    path = Path(model)
    if path.exists():
        if not (path / "config.json").exists():
            raise ValueError(f"{path} has no config.json: it is not a Hugging Face model folder")
        return path
    if str(model).startswith((".", "/")) or str(model).count("/") != 1:
        raise ValueError(f"model {str(model)!r} is neither an existing folder nor a hub id like 'Org/Model-Name'")
    from huggingface_hub import snapshot_download

    return Path(snapshot_download(str(model), allow_patterns=["*.json", "*.safetensors", "*.jinja", "*.txt", "*.model"]))


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


def safetensors_files(path: Path) -> list[Path]:
    index = path / "model.safetensors.index.json"
    if index.exists():
        shards = sorted(set(json.loads(index.read_text())["weight_map"].values()))
        return [path / s for s in shards]
    files = sorted(path.glob("*.safetensors"))
    if not files:
        raise ValueError(f"no *.safetensors weights in {path}")
    return files


def read_state_dict(path: Path, prefix: str, *, dtype: torch.dtype | None = None,
                    checkpoint_key=same_key, checkpoint_tensor=as_stored) -> dict[str, torch.Tensor]:
    """All tensors whose canonical key starts with `prefix`, under their canonical keys (the
    prefix kept), in the layout the modules hold them. `checkpoint_key`: the family's map from
    the file's own keys to the canonical ones (None: a tensor saccade never reads);
    `checkpoint_tensor`: its map from the file's layout to the modules' (MoE experts are stored
    transposed). Others are never read."""
    from safetensors import safe_open

    out: dict[str, torch.Tensor] = {}
    for file in safetensors_files(path):
        with safe_open(str(file), framework="pt") as f:
            for key in f.keys():
                canonical = checkpoint_key(key)
                if canonical is not None and canonical.startswith(prefix):
                    t = checkpoint_tensor(canonical, f.get_tensor(key))
                    out[canonical] = t.to(dtype) if dtype is not None and t.is_floating_point() else t
    return out


def read_family_state_dict(path: Path, prefix: str, family: ModelFamily, *,
                           dtype: torch.dtype | None = None) -> dict[str, torch.Tensor]:
    """`read_state_dict` with the family's key and layout maps."""
    return read_state_dict(path, prefix, dtype=dtype, checkpoint_key=family.checkpoint_key,
                           checkpoint_tensor=family.checkpoint_tensor)


@contextlib.contextmanager
def parameters_on_meta():
    """Modules built inside get their parameters on the meta device (no memory, no init: the
    checkpoint's tensors are assigned next) and their buffers for real. Buffers that are not in
    the checkpoint (rotary inverse frequencies) are so computed by the family's own constructor,
    whatever its signature, instead of rebuilt here by hand."""
    register = nn.Module.register_parameter

    def on_meta(module: nn.Module, name: str, param: nn.Parameter | None) -> None:
        if param is not None and param.device.type != "meta":
            param = nn.Parameter(param.to("meta"), requires_grad=param.requires_grad)
        register(module, name, param)

    nn.Module.register_parameter = on_meta
    try:
        yield
    finally:
        nn.Module.register_parameter = register


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
    """The frozen vision tower (patch embed, blocks, merger, and DeepStack mergers where the family
    has them), in eval mode."""
    path = resolve_model_path(model)
    config = load_config(path)
    family = family_of(config)
    config.vision_config._attn_implementation = "sdpa"
    with parameters_on_meta():
        tower = family.vision_model_class()._from_config(config.vision_config)
    state = read_family_state_dict(path, VISION_PREFIX, family, dtype=dtype)
    state = {k[len(VISION_PREFIX):]: v for k, v in state.items()}
    tower.load_state_dict(state, strict=True, assign=True)
    to_keeping_rotary_fp32(tower, device=device, dtype=dtype)
    tower.requires_grad_(False)
    return tower.eval()


def load_full_model(model: str | os.PathLike, *, dtype: torch.dtype = torch.float32, attn_implementation: str = "sdpa"):
    """The family's whole transformers model (vision tower and all): the reference for parity checks."""
    path = resolve_model_path(model)
    return load_family(path).full_model_class().from_pretrained(
        path, dtype=dtype, attn_implementation=attn_implementation
    ).eval()
