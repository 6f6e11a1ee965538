"""What packing costs a hybrid (Gated DeltaNet + full attention) language model on this CPU.

One run, side by side, forward + backward of one micro-batch, medians of --repeats:
- each sample alone (a forward per sample), the packed row with the reset
  (`make_packing_exact`), and the packed row without it (wrong: the state leaks; the
  gather/scatter's own price);
- the packed row on the varlen path (`TORCH_VARLEN`: the torch kernels in a loop over segments);
- a group sharing one prompt: packed with the shared prompt against every sample packed whole.
A random Qwen3.5 text model, fp32, packed_sdpa for the full-attention layers, the reference
(torch) linear-attention kernels: flash-linear-attention is not installed here.

`--grpo`: instead, a GRPO group on qwen3.5-small (PolicyLM, fp32, every parameter trained): one
prompt of --prompt tokens and G completions of 60-120 tokens, packed whole or with the prompt shared,
the linear layers on the padded path (a shared prompt recomputed per completion) or the varlen path
(a shared prompt run once, its state carried into each completion).

    OMP_NUM_THREADS=1 PYTHONPATH=src python scripts/bench_linear_attention.py
    OMP_NUM_THREADS=1 PYTHONPATH=src python scripts/bench_linear_attention.py --grpo
"""

from __future__ import annotations

import argparse
import copy

import torch

from saccade.tools.bench.linear_attention import forced_kernels, side_by_side


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--hidden", type=int, default=256)
    parser.add_argument("--layers", type=int, default=8)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--grpo", action="store_true", help="a GRPO group on qwen3.5-small instead")
    parser.add_argument("--prompt", type=int, default=300)
    parser.add_argument("--group", type=int, default=8)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    if args.grpo:
        return grpo(args)

    from transformers.models.qwen3_5 import Qwen3_5TextConfig, Qwen3_5TextModel

    from saccade.models.attention import NO_MASK, PACKED_SDPA, PackedLayout
    from saccade.models.linear_attention import TORCH_VARLEN, make_packing_exact

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

    print(f"hidden {args.hidden}, {args.layers} layers ({config.layer_types.count('linear_attention')} linear), "
          f"{args.threads} threads, forward + backward, median of {args.repeats} (ms)")
    rows = {"8 samples of 200-300 tokens": [212, 298, 251, 203, 277, 230, 265, 241],
            "2 x 300 + 30 x 60 tokens": [300, 300] + [60] * 30,
            "8 mixed, 3-140 tokens": [65, 66, 3, 140, 9, 50, 77, 21]}
    print("| row | each alone | packed, reset (padded) | packed, varlen | packed, no reset (leaks) | alone / packed |")
    print("|---|---|---|---|---|---|")
    for name, lengths in rows.items():
        samples = [torch.randint(0, 1000, (1, n)) for n in lengths]
        row = torch.cat(samples, 1)
        alone, packed, varlen, wrong = side_by_side([
            lambda: [step(exact, s, [s.shape[1]], packed=False) for s in samples],
            lambda: step(exact, row, lengths),
            lambda: linear_kernels(TORCH_VARLEN, lambda: step(exact, row, lengths)),
            lambda: step(leaky, row, lengths)], args.repeats)
        print(f"| {name} ({sum(lengths)}) | {alone:.0f} | {packed:.0f} | {varlen:.0f} | {wrong:.0f} "
              f"| {alone / packed:.2f}x |")

    P, G, C = 300, 8, 30
    prompt = torch.randint(0, 1000, (1, P))
    outs = [torch.randint(0, 1000, (1, C)) for _ in range(G)]
    whole = torch.cat([torch.cat([prompt, o], 1) for o in outs], 1)
    shared = torch.cat([prompt, *outs], 1)
    shared_lengths = [P + C] + [C] * (G - 1)
    context = [(0, 0)] + [(0, P)] * (G - 1)
    def shared_step():
        step(exact, shared, shared_lengths, starts=[0] + [P] * (G - 1), context=context)

    t_whole, recompute, t_shared = side_by_side([
        lambda: step(exact, whole, [P + C] * G), lambda: linear_kernels(None, shared_step), shared_step],
        args.repeats)
    print(f"\nshared prompt, {G} completions of {C} tokens after {P}: every sample whole ({G * (P + C)} tokens) "
          f"{t_whole:.0f} ms; shared ({P + G * C} tokens in the row), the linear layers recomputing the prompt "
          f"{recompute:.0f} ms ({t_whole / recompute:.2f}x), running it once {t_shared:.0f} ms "
          f"({t_whole / t_shared:.2f}x)")


def grpo(args) -> None:
    """A GRPO group's training forward + backward on qwen3.5-small, side by side: packed whole, or with
    the prompt shared; the linear layers padded (a shared prompt recomputed) or varlen (run once).
    The group and the step are saccade.tools.bench.linear_attention's (`saccade bench gpu`'s linear-attention
    stage times them on a GPU)."""
    from saccade.tools.bench.linear_attention import grpo_rows, grpo_step
    from saccade.models.presets import preset_path
    from saccade.models.linear_attention import TORCH_VARLEN
    from saccade.models.lm import load_policy_lm

    policy = load_policy_lm(preset_path("qwen3.5-small"))
    linear = policy.config.text_config.layer_types.count("linear_attention")
    P, G = args.prompt, args.group
    # The prompt: 20 tokens, one image of 256 x 256 px (64 tokens: 32 x 32 px each), then text.
    rows = grpo_rows(policy, prompt=P, group=G)
    completions = rows["completions"]
    total, once = G * P + sum(completions), P + sum(completions)
    print(f"qwen3.5-small ({linear} of {len(policy.config.text_config.layer_types)} layers linear), fp32, "
          f"{args.threads} threads, forward + backward of every parameter, median of {args.repeats}: a prompt of "
          f"{P} tokens, {G} completions of {min(completions)}-{max(completions)} ({sum(completions)} tokens)")
    print("| row | linear layers | tokens through the linear layers | ms |")
    print("|---|---|---|---|")
    cases = (("every sample whole", None, "whole", total), ("every sample whole", TORCH_VARLEN, "whole", total),
             ("prompt shared", None, "shared", total), ("prompt shared", TORCH_VARLEN, "shared", once))
    times = side_by_side([lambda k=kernels, w=which: linear_kernels(k, lambda: grpo_step(policy, rows, w))
                          for _, kernels, which, _ in cases], args.repeats)
    for (name, kernels, which, tokens), ms in zip(cases, times):
        path = "padded (reference, recomputes a shared prompt)" if kernels is None else "varlen (torch loop)"
        print(f"| {name} ({rows[which][0].shape[1]} in the row) | {path} | {tokens} | {ms:.0f} |")


def linear_kernels(kernels, fn):
    """fn() with the linear layers' path for packed rows forced: `VarlenKernels`, or None for the padded one."""
    with forced_kernels(kernels):
        return fn()


if __name__ == "__main__":
    main()
