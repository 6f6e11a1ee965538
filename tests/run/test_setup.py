"""Building a run: the device it trains on, its precision, the cache and engine it gets.

The CUDA tests run only where a GPU is (the README lists them among the GPU runs)."""

from __future__ import annotations

import warnings

import pytest
import torch

from saccade.config import RunConfig, load_config
from saccade.run.setup import build_setup

cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")


def test_the_config_refuses_an_unknown_device():
    from saccade.config import ConfigError

    with pytest.raises(ConfigError, match="trainer.device"):
        load_config(RunConfig, None, ["--trainer.device", "tpu"])


def test_a_cpu_setup_in_bf16_keeps_everything_where_and_as_asked(tmp_path):
    cfg = load_config(RunConfig, "configs/demo.toml", ["--model.dtype", "bfloat16", "--lora", "true",
                                                        "--image_cache.budget_bytes", "123456"])
    setup = build_setup(cfg, tmp_path)
    assert setup.device == torch.device("cpu") and setup.engine.device == torch.device("cpu")
    frozen = {p.dtype for p in setup.model.parameters() if not p.requires_grad}
    trained = {p.dtype for p in setup.model.parameters() if p.requires_grad}
    assert frozen == {torch.bfloat16} and trained == {torch.float32}  # bf16 base, fp32 adapters
    assert setup.cache.max_bytes == 123456 and setup.cache.dtype == torch.bfloat16
    assert next(setup.engine.encoder.tower.parameters()).dtype == torch.bfloat16
    # Rotary inverse frequencies are never rounded to bf16: not in the trainer's model (which the
    # embedded engine samples from) and not in the engine's tower, where the cast would do it.
    from saccade.models.loading import ROTARY_BUFFERS, rotary_buffers_not_fp32

    for module in (setup.model, setup.engine.model, setup.engine.encoder.tower):
        rotary = [n for n, _ in module.named_buffers() if n.rpartition(".")[2] in ROTARY_BUFFERS]
        assert rotary and rotary_buffers_not_fp32(module) == [], rotary_buffers_not_fp32(module)


@pytest.mark.slow
@cuda
def test_rl_steps_on_cuda_with_the_embedded_engine(tmp_path):
    from stub_tasks import scored_task

    from saccade.metrics import read_metrics
    from saccade.loops.rl import train_rl

    cfg = load_config(RunConfig, "configs/demo.toml", [
        "--trainer.device", "cuda", "--model.dtype", "bfloat16", "--trainer.steps", "3", "--eval.every_steps", "0",
        "--rollout.prompts_per_step", "8", "--log.dir", str(tmp_path)])
    setup = train_rl(cfg, run_dir=cfg.run_dir, task=scored_task(cfg), progress=False)["setup"]
    assert all(p.is_cuda for p in setup.model.parameters())
    rows = [r for r in read_metrics(cfg.run_dir) if r["phase"] == "train"]
    assert len(rows) == 3 and all(r["cuda_peak_mb"] > 0 and r["mismatch_abs"] < 1e-2 for r in rows)


@cuda
def test_the_embedded_engine_does_not_sync_per_token(tmp_path):
    """Under CUDA's sync debug mode, 64 decode steps cost no more host syncs than 16 do, but for
    the stop check every 16 tokens."""
    from saccade.inference.engine import SamplingParams
    from saccade.run.tasks import task_from_config

    cfg = load_config(RunConfig, "configs/demo.toml", ["--trainer.device", "cuda"])
    setup = build_setup(cfg, tmp_path)
    engine = setup.engine
    engine.stop_token_ids = []  # every row decodes to max_tokens
    task = task_from_config(cfg)
    from saccade.inference.engine import ChatRequest

    requests = [ChatRequest(s.sample_id, task.make_env().reset(s)) for s in task.eval_samples(4)]

    def syncs(max_tokens: int) -> int:
        engine.generate(requests, SamplingParams(max_tokens=max_tokens, n=2))  # warm: images cached
        torch.cuda.synchronize()
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            torch.cuda.set_sync_debug_mode("warn")
            try:
                engine.generate(requests, SamplingParams(max_tokens=max_tokens, n=2))
            finally:
                torch.cuda.set_sync_debug_mode("default")
        return sum("synchroniz" in str(w.message) for w in caught)

    short, long = syncs(16), syncs(64)
    assert long - short <= (64 - 16) // engine.stop_check_every + 1, (short, long)


def test_a_vllm_setup_hands_the_engine_every_server_rule_of_the_config(tmp_path, monkeypatch):
    """engine.health_interval_s, no_server_wait_s and hang_after_s reach the servers' client (the
    first two were declared and documented, and never passed: every run had 2 s and 60 s)."""
    from saccade.inference.vllm import VLLMEngine

    given: dict = {}

    class Stop(Exception):
        pass

    def for_servers(cls, urls, processor, **kwargs):
        given.update(kwargs)
        raise Stop

    monkeypatch.setattr(VLLMEngine, "for_servers", classmethod(for_servers))
    cfg = load_config(RunConfig, "configs/demo.toml", [
        "--engine.kind", "vllm", "--engine.urls", '["http://127.0.0.1:9"]', "--engine.health_interval_s", "0.5",
        "--engine.no_server_wait_s", "7", "--engine.hang_after_s", "42", "--engine.timeout_s", "900"])
    with pytest.raises(Stop):
        build_setup(cfg, tmp_path)
    assert {k: given[k] for k in ("health_interval_s", "no_server_wait_s", "hang_after_s", "timeout_s")} == {
        "health_interval_s": 0.5, "no_server_wait_s": 7.0, "hang_after_s": 42.0, "timeout_s": 900.0}
