"""What a run holds, built once from its config: the trainer's model, the engine, the image cache.

`build_setup` places the model on `trainer.device`, in the precision `model.dtype` asks for
(docs/precision.md), with LoRA or for full fine-tuning, optionally with activation
checkpointing; builds the embedding cache (`image_cache.budget_bytes`, `image_cache.dir`, stored
in the model's dtype); and the engine the config names:

- embedded: samples in this process from the trainer's very module, on the same device,
  and holds the frozen vision tower that fills the cache;
- vLLM: the servers hold the tower; image embeddings come from their /encode_images, so no
  tower is loaded in this process at all. Weights reach them by a transport
  (`engine.weight_sync`, `saccade.transports`): a folder, the LoRA adapter's folder, or a process
  group.
"""

from __future__ import annotations

import functools
import logging
import os
import random
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch import nn

from saccade.config import ImagesConfig, RunConfig
from saccade.config.launch import NODE_HOST_ENV
from saccade.devices import resolve_device
from saccade.distributed import SINGLE, World, barrier, broadcast
from saccade.trainer.sharding import shard_model
from saccade.inference.engine import Engine
from saccade.models.families import Positions
from saccade.models.head import use_full_fp32_matmuls
from saccade.models.vision import EmbeddingCache


@dataclass
class Setup:
    """Everything a run holds besides its config: built once by `build_setup`, used by the loops."""

    model_path: str
    processor: Any
    model: nn.Module  # PolicyLM, LoRA-wrapped or not, on `device`
    engine: Engine
    cache: EmbeddingCache  # the images' embeddings: filled by the engine, read by the trainer
    images: ImagesConfig  # the image limits every stage applies
    merge: int  # the vision tower's spatial merge size (2x2 patches per image token)
    image_token_id: int
    device: torch.device
    positions: Positions  # the model's M-RoPE rule (its family's, at `merge`): every sample's positions
    video_token_id: int | None = None  # the clips' pad token (the packer's `video_token_id`)

    @functools.cached_property
    def continuation(self):
        """The chat template's incremental form, for multi-turn trajectories (built on first use)."""
        from saccade.envs.trajectory import ChatContinuation

        return ChatContinuation(self.processor, limits=self.images)


def set_seed(seed: int) -> None:
    random.seed(seed)
    np.random.seed(seed % 2**32)
    torch.manual_seed(seed)


def weights_dtype(model_dtype: torch.dtype, *, sharded: bool, lora: bool) -> torch.dtype:
    """The dtype the trainer's model is loaded in (docs/precision.md).

    The model computes in `model.dtype`, as an inference engine does, and what trains keeps
    float32 copies: LoRA adapters are float32 (peft), and full fine-tuning's optimizer holds
    float32 master weights. Sharded full fine-tuning loads float32 instead: its float32 shards
    are the master weights, and FSDP computes them in `model.dtype`. A LoRA base is frozen, so
    sharded or not it is stored in `model.dtype` (`saccade.trainer.sharding.mixed_precision`)."""
    return torch.float32 if sharded and not lora else model_dtype


def build_setup(cfg: RunConfig, run_dir: Path, world: World = SINGLE) -> Setup:
    """The trainer's model (LoRA or full) on its device, the embedding cache, and the engine.

    Under torchrun (`world.sharded`) the model is FSDP2-sharded over the ranks
    (`saccade.trainer.sharding.shard_model`), each piece stored and computed as on one process
    except what full fine-tuning trains: float32 shards, computed in `model.dtype` by FSDP's
    mixed precision, so AdamW steps them directly and no separate master copy is kept. A
    LoRA base is frozen: its shards stay in `model.dtype`, beside the float32 adapters."""
    from saccade.models.lm import apply_lora, load_policy_lm, set_full_finetune
    from saccade.models.loading import load_processor
    from saccade.models.presets import resolve_model

    if cfg.trainer.torch_threads:
        torch.set_num_threads(cfg.trainer.torch_threads)
    set_seed(cfg.trainer.seed)
    use_full_fp32_matmuls()  # TF32 off: a float32 run is float32 on every device (saccade.models.head)
    device = resolve_device(cfg.trainer.device)
    if device.type == "cuda":
        torch.cuda.set_device(device)
    if not world.is_main:  # a preset is built once, by rank 0, then read from its cache by all
        barrier(world)
    model_path = resolve_model(cfg.model.path)
    if world.is_main:
        barrier(world)
    dtype = getattr(torch, cfg.model.dtype)
    processor = load_processor(model_path)
    policy = load_policy_lm(model_path, dtype=weights_dtype(dtype, sharded=world.sharded, lora=cfg.lora is not None),
                            attn_implementation=cfg.model.attn_implementation, device=device)
    if cfg.trainer.activation_checkpointing:
        policy.enable_activation_checkpointing()
    model = apply_lora(policy, cfg.lora) if cfg.lora is not None else set_full_finetune(policy)
    if world.sharded:
        shard_model(model, world, device=device, compute_dtype=dtype)
    cache = EmbeddingCache(cfg.image_cache.budget_bytes, cfg.image_cache.dir, dtype=dtype)
    if cfg.engine.kind == "vllm":
        engine = build_vllm_engine(cfg, model, model_path, processor, cache, run_dir, world)
    else:
        engine = build_local_engine(cfg, model, model_path, processor, cache, dtype, device)
    merge = int(policy.config.vision_config.spatial_merge_size)  # the full model's config; no tower read
    return Setup(model_path, processor, model, engine, cache, cfg.images, merge, policy.image_token_id, device,
                 policy.positions, policy.video_token_id)


def build_local_engine(cfg: RunConfig, model: nn.Module, model_path: str, processor, cache: EmbeddingCache,
                       dtype: torch.dtype, device: torch.device) -> Engine:
    from saccade.inference.local import LocalEngine
    from saccade.models.loading import load_vision_tower
    from saccade.models.vision import VisionEncoder

    # The engine side holds the frozen tower; the trainer's model never does.
    tower = load_vision_tower(model_path, dtype=dtype, device=device)
    encoder = VisionEncoder(tower, processor, limits=cfg.images, cache=cache)
    return LocalEngine(model, processor, encoder, limits=cfg.images, seed=cfg.trainer.seed)


def build_vllm_engine(cfg: RunConfig, model: nn.Module, model_path: str, processor, cache: EmbeddingCache,
                      run_dir: Path, world: World = SINGLE) -> Engine:
    """The servers of `engine.urls` as the run's engine, with the transport `engine.weight_sync`
    and the servers allow (`saccade.transports.choose`): rank 0 decides (it alone asks the
    servers), every rank follows, a refusal included."""
    from saccade.inference.vllm import VLLMEngine
    from saccade.models.checkpoint_layout import fingerprint
    from saccade.models.loading import load_family, load_layout
    from saccade.transports.choose import Choice, build_transport, check_servers_take_weights, choose, trainer_side

    engine_cfg = cfg.engine
    engine = VLLMEngine.for_servers(
        engine_cfg.urls, processor, limits=cfg.images, cache=cache, api_key=os.environ.get("VLLM_API_KEY"),
        model=(cfg.model.path, fingerprint(load_layout(model_path))), family=load_family(model_path),
        max_concurrency=engine_cfg.max_concurrency, timeout_s=engine_cfg.timeout_s,
        health_interval_s=engine_cfg.health_interval_s, no_server_wait_s=engine_cfg.no_server_wait_s,
        hang_after_s=engine_cfg.hang_after_s, vocab_size=_vocab_rows(model), positions=_positions(model),
    )
    # Under `saccade launch`, the host of rank 0's own node in the layout (torchrun numbers the nodes
    # its own way); else the layout's first trainer node.
    layout_host = os.environ.get(NODE_HOST_ENV) or cfg.launch.trainer_host
    choice = None
    if world.is_main:
        try:
            infos = engine.info()
            choice = choose(engine_cfg, lora=cfg.lora is not None, infos=infos, layout_host=layout_host,
                            trainer=trainer_side(model, world, full_weights=cfg.lora is None))
            check_servers_take_weights(choice.kind, infos, [s.url for s in engine.client.pool.alive])
        except ValueError as err:
            choice = Choice("error", None, str(err))
    choice = Choice(*broadcast(choice, world))  # rank 0 decided; the others hold None until now
    if choice.kind == "error":
        engine.close()
        raise ValueError(choice.why)
    logging.getLogger(__name__).warning("weight sync: %s (%s)", choice.kind, choice.why)
    engine.transport = build_transport(choice, engine_cfg, engine.client, model, model_path, run_dir, world=world,
                                       layout_host=layout_host)
    return engine


def _positions(model: nn.Module):
    """The policy's M-RoPE rule (`PolicyLM.positions`), None for a model that has none."""
    from saccade.models.lm import unwrap_policy

    try:
        return unwrap_policy(model).positions
    except (AttributeError, TypeError):
        return None


def _vocab_rows(model: nn.Module) -> int | None:
    """The policy's embedding rows: a server's sampled id at or past them is a malformed reply
    (None where the model does not say, and ids are then checked for sign only)."""
    try:
        return int(model.get_input_embeddings().num_embeddings)
    except (AttributeError, TypeError, NotImplementedError):
        return None
