"""`saccade bench weight-sync`: one full fine-tuning sync to a `saccade serve` through a folder
(`engine.weight_sync.kind = "files"`: the trainer writes the engine's folder, the server reads it back)
against the collective transfer ("collective": the language model broadcast over gloo, layer
group by layer group, no files), interleaved on the same server and the same weights, medians of
`repeats`. The collective's one-time rendezvous is timed apart. The server is left serving its
checkpoint, as found.

It then prints what one sync of a real model costs on GPU machines (`scale_estimates`): the bytes
come from the published configs (the language model alone for the collective, which never sends
the frozen tower; the whole model for a folder, which holds it), and the bandwidths are assumptions
stated beside them, not measurements: `saccade bench gpu` measures on a lent GPU machine.
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
# GB/s; one sender (rank 0) reaches about 90%. A folder on local NVMe or a parallel filesystem:
# about 2 GB/s written by rank 0 and 2 GB/s read back by each server.
NVLINK_BPS = 360e9
NIC_BPS = 45e9
FILES_BPS = 2e9
SCALE_MODELS = ("Qwen/Qwen3-VL-2B-Instruct", "Qwen/Qwen3-VL-8B-Instruct")


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


def scale_estimates(name: str, lm_params: int, all_params: int, *, bytes_per_param: int = 2) -> list[str]:
    """One model's sync at bf16 on GPU machines, the arithmetic shown (see the constants' note)."""
    lm, whole = lm_params * bytes_per_param / 1e9, all_params * bytes_per_param / 1e9
    nvlink, nic, files = NVLINK_BPS / 1e9, NIC_BPS / 1e9, FILES_BPS / 1e9
    rows = [
        (f"collective, one node (NVLink, {nvlink:.0f} GB/s)", f"{lm:.2f} / {nvlink:.0f} = {lm / nvlink:.3f} s"),
        (f"collective, across nodes (400 Gb/s NIC, {nic:.0f} GB/s)", f"{lm:.2f} / {nic:.0f} = {lm / nic:.3f} s"),
        (f"files (written, read back, {files:.0f} GB/s each)", f"2 x {whole:.2f} / {files:.0f} = {2 * whole / files:.1f} s"),
    ]
    return [f"  {name}: language model {lm_params / 1e9:.2f}B params x {bytes_per_param} B = {lm:.2f} GB "
            f"(whole model {whole:.2f} GB)", *(f"    {label:<52}{sum_}" for label, sum_ in rows)]


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
        "at_scale": {hub_id: published_params(hub_id) for hub_id in SCALE_MODELS},
        "model": str(path), "repeats": cfg.repeats, "lm_bytes": sync.nbytes, "groups": len(sync.weights.groups),
        "join_s": join_s, "files_s": files_s, "collective_s": collective_s, "files_over_collective": files_s / collective_s,
        "files_all_s": times["files"], "collective_all_s": times["collective"],
        **{f"collective_{k}": statistics.median(p[k] for p in phases[1:])
           for k in ("start_s", "stream_s", "materialize_s", "finish_s")},
    }


def format_weight_sync(r: dict[str, Any]) -> str:
    return "\n".join([
        f"weight sync, {Path(r['model']).name}: language model {r['lm_bytes'] / 2**20:.1f} MiB in {r['groups']} "
        f"layer groups, medians of {r['repeats']} interleaved syncs:",
        f"  files (write the folder, the server reads it)  {r['files_s']:.3f} s",
        f"  collective (gloo broadcast, no files)          {r['collective_s']:.3f} s",
        f"  files / collective                             {r['files_over_collective']:.2f}x",
        f"    start {r['collective_start_s']:.3f} s, stream {r['collective_stream_s']:.3f} s (of it materialize "
        f"{r['collective_materialize_s']:.3f} s), finish {r['collective_finish_s']:.3f} s",
        f"  collective rendezvous, once per server         {r['join_s']:.3f} s",
        "at bf16 on H100 machines (estimates: bytes from the published configs, bandwidths assumed):",
        *[line for hub_id, (lm, whole) in r.get("at_scale", {}).items()
          for line in scale_estimates(hub_id.split("/")[-1], lm, whole)],
    ])
