"""Where a step's time goes: named parts timed where they run, collected only on request.

The library marks its parts with `with timed("decode"):`. Nothing is recorded (and nothing
synchronises a GPU) unless a caller collects them:

    with breakdown(device) as parts:
        ...one RL step...
    parts  # {"templating": 0.01, "prefill": 0.2, ...} seconds

`saccade bench step` does so; the RL loop does not, so a GPU step never waits on the host
for a timer. Parts must not nest: each second is counted in one part only, and the bench
reports what no part covers as "other".
"""

from __future__ import annotations

import time
from collections import defaultdict
from collections.abc import Iterator
from contextlib import contextmanager

import torch

_parts: dict[str, float] | None = None
_device: torch.device | None = None


def _sync() -> None:
    if _device is not None and _device.type == "cuda":
        torch.cuda.synchronize(_device)


@contextmanager
def timed(part: str) -> Iterator[None]:
    """Add this block's wall time to `part`, when a breakdown is being collected."""
    if _parts is None:
        yield
        return
    _sync()
    start = time.perf_counter()
    try:
        yield
    finally:
        _sync()
        _parts[part] += time.perf_counter() - start


@contextmanager
def breakdown(device: torch.device | str | None = None) -> Iterator[dict[str, float]]:
    """Collect the parts timed inside this block (seconds per part); on CUDA every part ends
    with a device synchronisation, so kernels are charged to the part that launched them."""
    global _parts, _device
    if _parts is not None:
        raise RuntimeError("a step-time breakdown is already being collected")
    parts: dict[str, float] = defaultdict(float)
    _parts, _device = parts, torch.device(device) if device is not None else None
    try:
        yield parts
    finally:
        _parts, _device = None, None


def split_cores(cores: list[int]) -> tuple[list[int], list[int]]:
    """(the server's cores, the trainer's cores): halves, the server's first, so that a vLLM
    server and the trainer beside it on one CPU machine do not take turns on the same cores."""
    if len(cores) < 2:
        raise ValueError("an engine beside the trainer needs at least 2 cores: one for the server, one for the trainer")
    half = len(cores) // 2
    return cores[:half], cores[half:]


def synchronize(device: torch.device) -> None:
    """Wait for the work queued on `device` (CUDA; nothing to wait for elsewhere), so that a
    wall-clock time read next holds it."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)
