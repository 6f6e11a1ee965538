"""`saccade bench async`: the vLLM demo config at rollout.max_async_level 0 and then 1, back to
back on the same server, from the demo's warm start: wall time per step, their ratio, how idle
the trainer and the server were, and the held-out accuracy each run reached.

The cores are split so that the overlap is real: the server's compute threads are bound to
the first half of the machine's cores (VLLM_CPU_OMP_THREADS_BIND), the trainer's process to
the other half, with as many torch threads (on 2 cores: one each). Both runs use the same split.
"""

from __future__ import annotations

import os
import tempfile
import time
from pathlib import Path
from typing import Any

from saccade.config import RunConfig, load_config
from saccade.timing import split_cores


def run_async_bench(config: str = "configs/demo.toml", overrides: list[str] | None = None, *, levels=(0, 1),
                    url: str | None = None, out_dir: str | None = None, progress: bool = True) -> dict[str, Any]:
    from saccade.evaluation import evaluate
    from saccade.metrics import read_metrics
    from saccade.demo import resolve_model_name
    from saccade.rl import train_rl
    from saccade.serving.launch import cpu_args, served
    from saccade.setup import build_setup
    from saccade.tasks import task_from_config

    out = Path(out_dir or tempfile.mkdtemp(prefix="saccade-bench-async-"))
    out.mkdir(parents=True, exist_ok=True)
    model = resolve_model_name("tiny-warm")  # a folder from here down
    base = load_config(RunConfig, config, ["--model.path", model, "--eval.every_steps", "0",
                                           "--checkpoint.every_steps", "0", *(overrides or [])])
    server_cores, trainer_cores = split_cores(sorted(os.sched_getaffinity(0)))
    base = base.model_copy(update={"trainer": base.trainer.model_copy(update={"torch_threads": len(trainer_cores)})})
    env = {"VLLM_CPU_OMP_THREADS_BIND": ",".join(map(str, server_cores))}

    def run_level(url: str, level: int) -> dict[str, Any]:
        cfg = base.model_copy(update={
            "engine": base.engine.model_copy(update={"kind": "vllm", "urls": [url]}),
            "rollout": base.rollout.model_copy(update={"max_async_level": level}),
            "log": base.log.model_copy(update={"dir": str(out / f"level{level}")}),
        })
        RunConfig.model_validate(cfg.model_dump())  # the validators, on the combination
        setup = build_setup(cfg, cfg.run_dir)
        task = task_from_config(cfg)
        start = time.perf_counter()
        train_rl(cfg, run_dir=cfg.run_dir, setup=setup, task=task, progress=progress)
        wall = time.perf_counter() - start
        accuracy = evaluate(setup, task, task.eval_samples(cfg.eval.prompts), max_tokens=cfg.sampling.max_tokens)
        setup.engine.close()
        rows = [r for r in read_metrics(cfg.run_dir) if r["phase"] == "train"]
        lag0 = [r["mismatch_abs_lag0"] for r in rows if "mismatch_abs_lag0" in r]
        return {
            "max_async_level": level,
            "steps": len(rows),
            "wall_s": wall,
            "step_s": wall / len(rows),
            "trainer_idle_frac": sum(r["trainer_idle_s"] for r in rows) / wall,
            "engine_idle_frac": sum(r["engine_idle_s"] for r in rows) / wall,
            "policy_lag_mean": sum(r["policy_lag_mean"] for r in rows) / len(rows),
            "mismatch_abs_lag0_max": max(lag0) if lag0 else None,
            "accuracy_after": accuracy["accuracy"],
        }

    def run_all(url: str) -> list[dict[str, Any]]:
        everything = os.sched_getaffinity(0)
        os.sched_setaffinity(0, trainer_cores)  # after the server started: it keeps every core
        try:
            return [run_level(url, level) for level in levels]
        finally:
            os.sched_setaffinity(0, everything)

    if url:
        runs = run_all(url)
    else:
        if progress:
            print(f"starting a vLLM server on cores {server_cores}; the trainer runs on {trainer_cores} ...", flush=True)
        args = (*cpu_args(model), "--disable-uvicorn-access-log")
        # Every level's run (and its engine-weights folder, unless overridden) lives under `out`.
        with served(model, args=args, log_path=out / "vllm-server.log", env=env,
                    cores=server_cores, weights_root=base.engine.weights_dir or out) as url:
            runs = run_all(url)
    by_level = {r["max_async_level"]: r for r in runs}
    result: dict[str, Any] = {"runs": runs, "server_cores": server_cores, "trainer_cores": trainer_cores,
                              "prompts_per_step": base.rollout.prompts_per_step,
                              "group_size": base.rollout.group_size, "out_dir": str(out)}
    if 0 in by_level and 1 in by_level:
        result["steps_per_s_ratio"] = by_level[0]["step_s"] / by_level[1]["step_s"]
    return result


def format_async_report(result: dict[str, Any]) -> str:
    lines = [f"server on cores {result['server_cores']}, trainer on {result['trainer_cores']}; "
             f"{result['prompts_per_step']} prompts x {result['group_size']} per step"]
    for r in result["runs"]:
        lag0 = r["mismatch_abs_lag0_max"]
        lines.append(
            f"max_async_level {r['max_async_level']}: {r['steps']} steps, {r['step_s']:.2f} s/step, trainer idle "
            f"{r['trainer_idle_frac']:.0%}, server idle {r['engine_idle_frac']:.0%}, lag {r['policy_lag_mean']:.2f}, "
            f"mismatch at lag 0 <= {lag0 if lag0 is None else f'{lag0:.1e}'}, held-out accuracy {r['accuracy_after']:.3f}"
        )
    if "steps_per_s_ratio" in result:
        lines.append(f"steps per second, level 1 / level 0: {result['steps_per_s_ratio']:.2f}x")
    return "\n".join(lines)
