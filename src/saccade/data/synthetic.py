"""Deterministic pictures with structure, for parity checks, example environments and tests:
a seed gives the same picture on every machine, and different seeds give different features."""

from __future__ import annotations

import numpy as np
from PIL import Image, ImageDraw


def synthetic_image(width: int, height: int, seed: int) -> Image.Image:
    """A deterministic picture with structure (shapes on noise), so features differ per image."""
    rng = np.random.default_rng(seed)
    pixels = rng.integers(0, 256, size=(height, width, 3), dtype=np.uint8)
    image = Image.fromarray(pixels, "RGB")
    draw = ImageDraw.Draw(image)
    for _ in range(3):
        x0, y0 = int(rng.integers(0, width // 2)), int(rng.integers(0, height // 2))
        x1, y1 = x0 + int(rng.integers(4, width // 2 + 5)), y0 + int(rng.integers(4, height // 2 + 5))
        draw.ellipse([x0, y0, x1, y1], fill=tuple(int(c) for c in rng.integers(0, 256, 3)))
    return image
