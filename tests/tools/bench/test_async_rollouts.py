"""bench async's figures and report: pure functions on made-up runs (the runs themselves are
`saccade bench async`, minutes each); and the bench killed, its children gone with it (long)."""

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from saccade.tools.bench.async_rollouts import (
    format_async_report, learning_by_seed, level_ratios, longest_zero_reward_run,
)


def test_longest_zero_reward_run_counts_consecutive_zero_steps_only():
    assert longest_zero_reward_run([]) == 0
    assert longest_zero_reward_run([0.3, 0.0, 0.0, 0.1, 0.0, 0.0, 0.0, 0.5]) == 3
    assert longest_zero_reward_run([0.01, 0.02]) == 0


def run(seed, level, accuracy, step_s, zeros=0, world=1):
    return {"seed": seed, "world_size": world, "max_async_level": level, "steps": 150, "step_s": step_s,
            "trainer_idle_frac": 0.5, "engine_idle_frac": 0.2, "policy_lag_mean": float(level),
            "mismatch_abs_lag0_max": 3e-7, "accuracy_after": accuracy, "zero_reward_steps_max": zeros}


RUNS = [run(0, 0, 0.969, 2.0), run(0, 1, 1.000, 1.0), run(1, 0, 1.000, 2.0), run(1, 1, 0.344, 3.0, zeros=57)]


def test_learning_is_judged_per_seed_against_that_seeds_level_0():
    rows = {row["seed"]: row for row in learning_by_seed(RUNS)}
    assert rows[0]["gap"] == 1.000 - 0.969 and rows[0]["learned_as_level0"]
    assert rows[1]["gap"] == 0.344 - 1.000 and not rows[1]["learned_as_level0"]
    assert rows[1]["zero_reward_steps_max"] == [0, 57]
    # Just inside and just outside the 0.05 bar.
    assert learning_by_seed([run(2, 0, 0.95, 1), run(2, 1, 0.90, 1)])[0]["learned_as_level0"]
    assert not learning_by_seed([run(2, 0, 0.95, 1), run(2, 1, 0.89, 1)])[0]["learned_as_level0"]
    # A seed with one level only is not judged.
    assert learning_by_seed([run(3, 1, 1.0, 1)]) == []


def test_the_speed_ratio_is_over_every_seeds_runs():
    # level 0: (2 + 2) / 2 = 2 s/step; level 1: (1 + 3) / 2 = 2 s/step.
    assert level_ratios(RUNS) == {"1": 1.0}


def test_the_report_names_each_seeds_verdict():
    result = {"runs": RUNS, "server_cores": [0], "trainer_cores": [1], "prompts_per_step": 32, "group_size": 8,
              "steps_per_s_ratio": level_ratios(RUNS), "learning": learning_by_seed(RUNS)}
    report = format_async_report(result)
    assert "seed 0, world 1: held-out level 0 0.969, level 1 1.000 (+0.031: learned as level 0)" in report
    assert "seed 1, world 1: held-out level 0 1.000, level 1 0.344 (-0.656: NOT within 0.05 of level 0); " \
           "longest run of reward-0 steps 0 and 57" in report


def processes_below(pid: int) -> dict[int, tuple[int | None, str]]:
    """Every process below `pid` (itself left out): pid -> (start time, command line)."""
    from saccade.tools.launcher.supervisor import process_tree, start_time

    found = {}
    for child in process_tree(pid)[1:]:
        try:
            command = (Path("/proc") / str(child) / "cmdline").read_bytes().replace(b"\0", b" ").decode()
        except OSError:
            continue
        found[child] = (start_time(child), command)
    return found


@pytest.mark.vllm
@pytest.mark.slow
@pytest.mark.long
def test_killing_the_bench_ends_its_server_and_its_run(tmp_path):
    """`saccade bench async` SIGKILLed once its `saccade rl` runs: the vLLM server (with vLLM's
    engine processes) and the run end within seconds, as `saccade launch`'s children do. Before,
    both ran on (the server for good)."""
    pytest.importorskip("vllm")
    from saccade.tools.launcher.supervisor import alive, start_time

    bench = subprocess.Popen([sys.executable, "-m", "saccade", "bench", "async", "--out", str(tmp_path),
                              "configs/demo.toml", "--trainer.steps", "100"],
                             stdout=subprocess.DEVNULL, stderr=subprocess.STDOUT)
    seen: dict[int, tuple[int | None, str]] = {}

    def running() -> dict[int, str]:
        return {p: c for p, (started, c) in seen.items() if started is not None and start_time(p) == started
                and alive(p)}

    try:
        deadline = time.time() + 600  # the server's start: 90 s on a loaded 2-core machine
        while not any(" saccade rl " in c for _, c in seen.values()):
            assert bench.poll() is None and time.time() < deadline, (tmp_path / "vllm-server.log").read_text()[-3000:]
            seen.update(processes_below(bench.pid))
            time.sleep(0.2)
        time.sleep(5)  # the run under way: its own children started, if any
        seen.update(processes_below(bench.pid))
        commands = " | ".join(c for _, c in seen.values())
        assert "saccade.serving.server" in commands and "VLLM::EngineCore" in commands, commands
        bench.kill()
        bench.wait(timeout=10)
        killed = time.perf_counter()
        while running() and time.perf_counter() - killed < 20:
            time.sleep(0.05)
        took = time.perf_counter() - killed
        left = running()
        assert not left, f"still running {took:.0f} s after the bench's SIGKILL: {left}"
        # Measured on the 2-core machine: the run at once, the server's whole tree in 0.7-1.0 s.
        print(f"{len(seen)} processes below the bench, all gone {took:.2f} s after its SIGKILL")
    finally:
        for pid in running():
            os.kill(pid, signal.SIGKILL)
        if bench.poll() is None:
            bench.kill()
