"""Which way the run's weights reach its servers, and the transport built for it.

`choose` reads `engine.weight_sync` (its kind: files, adapter, collective or auto), whether the
trainer has LoRA, the servers' /saccade/info (their transfer backend, LoRA support, whether they
take weights at all) and where they are; it returns the kind and why, or a ValueError that says
what to change. `build_transport` makes that kind's transport over the engine's HTTP client.
"""

from __future__ import annotations

from pathlib import Path

from torch import nn

from saccade.config import VLLMEngineConfig
from saccade.distributed import SINGLE, World
from saccade.inference.engine import WeightTransport
from saccade.serving.wire import GLOO_BACKEND


def check_servers_take_weights(kind: str, infos: list[dict], urls: list[str]) -> None:
    """ValueError naming a server that cannot load what `kind` sends: one that refuses weight
    updates (a model whose weights the CPU build cannot reload), or one without LoRA for an adapter."""
    for url, info in zip(urls, infos, strict=False):
        refused = info.get("weight_updates_refused")
        if refused:
            raise ValueError(f"the server at {url} cannot load the trainer's weights: {refused}. Train this "
                             'model with engine.kind = "embedded" (the trainer samples itself), or on GPU servers')
        if kind == "adapter" and not info.get("lora_enabled"):
            raise ValueError(f"the server at {url} has no LoRA support, so it cannot load the trainer's adapter; "
                             "restart it with --enable-lora --max-lora-rank R (R >= lora.rank)")


def collective_problem(engine_cfg: VLLMEngineConfig, infos: list[dict], layout_host: str | None) -> str | None:
    """Why the collective cannot be used with these servers (None: it can)."""
    from saccade.transports.collective import trainer_address

    lacking = [i.get("model", "?") for i in infos if (i.get("weight_transfer") or {}).get("backend") != GLOO_BACKEND]
    if lacking:
        return (f"{len(lacking)} server(s) offer no {GLOO_BACKEND} weight transfer (an older saccade serve, or "
                "--weight-transfer-config set to another backend)")
    try:
        trainer_address(engine_cfg.urls, getattr(engine_cfg.weight_sync, "transfer_address", None), layout_host)
    except ValueError as err:
        return str(err)
    return None


def choose(engine_cfg: VLLMEngineConfig, *, lora: bool, infos: list[dict],
           layout_host: str | None = None) -> tuple[str, str]:
    """How weights reach the servers ("files", "adapter" or "collective") and why. "adapter" without
    LoRA, or "collective" asked for but impossible, is a ValueError that says what to change;
    "auto" then falls back to files."""
    from saccade.transports.collective import trainer_address

    sync = engine_cfg.weight_sync
    if sync.kind == "adapter":
        if not lora:
            raise ValueError('engine.weight_sync.kind = "adapter" needs LoRA, and lora = false is full fine-tuning '
                             '(which sends full weights): set engine.weight_sync.kind = "files" or "collective"')
        return "adapter", 'engine.weight_sync.kind = "adapter": the servers load the LoRA adapter\'s folder'
    if sync.kind == "files":
        return "files", 'engine.weight_sync.kind = "files": written to a folder each server reads back'
    problem = collective_problem(engine_cfg, infos, layout_host)
    if problem is None:
        address = trainer_address(engine_cfg.urls, sync.transfer_address, layout_host)
        return "collective", (f'engine.weight_sync.kind = "{sync.kind}": broadcast over gloo, the servers meet this '
                              f"trainer at {address}, no files")
    if sync.kind == "collective":
        raise ValueError(f'engine.weight_sync.kind = "collective" cannot be used: {problem}; or set '
                         'engine.weight_sync.kind = "files"')
    return "files", f'engine.weight_sync.kind = "auto", and the collective cannot be used: {problem}'


def build_transport(kind: str, engine_cfg: VLLMEngineConfig, client, model: nn.Module, model_path: str,
                    run_dir: Path, *, world: World = SINGLE, layout_host: str | None = None) -> WeightTransport:
    """The transport of `kind` (what `choose` returned) over `client`, the engine's HTTP client."""
    sync = engine_cfg.weight_sync
    if kind == "collective":
        from saccade.transports.collective import CollectiveTransport, trainer_address

        address = trainer_address(engine_cfg.urls, sync.transfer_address, layout_host)
        return CollectiveTransport(client, model, model_path, address=address, timeout_s=engine_cfg.timeout_s,
                                   sends=world.is_main)
    folder = Path(sync.weights_dir) if getattr(sync, "weights_dir", None) else run_dir / "engine-weights"  # as RunConfig.engine_weights_dir
    if kind == "adapter":
        from saccade.transports.adapter import adapter_transport

        return adapter_transport(client, model, model_path, folder, world=world)
    from saccade.transports.files import files_transport

    return files_transport(client, model, model_path, folder, world=world)
