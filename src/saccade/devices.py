"""Which torch device a device setting names (`resolve_device`): one reading of 'auto' for the
trainer, the scene renderer and the benchmarks."""

from __future__ import annotations

import os

import torch


def resolve_device(name: str, *, setting: str = "trainer.device") -> torch.device:
    """'auto': this process's CUDA device (LOCAL_RANK under torchrun, else cuda:0) when CUDA is
    there, else the CPU. 'cuda' without an index means the same local device. `setting` is what
    the user set, named when the device asked for is not there."""
    if name in ("auto", "cuda"):
        if not torch.cuda.is_available():
            if name == "cuda":
                raise ValueError(f"{setting} = 'cuda' but torch sees no CUDA device; use 'auto' or 'cpu'")
            return torch.device("cpu")
        return torch.device("cuda", int(os.environ.get("LOCAL_RANK", 0)))
    device = torch.device(name)
    if device.type == "cuda" and not torch.cuda.is_available():
        raise ValueError(f"{setting} = {name!r} but torch sees no CUDA device; use 'auto' or 'cpu'")
    return device
