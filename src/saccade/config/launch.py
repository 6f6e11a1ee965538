"""`[launch]`: where `saccade launch` runs a run's vLLM servers and its trainer.

A layout is a list of nodes (machines), each with its trainer ranks and its servers:

    [[launch.nodes]]            # one machine, 8 GPUs: the trainer on GPU 0, seven servers
    trainer_gpus = [0]
    server_gpus = [[1], [2], [3], [4], [5], [6], [7]]

Server i of the whole layout (counted node after node) listens on `server_port + i` at its
node's `host`; those addresses are the run's `engine.urls`, which a config with a layout leaves
out (`saccade.config.run.RunConfig` fills them in), so a trainer started by hand with the same
config finds the same servers. A node without GPUs runs its ranks and servers on the CPU
(vLLM's CPU build).

This module imports no other part of saccade but `saccade.config.sections`.
"""

from __future__ import annotations

import ipaddress

from pydantic import Field, model_validator

from saccade.config.sections import Section

LOOPBACK_NAMES = ("localhost",)


def is_loopback(host: str | None) -> bool:
    """True for 127.0.0.0/8, ::1 and 'localhost': an address no other machine reaches. False for
    0.0.0.0 and "" (all interfaces), None, and the rest. `saccade serve` and the launcher use it."""
    if host in LOOPBACK_NAMES:
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


# Set by `saccade launch` on each node's trainer process: that node's `host` in the layout (where
# the servers reach the trainer's rank 0 for a collective weight sync, when it runs there).
NODE_HOST_ENV = "SACCADE_NODE_HOST"


class LaunchNode(Section):
    """One machine of the layout: how many trainer ranks and vLLM servers it runs, on which GPUs."""

    host: str = Field(
        "127.0.0.1", min_length=1,
        description="the address the trainer reaches this node's servers at (and, on the first trainer node, the "
        "other trainer nodes reach torchrun's rendezvous at). A non-loopback address makes the servers listen on "
        "it, which needs VLLM_API_KEY set in the launcher's environment (the servers and the trainer read it)",
    )
    trainer_gpus: list[int] = Field(
        default_factory=list,
        description="the GPUs of this node's trainer ranks, one rank each (CUDA_VISIBLE_DEVICES); empty: the "
        "ranks (trainer_ranks) run on the CPU",
    )
    trainer_ranks: int | None = Field(
        None, ge=0, description="trainer processes on this node (torchrun --nproc-per-node); unset: len(trainer_gpus)"
    )
    server_gpus: list[list[int]] = Field(
        default_factory=list,
        description="each of this node's vLLM servers' GPUs: [[1], [2]] is two servers of one GPU each; a server "
        "of several GPUs splits the model over them (--tensor-parallel-size). Empty: `servers` CPU servers. A "
        "server may share a GPU with a trainer rank (the one-GPU layout: the server starts first and takes "
        "launch.gpu_memory_utilization of it)",
    )
    servers: int | None = Field(None, ge=0, description="vLLM servers on this node; unset: len(server_gpus)")

    @model_validator(mode="after")
    def _counts_agree(self) -> LaunchNode:
        if self.trainer_ranks is None:
            self.trainer_ranks = len(self.trainer_gpus)
        elif self.trainer_gpus and self.trainer_ranks != len(self.trainer_gpus):
            raise ValueError(f"trainer_ranks = {self.trainer_ranks} but trainer_gpus names {len(self.trainer_gpus)} "
                             "GPUs: one rank per GPU (leave trainer_ranks out)")
        if self.servers is None:
            self.servers = len(self.server_gpus)
        elif self.server_gpus and self.servers != len(self.server_gpus):
            raise ValueError(f"servers = {self.servers} but server_gpus lists {len(self.server_gpus)} servers "
                             "(leave servers out)")
        if len(set(self.trainer_gpus)) != len(self.trainer_gpus):
            raise ValueError(f"trainer_gpus {self.trainer_gpus} names a GPU twice: one rank per GPU")
        taken: set[int] = set()
        for gpus in self.server_gpus:
            if not gpus:
                raise ValueError("server_gpus: every server needs at least one GPU, e.g. [[1], [2]]")
            if taken & set(gpus) or len(set(gpus)) != len(gpus):
                raise ValueError(f"server_gpus {self.server_gpus}: two servers cannot share a GPU")
            taken |= set(gpus)
        if any(g < 0 for g in [*self.trainer_gpus, *taken]):
            raise ValueError("GPU indices are >= 0")
        return self

    @property
    def on_gpus(self) -> bool:
        """True when this node's servers run on GPUs (else vLLM's CPU build)."""
        return bool(self.server_gpus)


class LaunchConfig(Section):
    """The layout `saccade launch` starts: per node, its trainer ranks and vLLM servers, and the
    flags every server gets (docs/launch.md). No nodes: the run has no layout (start the servers
    and the trainer yourself, `engine.urls` naming the servers)."""

    nodes: list[LaunchNode] = Field(
        default_factory=list,
        description="the machines, in order: [[launch.nodes]] tables, each with trainer_gpus (or trainer_ranks) and "
        "server_gpus (or servers). Several nodes: the same config on each, `saccade launch CONFIG --node-rank R`",
    )
    server_port: int = Field(
        8001, ge=1024, le=65000, description="the first server's port; server i of the layout (node after node) "
        "listens on server_port + i"
    )
    gpu_memory_utilization: float = Field(
        0.9, gt=0, le=1,
        description="each GPU server's --gpu-memory-utilization: the share of its GPU it takes (weights, KV cache). "
        "Beside a trainer rank on the same GPU, what the trainer leaves: `saccade memory CONFIG` estimates both "
        "with this value",
    )
    max_model_len: int | None = Field(
        None, ge=64, description="the servers' --max-model-len, tokens of prompt + completion; unset: "
        "trainer.max_tokens (a longer sample cannot be trained anyway)"
    )
    images_per_prompt: int = Field(
        4, ge=0, le=1024,
        description="the most images one request may carry (--limit-mm-per-prompt; a multi-turn episode's "
        "request carries every turn's images so far); vLLM refuses a request with more",
    )
    cpu_kv_cache_gib: float = Field(
        1.0, gt=0, le=1024, description="a CPU server's KV cache, GiB (VLLM_CPU_KVCACHE_SPACE)"
    )
    server_args: list[str] = Field(
        default_factory=list,
        description="more vLLM arguments for every server, e.g. [\"--enable-prefix-caching\"] (docs/launch.md lists "
        "those the launcher sets itself)",
    )
    max_restarts: int = Field(
        3, ge=0, le=1000,
        description="how often in a row a server that exits or hangs while the trainer runs is started again (on "
        "its port; the trainer takes it back with the current weights); past that, it stays down and the others go "
        "on. The count goes back to 0 once a server has run restart_budget_reset_s",
    )
    restart_budget_reset_s: float = Field(
        3600.0, ge=60, le=604800,
        description="a restarted server that has run this long in one life and answers /health has its restart "
        "count back at 0, so a long run does not give up for good on a server that failed max_restarts times over "
        "days; seconds",
    )
    ready_timeout_s: float = Field(
        1800.0, gt=0, description="how long the launcher waits for every server to answer before it gives up, seconds"
    )
    hang_after_s: float = Field(
        120.0, ge=10, le=3600,
        description="a running server whose /health has not answered for this long (asked every 5 s) is taken as "
        "hung: its processes are ended and it is started again, as one that exited; seconds",
    )
    rdzv_port: int = Field(
        29500, ge=1024, le=65535,
        description="several trainer nodes: torchrun's rendezvous port on the first trainer node's host",
    )

    @model_validator(mode="after")
    def _one_trainer_shape(self) -> LaunchConfig:
        counts = {n.trainer_ranks for n in self.nodes if n.trainer_ranks}
        if len(counts) > 1:
            raise ValueError(f"every node that trains runs as many trainer ranks (torchrun --nproc-per-node), got "
                             f"{sorted(counts)}")
        if self.nodes and not counts:
            raise ValueError("no node runs the trainer: give one node trainer_gpus (or trainer_ranks on the CPU)")
        if self.server_port + self.servers > 65536:
            raise ValueError(f"server_port {self.server_port} + {self.servers} servers runs past port 65535")
        return self

    @property
    def servers(self) -> int:
        return sum(n.servers for n in self.nodes)

    @property
    def trainer_nodes(self) -> list[int]:
        """The indices of the nodes that run trainer ranks, in order (torchrun's node ranks)."""
        return [i for i, n in enumerate(self.nodes) if n.trainer_ranks]

    @property
    def trainer_host(self) -> str | None:
        """The host of the first node with trainer ranks (where torchrun's rendezvous meets; with one
        trainer rank, where the trainer runs, so where the servers reach it for a collective weight
        sync); None without a layout."""
        nodes = self.trainer_nodes
        return self.nodes[nodes[0]].host if nodes else None

    @property
    def world_size(self) -> int:
        """The trainer's ranks over every node (1 without a layout)."""
        return sum(n.trainer_ranks for n in self.nodes) or 1

    def server_urls(self) -> list[str]:
        """Every server's base URL, node after node: http://host:server_port + i."""
        urls, port = [], self.server_port
        for node in self.nodes:
            host = f"[{node.host}]" if ":" in node.host else node.host
            for _ in range(node.servers):
                urls.append(f"http://{host}:{port}")
                port += 1
        return urls

    def shares_gpu(self) -> bool:
        """True when some trainer rank and some server are on the same GPU of one node."""
        return any(set(n.trainer_gpus) & {g for gpus in n.server_gpus for g in gpus} for n in self.nodes)
