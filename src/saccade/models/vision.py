"""Encode each distinct image and clip once with the frozen vision tower, and cache the result.

The tower is frozen, so an image's features never change: every rollout of a group,
every epoch and every micro-batch can reuse them. `VisionEncoder.encode` looks each
image up by content hash in an `EmbeddingCache` (in-memory LRU under a byte budget,
optionally backed by safetensors files on disk) and runs the tower only on the misses,
all of them in one batched call.

Clips go the same way (`VisionEncoder.encode_videos`): a clip's embedding is an
`ImageEmbedding` whose `grid_thw` has t > 1 temporal patches, its rows one per video pad in
the clip's order (frame group after frame group), DeepStack levels included where the family
has them (transformers runs a clip through the tower as an image: `get_video_features` is
`get_image_features` on the clip's pixels). Its key is `saccade.data.videos.video_cache_key`
(the sampled frames' hash, the sampling settings, the pixel limits), which
`messages_to_inputs` already wrote into `ModelInputs.videos`; the encoder recomputes it from
the frames it is given and refuses a key made under other settings.

A step's images must outlive the budget: the trainer reads them after the whole rollout
has put them. `EmbeddingCache.pins()` gives a `Pins` scope: while it is active, every
entry put or read is pinned (never evicted), and stays so until `Pins.release()`, after
the step's train step. Meanwhile the cache may hold more than its budget; the release
brings it back under. Embeddings are stored in the cache's dtype (the model's).
"""

from __future__ import annotations

import os
import threading
from collections import Counter, OrderedDict
from dataclasses import dataclass
from pathlib import Path

import torch
from PIL import Image

from saccade.timing import timed
from saccade.config import ImagesConfig
from saccade.data.images import image_hash
from saccade.data.videos import VideoClip, VideoSampling, video_cache_key
from saccade.models.families import family_of


@dataclass
class ImageEmbedding:
    """What the language model needs from one image."""

    embeds: torch.Tensor  # (n_tokens, H): main features, one row per image-pad token
    # (levels, n_tokens, H): added after decoder layers 0..levels-1; (0, n_tokens, H) for a
    # family without DeepStack, so that every engine, cache file and wire has one shape.
    deepstack: torch.Tensor
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


class EmbeddingCacheMiss(ValueError):
    """An image's embedding is not in the cache when a micro-batch is built from it."""


class Pins:
    """Cache keys kept in memory until `release()`: one step's images, from its rollout until
    its train step ends. While active (`with pins:`), every entry the cache puts or returns is
    added."""

    def __init__(self, cache: EmbeddingCache, name: str):
        self.cache, self.name = cache, name
        self.keys: set[str] = set()

    def _add(self, key: str) -> None:  # the cache's lock is held
        if key not in self.keys:
            self.keys.add(key)
            self.cache._pin_counts[key] += 1

    def release(self) -> None:
        """Unpin every key; the least recently used unpinned entries then go until the cache is
        back under its budget."""
        with self.cache._lock:
            for key in self.keys:
                self.cache._pin_counts[key] -= 1
                if not self.cache._pin_counts[key]:
                    del self.cache._pin_counts[key]
            self.keys.clear()
            self.cache._shrink()

    def __enter__(self) -> Pins:
        with self.cache._lock:
            self.cache._active.append(self)
        return self

    def __exit__(self, *exc) -> None:
        with self.cache._lock:
            self.cache._active.remove(self)


class EmbeddingCache:
    """LRU of ImageEmbedding by key, bounded in bytes, with pinning; optional on-disk layer.

    An unpinned entry bigger than the whole budget is still returned to the caller but not
    kept. Thread-safe: the engine and the trainer may share one. `dtype`: what entries are
    stored in (None: as given).
    """

    def __init__(self, max_bytes: int = 1 << 30, disk_dir: str | os.PathLike | None = None, *,
                 dtype: torch.dtype | None = None):
        if max_bytes <= 0:
            raise ValueError("max_bytes must be positive")
        self.max_bytes = max_bytes
        self.dtype = dtype
        self.disk_dir = Path(disk_dir) if disk_dir is not None else None
        if self.disk_dir is not None:
            self.disk_dir.mkdir(parents=True, exist_ok=True)
        self._entries: OrderedDict[str, ImageEmbedding] = OrderedDict()
        self._bytes = 0
        self._lock = threading.Lock()
        self._pin_counts: Counter[str] = Counter()
        self._active: list[Pins] = []
        self.stats = CacheStats()

    def __len__(self) -> int:
        return len(self._entries)

    def __contains__(self, key: str) -> bool:
        return key in self._entries or (self.disk_dir is not None and self._disk_path(key).exists())

    @property
    def nbytes(self) -> int:
        return self._bytes

    @property
    def pinned_bytes(self) -> int:
        with self._lock:
            return sum(self._entries[k].nbytes for k in self._pin_counts if k in self._entries)

    def pins(self, name: str = "step") -> Pins:
        """A new pin scope (see `Pins`)."""
        return Pins(self, name)

    def get(self, key: str) -> ImageEmbedding | None:
        with self._lock:
            entry = self._entries.get(key)
            if entry is not None:
                self._entries.move_to_end(key)
                self.stats.hits += 1
                self._pin_active(key)
                return entry
        entry = self._read_disk(key)
        with self._lock:
            if entry is None:
                self.stats.misses += 1
                return None
            self.stats.disk_hits += 1
            self._pin_active(key)
            self._insert(key, entry)
            return entry

    def put(self, key: str, entry: ImageEmbedding) -> ImageEmbedding:
        """Store `entry` (in the cache's dtype) and return what was stored."""
        if self.dtype is not None and entry.embeds.dtype != self.dtype:
            entry = ImageEmbedding(entry.embeds.to(self.dtype), entry.deepstack.to(self.dtype), entry.grid_thw)
        with self._lock:
            self._pin_active(key)
            self._insert(key, entry)
        self._write_disk(key, entry)
        return entry

    def _pin_active(self, key: str) -> None:
        for pins in self._active:
            pins._add(key)

    def _insert(self, key: str, entry: ImageEmbedding) -> None:
        if key in self._entries:
            self._bytes -= self._entries.pop(key).nbytes
        if entry.nbytes > self.max_bytes and not self._pin_counts[key]:
            return
        self._entries[key] = entry
        self._bytes += entry.nbytes
        self._shrink()

    def _shrink(self) -> None:
        """Evict least recently used unpinned entries until the cache is within its budget."""
        if self._bytes <= self.max_bytes:
            return
        for key in list(self._entries):
            if self._bytes <= self.max_bytes:
                break
            if self._pin_counts[key]:
                continue
            self._bytes -= self._entries.pop(key).nbytes
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


def image_cache_key(content_hash: str, limits: ImagesConfig) -> str:
    """The embedding cache key of an image: its content hash and the resize bounds, which
    change the grid. Every engine names cached images this way."""
    return f"{content_hash}-{limits.min_pixels}-{limits.max_pixels}"


def split_tower_output(main_NH: torch.Tensor, deepstack: list[torch.Tensor], grid_thw_I3: torch.Tensor, merge: int):
    """Cut the tower's concatenated output (the family's `run_tower`) into one ImageEmbedding per
    image; no DeepStack levels give each image a (0, n, H) `deepstack`."""
    sizes = (grid_thw_I3.prod(-1) // merge**2).tolist()
    mains = torch.split(main_NH, sizes)
    levels = [torch.split(d, sizes) for d in deepstack]
    return [
        ImageEmbedding(
            embeds=mains[i].contiguous(),
            deepstack=stack_levels([lvl[i] for lvl in levels], mains[i]),
            grid_thw=grid_thw_I3[i].clone(),
        )
        for i in range(len(sizes))
    ]


def stack_levels(levels: list[torch.Tensor], main_NH: torch.Tensor) -> torch.Tensor:
    """(levels, n, H); (0, n, H) when there are none (torch.stack refuses an empty list)."""
    if not levels:
        return main_NH.new_zeros(0, *main_NH.shape)
    return torch.stack(levels).contiguous()


def select_images(pixel_values: torch.Tensor, grid_thw_I3: torch.Tensor,
                  indices: list[int]) -> tuple[torch.Tensor, torch.Tensor]:
    """The pixel rows and grids of some of a processor batch's images (an image owns t*h*w rows)."""
    ends = grid_thw_I3.prod(-1).cumsum(0).tolist()
    starts = [0] + ends[:-1]
    rows = torch.cat([torch.arange(starts[i], ends[i]) for i in indices])
    return pixel_values[rows], grid_thw_I3[indices]


class VisionEncoder:
    """Frozen tower + image (and video) processor + cache: PIL images or clips in, ImageEmbedding out."""

    def __init__(self, tower, processor, *, limits: ImagesConfig = ImagesConfig(), cache: EmbeddingCache | None = None):
        self.tower = tower
        self.family = family_of(tower.config)  # the vision config names its family too
        self.processor = processor
        self.image_processor = processor.image_processor
        self.limits = limits
        self.cache = cache if cache is not None else EmbeddingCache()
        self.merge = int(tower.config.spatial_merge_size)
        self.positions = self.family.positions_of(tower.config)  # the prompts' M-RoPE positions
        self.levels = self.family.deepstack_levels(tower.config)
        self._sampling: VideoSampling | None = None

    @property
    def device(self) -> torch.device:
        return next(self.tower.parameters()).device

    @property
    def sampling(self) -> VideoSampling:
        """The clips' settings: `limits.video` over the model's video processor (made when first asked)."""
        if self._sampling is None:
            self._sampling = VideoSampling.from_processor(self.processor, self.limits)
        return self._sampling

    def cache_key(self, image: Image.Image) -> str:
        return self.key_for_hash(image_hash(image))

    def key_for_hash(self, content_hash: str) -> str:
        """The cache key of an image whose `image_hash` is known (ModelInputs.image_hashes)."""
        return image_cache_key(content_hash, self.limits)

    def video_key(self, clip: VideoClip) -> str:
        """The cache key of a clip under this encoder's settings (`video_cache_key`)."""
        return video_cache_key(clip.content_hash, self.sampling)

    def preprocess(self, images: list[Image.Image]) -> tuple[torch.Tensor, torch.Tensor]:
        """The image processor's (pixel_values, grid_thw) for these images under the limits."""
        out = self.image_processor(images=images, size=self.family.processor_size(self.limits), return_tensors="pt")
        return out["pixel_values"], out["image_grid_thw"].long()

    def preprocess_videos(self, clips: list[VideoClip]) -> tuple[torch.Tensor, torch.Tensor]:
        """The video processor's (pixel_values_videos, video_grid_thw) for these sampled clips, as
        `messages_to_inputs` makes them (the same call: frames, their metadata, no resampling)."""
        out = self.processor.video_processor(
            videos=[c.frames for c in clips], video_metadata=[c.metadata() for c in clips], return_tensors="pt",
            **self.sampling.processor_kwargs())
        return out["pixel_values_videos"], out["video_grid_thw"].long()

    @torch.no_grad()
    def encode_pixels(self, pixel_values: torch.Tensor, grid_thw_I3: torch.Tensor) -> list[ImageEmbedding]:
        """The tower's output for these images (or clips), on the host, in the tower's dtype."""
        dtype = next(self.tower.parameters()).dtype
        main_NH, deepstack = self.family.run_tower(self.tower, pixel_values.to(self.device, dtype),
                                                   grid_thw_I3.to(self.device))
        embeddings = split_tower_output(main_NH, deepstack, grid_thw_I3, self.merge)
        return [ImageEmbedding(e.embeds.cpu(), e.deepstack.cpu(), e.grid_thw.cpu()) for e in embeddings]

    def encode(self, images: list[Image.Image], keys: list[str] | None = None,
               pixels: tuple[torch.Tensor, torch.Tensor] | None = None) -> list[ImageEmbedding]:
        """One ImageEmbedding per image, in order; the tower runs once on all misses together.
        `pixels`: (pixel_values, grid_thw) the processor already made of these very images under
        these limits (`ModelInputs`), used for the misses instead of preprocessing them again."""
        keys = keys if keys is not None else [self.cache_key(im) for im in images]
        return self._encode(images, keys, pixels, self.preprocess)

    def encode_videos(self, clips: list[VideoClip | None], keys: list[str],
                      pixels: tuple[torch.Tensor, torch.Tensor] | None = None) -> list[ImageEmbedding]:
        """One ImageEmbedding per clip, in order, the tower run once on all misses together, in a
        call of their own (as transformers runs a prompt's clips apart from its images). `pixels`:
        (pixel_values_videos, video_grid_thw) of these very clips (`ModelInputs`); without them a
        miss is preprocessed from its frames (`preprocess_videos`). A clip whose key names other
        settings than this encoder's is refused: its pads were counted under those."""
        for clip, key in zip(clips, keys, strict=True):
            if clip is not None and key != self.video_key(clip):
                raise ValueError(f"clip {key} was sampled or sized under other settings than this engine's "
                                 f"({self.video_key(clip)}): images.video must be the same at every stage")
        return self._encode(clips, keys, pixels, self.preprocess_videos)

    def _encode(self, items: list, keys: list[str], pixels, preprocess) -> list[ImageEmbedding]:
        found: dict[str, ImageEmbedding] = {}
        missing: dict[str, int] = {}  # key -> index of the item in `items`
        for i, (key, _) in enumerate(zip(keys, items, strict=True)):
            if key in found or key in missing:
                continue
            hit = self.cache.get(key)
            if hit is not None:
                found[key] = hit
            else:
                missing[key] = i
        if missing:
            if pixels is None and any(items[i] is None for i in missing.values()):
                raise ValueError(f"embeddings of {sorted(k for k, i in missing.items() if items[i] is None)[:3]} are "
                                 "not cached and their pixels were not given to encode")
            with timed("encode"):
                if pixels is not None:
                    values, grid = select_images(*pixels, list(missing.values()))
                else:
                    values, grid = preprocess([items[i] for i in missing.values()])
                for key, emb in zip(missing, self.encode_pixels(values, grid), strict=True):
                    found[key] = self.cache.put(key, emb)
        return [found[k] for k in keys]
