"""`saccade bench weight-sync`: one full fine-tuning sync to a `saccade serve` through a folder
(`engine.weight_sync = "files"`: the trainer writes the engine's folder, the server reads it back)
against the collective transfer ("collective": the language model broadcast over gloo, layer
group by layer group, no files), interleaved on the same server and the same weights, medians of
`repeats`. The collective's one-time rendezvous is timed apart. The server is left serving its
checkpoint, as found.
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


def run_weight_sync_bench(cfg: WeightSyncBenchConfig) -> dict[str, Any]:
    from saccade.inference.vllm import VLLMEngine
    from saccade.models.lm import load_policy_lm, set_full_finetune
    from saccade.models.loading import load_processor
    from saccade.serving.launch import cpu_args, served
    from saccade.tools.demo import resolve_model_name
    from saccade.trainer.checkpoint.engine_weights import merge_full_weights_for_engine
    from saccade.trainer.weight_transfer import CollectiveSync

    path = resolve_model_name(cfg.model)
    work = Path(tempfile.mkdtemp(prefix="saccade-weight-sync-bench-"))
    server = nullcontext(cfg.url) if cfg.url else served(path, args=cpu_args(path), log_path=work / "serve.log",
                                                         weights_root=work)
    with server as url:
        engine = VLLMEngine.for_servers([url], load_processor(path))
        model = set_full_finetune(load_policy_lm(path, dtype=torch.float32))
        export = lambda v: str(merge_full_weights_for_engine(model, path, work / f"v{v}"))  # noqa: E731
        sync = CollectiveSync(engine.client, model, path, address="127.0.0.1", timeout_s=cfg.timeout_s)
        t0 = time.perf_counter()
        sync.join(engine.client.pool.alive[0])
        join_s = time.perf_counter() - t0
        ways = {"files": (None, export), "collective": (sync, None)}
        times: dict[str, list[float]] = {k: [] for k in ways}
        phases: list[dict[str, float]] = []
        try:
            for _ in range(cfg.repeats + 1):  # the first round warms both up and is not counted
                for name, (transfer, exporter) in ways.items():
                    engine.transfer, engine.exporter = transfer, exporter
                    times[name].append(engine.update_weights())
                    if transfer is not None:
                        phases.append(dict(sync.last))
        finally:
            engine.transfer, engine.exporter = None, lambda v: str(path)
            engine.update_weights()  # the server's own checkpoint again
            engine.close()
    files_s, collective_s = (statistics.median(times[k][1:]) for k in ("files", "collective"))
    return {
        "model": str(path), "repeats": cfg.repeats, "lm_bytes": sync.nbytes, "groups": len(sync.groups),
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
    ])
