"""The bf16 bars of tests/models/test_qwen3_5_vllm.py: the embedded engine's own bf16 gap on the tiny Qwen3.5.

The embedded engine samples in bf16 (`saccade bench engine-parity`'s requests: 8 shapes prompts x
n = 4 x 16 tokens, T = 1) and every sampled token's logprob is compared with
- the bf16 trainer (the same model object: only the batch shapes differ, padded decode against
  the packed forward), and
- the fp32 trainer (the whole model's bf16 rounding on these prompts: the unit the vLLM bars use);
then the same with a LoRA adapter on the family's 12 targets (B ~ N(0, 0.05), as the vLLM test),
against the bf16 LoRA trainer and an fp32 one holding the same (bf16-representable) weights.
docs/families.md, Qwen3.5, has the figures.

    OMP_NUM_THREADS=1 PYTHONPATH=src python scripts/qwen3_5/embedded_bf16_bars.py [--seeds 0 1 2]
"""

from __future__ import annotations

import argparse

import torch


def lora_model(path, dtype):
    from saccade.config import LoraConfig
    from saccade.models.families import qwen3_5
    from saccade.models.lm import apply_lora, load_policy_lm

    model = apply_lora(load_policy_lm(path, dtype=dtype), LoraConfig(rank=4, target_modules=list(qwen3_5.LORA_TARGETS)))
    with torch.no_grad():
        for n, p in model.named_parameters():
            if "lora_B" in n:
                p.normal_(0, 0.05, generator=torch.Generator().manual_seed(len(n)))
    return model.eval()


def main() -> None:
    from saccade.tools.bench.engine import shapes_requests, trainer_logprob_diffs
    from saccade.config import ImagesConfig
    from saccade.inference.engine import SamplingParams
    from saccade.inference.local import LocalEngine
    from saccade.models.presets import resolve_model
    from saccade.models.lm import load_policy_lm, unwrap_policy
    from saccade.models.loading import load_processor, load_vision_tower
    from saccade.models.vision import EmbeddingCache, VisionEncoder

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="qwen3.5-tiny")
    parser.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    args = parser.parse_args()
    torch.set_num_threads(1)
    path = resolve_model(args.model)
    processor = load_processor(path)
    limits = ImagesConfig(min_pixels=32 * 32, max_pixels=256 * 256)
    encoder = VisionEncoder(load_vision_tower(path, dtype=torch.bfloat16), processor, limits=limits,
                            cache=EmbeddingCache())
    plain = {"bf16": load_policy_lm(path, dtype=torch.bfloat16).eval(), "fp32": load_policy_lm(path).eval()}
    lora = {"bf16": lora_model(path, torch.bfloat16), "fp32": lora_model(path, torch.float32)}
    lora["fp32"].load_state_dict({k: v.float() for k, v in lora["bf16"].state_dict().items()})
    params = SamplingParams(temperature=1.0, max_tokens=16, n=4)
    for name, models in (("base", plain), ("LoRA", lora)):
        for seed in args.seeds:
            engine = LocalEngine(models["bf16"], processor, encoder, seed=seed)
            completions = [c for g in engine.generate(shapes_requests(8), params) for c in g]
            for trainer in ("bf16", "fp32"):
                with torch.no_grad():
                    d = trainer_logprob_diffs(
                        models[trainer], completions, cache_get=encoder.cache.get,
                        image_token_id=unwrap_policy(models["bf16"]).image_token_id,
                        banned_token_ids=engine.banned_token_ids, distribution=params.distribution)
                print(f"{name}: embedded engine (bf16), seed {seed}, vs the {trainer} trainer: {d.numel()} tokens, "
                      f"mean {float(d.mean()):.2e}, max {float(d.max()):.2e}", flush=True)


if __name__ == "__main__":
    main()
