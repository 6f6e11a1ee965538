"""Renders per second of the mesh renderer (saccade.scenes.render) on generated rooms.

Cold: every render a new pose (random free poses over `rooms` rooms), so every call
rasterizes. Cached: the same poses again through a `CachedRenderer` that has seen them,
so every call is a hit (what an RL group pays when its rollouts revisit a view). Both are
wall-clock renders/s of `render_buffers` at `size` x `size`; torch's thread count is
reported because on a shared CPU it decides the figure (see docs/scenes.md).
"""

from __future__ import annotations

import time
from typing import Any

import numpy as np

from saccade.config.bench import RenderBenchConfig


def run_render_bench(cfg: RenderBenchConfig) -> dict[str, Any]:
    """Cold and cached renders/s at `cfg.size` on `cfg.device` (`RenderBenchConfig`)."""
    import torch

    from saccade.scenes.generate import generate_room, start_pose
    from saccade.scenes.render import CachedRenderer, MeshRenderer

    size, renders, rooms, seed, device = cfg.size, cfg.renders, cfg.rooms, cfg.seed, cfg.device
    if cfg.threads is not None:
        torch.set_num_threads(cfg.threads)
    rng = np.random.default_rng(seed)
    scenes = [generate_room(i, seed=seed) for i in range(rooms)]
    jobs = [(scenes[i % rooms], start_pose(scenes[i % rooms], rng)) for i in range(renders)]
    renderer = MeshRenderer(size=size, device=device)
    for scene in scenes:  # warm-up: meshes onto the device, kernels compiled/loaded
        renderer.render_buffers(scene, start_pose(scene, rng))
    if renderer.device.type == "cuda":
        torch.cuda.synchronize()

    start = time.perf_counter()
    for scene, pose in jobs:
        renderer.render_buffers(scene, pose)  # returns numpy arrays: already synchronised
    cold_s = time.perf_counter() - start

    cached = CachedRenderer(renderer)
    for scene, pose in jobs:
        cached.render_buffers(scene, pose)
    start = time.perf_counter()
    for scene, pose in jobs:
        cached.render_buffers(scene, pose)
    cached_s = time.perf_counter() - start

    return {"size": size, "renders": renders, "rooms": rooms, "device": str(renderer.device),
            "threads": torch.get_num_threads(), "mean_faces": float(np.mean([s.mesh.num_faces for s in scenes])),
            "cold_renders_per_s": renders / cold_s, "cached_renders_per_s": renders / cached_s,
            "cache_hits": cached.stats.hits, "cache_misses": cached.stats.misses}


def format_render_report(result: dict[str, Any]) -> str:
    return (f"mesh renderer, {result['size']}x{result['size']}, {result['rooms']} generated rooms "
            f"(~{result['mean_faces']:.0f} faces), device {result['device']}, {result['threads']} torch threads\n"
            f"  cold:   {result['cold_renders_per_s']:9.1f} renders/s ({result['renders']} new poses)\n"
            f"  cached: {result['cached_renders_per_s']:9.1f} renders/s ({result['cache_hits']} hits)")
