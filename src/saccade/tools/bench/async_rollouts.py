"""`saccade bench async`: the vLLM demo config at rollout.max_async_level 0 and then 1, back to
back on the same server, from the demo's warm start, at each trainer world size asked for (1:
one `saccade rl` process; 2 and more: torchrun, FSDP2 over gloo) and each seed: seconds per
step, the ratio of level 1's steps per second over level 0's at each world size, how idle the
trainer and the server were, and per seed whether level 1 learned as level 0 did (the
held-out accuracy each run reached, and its longest run of steps with reward 0: the collapse
that one step ahead once showed, docs/async.md).

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
import tempfile
from pathlib import Path
from typing import Any

from saccade.config import RunConfig, VLLMEngineConfig, load_config
from saccade.config.bench import AsyncBenchConfig
from saccade.parent_death import run_child
from saccade.tools.bench import rl_command, rl_death_signal
from saccade.timing import split_cores


def longest_zero_reward_run(rewards: list[float]) -> int:
    """The most consecutive steps whose mean reward was 0: a run that has collapsed (every
    reply wrong, or cut at max_tokens) trains on nothing, since no group has a reward spread."""
    longest = current = 0
    for reward in rewards:
        current = current + 1 if reward == 0 else 0
        longest = max(longest, current)
    return longest


def run_figures(run_dir: Path, level: int, world: int, seed: int = 0) -> dict[str, Any]:
    """A finished run's figures, from its metrics.jsonl."""
    from saccade.metrics import read_metrics

    rows = read_metrics(run_dir)
    train = [r for r in rows if r["phase"] == "train"]
    evals = [r for r in rows if r["phase"] == "eval"]
    loop_s = sum(r["step_s"] for r in train)
    lag0 = [r["mismatch_abs_lag0"] for r in train if "mismatch_abs_lag0" in r]
    return {
        "seed": seed,
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
        "zero_reward_steps_max": longest_zero_reward_run([r["reward_mean"] for r in train]),
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

    def run_one(url: str, seed: int, world: int, level: int) -> dict[str, Any]:
        name = f"seed{seed}-world{world}-level{level}"
        threads = max(1, len(trainer_cores) // world)
        run = base.model_copy(update={
            # The config's engine as the vllm variant of the [engine] union (the demo's is embedded: a
            # model_copy would keep its class, and drop urls when it is dumped and validated below).
            "engine": VLLMEngineConfig.model_validate({**base.engine.model_dump(), "kind": "vllm", "urls": [url]}),
            "rollout": base.rollout.model_copy(update={"max_async_level": level}),
            "trainer": base.trainer.model_copy(update={"torch_threads": threads, "seed": seed}),
            "log": base.log.model_copy(update={"dir": str(out / name)}),
        })
        RunConfig.model_validate(run.model_dump())  # the validators, on the combination
        config_file = out / f"{name}.toml"
        config_file.write_text(describe(run))
        if progress:
            print(f"{name}: {' '.join(rl_command(config_file, world)[1:])}", flush=True)
        run_env = {**os.environ, "OMP_NUM_THREADS": str(threads), "TRANSFORMERS_VERBOSITY": "error"}
        command = rl_command(config_file, world)
        with open(out / f"{name}.log", "w") as log:  # the run ends with the bench, as its server does
            done = run_child(command, death_signal=rl_death_signal(command), cores=trainer_cores, env=run_env,
                             stdout=log, stderr=subprocess.STDOUT)
        if done.returncode != 0:
            raise RuntimeError(f"{name} exited with {done.returncode}:\n{(out / f'{name}.log').read_text()[-4000:]}")
        return run_figures(run.run_dir, level, world, seed)

    def run_all(url: str) -> list[dict[str, Any]]:
        return [run_one(url, seed, world, level) for seed in cfg.seeds for world in world_sizes for level in levels]

    if url:
        runs = run_all(url)
    else:
        if progress:
            print(f"starting a vLLM server on cores {server_cores}; the trainer runs on {trainer_cores} ...", flush=True)
        args = (*cpu_args(model), "--disable-uvicorn-access-log")
        # Every run (and its engine-weights folder, unless overridden) lives under `out`.
        with served(model, args=args, log_path=out / "vllm-server.log", env=env,
                    cores=server_cores, weights_root=getattr(getattr(base.engine, "weight_sync", None), "weights_dir", None) or out) as url:
            runs = run_all(url)
    result: dict[str, Any] = {"runs": runs, "server_cores": server_cores, "trainer_cores": trainer_cores,
                              "prompts_per_step": base.rollout.prompts_per_step,
                              "group_size": base.rollout.group_size, "out_dir": str(out),
                              "steps_per_s_ratio": level_ratios(runs), "learning": learning_by_seed(runs)}
    (out / "result.json").write_text(json.dumps(result, indent=1))
    return result


def level_ratios(runs: list[dict[str, Any]]) -> dict[str, float]:
    """Per world size, level 1's steps per second over level 0's, over every seed's runs (keys:
    the world size)."""
    step_s: dict[tuple[int, int], list[float]] = {}
    for r in runs:
        step_s.setdefault((r["world_size"], r["max_async_level"]), []).append(r["step_s"])
    mean = {key: sum(values) / len(values) for key, values in step_s.items()}
    return {str(w): mean[w, 0] / mean[w, 1] for w, level in mean if level == 1 and (w, 0) in mean}


# Level 1 learned as level 0 did: held-out accuracy within this of level 0's (issue 47's bar).
LEARNED_AS_LEVEL0 = 0.05


def learning_by_seed(runs: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Per (seed, world size) with both levels run: each level's held-out accuracy, level 1's
    gap to level 0 (negative: level 1 learned less) and whether it is within LEARNED_AS_LEVEL0,
    and each level's longest run of steps with reward 0."""
    by = {(r["seed"], r["world_size"], r["max_async_level"]): r for r in runs}
    rows = []
    for seed, world, level in by:
        if level != 1 or (seed, world, 0) not in by:
            continue
        level0, level1 = by[seed, world, 0], by[seed, world, 1]
        gap = None
        if level0["accuracy_after"] is not None and level1["accuracy_after"] is not None:
            gap = level1["accuracy_after"] - level0["accuracy_after"]
        rows.append({"seed": seed, "world_size": world, "accuracy_level0": level0["accuracy_after"],
                     "accuracy_level1": level1["accuracy_after"], "gap": gap,
                     "learned_as_level0": gap is not None and gap >= -LEARNED_AS_LEVEL0,
                     "zero_reward_steps_max": [level0["zero_reward_steps_max"], level1["zero_reward_steps_max"]]})
    return rows


def format_async_report(result: dict[str, Any]) -> str:
    lines = [f"server on cores {result['server_cores']}, trainer on {result['trainer_cores']}; "
             f"{result['prompts_per_step']} prompts x {result['group_size']} per step"]
    for r in result["runs"]:
        lag0, accuracy = r["mismatch_abs_lag0_max"], r["accuracy_after"]
        lines.append(
            f"seed {r.get('seed', 0)}, world {r['world_size']}, max_async_level {r['max_async_level']}: "
            f"{r['steps']} steps, {r['step_s']:.2f} s/step, trainer idle {r['trainer_idle_frac']:.0%}, server idle "
            f"{r['engine_idle_frac']:.0%}, lag {r['policy_lag_mean']:.2f}, mismatch at lag 0 <= "
            f"{lag0 if lag0 is None else f'{lag0:.1e}'}, held-out accuracy "
            f"{fmt_accuracy(accuracy)}")
    for world, ratio in result["steps_per_s_ratio"].items():
        lines.append(f"steps per second, level 1 / level 0, world {world}: {ratio:.2f}x")
    for row in result.get("learning", []):
        gap = "-" if row["gap"] is None else f"{row['gap']:+.3f}"
        verdict = "learned as level 0" if row["learned_as_level0"] else f"NOT within {LEARNED_AS_LEVEL0} of level 0"
        lines.append(
            f"seed {row['seed']}, world {row['world_size']}: held-out level 0 {fmt_accuracy(row['accuracy_level0'])}, "
            f"level 1 {fmt_accuracy(row['accuracy_level1'])} ({gap}: {verdict}); longest run of reward-0 steps "
            f"{row['zero_reward_steps_max'][0]} and {row['zero_reward_steps_max'][1]}")
    return "\n".join(lines)


def fmt_accuracy(value: float | None) -> str:
    return "-" if value is None else f"{value:.3f}"
