"""A run stopped on request (saccade.stopping): a STOP file or Ctrl-C ends it after the step under
way with a checkpoint, and --resume goes on from there, no step twice."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from stub_tasks import scored_task

from saccade.config import RunConfig, load_config
from saccade.metrics import read_metrics
from saccade.loops.rl import train_rl
from saccade.stopping import REPEAT_WINDOW_S, STOP_FILE, STOPPED_FILE, RunStopped, StopRequest, stopped_since

ROOT = Path(__file__).resolve().parents[1]
FAST = ["--trainer.steps", "4", "--rollout.prompts_per_step", "2", "--rollout.group_size", "4",
        "--rollout.filter_zero_variance", "false", "--sampling.max_tokens", "4", "--loss.max_completion_tokens", "4",
        "--eval.every_steps", "0", "--checkpoint.every_steps", "0"]


def test_a_stop_file_counts_only_when_written_since_the_run_started(tmp_path):
    (tmp_path / STOP_FILE).touch()
    old = time.time() - 60
    os.utime(tmp_path / STOP_FILE, (old, old))  # left from an earlier run
    stop = StopRequest(tmp_path)
    assert not stop.asked() and not stop.agreed()
    (tmp_path / STOP_FILE).touch()
    assert stop.asked() and stop.agreed()
    stop.done("stopped on request after step 3")
    assert not (tmp_path / STOP_FILE).exists() and not stop.asked()
    assert (tmp_path / STOPPED_FILE).read_text() == "stopped on request after step 3\n"
    assert stopped_since(tmp_path, time.time() - 5) and not stopped_since(tmp_path, time.time() + 60)


def test_signals_ask_once_and_a_later_one_stops_at_once(tmp_path):
    # What was there before, not Python's default: a process started in the background (no job
    # control, as a CI runner may start pytest) begins with SIGINT ignored, and that is put back.
    found = {s: signal.getsignal(s) for s in (signal.SIGINT, signal.SIGTERM)}
    stop = StopRequest(tmp_path)
    with stop.catch_signals():
        os.kill(os.getpid(), signal.SIGTERM)
        os.kill(os.getpid(), signal.SIGINT)  # within the window: the same request (torchrun forwards one)
        assert stop.asked()
        stop.signalled_at -= REPEAT_WINDOW_S + 1
        with pytest.raises(KeyboardInterrupt):
            os.kill(os.getpid(), signal.SIGINT)
    assert {s: signal.getsignal(s) for s in found} == found  # put back


def test_signals_put_back_an_ignored_sigint(tmp_path):
    """Started as a background job starts it (SIGINT ignored), the run still asks for a stop on
    SIGINT, and leaves it ignored afterwards."""
    code = ("import os, signal, sys; from saccade.stopping import StopRequest\n"
            "assert signal.getsignal(signal.SIGINT) is signal.SIG_IGN\n"
            "stop = StopRequest(sys.argv[1])\n"
            "with stop.catch_signals():\n"
            "    os.kill(os.getpid(), signal.SIGINT); assert stop.asked()\n"
            "assert signal.getsignal(signal.SIGINT) is signal.SIG_IGN\n")
    ignore = lambda: signal.signal(signal.SIGINT, signal.SIG_IGN)  # noqa: E731 - the background's start
    done = subprocess.run([sys.executable, "-c", code, str(tmp_path)], preexec_fn=ignore, capture_output=True,
                          text=True, timeout=60)
    assert done.returncode == 0, done.stderr


def test_a_stopped_run_saves_its_step_and_resumes_without_repeating_one(tmp_path):
    cfg = load_config(RunConfig, "configs/demo.toml", [*FAST, "--log.dir", str(tmp_path / "run")])
    stop = StopRequest(cfg.run_dir)
    cfg.run_dir.mkdir(parents=True)
    (cfg.run_dir / STOP_FILE).touch()  # asked before the first step ends
    with pytest.raises(RunStopped, match=r"stopped on request after step 1; saved .*step_000001; go on with: "
                                         r"saccade rl .*config.toml --resume"):
        train_rl(cfg, run_dir=cfg.run_dir, task=scored_task(cfg), progress=False, stop=stop)
    assert (cfg.run_dir / "checkpoints" / "step_000001" / "COMPLETE").exists()
    assert not (cfg.run_dir / STOP_FILE).exists()  # carried out: the resume is not stopped by it
    assert (cfg.run_dir / STOPPED_FILE).read_text().startswith("stopped on request after step 1; saved ")
    train_rl(cfg, run_dir=cfg.run_dir, task=scored_task(cfg), progress=False, resume=True)
    assert [r["step"] for r in read_metrics(cfg.run_dir) if r["phase"] == "train"] == [1, 2, 3, 4]


@pytest.mark.slow
def test_ctrl_c_to_saccade_rl_saves_a_checkpoint_and_exits_130(tmp_path):
    run = tmp_path / "run"
    cmd = [sys.executable, "-m", "saccade", "rl", "configs/demo.toml", *FAST, "--trainer.steps", "200",
           "--log.dir", str(run), "--trainer.torch_threads", "1"]
    proc = subprocess.Popen(cmd, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            env={**os.environ, "PYTHONPATH": str(ROOT / "src")})
    deadline = time.time() + 240
    while not (run / "metrics.jsonl").exists() or not (run / "metrics.jsonl").read_text().strip():
        assert proc.poll() is None and time.time() < deadline, proc.communicate()
        time.sleep(0.2)
    proc.send_signal(signal.SIGINT)
    asked = time.time()
    out, err = proc.communicate(timeout=120)
    assert proc.returncode == 130, err[-3000:]
    assert time.time() - asked < 30
    assert "saccade: SIGINT: stopping after this step, with a checkpoint" in err  # logged (saccade.logs)
    assert "saccade: stopped: stopped on request after step" in err and "--resume" in err
    step = int(err.split("stopped on request after step ")[1].split(";")[0])
    assert 1 <= step < 200 and (run / "checkpoints" / f"step_{step:06d}" / "COMPLETE").exists()
