"""The collective's backends by where the processes are (saccade.transports.backends, choose): the
servers' own at run time, a layout's before anything runs (saccade launch), each refusal saying
what to change; a CPU run asked for NCCL or IPC refused; sparse patches that bring a server from
the last values sent to the new ones. vLLM's backends are never run here (no GPU)."""

from __future__ import annotations

import json
import typing
from pathlib import Path

import pytest
import torch

from saccade.config import ConfigError, RunConfig, VLLMEngineConfig, load_config
from saccade.config.engine import BACKEND_NAMES, Backend
from saccade.transports.backends import BACKENDS
from saccade.transports.backends.base import Place
from saccade.transports.choose import TrainerSide, choose, launch_backend, layout_place, pick

CONFIGS = Path(__file__).resolve().parents[2] / "configs"
CPU = [{"type": "cpu"}]


def offers(backend: str, devices=CPU, servers: int = 1) -> list[dict]:
    return [{"weight_transfer": {"backend": backend, "workers": len(devices), "devices": devices}}] * servers


def engine(kind="collective", backend="auto", urls=("http://127.0.0.1:8000",)) -> VLLMEngineConfig:
    return VLLMEngineConfig(urls=list(urls), weight_sync={"kind": kind, "backend": backend})


def test_the_configs_backends_are_the_tables():
    assert tuple(BACKENDS) == BACKEND_NAMES
    assert set(typing.get_args(Backend)) == {"auto", *BACKEND_NAMES}
    assert {b.server_backend for b in BACKENDS.values()} == {"saccade_gloo", *BACKEND_NAMES[1:]}
    assert [b.name for b in BACKENDS.values() if b.ours] == ["gloo"]  # the others are vLLM's, untested here


def test_a_cpu_run_asked_for_nccl_or_ipc_is_refused_saying_what_to_set():
    for backend in ("nccl", "ipc", "sparse_nccl", "nccl_m2n"):
        with pytest.raises(ValueError, match=f'backend "{backend}" needs GPUs, and the trainer runs on the CPU.*'
                                             'use backend = "gloo"'):
            choose(engine(backend=backend), lora=False, infos=offers("saccade_gloo"))
    # kind auto falls back to files, saying why
    kind, backend, why = choose(engine("auto", backend="nccl"), lora=False, infos=offers("saccade_gloo"))
    assert (kind, backend) == ("files", None) and "needs GPUs" in why


def test_at_run_time_auto_takes_what_the_servers_offer_where_it_can_run():
    gpu_trainer = TrainerSide(gpu_uuid="GPU-0")
    other_gpu = [{"type": "cuda", "uuid": "GPU-1"}]
    kind, backend, why = choose(engine(), lora=False, infos=offers("nccl", other_gpu, 2), trainer=gpu_trainer)
    assert (kind, backend) == ("collective", "nccl") and "vLLM's, untested here" in why
    same_gpu = [{"type": "cuda", "uuid": "GPU-0"}]
    assert choose(engine(), lora=False, infos=offers("ipc", same_gpu), trainer=gpu_trainer).backend == "ipc"
    with pytest.raises(ValueError, match="every worker of the server on the trainer's GPU"):
        choose(engine(), lora=False, infos=offers("ipc", other_gpu), trainer=gpu_trainer)
    with pytest.raises(ValueError, match="NCCL takes one rank per GPU"):  # nccl with a server on the trainer's GPU
        choose(engine(), lora=False, infos=offers("nccl", same_gpu), trainer=gpu_trainer)
    with pytest.raises(ValueError, match="the servers run on the CPU"):
        choose(engine(), lora=False, infos=offers("nccl"), trainer=gpu_trainer)
    # a backend named must be the servers' own
    with pytest.raises(ValueError, match="offer the nccl weight transfer, not sparse_nccl: start them with "
                                         "--weight-transfer-config"):
        choose(engine(backend="sparse_nccl"), lora=False, infos=offers("nccl", other_gpu), trainer=gpu_trainer)
    mixed = offers("nccl", other_gpu) + offers("saccade_gloo")
    assert "different weight-transfer backends" in choose(engine("auto"), lora=False, infos=mixed).why


def layout(*overrides: str, config: str = "qwen3vl-8b-8gpu.toml") -> RunConfig:
    return load_config(RunConfig, CONFIGS / config, ["--lora", "false", "--engine.weight_sync.kind", "auto",
                                                     *overrides])


def test_a_layout_picks_by_where_the_processes_are_and_says_why(monkeypatch):
    from saccade.transports.backends import sparse_nccl

    monkeypatch.setattr(sparse_nccl, "MEASURED", {})
    assert launch_backend(load_config(RunConfig, CONFIGS / "qwen3vl-8b-8gpu.toml")).kind == "adapter"  # as shipped
    one_gpu = launch_backend(layout(config="qwen3vl-8b-1gpu.toml"))
    assert one_gpu.backend == "ipc" and "one GPU" in one_gpu.why
    eight = launch_backend(layout())
    assert eight.backend == "nccl" and "not sparse_nccl: no measurement" in eight.why
    sharded = launch_backend(layout(config="qwen3vl-30b-a3b-8gpu.toml"))
    assert sharded.backend == "nccl" and "engine holds the MoE experts transposed" in sharded.why
    cpu = launch_backend(layout("--launch.nodes", json.dumps([{"trainer_ranks": 1, "servers": 2}]),
                                "--model.path", "tiny", "--model.dtype", "float32"))
    assert cpu.backend == "gloo" and "run on the CPU" in cpu.why
    monkeypatch.setattr(sparse_nccl, "MEASURED", {2e-6: 0.02})
    sparse = launch_backend(layout("--trainer.lr", "1e-6"))
    assert sparse.backend == "sparse_nccl" and "0.06 of a dense sync's bytes, pays" in sparse.why
    every_4 = launch_backend(layout("--trainer.lr", "1e-6", "--engine.sync_every_steps", "4"))
    assert every_4.backend == "sparse_nccl" and "4 step(s) a sync" in every_4.why  # 4 x 2% x 3 = 0.24: pays still
    every_16 = launch_backend(layout("--trainer.lr", "1e-6", "--engine.sync_every_steps", "16"))
    assert every_16.backend == "nccl" and "0.96 of a dense sync's bytes, does not pay" in every_16.why
    assert launch_backend(layout("--trainer.lr", "1e-4")).backend == "nccl"  # above every measured rate


def test_a_cpu_layout_asked_for_nccl_is_refused_and_its_servers_get_the_backend_flag_on_gpus():
    from saccade.tools.launcher.plan import node_plan

    nodes = json.dumps([{"trainer_ranks": 1, "servers": 1}])
    with pytest.raises(ValueError, match='backend "nccl" needs GPUs, and the trainer runs on the CPU'):
        launch_backend(layout("--launch.nodes", nodes, "--engine.weight_sync.kind", "collective",
                              "--engine.weight_sync.backend", "nccl", "--model.path", "tiny"))
    cfg = layout("--engine.weight_sync.backend", "nccl")
    servers = [p for p in node_plan(cfg, 0, config="c.toml", overrides=[], python="python") if p.url]
    assert all(json.loads(s.argv[s.argv.index("--weight-transfer-config") + 1]) == {"backend": "nccl"} for s in servers)
    cpu = layout("--launch.nodes", nodes, "--model.path", "tiny", "--model.dtype", "float32")
    assert all("--weight-transfer-config" not in p.argv for p in node_plan(cpu, 0, config="c.toml", overrides=[]))


def test_the_layouts_place():
    place = layout_place(layout(config="qwen3vl-2b-1gpu.toml"))
    assert place == Place(trainer_gpu=True, trainer_ranks=1, servers_gpu=True, shares_gpu=True, one_gpu=True,
                          servers=1, full_weights=True, keeps_layout=True)
    place = layout_place(layout(config="qwen3vl-30b-a3b-8gpu.toml"))
    assert (place.trainer_ranks, place.shares_gpu, place.servers, place.keeps_layout) == (4, False, 4, False)
    assert pick(Place(True, 4, True, False, False, 4), lr=1e-5, steps_per_sync=1, itemsize=2)[0].name == "nccl"


def test_sparse_patches_bring_a_server_from_the_last_values_sent_to_the_new_ones():
    pytest.importorskip("vllm", reason="the patches are vLLM's SparseWeightPatch")
    from saccade.transports.backends.sparse_nccl import expected_fraction, patches, sparse_share

    torch.manual_seed(0)
    a, b = torch.randn(4, 5).to(torch.bfloat16), torch.randn(7).to(torch.bfloat16)
    last: dict = {}
    first = patches(["a", "b"], [a, b], last)  # nothing sent before: every index
    assert [p.indices.numel() for p in first] == [20, 7] and all(p.indices.dtype == torch.int32 for p in first)
    a2, b2 = a.clone(), b.clone()
    a2[1, 2] += 1
    b2[5] = -b2[5]
    served = {"a": a.clone().reshape(-1), "b": b.clone().reshape(-1)}
    for patch in patches(["a", "b"], [a2, b2], last):
        served[patch.name][patch.indices.long()] = patch.values
        assert patch.full_shape == {"a": (4, 5), "b": (7,)}[patch.name]
    assert torch.equal(served["a"].reshape(4, 5), a2) and torch.equal(served["b"], b2)
    assert [p.indices.tolist() for p in patches(["a", "b"], [a2, b2], last)] == [[], []]  # nothing changed since
    assert sparse_share(0.02) == pytest.approx(0.06) and sparse_share(0.5, itemsize=4) == 1.0
    with pytest.MonkeyPatch.context() as m:
        from saccade.transports.backends import sparse_nccl

        m.setattr(sparse_nccl, "MEASURED", {1e-6: 0.01, 1e-5: 0.1})
        assert expected_fraction(5e-7) == 0.01 and expected_fraction(2e-6, steps=2) == 0.2
        assert expected_fraction(1e-4) is None


def test_a_layout_that_asks_for_a_backend_by_name_is_checked_when_it_dry_runs(capsys):
    from saccade.cli import main

    path = str(CONFIGS / "qwen3vl-8b-1gpu.toml")
    assert main(["launch", path, "--dry-run", "--lora", "false", "--engine.weight_sync.kind", "collective",
                 "--engine.weight_sync.backend", "nccl"]) == 2
    assert "NCCL takes one rank per GPU" in capsys.readouterr().err
    with pytest.raises(ConfigError):
        layout("--engine.weight_sync.backend", "rdma")


GPU_CONFIGS = sorted(CONFIGS.glob("*gpu.toml")) + sorted((CONFIGS / "recipes").glob("*.toml"))
SHARDED = ["--launch.nodes", json.dumps([{"trainer_gpus": [0, 1, 2, 3], "server_gpus": [[4], [5], [6], [7]]}])]


def test_every_shipped_gpu_config_dry_runs_naming_its_weight_sync_and_why(monkeypatch):
    """`saccade launch CONFIG --dry-run`'s first trainer node line, for every shipped GPU config and
    recipe: as shipped (LoRA: the adapter, no collective), and with full fine-tuning synced by the
    collective (auto) at the config's rate and at the headers' full fine-tuning rate (2e-6)."""
    from saccade.tools.launcher.plan import dry_run_text
    from saccade.transports.backends import nccl_m2n

    monkeypatch.setattr(nccl_m2n, "has_module", lambda name: False)  # as here: no nccl-extensions
    assert len(GPU_CONFIGS) == 16

    def line(path: Path, *overrides: str) -> str:
        cfg = load_config(RunConfig, path, list(overrides))
        text = dry_run_text(cfg, config=str(path), overrides=list(overrides), python="python")
        return next(x for x in text.splitlines() if x.startswith("# node")).split("weight sync: ", 1)[1]

    full = ("--lora", "false", "--engine.weight_sync.kind", "auto")
    for path in GPU_CONFIGS:
        shipped, at_own_lr, at_2e6 = line(path), line(path, *full), line(path, *full, "--trainer.lr", "2e-6")
        assert shipped.startswith("adapter (") and "no collective backend" in shipped, path.name
        if "1gpu" in path.name:  # the trainer and its one server on one GPU
            assert at_own_lr.startswith("collective over ipc (auto: the trainer and its one server on one GPU"), path
            assert at_2e6.startswith("collective over ipc ("), path.name
            continue
        sharded = load_config(RunConfig, path, list(full)).launch.world_size > 1  # the MoE configs: 4 ranks
        assert at_own_lr.startswith("collective over nccl (auto: the trainer and the servers on GPUs of their own")
        why_not = ("not sparse_nccl: no measurement of the weights that change at lr 2e-05" if "qwen3vl-2b" in path.name
                   else "not sparse_nccl: at lr 1e-05, 1 step(s) a sync, about 20.0% of the weights change: a patch "
                        "sends 0.200 x (4 + 2) / 2 = 0.60 of a dense sync's bytes, does not pay")
        assert why_not in at_own_lr, path.name
        assert at_2e6.startswith("collective over sparse_nccl (") and "0.19 of a dense sync's bytes, pays" in at_2e6
        if sharded:  # the MoE experts transposed (Qwen3-VL-MoE) or no nccl-extensions: rank 0 gathers
            assert "not nccl_m2n: " in at_own_lr and "not nccl_m2n: " in at_2e6, path.name
        else:  # the headers' sharded layout: 4 trainer GPUs, 4 servers
            sharded_line = line(path, *full, "--trainer.lr", "2e-6", *SHARDED)
            assert sharded_line.startswith("collective over sparse_nccl (") and "not nccl_m2n: " in sharded_line


def test_vllms_backends_get_their_own_init_info_with_the_rendezvous_saccade_picked():
    """What saccade hands vLLM's trainer engines (their code is never run here): its rank, the
    address and port it bound, the world of the trainer's ranks and every server's workers."""
    pytest.importorskip("vllm", reason="the init infos are vLLM's dataclasses")
    from saccade.transports.backends.base import Party

    party = Party(rank=0, trainer_ranks=2, address="10.0.0.1", workers=(2, 1), token="t", timeout_s=5.0, port=1234)
    infos = {name: b.init_info(party) for name, b in BACKENDS.items() if not b.ours}
    assert {n: type(i).__name__ for n, i in infos.items()} == {
        "nccl": "NCCLTrainerInitInfo", "ipc": "IPCTrainerInitInfo", "sparse_nccl": "SparseNCCLTrainerInitInfo",
        "nccl_m2n": "M2NTrainerInitInfo"}
    for name in ("nccl", "sparse_nccl", "nccl_m2n"):
        info = infos[name]
        assert (info.rank, info.master_address, info.master_port, info.world_size) == (0, "10.0.0.1", 1234, 5), name
    assert infos["nccl_m2n"].num_trainer_ranks == 2 and infos["ipc"].packed  # ipc: no rendezvous, a bounded buffer


def test_a_sharded_trainers_group_holds_rank_0_alone_unless_every_rank_sends():
    """World 2 over gloo (or nccl): the group is rank 0 and the servers' workers, so its world is 1 +
    the workers (counting both trainer ranks, rank 0 waited for a member that never came); nccl_m2n
    puts every trainer rank in it."""
    from types import SimpleNamespace

    from saccade.distributed import World
    from saccade.transports.collective import CollectiveTransport

    for name, world_size in (("gloo", 3), ("nccl", 3), ("nccl_m2n", 4)):
        me = SimpleNamespace(world=World(rank=0, size=2), backend=BACKENDS[name], address="127.0.0.1", token="t",
                             timeout_s=5.0)
        assert CollectiveTransport._party(me, [1, 1]).world_size == world_size, name
