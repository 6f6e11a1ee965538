"""`saccade bench kill`: SIGKILL a run at random instants, resume it after each kill, and
compare the result with the same run never killed.

Both runs are `saccade rl CONFIG` processes (the demo config by default, embedded engine,
from the demo's warm start, a checkpoint every step, fixed seed). The straight run goes first
and gives the timing the kills are drawn from. Each life of the killed run is SIGKILLed (its
whole process group) at a random instant: every fourth kill lands in start-up (uniform
over the straight run's start-up time: imports, model, loading the checkpoint), the rest once
the life has logged a step of its own, uniform over the next 1.5 steps (sampling, training,
writing metrics, writing checkpoints). Drawn against the life's own progress, not the clock,
a slow or loaded machine still sees every kill land before the run ends. After each kill the
folder is inspected as the next life finds it (a half-written checkpoint folder, a torn
metrics line), and the run is started again with `--resume` (without it while no checkpoint
exists yet). Once the kills are spent the last life runs to the end.

Compared: every metrics.jsonl line whole, each (step, phase) once, every computed figure
equal to the straight run's (wall-clock, memory and this process's cache figures left out),
and the final checkpoint's trainable weights bit for bit.
"""

from __future__ import annotations

import json
import math
import os
import random
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from saccade.config.bench import KillBenchConfig

# The run both arms make: the demo's warm start, the embedded engine (seeded: bit-reproducible),
# a checkpoint every step (a resume loses at most the step in flight), no evaluation.
RUN_DEFAULTS = ["--model.path", "tiny-warm", "--engine.kind", "embedded", "--eval.every_steps", "0",
                "--checkpoint.every_steps", "1", "--checkpoint.keep_last", "2"]
# Figures of how a process ran rather than what the run computed.
NOT_COMPUTED = {"time", "tokens_per_s", "rss_mb", "peak_rss_mb", "cuda_peak_mb", "cache_hit_rate", "cache_evictions",
                "cache_mb", "cache_entries", "open_fds", "threads", "python_threads"}
TOLERANCE = 1e-6  # absolute, on every computed figure: resumed runs are expected to be bit-identical
STARTUP_SHARE = 0.25  # of the kills, those aimed at start-up rather than at a step under way


def rl_command(config: str, run_dir: Path, overrides: list[str], *, resume: bool) -> list[str]:
    return [sys.executable, "-m", "saccade", "rl", config, *RUN_DEFAULTS, *overrides, "--log.dir", str(run_dir),
            *(["--resume"] if resume else ["--fresh"])]  # --fresh: a --out folder the bench used before


def computed(record: dict) -> dict:
    return {k: v for k, v in record.items() if k not in NOT_COMPUTED and not k.endswith("_s")}


def metrics_lines(run_dir: Path) -> tuple[list[dict], list[str]]:
    """The records of run_dir/metrics.jsonl and what is wrong with the file (torn or unparsable
    lines, a (step, phase) logged twice)."""
    path = run_dir / "metrics.jsonl"
    raw = path.read_bytes() if path.exists() else b""
    problems, records = [], []
    if raw and not raw.endswith(b"\n"):
        problems.append("the last line is torn")
    for n, line in enumerate(raw.splitlines(), 1):
        try:
            records.append(json.loads(line))
        except ValueError:
            problems.append(f"line {n} does not parse")
    keys = [(r.get("step"), r.get("phase")) for r in records]
    doubled = sorted({k for k in keys if keys.count(k) > 1}, key=str)
    if doubled:
        problems.append(f"logged twice: {doubled[:5]}")
    return records, problems


def compare_metrics(killed: list[dict], straight: list[dict]) -> dict[str, Any]:
    """How the killed run's records differ from the straight run's: the largest absolute
    difference of any computed figure, and the first few differences."""
    differences: list[str] = []
    if [(r["step"], r["phase"]) for r in killed] != [(r["step"], r["phase"]) for r in straight]:
        differences.append("the steps logged differ")
    largest = 0.0
    for a, b in zip(killed, straight):
        a, b = computed(a), computed(b)
        for key in sorted(a.keys() | b.keys()):
            x, y = a.get(key), b.get(key)
            if isinstance(x, (int, float)) and isinstance(y, (int, float)):
                d = abs(x - y) if math.isfinite(x) and math.isfinite(y) else (0.0 if str(x) == str(y) else math.inf)
                largest = max(largest, d)
                if d > TOLERANCE:
                    differences.append(f"step {a.get('step')} {key}: {x} vs {y}")
            elif x != y:
                differences.append(f"step {a.get('step')} {key}: {x!r} vs {y!r}")
    return {"largest_difference": largest, "differences": differences[:10], "n_differences": len(differences)}


def compare_weights(killed_dir: Path, straight_dir: Path) -> dict[str, Any]:
    """The final checkpoints' trainable tensors: equal bit for bit, or the largest difference."""
    import torch
    from safetensors.torch import load_file

    from saccade.trainer.checkpoint.folder import latest_checkpoint

    a, b = latest_checkpoint(killed_dir), latest_checkpoint(straight_dir)
    if a is None or b is None or a.name != b.name:
        return {"weights_identical": False, "weights_note": f"final checkpoints {a} and {b}"}
    files = sorted(p.relative_to(b) for p in b.rglob("*.safetensors"))
    largest, identical = 0.0, bool(files)
    for rel in files:
        x, y = load_file(a / rel), load_file(b / rel)
        if x.keys() != y.keys():
            return {"weights_identical": False, "weights_note": f"{rel}: other tensors"}
        for k in x:
            identical &= torch.equal(x[k], y[k])
            largest = max(largest, (x[k].double() - y[k].double()).abs().max().item() if x[k].numel() else 0.0)
    return {"weights_identical": identical, "weights_largest_difference": largest,
            "weights_files": [str(f) for f in files]}


def checkpoint_step(run_dir: Path) -> int | None:
    """The step of the run's newest complete checkpoint, or None."""
    from saccade.trainer.checkpoint.folder import latest_checkpoint

    latest = latest_checkpoint(run_dir)
    return None if latest is None else int(latest.name.split("_")[-1])


def logged_a_step(run_dir: Path, *, since: float) -> bool:
    """Whether a life started at `since` (wall clock) has logged a step of its own: metrics.jsonl
    written since then, and past the checkpoint it resumed from (a resume first drops the lines
    after that checkpoint, which the killed life had logged)."""
    path = run_dir / "metrics.jsonl"
    if not path.exists() or path.stat().st_mtime < since:
        return False
    return newest_step(run_dir) > (checkpoint_step(run_dir) or 0)


def newest_step(run_dir: Path) -> int:
    """The step of metrics.jsonl's last whole line (0 without one)."""
    path = run_dir / "metrics.jsonl"
    if not path.exists():
        return 0
    with open(path, "rb") as f:
        f.seek(max(0, f.seek(0, os.SEEK_END) - 65536))
        lines = f.read().split(b"\n")[:-1]  # the last element is a torn line or empty
    for line in reversed(lines):
        try:
            return int(json.loads(line)["step"])
        except (ValueError, KeyError, TypeError):
            continue
    return 0


def folder_after_kill(run_dir: Path) -> dict[str, Any]:
    """What the next life finds: its newest complete checkpoint, half-written folders, a torn line."""
    tmp = [p.name for sub in (run_dir / "checkpoints", run_dir / "engine-weights") if sub.is_dir()
           for p in sub.iterdir() if p.name.startswith(".tmp-")]
    path = run_dir / "metrics.jsonl"
    torn = path.exists() and path.stat().st_size > 0 and not path.read_bytes().endswith(b"\n")
    return {"checkpoint_step": checkpoint_step(run_dir),
            "half_written_folders": tmp, "torn_metrics_line": torn}


class Life:
    """One `saccade rl` process, in its own process group (so a kill takes all of it)."""

    def __init__(self, cmd: list[str], log_path: Path):
        self.log_path = log_path
        with open(log_path, "ab") as log:
            env = {**os.environ, "OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS", "1")}
            self.proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=env, start_new_session=True)
        self.started = time.perf_counter()
        self.started_wall = time.time()

    def wait(self, timeout: float | None = None) -> int | None:
        try:
            return self.proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            return None

    def kill(self) -> None:
        try:
            os.killpg(self.proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        self.proc.wait()

    def failed(self, what: str) -> RuntimeError:
        tail = self.log_path.read_text(errors="replace")[-3000:]
        return RuntimeError(f"{what} exited with {self.proc.returncode}; the end of {self.log_path}:\n{tail}")


def straight_run(cmd: list[str], run_dir: Path, log_path: Path) -> dict[str, float]:
    """Run to the end; returns its wall time and its start-up time (until the first metrics line)."""
    life = Life(cmd, log_path)
    startup = None
    while life.wait(timeout=0.2) is None:
        if startup is None and (run_dir / "metrics.jsonl").exists() and (run_dir / "metrics.jsonl").stat().st_size:
            startup = time.perf_counter() - life.started
    if life.proc.returncode != 0:
        raise life.failed("the straight run")
    wall = time.perf_counter() - life.started
    return {"wall_s": wall, "startup_s": startup if startup is not None else wall}


def run_kill_bench(cfg: KillBenchConfig, *, progress: bool = True) -> dict[str, Any]:
    """The straight run, then the killed one (`cfg.kills` SIGKILLs, each life resumed), compared."""
    config, kills, steps, seed = cfg.config, cfg.kills, cfg.steps, cfg.seed
    out = Path(cfg.out or tempfile.mkdtemp(prefix="saccade-bench-kill-"))
    out.mkdir(parents=True, exist_ok=True)
    overrides = ["--trainer.steps", str(steps), *cfg.overrides]
    straight_dir, killed_dir = out / "straight", out / "killed"

    def say(text: str) -> None:
        if progress:
            print(text, flush=True)

    say(f"straight run: {steps} steps in {straight_dir} ...")
    timing = straight_run(rl_command(config, straight_dir, overrides, resume=False), straight_dir,
                          out / "straight.log")
    step_s = (timing["wall_s"] - timing["startup_s"]) / steps
    say(f"  {timing['wall_s']:.0f} s, {timing['startup_s']:.1f} s of it starting, {step_s:.2f} s/step")

    from saccade.trainer.checkpoint.folder import latest_checkpoint

    rng = random.Random(seed)
    events: list[dict[str, Any]] = []
    for n in range(1, kills + 1):
        resume = latest_checkpoint(killed_dir) is not None
        life = Life(rl_command(config, killed_dir, overrides, resume=resume), out / "killed.log")
        in_startup = n % round(1 / STARTUP_SHARE) == 0  # every 4th kill: a quarter, whatever the seed
        delay = rng.uniform(0, timing["startup_s"] if in_startup else 1.5 * step_s)
        ended = None
        if not in_startup:  # wait for a step of this life's own, then aim at the steps after it
            while ended is None and not logged_a_step(killed_dir, since=life.started_wall):
                ended = life.wait(timeout=0.05)
        if ended is None:
            ended = life.wait(timeout=delay)
        if ended is not None:  # it ended before the kill: nothing left to kill
            if ended != 0:
                raise life.failed(f"life {n} of the killed run")
            say(f"  the run finished before kill {n}")
            break
        after_s = time.perf_counter() - life.started
        life.kill()
        found = folder_after_kill(killed_dir)
        events.append({"kill": n, "aimed_at": "start-up" if in_startup else "a step", "after_s": round(after_s, 2),
                       "resumed": resume, **found})
        say(f"  kill {n:2d} ({events[-1]['aimed_at']}) at {after_s:5.1f} s: checkpoint step "
            f"{found['checkpoint_step']}, half-written {len(found['half_written_folders'])}, "
            f"torn line {found['torn_metrics_line']}")

    life = Life(rl_command(config, killed_dir, overrides, resume=latest_checkpoint(killed_dir) is not None),
                out / "killed.log")
    if life.wait() != 0:
        raise life.failed("the last life of the killed run")

    straight, straight_problems = metrics_lines(straight_dir)
    killed, killed_problems = metrics_lines(killed_dir)
    result: dict[str, Any] = {
        "config": config, "steps": steps, "kills_asked": kills, "kills": len(events),
        "kills_inside_a_write": kills_inside_a_write(events),
        "kills_tearing_a_metrics_line": sum(e["torn_metrics_line"] for e in events),
        "straight_wall_s": timing["wall_s"], "startup_s": timing["startup_s"], "step_s": step_s,
        "file_problems": killed_problems + [f"straight run: {p}" for p in straight_problems],
        **compare_metrics(killed, straight), **compare_weights(killed_dir, straight_dir),
        "events": events, "out_dir": str(out),
    }
    result["survived"] = len(events) if identical(result) else 0
    return result


def kills_inside_a_write(events: list[dict[str, Any]]) -> int:
    """Kills that left a half-written folder of their own (a life killed in start-up still finds
    the one its predecessor left: its first save sweeps it)."""
    seen: set[str] = set()
    count = 0
    for e in events:
        new = set(e["half_written_folders"]) - seen
        count += bool(new)
        seen |= new
    return count


def identical(result: dict[str, Any]) -> bool:
    return not result["file_problems"] and result["n_differences"] == 0 and result["weights_identical"]


def format_kill_report(result: dict[str, Any]) -> str:
    lines = [
        f"{result['config']}, {result['steps']} steps, a checkpoint every step; straight run "
        f"{result['straight_wall_s']:.0f} s ({result['startup_s']:.1f} s starting, {result['step_s']:.2f} s/step)",
        f"kills: {result['kills']} of {result['kills_asked']} landed ({result['kills_inside_a_write']} inside a "
        f"checkpoint or export write, {result['kills_tearing_a_metrics_line']} tearing a metrics line)",
        f"survived with identical results: {result['survived']} of {result['kills']}",
        f"metrics: largest difference {result['largest_difference']:.1e} over every computed figure "
        f"({result['n_differences']} above {TOLERANCE:g}); final weights bit-identical: {result['weights_identical']}",
    ]
    lines += [f"  file: {p}" for p in result["file_problems"]]
    lines += [f"  differs: {d}" for d in result["differences"]]
    return "\n".join(lines)
