"""Which device a device setting names: 'auto' is the local rank's GPU, or the CPU without one."""

from __future__ import annotations

import pytest
import torch

from saccade.devices import resolve_device


def test_auto_is_the_cpu_without_cuda_and_cuda_is_refused_there(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert resolve_device("auto") == torch.device("cpu") and resolve_device("cpu") == torch.device("cpu")
    for name in ("cuda", "cuda:1"):
        with pytest.raises(ValueError, match="no CUDA device; use 'auto' or 'cpu'"):
            resolve_device(name)


def test_auto_is_the_local_ranks_gpu(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setenv("LOCAL_RANK", "3")
    assert resolve_device("auto") == torch.device("cuda", 3) == resolve_device("cuda")
    assert resolve_device("cuda:1") == torch.device("cuda", 1)


def test_the_error_names_the_setting(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    with pytest.raises(ValueError, match="MeshRenderer device = 'cuda' but torch sees no CUDA device"):
        resolve_device("cuda", setting="MeshRenderer device")
