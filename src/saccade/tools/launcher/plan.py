"""What `saccade launch` runs on one node of a layout: each process's command line and
environment, made from the run config alone (pure: nothing is started here, nothing is
downloaded). `saccade launch --dry-run` prints exactly these.

A server's flags follow from the config, so that it samples what the trainer will score:
- `--mm-processor-kwargs` with the run's image bounds (`images.min_pixels` / `max_pixels`):
  vLLM resizes a chat request's images as the trainer does, with no copied model folder;
- `--enable-lora --max-lora-rank lora.rank` when the trainer pushes LoRA adapters;
- `--limit-mm-per-prompt` from `launch.images_per_prompt`, `--max-model-len` from
  `launch.max_model_len` (default `trainer.max_tokens`, the longest sample that can train);
- on GPUs: `--dtype model.dtype`, `--gpu-memory-utilization` (the value `saccade memory`
  estimates the layout with), `--tensor-parallel-size` for a server of several GPUs;
- on the CPU (vLLM's CPU build): the family's CPU dtype, `--enforce-eager`, and its KV cache
  from `launch.cpu_kv_cache_gib`;
- `--weights-root`: the folder the trainer writes the engine's weights under;
- `--weight-transfer-config` with the backend a collective weight sync takes in this layout
  (`saccade.transports.choose.launch_backend`: ipc for a server on the trainer's GPU, nccl, ...,
  by where the processes are), unless it is saccade serve's own default (saccade_gloo); the dry
  run's first trainer node line says which and why.
"""

from __future__ import annotations

import json
import shlex
import sys
from dataclasses import dataclass, field
from pathlib import Path

from saccade.config import LaunchNode, RunConfig, is_loopback
from saccade.config.launch import NODE_HOST_ENV


@dataclass(frozen=True)
class Process:
    """One process the launcher starts: a name for its log lines, its command, the environment
    variables set for it on top of the launcher's, and a server's base URL."""

    name: str
    argv: tuple[str, ...]
    env: dict[str, str] = field(default_factory=dict)
    url: str | None = None

    def shell(self) -> str:
        """The command as one shell line, its variables first."""
        variables = [f"{k}={shlex.quote(v)}" for k, v in self.env.items()]
        return " ".join([*variables, shlex.join(self.argv)])


def weights_root(cfg: RunConfig) -> Path:
    """Where the trainer writes the weights it pushes (engine.weight_sync.weights_dir, else the run
    folder): the servers load only from below it (`saccade serve --weights-root`)."""
    configured = getattr(getattr(cfg.engine, "weight_sync", None), "weights_dir", None)
    return Path(configured or cfg.run_dir).absolute()


def cpu_server_dtype(cfg: RunConfig) -> str:
    """The dtype a CPU server of the run's model takes: model.dtype, unless vLLM's CPU build serves
    the family in one dtype only (Qwen3.5: bfloat16; `saccade.serving.launch.cpu_dtype`). Known
    without a download for the built-in presets and local folders; a hub id on the CPU is asked
    for model.dtype (a plan downloads nothing)."""
    from saccade.serving.launch import cpu_dtype

    if not (cfg.model.is_preset or Path(cfg.model.path).is_dir()):
        return cfg.model.dtype
    return cpu_dtype(cfg.model.path, default=cfg.model.dtype)


def server_processes(cfg: RunConfig, node_rank: int, *, model: str | None = None,
                     python: str = sys.executable) -> list[Process]:
    """Node `node_rank`'s vLLM servers (`saccade serve`), each on its port of the layout.
    `model`: what the servers load, default model.path (the launcher passes a preset's built folder)."""
    from saccade.data.messages import processor_size

    launch = cfg.launch
    node = launch.nodes[node_rank]
    first = sum(n.servers for n in launch.nodes[:node_rank])  # this node's first server in the layout
    urls = launch.server_urls()[first:first + node.servers]
    common = [
        "--weights-root", str(weights_root(cfg)),
        "--max-model-len", str(launch.max_model_len or cfg.trainer.max_tokens),
        "--limit-mm-per-prompt", json.dumps({"image": launch.images_per_prompt, "video": 0}),
        "--mm-processor-kwargs", json.dumps({"size": processor_size(cfg.images)}),
    ]
    if cfg.lora is not None and cfg.engine.kind == "vllm" and cfg.engine.weight_sync.kind == "adapter":
        common += ["--enable-lora", "--max-lora-rank", str(cfg.lora.rank)]
    if not is_loopback(node.host):
        common += ["--host", node.host]  # then `saccade serve` requires VLLM_API_KEY
    common += transfer_flags(cfg)
    out = []
    for i, url in enumerate(urls):
        port = launch.server_port + first + i
        argv = [python, "-m", "saccade", "serve", model or cfg.model.path, "--port", str(port), *common]
        if node.on_gpus:
            gpus = node.server_gpus[i]
            argv += ["--dtype", cfg.model.dtype, "--gpu-memory-utilization", f"{launch.gpu_memory_utilization:g}"]
            if len(gpus) > 1:
                argv += ["--tensor-parallel-size", str(len(gpus))]
            env = {"CUDA_VISIBLE_DEVICES": ",".join(map(str, gpus))}
        else:
            argv += ["--dtype", cpu_server_dtype(cfg), "--enforce-eager"]
            env = {"VLLM_CPU_KVCACHE_SPACE": f"{launch.cpu_kv_cache_gib:g}"}
        out.append(Process(f"server {first + i}", (*argv, *launch.server_args), env, url))
    return out


def transfer_flags(cfg: RunConfig) -> list[str]:
    """The servers' --weight-transfer-config for the layout's collective backend, where it is not
    saccade serve's default."""
    from saccade.serving.wire import GLOO_BACKEND
    from saccade.transports.backends import BACKENDS
    from saccade.transports.choose import launch_backend

    choice = launch_backend(cfg)
    if choice.kind != "collective" or BACKENDS[choice.backend].server_backend == GLOO_BACKEND:
        return []
    return ["--weight-transfer-config", json.dumps({"backend": BACKENDS[choice.backend].server_backend})]


def weight_sync_line(cfg: RunConfig) -> str:
    """How the layout's weights will reach its servers, and why (the dry run says it)."""
    from saccade.transports.choose import launch_backend

    choice = launch_backend(cfg)
    what = f"collective over {choice.backend}" if choice.kind == "collective" else choice.kind
    return f"weight sync: {what} ({choice.why})"


def trainer_process(cfg: RunConfig, node_rank: int, *, config: str, overrides: list[str], resume: bool = False,
                    python: str = sys.executable) -> Process | None:
    """Node `node_rank`'s share of the trainer: `saccade rl CONFIG` with the launcher's own
    overrides (so the trainer reads the config the launcher read), under torchrun when the
    layout has more than one rank. None when the node runs no trainer rank."""
    launch = cfg.launch
    node = launch.nodes[node_rank]
    if not node.trainer_ranks:
        return None
    rl = ["-m", "saccade", "rl", config, *overrides, *(["--resume"] if resume else [])]
    trainer_nodes = launch.trainer_nodes
    if launch.world_size == 1:
        argv = [python, *rl]
    elif len(trainer_nodes) == 1:
        argv = [python, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", str(node.trainer_ranks), *rl]
    else:
        host = launch.nodes[trainer_nodes[0]].host
        argv = [python, "-m", "torch.distributed.run", "--nnodes", str(len(trainer_nodes)),
                "--nproc-per-node", str(node.trainer_ranks), "--node-rank", str(trainer_nodes.index(node_rank)),
                "--rdzv-backend", "c10d", "--rdzv-endpoint", f"{host}:{launch.rdzv_port}",
                "--rdzv-id", cfg.log.name, *rl]
    env = {}
    if node.trainer_gpus:
        env = {"CUDA_VISIBLE_DEVICES": ",".join(map(str, node.trainer_gpus)),
               "PYTORCH_CUDA_ALLOC_CONF": "expandable_segments:True"}
    if len(trainer_nodes) > 1:  # rank 0 may run on any of them: a collective weight sync's servers reach it here
        env[NODE_HOST_ENV] = node.host
    return Process("trainer", tuple(argv), env)


def node_plan(cfg: RunConfig, node_rank: int, *, config: str, overrides: list[str], resume: bool = False,
              model: str | None = None, python: str = sys.executable) -> list[Process]:
    """Everything node `node_rank` starts, in order: its servers, then its trainer ranks."""
    check_node_rank(cfg, node_rank)
    trainer = trainer_process(cfg, node_rank, config=config, overrides=overrides, resume=resume, python=python)
    return [*server_processes(cfg, node_rank, model=model, python=python), *([trainer] if trainer else [])]


def check_node_rank(cfg: RunConfig, node_rank: int) -> LaunchNode:
    nodes = cfg.launch.nodes
    if not nodes:
        raise ValueError("the config has no [launch] layout: add [[launch.nodes]] tables with trainer_gpus and "
                         "server_gpus (docs/launch.md), or start `saccade serve` and `saccade rl` yourself")
    if not 0 <= node_rank < len(nodes):
        raise ValueError(f"--node-rank {node_rank}: the layout has {len(nodes)} node(s), 0..{len(nodes) - 1}")
    return nodes[node_rank]


def dry_run_text(cfg: RunConfig, *, config: str, overrides: list[str], resume: bool = False,
                 python: str = sys.executable) -> str:
    """Every node's commands, as `saccade launch --dry-run` prints them."""
    lines = []
    for rank, node in enumerate(cfg.launch.nodes):
        where = "GPUs" if node.on_gpus or node.trainer_gpus else "the CPU"
        line = f"# node {rank} ({node.host}): {node.servers} vLLM server(s), {node.trainer_ranks} trainer rank(s), on {where}"
        if cfg.launch.trainer_nodes and rank == cfg.launch.trainer_nodes[0]:
            line += f"; {weight_sync_line(cfg)}"
        if len(cfg.launch.nodes) > 1:
            line += f"; on that machine: saccade launch {config} --node-rank {rank}"
        lines.append(line)
        lines += [p.shell() for p in node_plan(cfg, rank, config=config, overrides=overrides, resume=resume,
                                                python=python)]
    return "\n".join(lines)
