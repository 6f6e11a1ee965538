"""`saccade bench weight-sync`: one full fine-tuning sync to a `saccade serve` through a folder
(`engine.weight_sync.kind = "files"`: the trainer writes the engine's folder, the server reads it back)
against the collective transfer ("collective", backend gloo: the language model sent layer group by
layer group through vLLM's trainer-side interface, no files), interleaved on the same server and
the same weights, medians of `repeats`. The collective's one-time rendezvous is timed apart. The
server is left serving its checkpoint, as found. These are measured, on this machine's CPU.

It then prints what one sync of a real model would cost on H100 machines over each way that
exists (`scale_estimates`): estimates, labelled so, each with its arithmetic. The bytes come from
the published configs (the language model alone for the collective backends, which never send the
frozen tower; the whole model for a folder, which holds it); sparse_nccl's share of weights changed
a step is the one `saccade bench changed-weights` measured on the CPU, at each measured learning
rate, beside the dense nccl row; the bandwidths are assumptions stated beside the constants, not
measurements. Only the bytes' travel is estimated, not the servers' reload. nccl, ipc and
sparse_nccl are vLLM's code, wired and untested here (no GPU).
"""

from __future__ import annotations

import statistics
import tempfile
import time
from contextlib import nullcontext
from pathlib import Path
from typing import Any

import torch

from saccade.config.bench import WeightSyncBenchConfig


# Assumed effective bandwidths, bytes/s (not measured here). NVLink 4 on an H100 SXM node carries
# 450 GB/s each way; a broadcast reaches about 80% of it. A 400 Gb/s InfiniBand NIC (NDR) is 50
# GB/s; one sender reaches about 90%. An H100's memory (HBM3) about 3 TB/s, of which a copy reaches
# about 2 TB/s: ipc copies twice on the GPU (the trainer packs the tensors into a buffer, the
# server loads from its handle). gloo sends from host memory over TCP sockets, one group a server,
# the bytes once per server: about 5 GB/s from one sender, whatever the link. A folder on local
# NVMe or a parallel filesystem: about 2 GB/s written by rank 0 and 2 GB/s read back by each server.
NVLINK_BPS = 360e9
NIC_BPS = 45e9
HBM_COPY_BPS = 2000e9
GLOO_BPS = 5e9
FILES_BPS = 2e9
SCALE_MODELS = ("Qwen/Qwen3-VL-2B-Instruct", "Qwen/Qwen3-VL-8B-Instruct")
SCALE_SERVERS = 7  # the 8-GPU configs' servers (trainer on GPU 0, a server on each of GPUs 1-7)


def published_params(hub_id: str) -> tuple[int, int]:
    """(language model, whole model) parameter counts of a published config, built on the meta
    device (no weights); the language model is every parameter outside the vision tower, a tied
    head counted once."""
    import transformers

    from saccade.models.presets.table import HUB

    config = transformers.AutoConfig.from_pretrained(HUB / hub_id)
    with torch.device("meta"):
        model = transformers.AutoModelForImageTextToText.from_config(config)
    whole = sum(p.numel() for p in model.parameters())
    tower = sum(p.numel() for n, p in model.named_parameters() if ".visual." in f".{n}")
    return whole - tower, whole


def scale_estimates(name: str, lm_params: int, all_params: int, *, bytes_per_param: int = 2,
                    servers: int = SCALE_SERVERS, changed: list[tuple[float, float]] = ()) -> list[str]:
    """One model's sync at bf16 on GPU machines over each way that exists, the arithmetic shown (see
    the constants' note); `changed`: (learning rate, share of weights one step changes) for a
    sparse_nccl row each, beside the dense nccl row."""
    from saccade.transports.backends.sparse_nccl import INDEX_BYTES

    s = bytes_per_param
    lm, whole = lm_params * s / 1e9, all_params * s / 1e9
    nvlink, nic, hbm, gloo, files = (bps / 1e9 for bps in (NVLINK_BPS, NIC_BPS, HBM_COPY_BPS, GLOO_BPS, FILES_BPS))
    rows = [
        (f"nccl, one node (NVLink, {nvlink:.0f} GB/s)", f"{lm:.2f} GB / {nvlink:.0f} = {lm / nvlink:.3f} s"),
        (f"nccl, across nodes (400 Gb/s NIC, {nic:.0f} GB/s)", f"{lm:.2f} GB / {nic:.0f} = {lm / nic:.3f} s"),
    ]
    for lr, fraction in changed:
        sparse = lm * fraction * (INDEX_BYTES + s) / s
        rows.append((f"sparse_nccl, one node, lr {lr:g} ({fraction:.2%} changed)",
                     f"{lm:.2f} GB x {fraction:.4f} x ({INDEX_BYTES} + {s}) / {s} = {sparse:.2f} GB ({sparse / lm:.2f} "
                     f"of dense); / {nvlink:.0f} = {sparse / nvlink:.4f} s"))
    rows += [
        (f"ipc, one shared GPU (two copies, {hbm:.0f} GB/s)", f"2 x {lm:.2f} GB / {hbm:.0f} = {2 * lm / hbm:.4f} s"),
        (f"gloo, {servers} servers (TCP from host memory, {gloo:.0f} GB/s)",
         f"{servers} x {lm:.2f} GB / {gloo:.0f} = {servers * lm / gloo:.1f} s"),
        (f"files (written, read back, {files:.0f} GB/s each)", f"2 x {whole:.2f} GB / {files:.0f} = {2 * whole / files:.1f} s"),
    ]
    return [f"  {name}: language model {lm_params / 1e9:.2f}B params x {s} B = {lm:.2f} GB "
            f"(whole model {whole:.2f} GB)", *(f"    {label:<52}{sum_}" for label, sum_ in rows)]


def measured_changed() -> list[tuple[float, float]]:
    """(learning rate, the largest share of weights one step changed) as `saccade bench
    changed-weights` measured them on the CPU (`sparse_nccl.MEASURED`), by rate."""
    from saccade.transports.backends.sparse_nccl import MEASURED

    return sorted(MEASURED.items())


def run_weight_sync_bench(cfg: WeightSyncBenchConfig) -> dict[str, Any]:
    from saccade.inference.vllm import VLLMEngine
    from saccade.models.lm import load_policy_lm, set_full_finetune
    from saccade.models.loading import load_processor
    from saccade.serving.launch import cpu_args, served
    from saccade.tools.demo import resolve_model_name
    from saccade.trainer.checkpoint.engine_weights import merge_full_weights_for_engine
    from saccade.transports.collective import CollectiveTransport
    from saccade.transports.files import FolderTransport

    path = resolve_model_name(cfg.model)
    work = Path(tempfile.mkdtemp(prefix="saccade-weight-sync-bench-"))
    server = nullcontext(cfg.url) if cfg.url else served(path, args=cpu_args(path), log_path=work / "serve.log",
                                                         weights_root=work)
    with server as url:
        engine = VLLMEngine.for_servers([url], load_processor(path))
        model = set_full_finetune(load_policy_lm(path, dtype=torch.float32))
        export = lambda v: str(merge_full_weights_for_engine(model, path, work / f"v{v}"))  # noqa: E731
        sync = CollectiveTransport(engine.client, model, path, address="127.0.0.1", timeout_s=cfg.timeout_s)
        t0 = time.perf_counter()
        sync.join(engine.client.pool.alive[0])
        join_s = time.perf_counter() - t0
        ways = {"files": FolderTransport(engine.client, export), "collective": sync}
        times: dict[str, list[float]] = {k: [] for k in ways}
        phases: list[dict[str, float]] = []
        try:
            for _ in range(cfg.repeats + 1):  # the first round warms both up and is not counted
                for name, transport in ways.items():
                    engine.transport = transport
                    times[name].append(engine.update_weights())
                    if transport is sync:
                        phases.append(dict(sync.last))
        finally:
            engine.transport = FolderTransport(engine.client, lambda v: str(path))
            engine.update_weights()  # the server's own checkpoint again
            engine.close()
    files_s, collective_s = (statistics.median(times[k][1:]) for k in ("files", "collective"))
    return {
        "at_scale": {hub_id: published_params(hub_id) for hub_id in SCALE_MODELS}, "changed": measured_changed(),
        "model": str(path), "repeats": cfg.repeats, "lm_bytes": sync.nbytes, "groups": len(sync.weights.groups),
        "join_s": join_s, "files_s": files_s, "collective_s": collective_s, "files_over_collective": files_s / collective_s,
        "files_all_s": times["files"], "collective_all_s": times["collective"],
        **{f"collective_{k}": statistics.median(p[k] for p in phases[1:])
           for k in ("start_s", "stream_s", "materialize_s", "finish_s")},
    }


def format_weight_sync(r: dict[str, Any]) -> str:
    return "\n".join([
        f"weight sync, {Path(r['model']).name}: language model {r['lm_bytes'] / 2**20:.1f} MiB in {r['groups']} "
        f"layer groups, medians of {r['repeats']} interleaved syncs (MEASURED, this machine's CPU, one server):",
        f"  files (write the folder, the server reads it)  {r['files_s']:.3f} s",
        f"  collective (gloo, vLLM's trainer interface)    {r['collective_s']:.3f} s",
        f"  files / collective                             {r['files_over_collective']:.2f}x",
        f"    start {r['collective_start_s']:.3f} s, stream {r['collective_stream_s']:.3f} s (of it materialize "
        f"{r['collective_materialize_s']:.3f} s), finish {r['collective_finish_s']:.3f} s",
        f"  collective rendezvous, once per server         {r['join_s']:.3f} s",
        "one sync at bf16 on H100 machines, by backend (ESTIMATES, not measured: the bytes from the published "
        "configs, the bandwidths assumed, the servers' reload left out; nccl, sparse_nccl and ipc are vLLM's code, "
        "untested here):",
        *changed_lines(r.get("changed") or []),
        *[line for hub_id, (lm, whole) in r.get("at_scale", {}).items()
          for line in scale_estimates(hub_id.split("/")[-1], lm, whole, changed=[tuple(c) for c in r.get("changed") or []])],
    ])


def changed_lines(changed: list) -> list[str]:
    """Where the sparse rows' shares come from (`measured_changed`), or that there are none."""
    if not changed:
        return ["  sparse_nccl: no share of changed weights measured (`saccade bench changed-weights`), no row"]
    shares = ", ".join(f"{fraction:.2%} at lr {lr:g}" for lr, fraction in changed)
    return [f"  sparse_nccl's shares of weights changed a step, MEASURED by `saccade bench changed-weights` on this "
            f"CPU (tiny and small presets, the largest after step 1): {shares}; a changed weight costs (4 + 2) B, "
            "an int32 index and its bf16 value (a group's first sync sends every weight so: 3x dense, once)"]
