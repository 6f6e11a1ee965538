"""Runs SIGKILLed at the worst instants (tests/kill_worker.py, real processes) stay resumable:
a kill inside a checkpoint write, half-way through a metrics line, or inside an engine-weights
export loses nothing, and `--resume` logs the same per-step metrics as a run never killed.
A checkpoint that cannot be written stops the run with an error that says what to do.

Whole runs killed and resumed, two minutes of the default suite: in the long suite (`pytest -m
long`, CI runs it). Their parts stay in the default one: the atomic write (tests/test_atomic.py),
the torn metrics line (tests/test_metrics.py), the checkpoint folder (tests/trainer/checkpoint)."""

from __future__ import annotations

import hashlib
import json
import os
import signal
import subprocess
import sys
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path

import pytest

from saccade.tools.bench.kill import computed
from saccade.metrics import read_metrics
from saccade.trainer.checkpoint.folder import latest_checkpoint

pytestmark = [pytest.mark.slow, pytest.mark.long]

WORKER = Path(__file__).with_name("kill_worker.py")


ENV = {**os.environ, "OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1", "PYTHONWARNINGS": "ignore"}


def _worker(*args: str, expect_killed: bool = False) -> None:
    proc = subprocess.run([sys.executable, str(WORKER), *args], env=ENV, capture_output=True, text=True, timeout=600)
    if expect_killed:
        assert proc.returncode == -signal.SIGKILL, (proc.returncode, proc.stderr[-3000:])
    else:
        assert proc.returncode == 0, proc.stderr[-3000:]


def computed_figures(records: list[dict]) -> list[dict]:
    """What the runs computed, not how long it took or what the process's cache held."""
    return [computed(r) for r in records]


def assert_same_run(run_dir: Path, straight_dir: Path) -> None:
    """Every line whole, each (step, phase) once, and the figures equal to the straight run's."""
    raw = (run_dir / "metrics.jsonl").read_bytes()
    assert raw.endswith(b"\n")
    lines = [json.loads(line) for line in raw.splitlines()]  # a torn line would not parse
    keys = [(r["step"], r["phase"]) for r in lines]
    assert len(keys) == len(set(keys)), "a step logged twice"
    straight = read_metrics(straight_dir)
    assert keys == [(r["step"], r["phase"]) for r in straight]
    for a, b in zip(computed_figures(lines), computed_figures(straight), strict=True):
        assert a.keys() == b.keys()
        for k in a:
            if isinstance(a[k], (int, float)) and isinstance(b[k], (int, float)):
                assert a[k] == pytest.approx(b[k], rel=0, abs=1e-6), (a["step"], k)
            else:
                assert a[k] == b[k], (a["step"], k)
    # Not vacuous: the run trained (its loss moved) and ended with its last checkpoint.
    assert len({round(r["loss"], 8) for r in lines if r["phase"] == "train"}) > 1
    assert latest_checkpoint(run_dir).name == "step_000006"


# Each scenario below is a chain of worker processes (and the checks between them), in a
# folder of its own. The workers run on one thread each (OMP_NUM_THREADS=1), so the `runs`
# fixture runs two chains at a time, keeping both cores busy: one after another they took
# about twice as long. The tests wait for their chain and check what it left.
SCENARIOS: dict = {}


def scenario(fn):
    SCENARIOS[fn.__name__] = fn
    return fn


@scenario
def straight(run_dir: Path) -> Path:
    _worker("rl", str(run_dir))
    return run_dir


@scenario
def killed_in_a_checkpoint_write(run_dir: Path) -> Path:
    _worker("rl", str(run_dir), "--die-at", "checkpoint:2", expect_killed=True)  # writing step 4's
    checkpoints = run_dir / "checkpoints"
    assert [p.name for p in checkpoints.iterdir() if p.name.startswith(".tmp-")], "the write was under way"
    assert latest_checkpoint(run_dir).name == "step_000002"  # the torn one is invisible
    _worker("rl", str(run_dir), "--resume")
    return run_dir


@scenario
def killed_in_a_metrics_line(run_dir: Path) -> Path:
    _worker("rl", str(run_dir), "--die-at", "metrics:5", expect_killed=True)  # step 5's line torn
    assert not (run_dir / "metrics.jsonl").read_bytes().endswith(b"\n")
    assert latest_checkpoint(run_dir).name == "step_000004"
    _worker("rl", str(run_dir), "--resume")
    return run_dir


@pytest.fixture(scope="module")
def runs(tmp_path_factory) -> dict[str, Future]:
    """name -> Future of every scenario, run two at a time, the longest chain (the export's
    three workers) among the first two."""
    root = tmp_path_factory.mktemp("kills")
    order = ("export_killed_and_resumed", "straight", "killed_in_a_checkpoint_write", "killed_in_a_metrics_line",
             "checkpoint_write_fails")
    assert sorted(order) == sorted(SCENARIOS)
    with ThreadPoolExecutor(max_workers=2) as pool:
        yield {name: pool.submit(SCENARIOS[name], root / name) for name in order}


def finished(runs: dict[str, Future], name: str):
    """What the scenario returned once its chain has run (its failure is raised here)."""
    return runs[name].result()


def test_a_kill_inside_a_checkpoint_write_resumes_from_the_one_before(runs):
    run_dir = finished(runs, "killed_in_a_checkpoint_write")
    assert_same_run(run_dir, finished(runs, "straight"))
    assert not [p for p in (run_dir / "checkpoints").iterdir() if p.name.startswith(".tmp-")]  # the dead writer's swept


def test_a_kill_half_way_through_a_metrics_line_resumes_without_a_torn_or_doubled_line(runs):
    assert_same_run(finished(runs, "killed_in_a_metrics_line"), finished(runs, "straight"))


def _tree_digest(folder: Path) -> dict[str, str]:
    return {str(p.relative_to(folder)): hashlib.sha256(p.read_bytes()).hexdigest()
            for p in sorted(folder.rglob("*")) if p.is_file()}


@scenario
def export_killed_and_resumed(run_dir: Path) -> tuple[dict[str, str], dict[str, str]]:
    """(v1's digest, v2's): the export of version 2 killed half-way, then made again."""
    weights = run_dir / "engine-weights"
    _worker("export", str(run_dir), "1")
    v1 = _tree_digest(weights / "v1")
    assert any(name.endswith(".safetensors") for name in v1)

    _worker("export", str(run_dir), "2", "--die-at", "export:1", expect_killed=True)
    assert sorted(p.name for p in weights.iterdir() if not p.name.startswith(".")) == ["v1"]
    assert _tree_digest(weights / "v1") == v1  # what the servers load is untouched
    leftover = [p for p in weights.iterdir() if p.name.startswith(".tmp-v2-")]
    assert leftover and any(f.suffix == ".safetensors" for f in leftover[0].iterdir())  # it died mid-export

    _worker("export", str(run_dir), "2")  # the run resumed: its next export
    assert sorted(p.name for p in weights.iterdir()) == ["v2"]  # v1 retired, the dead export's folder swept
    return v1, _tree_digest(weights / "v2")


def test_a_kill_inside_an_engine_weights_export_leaves_the_previous_export_whole(runs):
    v1, v2 = finished(runs, "export_killed_and_resumed")
    assert v2 != v1


@scenario
def checkpoint_write_fails(run_dir: Path) -> tuple[Path, str]:
    """(the run's folder, what it printed when it stopped). A real write failure: files over
    RLIMIT_FSIZE fail with EFBIG (as a full disk fails with ENOSPC), set in the run's own
    process after its first checkpoint."""
    script = f"""
import resource, signal, sys
sys.path.insert(0, {str(WORKER.parent)!r})
import kill_worker
import saccade.trainer.checkpoint.saving as ckpt
from saccade.loops.checkpointer import CheckpointWriteError
saves = {{"n": 0}}
save = ckpt.save_checkpoint
def limited(*args, **kwargs):
    saves["n"] += 1
    if saves["n"] == 2:  # step 4's: no file over 4 kB can be written from now on
        signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
        resource.setrlimit(resource.RLIMIT_FSIZE, (4096, resource.RLIM_INFINITY))
    return save(*args, **kwargs)
import saccade.loops.checkpointer
saccade.loops.checkpointer.save_checkpoint = limited
try:
    kill_worker.main(["rl", {str(run_dir)!r}])
except CheckpointWriteError as e:
    print("STOPPED:", e)
    sys.exit(3)
"""
    # saccade.loops.checkpointer imports save_checkpoint at its top: the patch replaces the name the loop calls.
    proc = subprocess.run([sys.executable, "-c", script], env=ENV, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 3, proc.stderr[-3000:]
    return run_dir, proc.stdout.split("STOPPED:", 1)[1]


def test_a_checkpoint_that_cannot_be_written_stops_the_run_and_keeps_the_previous_one(runs):
    run_dir, message = finished(runs, "checkpoint_write_fails")
    assert "step 4" in message and "step_000002" in message and "is intact" in message and "--resume" in message
    assert latest_checkpoint(run_dir).name == "step_000002"
    assert not [p for p in (run_dir / "checkpoints").iterdir() if p.name.startswith(".tmp-")]
    assert max(r["step"] for r in read_metrics(run_dir)) == 4  # it stopped at the failed save, not later
