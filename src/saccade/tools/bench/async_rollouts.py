"""`saccade bench async`: the vLLM demo config at rollout.max_async_level 0 and then 1, back to
back on the same server, from the demo's warm start, at each trainer world size asked for (1:
one `saccade rl` process; 2 and more: torchrun, FSDP2 over gloo): seconds per step, the ratio
of level 1's steps per second over level 0's at each world size, how idle the trainer and the
server were, and the held-out accuracy each run reached.

Every run is a real `saccade rl` in a fresh process, the way a user starts it; its seconds are
the loop's own (the sum of the steps' `step_s` in metrics.jsonl: from asking for the step's
rollouts to its weights on the server), so the start-up (imports, model, first push) is left
out at every world size alike. Each run evaluates once, after its last step, outside the timed steps.

The cores are split so that the overlap is real: the server's compute threads are bound to
the first half of the machine's cores (VLLM_CPU_OMP_THREADS_BIND), the trainer's processes to
the other half, their torch threads shared out among the ranks (on 2 cores: one core for the
trainer, so two ranks take turns on it). Every run uses the same split.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

from saccade.config import RunConfig, load_config
from saccade.config.bench import AsyncBenchConfig
from saccade.timing import split_cores


def rl_command(config: Path, world: int) -> list[str]:
    """`saccade rl CONFIG` in one process, or under torchrun with `world` ranks on this machine."""
    if world == 1:
        return [sys.executable, "-m", "saccade", "rl", str(config)]
    from saccade.serving.launch import free_port

    return [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", str(world), "--rdzv-backend", "c10d",
            "--rdzv-endpoint", f"127.0.0.1:{free_port()}", "-m", "saccade", "rl", str(config)]


def run_figures(run_dir: Path, level: int, world: int) -> dict[str, Any]:
    """A finished run's figures, from its metrics.jsonl."""
    from saccade.metrics import read_metrics

    rows = read_metrics(run_dir)
    train = [r for r in rows if r["phase"] == "train"]
    evals = [r for r in rows if r["phase"] == "eval"]
    loop_s = sum(r["step_s"] for r in train)
    lag0 = [r["mismatch_abs_lag0"] for r in train if "mismatch_abs_lag0" in r]
    return {
        "world_size": world,
        "max_async_level": level,
        "steps": len(train),
        "loop_s": loop_s,
        "step_s": loop_s / len(train),
        "trainer_idle_frac": sum(r["trainer_idle_s"] for r in train) / loop_s,
        "engine_idle_frac": sum(r["engine_idle_s"] for r in train) / loop_s,
        "policy_lag_mean": sum(r["policy_lag_mean"] for r in train) / len(train),
        "mismatch_abs_lag0_max": max(lag0) if lag0 else None,
        "accuracy_after": evals[-1]["accuracy"] if evals else None,
    }


def run_async_bench(cfg: AsyncBenchConfig, *, levels=(0, 1), progress: bool = True) -> dict[str, Any]:
    """Every (world size, async level) run of `cfg.config` on one server (`cfg.url`, else one
    started here); each run's figures and the level-1 over level-0 ratios."""
    from saccade.config import describe
    from saccade.tools.demo import resolve_model_name
    from saccade.serving.launch import cpu_args, served

    config, overrides, world_sizes, url = cfg.config, cfg.overrides, cfg.world_sizes, cfg.url
    out = Path(cfg.out or tempfile.mkdtemp(prefix="saccade-bench-async-"))
    out.mkdir(parents=True, exist_ok=True)
    model = resolve_model_name("tiny-warm")  # a folder from here down
    base = load_config(RunConfig, config, ["--model.path", model, "--checkpoint.every_steps", "0", *overrides])
    # One evaluation, after the last step: the accuracy each run reached, outside the timed steps.
    base = base.model_copy(update={"eval": base.eval.model_copy(update={"every_steps": base.trainer.steps})})
    server_cores, trainer_cores = split_cores(sorted(os.sched_getaffinity(0)))
    env = {"VLLM_CPU_OMP_THREADS_BIND": ",".join(map(str, server_cores))}

    def run_one(url: str, world: int, level: int) -> dict[str, Any]:
        name = f"world{world}-level{level}"
        threads = max(1, len(trainer_cores) // world)
        run = base.model_copy(update={
            "engine": base.engine.model_copy(update={"kind": "vllm", "urls": [url]}),
            "rollout": base.rollout.model_copy(update={"max_async_level": level}),
            "trainer": base.trainer.model_copy(update={"torch_threads": threads}),
            "log": base.log.model_copy(update={"dir": str(out / name)}),
        })
        RunConfig.model_validate(run.model_dump())  # the validators, on the combination
        config_file = out / f"{name}.toml"
        config_file.write_text(describe(run))
        if progress:
            print(f"{name}: {' '.join(rl_command(config_file, world)[1:])}", flush=True)
        run_env = {**os.environ, "OMP_NUM_THREADS": str(threads), "TRANSFORMERS_VERBOSITY": "error"}
        with open(out / f"{name}.log", "w") as log:
            done = subprocess.run(rl_command(config_file, world), env=run_env, stdout=log, stderr=subprocess.STDOUT,
                                  preexec_fn=lambda: os.sched_setaffinity(0, trainer_cores))
        if done.returncode != 0:
            raise RuntimeError(f"{name} exited with {done.returncode}:\n{(out / f'{name}.log').read_text()[-4000:]}")
        return run_figures(run.run_dir, level, world)

    def run_all(url: str) -> list[dict[str, Any]]:
        return [run_one(url, world, level) for world in world_sizes for level in levels]

    if url:
        runs = run_all(url)
    else:
        if progress:
            print(f"starting a vLLM server on cores {server_cores}; the trainer runs on {trainer_cores} ...", flush=True)
        args = (*cpu_args(model), "--disable-uvicorn-access-log")
        # Every run (and its engine-weights folder, unless overridden) lives under `out`.
        with served(model, args=args, log_path=out / "vllm-server.log", env=env,
                    cores=server_cores, weights_root=base.engine.weights_dir or out) as url:
            runs = run_all(url)
    result: dict[str, Any] = {"runs": runs, "server_cores": server_cores, "trainer_cores": trainer_cores,
                              "prompts_per_step": base.rollout.prompts_per_step,
                              "group_size": base.rollout.group_size, "out_dir": str(out),
                              "steps_per_s_ratio": level_ratios(runs)}
    (out / "result.json").write_text(json.dumps(result, indent=1))
    return result


def level_ratios(runs: list[dict[str, Any]]) -> dict[str, float]:
    """Per world size, level 1's steps per second over level 0's (keys: the world size)."""
    by = {(r["world_size"], r["max_async_level"]): r for r in runs}
    return {str(w): by[w, 0]["step_s"] / by[w, 1]["step_s"] for w, level in by if level == 1 and (w, 0) in by}


def format_async_report(result: dict[str, Any]) -> str:
    lines = [f"server on cores {result['server_cores']}, trainer on {result['trainer_cores']}; "
             f"{result['prompts_per_step']} prompts x {result['group_size']} per step"]
    for r in result["runs"]:
        lag0, accuracy = r["mismatch_abs_lag0_max"], r["accuracy_after"]
        lines.append(
            f"world {r['world_size']}, max_async_level {r['max_async_level']}: {r['steps']} steps, "
            f"{r['step_s']:.2f} s/step, trainer idle {r['trainer_idle_frac']:.0%}, server idle "
            f"{r['engine_idle_frac']:.0%}, lag {r['policy_lag_mean']:.2f}, mismatch at lag 0 <= "
            f"{lag0 if lag0 is None else f'{lag0:.1e}'}, held-out accuracy "
            f"{'-' if accuracy is None else f'{accuracy:.3f}'}")
    for world, ratio in result["steps_per_s_ratio"].items():
        lines.append(f"steps per second, level 1 / level 0, world {world}: {ratio:.2f}x")
    return "\n".join(lines)
