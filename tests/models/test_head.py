"""saccade.models.head: the probe that decides the float32-out addmm, asked once per device."""

from __future__ import annotations

import pytest
import torch

from saccade.models import head


@pytest.fixture(autouse=True)
def fresh_probe():
    head.addmm_takes_out_dtype.cache_clear()
    yield
    head.addmm_takes_out_dtype.cache_clear()


def test_the_probe_answers_on_this_machine():
    assert head.addmm_takes_out_dtype(torch.device("cpu"), torch.bfloat16) in (True, False)


def test_only_an_unsupported_out_dtype_means_no(monkeypatch):
    """"Not supported" is the one answer the probe turns into False; any other error (a CUDA
    error, an out-of-memory) reaches the caller, where the old blanket fallback swallowed it on
    every call."""
    def unsupported(*args, **kwargs):
        raise TypeError("addmm() got an unexpected keyword argument 'out_dtype'")

    monkeypatch.setattr(torch, "addmm", unsupported)
    assert head.addmm_takes_out_dtype(torch.device("cpu"), torch.bfloat16) is False
    head.addmm_takes_out_dtype.cache_clear()

    def device_fault(*args, **kwargs):
        raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB")

    monkeypatch.setattr(torch, "addmm", device_fault)
    with pytest.raises(torch.OutOfMemoryError):
        head.addmm_takes_out_dtype(torch.device("cpu"), torch.bfloat16)
