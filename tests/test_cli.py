"""The command line, run as a user runs it: a real `saccade` process."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from saccade.installed import module_available


def run_cli(*args, timeout=300):
    return subprocess.run(
        [sys.executable, "-m", "saccade.cli", *args], capture_output=True, text=True, timeout=timeout
    )


def test_help_explains_the_commands():
    out = run_cli("--help")
    assert out.returncode == 0
    for command in ("demo", "bench", "build-model"):
        assert command in out.stdout
    bench = run_cli("bench", "parity", "--help")
    assert "--model" in bench.stdout and "--json" in bench.stdout
    rl = " ".join(run_cli("rl", "--help").stdout.split())  # argparse wraps the description
    for field in ("action", "steps", "truncated_frac", "lr_factor", "max_rollbacks"):
        assert f"stall.{field}" in rl, field


def test_unknown_command_is_a_clear_error():
    out = run_cli("frobnicate")
    assert out.returncode == 2
    assert "invalid choice" in out.stderr


def test_dry_run_refuses_bad_reward_and_task_names_without_torch(tmp_path):
    """`saccade rl --dry-run` resolves a user's reward functions and task (importing their module)
    and refuses bad names, all before torch is imported, let alone a model built."""
    (tmp_path / "my_rewards.py").write_text("def brevity(completion):\n    return float(len(completion) < 20)\n")
    script = (
        "import sys; from saccade.cli import main; rc = main(sys.argv[1:]); "
        "print('torch imported' if 'torch' in sys.modules else 'no torch'); sys.exit(rc)"
    )

    def dry_run(*overrides):
        return subprocess.run([sys.executable, "-c", script, "rl", "--dry-run", *overrides], capture_output=True,
                              text=True, timeout=120, env={**os.environ, "PYTHONPATH": str(tmp_path)})

    good = dry_run("--rollout.reward_weights", '{"correct": 1, "my_rewards:brevity": 0.1}')
    assert good.returncode == 0, good.stderr
    assert '"my_rewards:brevity" = 0.1' in good.stdout and good.stdout.rstrip().endswith("no torch")
    for override, message in [
        (["--rollout.reward_weights", '{"my_rewards:brevty": 1}'], "'my_rewards' has no attribute 'brevty'; "
                                                                  "it has brevity"),
        (["--task.kind", "plugin", "--task.make_task", "my_rewards:make_task"],
         "task.make_task: 'my_rewards:make_task': 'my_rewards' has no attribute 'make_task'"),
        (["--task.kind", "verifiers", "--task.env_id", "no-such-env"], "no module 'no_such_env'"),
    ]:
        bad = dry_run(*override)
        assert bad.returncode == 2 and message in bad.stderr, bad.stderr
        assert bad.stdout.rstrip() == "no torch"

    # A real-model config dry-runs here; an attention kernel whose package is missing is refused
    # before a model is built (flash-attn is not installed here), with what to use instead.
    assert dry_run("configs/qwen3vl-2b-1gpu.toml").returncode == 0
    if not module_available("flash_attn"):
        flash = dry_run("configs/qwen3vl-2b-1gpu.toml", "--model.attn_implementation", "flash_attention_2")
        assert flash.returncode == 2 and "needs the flash-attn package" in flash.stderr and "Use 'auto'" in flash.stderr
        assert flash.stdout.rstrip() == "no torch"


@pytest.mark.slow
def test_bench_parity_writes_the_four_figures(tmp_path, tiny_path):
    path = tmp_path / "parity.json"
    out = run_cli("bench", "parity", "--model", str(tiny_path), "--json", str(path))
    assert out.returncode == 0, out.stderr
    figures = json.loads(path.read_text())
    assert figures["lm_only_vs_full_max_abs"] <= 1e-5
    assert figures["packed_vs_unpacked_max_abs"] <= 1e-5
    assert figures["deepstack_dropped_max_abs"] > 1e-2
    assert figures["positions_1d_max_abs"] > 1e-2
    assert "LM-only vs full" in out.stdout


@pytest.mark.slow
def test_bench_parity_on_a_folder_that_is_not_a_model(tmp_path):
    out = run_cli("bench", "parity", "--model", str(tmp_path))
    assert out.returncode != 0
    assert "not a Hugging Face model folder" in out.stderr
