"""Encode each distinct image once with the frozen vision tower, and cache the result.

The tower is frozen, so an image's features never change: every rollout of a group,
every epoch and every micro-batch can reuse them. `VisionEncoder.encode` looks each
image up by content hash in an `EmbeddingCache` (in-memory LRU under a byte budget,
optionally backed by safetensors files on disk) and runs the tower only on the misses,
all of them in one batched call.
"""

from __future__ import annotations

import os
import threading
from collections import OrderedDict
from dataclasses import dataclass
from pathlib import Path

import torch
from PIL import Image

from saccade.data.images import ImageLimits, image_hash


@dataclass
class ImageEmbedding:
    """What the language model needs from one image."""

    embeds: torch.Tensor  # (n_tokens, H): main features, one row per image-pad token
    deepstack: torch.Tensor  # (levels, n_tokens, H): added after decoder layers 0..levels-1
    grid_thw: torch.Tensor  # (3,) int64: (t, h, w) in patches, before the 2x2 merge

    @property
    def num_tokens(self) -> int:
        return self.embeds.shape[0]

    @property
    def nbytes(self) -> int:
        return self.embeds.nbytes + self.deepstack.nbytes + self.grid_thw.nbytes

    def to_tensors(self) -> dict[str, torch.Tensor]:
        return {"embeds": self.embeds, "deepstack": self.deepstack, "grid_thw": self.grid_thw}

    @classmethod
    def from_tensors(cls, tensors: dict[str, torch.Tensor]) -> ImageEmbedding:
        return cls(tensors["embeds"], tensors["deepstack"], tensors["grid_thw"].long())


@dataclass
class CacheStats:
    hits: int = 0
    disk_hits: int = 0
    misses: int = 0
    evictions: int = 0

    @property
    def hit_rate(self) -> float:
        total = self.hits + self.disk_hits + self.misses
        return (self.hits + self.disk_hits) / total if total else 0.0


class EmbeddingCache:
    """LRU of ImageEmbedding by key, bounded in bytes; optional on-disk safetensors layer.

    An entry bigger than the whole budget is still returned to the caller but not kept.
    Thread-safe: the engine and the trainer may share one.
    """

    def __init__(self, max_bytes: int = 1 << 30, disk_dir: str | os.PathLike | None = None):
        if max_bytes <= 0:
            raise ValueError("max_bytes must be positive")
        self.max_bytes = max_bytes
        self.disk_dir = Path(disk_dir) if disk_dir is not None else None
        if self.disk_dir is not None:
            self.disk_dir.mkdir(parents=True, exist_ok=True)
        self._entries: OrderedDict[str, ImageEmbedding] = OrderedDict()
        self._bytes = 0
        self._lock = threading.Lock()
        self.stats = CacheStats()

    def __len__(self) -> int:
        return len(self._entries)

    def __contains__(self, key: str) -> bool:
        return key in self._entries or (self.disk_dir is not None and self._disk_path(key).exists())

    @property
    def nbytes(self) -> int:
        return self._bytes

    def get(self, key: str) -> ImageEmbedding | None:
        with self._lock:
            entry = self._entries.get(key)
            if entry is not None:
                self._entries.move_to_end(key)
                self.stats.hits += 1
                return entry
        entry = self._read_disk(key)
        with self._lock:
            if entry is None:
                self.stats.misses += 1
                return None
            self.stats.disk_hits += 1
            self._insert(key, entry)
            return entry

    def put(self, key: str, entry: ImageEmbedding) -> None:
        with self._lock:
            self._insert(key, entry)
        self._write_disk(key, entry)

    def _insert(self, key: str, entry: ImageEmbedding) -> None:
        if key in self._entries:
            self._bytes -= self._entries.pop(key).nbytes
        if entry.nbytes > self.max_bytes:
            return
        self._entries[key] = entry
        self._bytes += entry.nbytes
        while self._bytes > self.max_bytes:
            _, evicted = self._entries.popitem(last=False)
            self._bytes -= evicted.nbytes
            self.stats.evictions += 1

    def _disk_path(self, key: str) -> Path:
        assert self.disk_dir is not None
        return self.disk_dir / key[:2] / f"{key}.safetensors"

    def _read_disk(self, key: str) -> ImageEmbedding | None:
        if self.disk_dir is None:
            return None
        path = self._disk_path(key)
        if not path.exists():
            return None
        from safetensors.torch import load_file

        return ImageEmbedding.from_tensors(load_file(str(path)))

    def _write_disk(self, key: str, entry: ImageEmbedding) -> None:
        if self.disk_dir is None:
            return
        from safetensors.torch import save_file

        path = self._disk_path(key)
        if path.exists():
            return
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_suffix(f".tmp{os.getpid()}.{threading.get_ident()}")
        save_file({k: v.contiguous() for k, v in entry.to_tensors().items()}, str(tmp))
        os.replace(tmp, path)  # atomic: readers never see half a file


def image_cache_key(content_hash: str, limits: ImageLimits) -> str:
    """The embedding cache key of an image: its content hash and the resize bounds, which
    change the grid. Every engine names cached images this way."""
    return f"{content_hash}-{limits.min_pixels}-{limits.max_pixels}"


def split_tower_output(pooler_NH: torch.Tensor, deepstack: list[torch.Tensor], grid_thw_I3: torch.Tensor, merge: int):
    """Cut the tower's concatenated output into one ImageEmbedding per image."""
    sizes = (grid_thw_I3.prod(-1) // merge**2).tolist()
    mains = torch.split(pooler_NH, sizes)
    levels = [torch.split(d, sizes) for d in deepstack]
    return [
        ImageEmbedding(
            embeds=mains[i].contiguous(),
            deepstack=torch.stack([lvl[i] for lvl in levels]).contiguous(),
            grid_thw=grid_thw_I3[i].clone(),
        )
        for i in range(len(sizes))
    ]


class VisionEncoder:
    """Frozen tower + image processor + cache: PIL images in, ImageEmbedding out."""

    def __init__(self, tower, processor, *, limits: ImageLimits = ImageLimits(), cache: EmbeddingCache | None = None):
        self.tower = tower
        self.image_processor = processor.image_processor
        self.limits = limits
        self.cache = cache if cache is not None else EmbeddingCache()
        self.merge = int(tower.config.spatial_merge_size)
        self.levels = len(tower.config.deepstack_visual_indexes)

    @property
    def device(self) -> torch.device:
        return next(self.tower.parameters()).device

    def cache_key(self, image: Image.Image) -> str:
        return self.key_for_hash(image_hash(image))

    def key_for_hash(self, content_hash: str) -> str:
        """The cache key of an image whose `image_hash` is known (ModelInputs.image_hashes)."""
        return image_cache_key(content_hash, self.limits)

    def preprocess(self, images: list[Image.Image]) -> tuple[torch.Tensor, torch.Tensor]:
        from saccade.data.messages import processor_size

        out = self.image_processor(images=images, size=processor_size(self.limits), return_tensors="pt")
        return out["pixel_values"], out["image_grid_thw"].long()

    @torch.no_grad()
    def encode_pixels(self, pixel_values: torch.Tensor, grid_thw_I3: torch.Tensor) -> list[ImageEmbedding]:
        dtype = next(self.tower.parameters()).dtype
        out = self.tower(pixel_values.to(self.device, dtype), grid_thw=grid_thw_I3.to(self.device), return_dict=True)
        embeddings = split_tower_output(out.pooler_output, list(out.deepstack_features), grid_thw_I3, self.merge)
        return [
            ImageEmbedding(e.embeds.float().cpu(), e.deepstack.float().cpu(), e.grid_thw.cpu()) for e in embeddings
        ]

    def encode(self, images: list[Image.Image], keys: list[str] | None = None) -> list[ImageEmbedding]:
        """One ImageEmbedding per image, in order; the tower runs once on all misses together."""
        keys = keys if keys is not None else [self.cache_key(im) for im in images]
        found: dict[str, ImageEmbedding] = {}
        missing: dict[str, Image.Image] = {}
        for key, image in zip(keys, images, strict=True):
            if key in found or key in missing:
                continue
            hit = self.cache.get(key)
            if hit is not None:
                found[key] = hit
            else:
                missing[key] = image
        if missing:
            pixels, grid = self.preprocess(list(missing.values()))
            for key, emb in zip(missing, self.encode_pixels(pixels, grid), strict=True):
                self.cache.put(key, emb)
                found[key] = emb
        return [found[k] for k in keys]
