"""What packing costs a hybrid (Gated DeltaNet + full attention) language model on this CPU.

One run, side by side, forward + backward of one micro-batch, medians of --repeats:
- each sample alone (a forward per sample), the packed row with the reset
  (`make_packing_exact`), and the packed row without it (wrong: the state leaks; the
  gather/scatter's own price);
- a group sharing one prompt: packed with the shared prompt (the linear layers recompute it per
  completion) against every sample packed whole.
A random Qwen3.5 text model, fp32, packed_sdpa for the full-attention layers, the reference
(torch) linear-attention kernels: flash-linear-attention is not installed here.

    OMP_NUM_THREADS=1 PYTHONPATH=src python scripts/bench_linear_attention.py
"""

from __future__ import annotations

import argparse
import copy
import statistics
import time

import torch


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--hidden", type=int, default=256)
    parser.add_argument("--layers", type=int, default=8)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--threads", type=int, default=1)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)

    from transformers.models.qwen3_5 import Qwen3_5TextConfig, Qwen3_5TextModel

    from saccade.models.attention import NO_MASK, PACKED_SDPA, PackedLayout
    from saccade.models.linear_attention import make_packing_exact

    torch.manual_seed(0)
    config = Qwen3_5TextConfig(
        vocab_size=1000, hidden_size=args.hidden, intermediate_size=3 * args.hidden, num_hidden_layers=args.layers,
        num_attention_heads=8, num_key_value_heads=2, head_dim=64, linear_key_head_dim=64,
        linear_value_head_dim=64, linear_num_key_heads=4, linear_num_value_heads=8,
        rope_parameters={"rope_type": "default", "rope_theta": 10000.0, "mrope_section": [11, 11, 10],
                         "partial_rotary_factor": 0.25},
    )
    config._attn_implementation = PACKED_SDPA
    leaky = Qwen3_5TextModel(config)
    exact = copy.deepcopy(leaky)
    make_packing_exact(exact)

    def positions(lengths, starts=None):
        starts = starts or [0] * len(lengths)
        return torch.cat([torch.arange(s, s + n) for s, n in zip(starts, lengths)]).view(1, 1, -1).expand(4, 1, -1)

    def step(model, ids, lengths, starts=None, context=None, packed=True):
        kwargs = {}
        if packed:
            cu = torch.tensor([0, *lengths]).cumsum(0)
            kwargs = dict(attention_mask=NO_MASK, packed_layout=PackedLayout.from_cu_seqlens(cu, context=context))
        out = model(input_ids=ids, position_ids=positions(lengths, starts), use_cache=False, **kwargs)
        out.last_hidden_state.square().mean().backward()

    def timed(fn):
        fn()  # warm-up
        times = []
        for _ in range(args.repeats):
            t = time.perf_counter()
            fn()
            times.append(time.perf_counter() - t)
        return 1000 * statistics.median(times)

    print(f"hidden {args.hidden}, {args.layers} layers ({config.layer_types.count('linear_attention')} linear), "
          f"{args.threads} threads, forward + backward, median of {args.repeats} (ms)")
    rows = {"8 samples of 200-300 tokens": [212, 298, 251, 203, 277, 230, 265, 241],
            "2 x 300 + 30 x 60 tokens": [300, 300] + [60] * 30,
            "8 mixed, 3-140 tokens": [65, 66, 3, 140, 9, 50, 77, 21]}
    print("| row | each alone | packed, reset | packed, no reset (leaks) | alone / packed |")
    print("|---|---|---|---|---|")
    for name, lengths in rows.items():
        samples = [torch.randint(0, 1000, (1, n)) for n in lengths]
        row = torch.cat(samples, 1)
        alone = timed(lambda: [step(exact, s, [s.shape[1]], packed=False) for s in samples])
        packed = timed(lambda: step(exact, row, lengths))
        wrong = timed(lambda: step(leaky, row, lengths))
        print(f"| {name} ({sum(lengths)}) | {alone:.0f} | {packed:.0f} | {wrong:.0f} | {alone / packed:.2f}x |")

    P, G, C = 300, 8, 30
    prompt = torch.randint(0, 1000, (1, P))
    outs = [torch.randint(0, 1000, (1, C)) for _ in range(G)]
    whole = torch.cat([torch.cat([prompt, o], 1) for o in outs], 1)
    shared = torch.cat([prompt, *outs], 1)
    shared_lengths = [P + C] + [C] * (G - 1)
    context = [(0, 0)] + [(0, P)] * (G - 1)
    t_whole = timed(lambda: step(exact, whole, [P + C] * G))
    t_shared = timed(lambda: step(exact, shared, shared_lengths, starts=[0] + [P] * (G - 1), context=context))
    print(f"\nshared prompt, {G} completions of {C} tokens after {P}: every sample whole ({G * (P + C)} tokens) "
          f"{t_whole:.0f} ms, shared ({P + G * C} tokens; the linear layers recompute the prompt) {t_shared:.0f} ms, "
          f"{t_whole / t_shared:.2f}x")


if __name__ == "__main__":
    main()
