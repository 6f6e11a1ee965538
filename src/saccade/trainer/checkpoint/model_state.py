"""A model's trainable state as the checkpoints and the engine weights see it.

Whether it is a peft model and its one adapter, which state-dict names are tied aliases, a
sharded (DTensor) tensor gathered whole, the float32 master weights of bf16 full fine-tuning,
and peft's adapter folder written under the full model's names. `process_world`: this
process's rank when a process group exists, for the collective saves and exports.
`load_plain_values`: the optimizer, scheduler and RNG files, read without running code.
"""

from __future__ import annotations

import json
import os
import pickle
import re
import sys
from pathlib import Path

import torch
from torch import nn

from saccade.distributed import SINGLE, World
from saccade.trainer.checkpoint.folder import ADAPTER_CONFIG


def gather_lora_state(model, *, keep: bool) -> dict[str, torch.Tensor] | None:
    """The LoRA tensors of a sharded PeftModel, whole, on CPU (`keep`: rank 0) or dropped.

    One all-gather per tensor, in state-dict order (the same on every rank). Adapters are small:
    rank 0 holding all of them is a few MB, never the base model."""
    out = {}
    with torch.no_grad():
        for key, value in model.state_dict().items():
            if ".lora_" not in key:
                continue
            full = full_tensor(value)
            if keep:
                out[key] = full.detach().to("cpu").clone()
    return out if keep else None


def save_adapter(adapter_dir: Path, model, base_model_path: str | None,
                 state_dict: dict[str, torch.Tensor] | None = None) -> None:
    """peft's folder for the model's one adapter; `state_dict` (the PeftModel's keys, whole tensors)
    stands in for the model's own when it is sharded (peft cannot write DTensors)."""
    name = single_adapter(model)
    kwargs = {} if state_dict is None else {"state_dict": state_dict}
    model.save_pretrained(str(adapter_dir), selected_adapters=[name], **kwargs)
    if name != "default":  # peft puts non-default adapters in a subfolder: keep one layout
        for p in (adapter_dir / name).iterdir():
            os.replace(p, adapter_dir / p.name)
        (adapter_dir / name).rmdir()
    config_path = adapter_dir / ADAPTER_CONFIG
    config = json.loads(config_path.read_text())
    config["base_model_name_or_path"] = base_model_path
    # peft records the class it wrapped (PolicyLM) for AutoPeftModel; point it at the full model
    # class, the one the adapter is meant to load onto.
    architectures = getattr(getattr(model.get_base_model(), "config", None), "architectures", None)
    if architectures:
        config["auto_mapping"] = {"base_model_class": architectures[0], "parent_library": "transformers"}
    config_path.write_text(json.dumps(config, indent=2, sort_keys=True) + "\n")


def master_weights(optimizer) -> dict[str, torch.Tensor] | None:
    """The float32 master weights of full fine-tuning in bf16 (`saccade.trainer.step.MasterWeights`), by name."""
    masters = getattr(optimizer, "master_weights", None)
    return masters.named if masters is not None else None


def process_world() -> World:
    """This process's rank and the world size when a process group exists (torchrun), else `World()`."""
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized():
        return World(rank=dist.get_rank(), size=dist.get_world_size(), sharded=True)
    return SINGLE


def full_tensor(t: torch.Tensor) -> torch.Tensor:
    """The whole tensor: a DTensor all-gathered (a collective), anything else as it is."""
    dtensor = sys.modules.get("torch.distributed.tensor")  # never imported means no DTensor exists
    if dtensor is not None and isinstance(t, dtensor.DTensor):
        return t.full_tensor()
    return t


def tied_aliases(model: nn.Module) -> dict[str, str]:
    """State-dict names that are the same tensor as an earlier name: {alias: kept}, e.g.
    {"lm_head.weight": "model.language_model.embed_tokens.weight"} when the head is tied.
    By identity of the tensor objects, which holds for FSDP2's DTensor parameters too (a shared
    parameter is one DTensor); the first name in state-dict order is kept, as HF does."""
    seen: dict[int, str] = {}
    aliases: dict[str, str] = {}
    for k, v in model.state_dict(keep_vars=True).items():
        if id(v) in seen:
            aliases[k] = seen[id(v)]
        else:
            seen[id(v)] = k
    return aliases


def is_peft(model) -> bool:
    peft = sys.modules.get("peft")  # never imported means never a PeftModel
    return peft is not None and isinstance(model, peft.PeftModel)


def single_adapter(model) -> str:
    names = list(model.peft_config)
    if len(names) != 1:
        raise ValueError(f"checkpointing supports one LoRA adapter per model; this one has {names}")
    return names[0]


def load_plain_values(path: Path):
    """A checkpoint's optimizer, scheduler or RNG file (torch.save of tensors, numbers, strings,
    lists and dicts: all saccade writes there) read with `weights_only`, so a checkpoint from
    elsewhere cannot construct or call anything else when a run resumes from it. A LambdaLR's
    state is numbers and lists (its lambdas are not saved), numpy's RNG state is saved as plain
    values (`_rng_state`). Anything else is refused with a ValueError naming what was found."""
    try:
        return torch.load(path, map_location="cpu", weights_only=True)
    except pickle.UnpicklingError as err:
        found = re.search(r"Unsupported global: GLOBAL (\S+)", str(err))
        what = f"it names {found.group(1)}" if found else "torch.load(weights_only=True) refused it"
        raise ValueError(f"{path} holds an object that is not a tensor or a plain value ({what}): saccade never "
                         "saves one, and loading it could run code, so it is refused. Resume only from checkpoints "
                         "your own runs wrote (docs/security.md)") from err
