"""Which way the run's weights reach its servers, over which backend, and why; and the transport
built for it.

`choose` reads `engine.weight_sync` (its kind: files, adapter, collective or auto; for the last
two, `backend`), whether the trainer has LoRA, the servers' /saccade/info (the weight transfer they
offer and the devices their workers are on, LoRA support, whether they take weights at all) and
where the trainer is (`TrainerSide`); it returns a `Choice` (kind, backend, why) or a ValueError
that says what to change. `launch_backend` makes the same choice from a `[launch]` layout, before
anything runs (the servers are then started with it: `saccade launch` and its `--dry-run`).

By where the processes are (`saccade.transports.backends`, each backend's `problem` and `where`):
the servers or the trainer on the CPU: gloo; the trainer and its one server on one GPU: ipc; GPUs
of their own: nccl, or sparse_nccl where the measured share of weights that change makes it pay,
or, for a sharded trainer, nccl_m2n where it fits. At run time the servers' backend is what they
were started with; `auto` takes it if it can run here and says why, a named one must be it.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import NamedTuple

from torch import nn

from saccade.config import VLLMEngineConfig
from saccade.distributed import SINGLE, World
from saccade.inference.engine import WeightTransport
from saccade.transports.backends import BACKENDS, backend_named
from saccade.transports.backends.base import Backend, Place, has_module


class Choice(NamedTuple):
    kind: str  # files, adapter or collective
    backend: str | None  # the collective's (engine.weight_sync.backend's names), else None
    why: str


@dataclass(frozen=True)
class TrainerSide:
    """Where the trainer is: its GPU's UUID (None: on the CPU), its ranks, full fine-tuning or LoRA."""

    gpu_uuid: str | None = None
    ranks: int = 1
    full_weights: bool = True


def trainer_side(model: nn.Module, world: World = SINGLE, *, full_weights: bool = True) -> TrainerSide:
    """This trainer's side: its model's GPU (by UUID, as the servers report theirs), ranks, LoRA or not."""
    import torch

    device = next(model.parameters()).device
    uuid = str(torch.cuda.get_device_properties(device).uuid) if device.type == "cuda" else None
    return TrainerSide(gpu_uuid=uuid, ranks=world.size, full_weights=full_weights)


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


def servers_place(trainer: TrainerSide, infos: list[dict]) -> Place:
    """`Place` from the servers' /saccade/info (each worker's device) and the trainer's side."""
    devices = [d for i in infos for d in (i.get("weight_transfer") or {}).get("devices") or [{"type": "cpu"}]]
    on_trainer = [d.get("uuid") is not None and d.get("uuid") == trainer.gpu_uuid for d in devices]
    return Place(trainer_gpu=trainer.gpu_uuid is not None, trainer_ranks=trainer.ranks,
                 servers_gpu=bool(devices) and all(d.get("type") == "cuda" for d in devices),
                 shares_gpu=any(on_trainer), one_gpu=bool(on_trainer) and all(on_trainer), servers=len(infos),
                 full_weights=trainer.full_weights)


def offered_backend(infos: list[dict]) -> tuple[Backend | None, str | None]:
    """The backend every server offers, or (None, why not)."""
    offered = [(i.get("weight_transfer") or {}).get("backend") for i in infos]
    if not offered or None in offered:
        return None, (f"{offered.count(None)} server(s) offer no weight transfer (an older saccade serve, or one "
                      "started without --weight-transfer-config)")
    if len(set(offered)) > 1:
        return None, f"the servers offer different weight-transfer backends ({', '.join(sorted(set(offered)))})"
    try:
        return backend_named(offered[0]), None
    except ValueError:
        return None, f"the servers offer the {offered[0]} weight transfer, which this saccade cannot drive"


def collective_problem(engine_cfg: VLLMEngineConfig, infos: list[dict], layout_host: str | None,
                       trainer: TrainerSide = TrainerSide()) -> tuple[Backend | None, str | None]:
    """The backend the collective would use with these servers and why it cannot (None: it can)."""
    from saccade.transports.collective import trainer_address

    if not has_module("vllm.distributed.weight_transfer"):
        return None, "vLLM's weight-transfer API is not installed where the trainer runs (import vllm failed)"
    backend, problem = offered_backend(infos)
    named = getattr(engine_cfg.weight_sync, "backend", "auto")
    if backend is not None and named != "auto" and backend.name != named:
        wanted = BACKENDS[named].server_backend
        problem = (f"the servers offer the {backend.server_backend} weight transfer, not {wanted}: start them with "
                   f"--weight-transfer-config '{{\"backend\": \"{wanted}\"}}' (saccade launch does)")
    if named != "auto":  # asked for by name: refused where it cannot run, whatever the servers offer
        problem = BACKENDS[named].problem(servers_place(trainer, infos)) or problem
    elif backend is not None and problem is None:
        problem = backend.problem(servers_place(trainer, infos))
    if problem is None:
        try:
            trainer_address(engine_cfg.urls, getattr(engine_cfg.weight_sync, "transfer_address", None), layout_host)
        except ValueError as err:
            problem = str(err)
    return backend, problem


def choose(engine_cfg: VLLMEngineConfig, *, lora: bool, infos: list[dict], layout_host: str | None = None,
           trainer: TrainerSide = TrainerSide()) -> Choice:
    """How weights reach the servers and why. "adapter" without LoRA, or "collective" asked for but
    impossible, is a ValueError that says what to change; "auto" then falls back to files."""
    from saccade.transports.collective import trainer_address

    sync = engine_cfg.weight_sync
    if sync.kind == "adapter":
        if not lora:
            raise ValueError('engine.weight_sync.kind = "adapter" needs LoRA, and lora = false is full fine-tuning '
                             '(which sends full weights): set engine.weight_sync.kind = "files" or "collective"')
        return Choice("adapter", None, 'engine.weight_sync.kind = "adapter": the servers load the LoRA adapter\'s folder')
    if sync.kind == "files":
        return Choice("files", None, 'engine.weight_sync.kind = "files": written to a folder each server reads back')
    backend, problem = collective_problem(engine_cfg, infos, layout_host, trainer)
    if problem is None:
        address = trainer_address(engine_cfg.urls, sync.transfer_address, layout_host)
        code = "saccade's" if backend.ours else "vLLM's, untested here"
        return Choice("collective", backend.name,
                      f'engine.weight_sync.kind = "{sync.kind}", backend {backend.name} ({code}; {backend.where}); '
                      f"the servers meet this trainer at {address}, no files")
    if sync.kind == "collective":
        raise ValueError(f'engine.weight_sync.kind = "collective" cannot be used: {problem}; or set '
                         'engine.weight_sync.kind = "files"')
    return Choice("files", None, f'engine.weight_sync.kind = "auto", and the collective cannot be used: {problem}')


def build_transport(choice: Choice, engine_cfg: VLLMEngineConfig, client, model: nn.Module, model_path: str,
                    run_dir: Path, *, world: World = SINGLE, layout_host: str | None = None) -> WeightTransport:
    """The transport of `choice` (what `choose` returned) over `client`, the engine's HTTP client."""
    sync = engine_cfg.weight_sync
    if choice.kind == "collective":
        from saccade.transports.collective import CollectiveTransport, trainer_address

        address = trainer_address(engine_cfg.urls, sync.transfer_address, layout_host)
        return CollectiveTransport(client, model, model_path, address=address, timeout_s=engine_cfg.timeout_s,
                                   sends=world.is_main, backend=choice.backend, world=world)
    folder = Path(sync.weights_dir) if getattr(sync, "weights_dir", None) else run_dir / "engine-weights"  # as RunConfig.engine_weights_dir
    if choice.kind == "adapter":
        from saccade.transports.adapter import adapter_transport

        return adapter_transport(client, model, model_path, folder, world=world)
    from saccade.transports.files import files_transport

    return files_transport(client, model, model_path, folder, world=world)


def layout_place(cfg) -> Place:
    """`Place` from a run config's `[launch]` layout (GPU indices, not UUIDs: a server GPU that is a
    trainer rank's on the same node is shared)."""
    nodes = cfg.launch.nodes
    trainers = [n for n in nodes if n.trainer_ranks]
    with_servers = [n for n in nodes if n.servers]
    rank0 = trainers[0] if trainers else None
    rank0_gpu = rank0.trainer_gpus[0] if rank0 is not None and rank0.trainer_gpus else None
    workers = [(node, gpu) for node in with_servers for gpus in node.server_gpus for gpu in gpus]
    return Place(trainer_gpu=bool(trainers) and all(n.trainer_gpus for n in trainers), trainer_ranks=cfg.launch.world_size,
                 servers_gpu=bool(with_servers) and all(n.on_gpus for n in with_servers),
                 shares_gpu=any(gpu in node.trainer_gpus for node, gpu in workers),
                 one_gpu=bool(workers) and all(node is rank0 and gpu == rank0_gpu for node, gpu in workers),
                 servers=sum(n.servers for n in nodes), full_weights=cfg.lora is None,
                 keeps_layout=not transposes(cfg.model.path))


def transposes(model: str) -> bool:
    """Whether the engine holds some trained tensor transposed (Qwen3-VL-MoE's experts), known without
    a download for a folder, a preset and the published configs saccade ships; False when unknown."""
    from saccade.models.families import family_of
    from saccade.models.presets.table import HUB

    for where in (Path(model), HUB / model):
        if (where / "config.json").is_file():
            return bool(family_of(where).checkpoint.transposed)
    return False


def pick(place: Place, *, lr: float, steps_per_sync: int, itemsize: int) -> tuple[Backend | None, str]:
    """`auto`'s backend where the processes are (the module note), and why; None: none fits."""
    from saccade.transports.backends import gloo, ipc, nccl, nccl_m2n, sparse_nccl

    if not (place.trainer_gpu and place.servers_gpu):
        side = "the servers" if not place.servers_gpu else "the trainer"
        return gloo.GLOO, f"{side} run on the CPU, and vLLM's NCCL and IPC backends need GPUs: {gloo.GLOO.where}"
    if place.shares_gpu:
        problem = ipc.IPC.problem(place)
        return (None, problem) if problem else (ipc.IPC, ipc.IPC.where)
    notes = []
    if place.trainer_ranks > 1:
        problem = nccl_m2n.NCCL_M2N.problem(place)
        if problem is None:
            return nccl_m2n.NCCL_M2N, nccl_m2n.NCCL_M2N.where
        notes.append(f"not nccl_m2n: {problem}; rank 0 gathers each layer group")
    if place.full_weights:
        pays, why = sparse_nccl.pays(lr, steps_per_sync, itemsize)
        if pays:
            return sparse_nccl.SPARSE_NCCL, "; ".join([f"{sparse_nccl.SPARSE_NCCL.where}: {why}", *notes])
        notes.append(f"not sparse_nccl: {why}")
    else:
        notes.append("not sparse_nccl: LoRA merged into full weights changes every targeted matrix each step")
    return nccl.NCCL, "; ".join([nccl.NCCL.where, *notes])


def launch_backend(cfg) -> Choice:
    """The weight sync a `[launch]` layout will use (its servers are started with the backend), and
    why; ValueError for a backend asked for by name that cannot run there (on the CPU: nccl, ipc,
    ...)."""
    import torch

    engine = cfg.engine
    if engine.kind != "vllm":
        return Choice("none", None, "engine.kind = \"embedded\": the trainer samples itself, nothing is sent")
    sync = engine.weight_sync
    if sync.kind in ("files", "adapter"):
        what = "the LoRA adapter's folder (MBs)" if sync.kind == "adapter" else "a folder of full weights"
        return Choice(sync.kind, None, f'engine.weight_sync.kind = "{sync.kind}": the servers load {what}; no '
                                       "collective backend")
    place = layout_place(cfg)
    if sync.backend != "auto":
        backend = BACKENDS[sync.backend]
        problem = backend.problem(place)
        why = f'engine.weight_sync.backend = "{backend.name}"' + ("" if backend.ours else " (vLLM's, untested here)")
    else:
        itemsize = getattr(torch, cfg.model.dtype).itemsize
        backend, why = pick(place, lr=cfg.trainer.lr, steps_per_sync=engine.sync_every_steps * cfg.trainer.num_iterations,
                            itemsize=itemsize)
        problem = None if backend is not None else why
        why = f"auto: {why}"
    if problem is None:
        return Choice("collective", backend.name, why)
    if sync.kind == "collective":
        raise ValueError(f'engine.weight_sync.kind = "collective" cannot be used in this layout: {problem}; or set '
                         'engine.weight_sync.kind = "files"')
    return Choice("files", None, f'engine.weight_sync.kind = "auto", and the collective cannot be used: {problem}')
