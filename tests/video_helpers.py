"""Clips for the tests, written by another program than saccade: OpenCV's `cv2.VideoWriter` (mp4v)."""

from __future__ import annotations

from pathlib import Path

import numpy as np


def moving_square_frames(frames: int = 20, size: tuple[int, int] = (96, 64), seed: int = 0) -> np.ndarray:
    """(frames, height, width, 3) uint8 RGB: a white square moving right over a colour that drifts."""
    width, height = size
    rng = np.random.default_rng(seed)
    base = rng.integers(0, 200, 3)
    out = np.zeros((frames, height, width, 3), np.uint8)
    for i in range(frames):
        out[i] = (base + 3 * i) % 255
        x = (i * (width - 16)) // max(1, frames - 1)
        out[i, 10:26, x:x + 16] = 255
    return out


def write_mp4(path: str | Path, frames: int = 20, fps: float = 8.0, size: tuple[int, int] = (96, 64),
              seed: int = 0) -> Path:
    """An mp4 (MPEG-4 part 2, 'mp4v') written by OpenCV, as any user's tool would write one."""
    import cv2

    path = Path(path)
    writer = cv2.VideoWriter(str(path), cv2.VideoWriter_fourcc(*"mp4v"), fps, size)
    assert writer.isOpened(), "OpenCV could not open an mp4 writer"
    for frame in moving_square_frames(frames, size, seed):
        writer.write(frame[:, :, ::-1].copy())  # OpenCV writes BGR
    writer.release()
    return path
