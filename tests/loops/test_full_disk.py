"""A run whose folder's disk fills up mid-run (issue 50): a real filesystem, not a patched write.

The run folder lives on a tmpfs of 64 MB (three of its checkpoints: two kept, one being written). Once the run has logged its second step,
the test fills what is left of the disk, so the next write of the run, whichever it is
(metrics.jsonl, the samples log, a checkpoint), fails with ENOSPC as on a real full disk. The
run must stop on its own within a bound (no hang, no raw traceback), say the disk is full and
how to go on, and leave a complete checkpoint to resume from; with room made, `--resume` goes
on to the end. Mounting a tmpfs needs root (CAP_SYS_ADMIN): the test is skipped without it.
"""

from __future__ import annotations

import os
import subprocess
import time
from pathlib import Path

import pytest

from saccade.cli.runs import UNWRITABLE_EXIT
from saccade.metrics import read_metrics
from saccade.tools.bench import rl_command
from saccade.trainer.checkpoint.folder import latest_checkpoint

STEPS = 8
RUN = ["--trainer.steps", str(STEPS), "--rollout.prompts_per_step", "2", "--rollout.group_size", "4",
       "--rollout.filter_zero_variance", "false", "--sampling.max_tokens", "4", "--loss.max_completion_tokens", "4",
       "--eval.every_steps", "0", "--checkpoint.every_steps", "1", "--checkpoint.keep_last", "2",
       "--trainer.torch_threads", "1"]
STOP_WITHIN_S = 120  # from the disk filling up to the run's exit: a step, a save attempt, start-up slack


@pytest.fixture
def small_disk(tmp_path):
    mount = tmp_path / "disk"
    mount.mkdir()
    if os.geteuid() != 0:
        pytest.skip("mounting a tmpfs needs root")
    done = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=64m", "tmpfs", str(mount)], capture_output=True, text=True)
    if done.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs here: {done.stderr.strip()}")
    yield mount
    subprocess.run(["umount", "-l", str(mount)], check=False)


def fill(disk: Path) -> Path:
    """Write zeros to `disk` until it has no room left; returns the filler file."""
    filler = disk / "filler"
    with open(filler, "wb") as f:
        chunk = b"\0" * (1 << 16)
        try:
            while True:
                f.write(chunk)
                f.flush()
        except OSError:
            pass
    return filler


def rl(run_dir: Path, *extra: str, world: int = 1) -> subprocess.Popen:
    return subprocess.Popen([*rl_command("configs/demo.toml", world), *RUN, "--log.dir", str(run_dir), *extra],
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            env={**os.environ, "OMP_NUM_THREADS": "1"})


def logged_steps(run_dir: Path) -> int:
    try:
        return max((r["step"] for r in read_metrics(run_dir) if r.get("phase") == "train"), default=0)
    except (OSError, ValueError):
        return 0


def checkpointed(run_dir: Path) -> int:
    latest = latest_checkpoint(run_dir) if (run_dir / "checkpoints").exists() else None
    return 0 if latest is None else int(latest.name.split("_")[-1])


def fill_once(disk: Path, run_dir: Path, proc: subprocess.Popen, reached) -> tuple[str, Path]:
    """Fill `disk` once `reached(run_dir)` is 2, then wait for the run to stop on its own: its
    output and the filler file. Fails the test if it is still running STOP_WITHIN_S later."""
    deadline = time.monotonic() + 600
    while reached(run_dir) < 2 and proc.poll() is None and time.monotonic() < deadline:
        time.sleep(0.05)
    assert proc.poll() is None, proc.stdout.read()[-3000:]  # still training when the disk fills
    filler = fill(disk)
    try:
        out, _ = proc.communicate(timeout=STOP_WITHIN_S)
    except subprocess.TimeoutExpired:
        proc.kill()
        pytest.fail(f"the run did not stop within {STOP_WITHIN_S} s of a full disk: {proc.communicate()[0][-3000:]}")
    # Which write fails first depends on the moment: any of them names the full disk.
    assert proc.returncode != 0 and "saccade: stopped:" in out, out[-3000:]
    assert "No space left on device" in out or "bytes free" in out, out[-3000:]
    kept = latest_checkpoint(run_dir)
    assert kept is not None and str(kept) in out, out[-3000:]  # named as the one to go on from
    return out, filler


def resumes_to_the_end(run_dir: Path, world: int) -> None:
    resumed = rl(run_dir, "--resume", world=world)
    out, _ = resumed.communicate(timeout=600)
    assert resumed.returncode == 0, out[-3000:]
    steps = [r["step"] for r in read_metrics(run_dir) if r.get("phase") == "train"]
    assert steps == list(range(1, STEPS + 1)), steps  # each step once: nothing lost, nothing twice


# When the disk fills: once step 2's metrics line is written (the next write is its checkpoint),
# or once step 2's checkpoint is (the next are step 3's samples and metrics line).
@pytest.mark.long
@pytest.mark.parametrize("filled_after", [logged_steps, checkpointed], ids=["metrics", "checkpoint"])
def test_a_run_whose_disk_fills_stops_with_a_checkpoint_and_resumes_once_there_is_room(small_disk, filled_after):
    run_dir = small_disk / "run"
    proc = rl(run_dir)
    out, filler = fill_once(small_disk, run_dir, proc, filled_after)
    assert proc.returncode == UNWRITABLE_EXIT and "--resume" in out and "Traceback" not in out, out[-3000:]
    filler.unlink()  # room again: the run goes on from its checkpoint to the end
    resumes_to_the_end(run_dir, world=1)
    assert latest_checkpoint(run_dir).name == f"step_{STEPS:06d}"


@pytest.mark.long
def test_a_sharded_run_whose_disk_fills_stops_naming_its_last_checkpoint_and_resumes(small_disk):
    """World 2 (torchrun): rank 0's write fails while rank 1 is in the step's collectives, so no
    checkpoint can be saved then; rank 0 says so, naming the last complete one, torchrun ends
    rank 1, and nothing waits for trainer.dist_timeout_s."""
    run_dir = small_disk / "run"
    out, filler = fill_once(small_disk, run_dir, rl(run_dir, world=2), checkpointed)
    assert "torchrun --nproc-per-node 2" in out, out[-3000:]
    filler.unlink()
    resumes_to_the_end(run_dir, world=2)
