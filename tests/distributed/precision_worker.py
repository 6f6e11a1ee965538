"""One forward and backward of the tiny model with LoRA in a given dtype, alone or as one rank
under torchrun, for tests/distributed/test_mixed_precision.py.

    python tests/distributed/precision_worker.py OUT [--dtype bfloat16] [--cast-adapters] [--preset P] [--repeat N]
    python -m torch.distributed.run --nproc-per-node 2 tests/distributed/precision_worker.py OUT ...

The model is loaded and sharded as `saccade.run.setup.build_setup` does (`weights_dtype`, then
`shard_model` under torchrun), with LoRA rank 8 whose B matrices are drawn at random (peft
starts them at 0, and an adapter that adds 0 computes the same in any dtype). Six text samples
are packed into micro-batches of 64 tokens and spread over the ranks as `saccade.loops.rl` spreads
them (`balance`, padding micro-batches). Each rank runs its micro-batches through the trainer's
forward (`forward_logprobs`) and backward of a policy-gradient surrogate over the step-global
loss-token count, so the sharded gradient is the single process's up to reduction order.

Rank 0 writes OUT (torch.save): `logprobs` (per planned micro-batch), `loss` (summed over the
ranks), `grads` (every trainable parameter's gradient, whole, float32, by name) and `dtypes`
(the weight dtypes the LoRA and base linears computed with during the forward); and, for
timing the layouts against each other, `step_s` (the median wall time of the forward and
backward over this rank's micro-batches, of --repeat runs after one warm-up; rank 0's) and
`param_bytes` (each rank's parameter shards); `collectives`: FSDP's all-gathers and
reduce-scatters in one forward and backward over rank 0's micro-batches.

--cast-adapters: the layout before issue 28 (the LoRA base loaded in float32, and FSDP's
`param_dtype` set to the compute dtype for every group, adapters included): the negative
control.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time

import torch

MAX_TOKENS = 64
LENGTHS = (40, 33, 29, 21, 17, 12)  # six samples, several micro-batches of 64
LORA_B_STD = 0.02


def micro_batches(vocab: int, world) -> tuple[list[int], list, int]:
    """This rank's planned micro-batch indices, its micro-batches (padding after them) and the
    step-global number of loss tokens."""
    from saccade.distributed import balance
    from saccade.trainer.packing import collate_segments, pack_plan, padding_micro_batch, planned_tokens
    from saccade.models.families import family_of
    from saccade.trainer.samples import make_sample

    positions = family_of({"model_type": "qwen3_vl"}).positions(2)  # text only: 0..L-1 on every row
    gen = torch.Generator().manual_seed(0)
    samples = []
    for i, n in enumerate(LENGTHS):
        mask = torch.zeros(n, dtype=torch.bool)
        mask[n // 2:] = True  # the second half is the "completion"
        samples.append(make_sample(
            f"s{i}", torch.randint(10, vocab, (n,), generator=gen), torch.zeros(n, dtype=torch.long), None, [],
            positions=positions, loss_mask=mask, inference_logprobs=torch.zeros(n), advantage=(-1.0) ** i))
    plan = pack_plan(samples, max_tokens=MAX_TOKENS, image_token_id=-1, spatial_merge_size=2)
    assignment = balance([planned_tokens(p) for p in plan], world.size)
    mine = assignment[world.rank]
    batches = [collate_segments(plan[i], lambda key: None, image_token_id=-1, spatial_merge_size=2) for i in mine]
    batches += [padding_micro_batch()] * (max(map(len, assignment)) - len(mine))
    loss_tokens = sum(int(s.loss_mask[1:].sum()) for s in samples)  # a sample's first token has no logprob
    return mine, batches, loss_tokens


def randomize_lora_b(model) -> int:
    """LoRA's B matrices drawn from N(0, LORA_B_STD^2), by parameter name: the same on every run."""
    gen = torch.Generator().manual_seed(1)
    named = sorted((n, p) for n, p in model.named_parameters() if "lora_B" in n)
    with torch.no_grad():
        for _, p in named:
            p.copy_(torch.randn(p.shape, generator=gen) * LORA_B_STD)
    return len(named)


def record_dtypes(model) -> dict[str, set[str]]:
    """Forward pre-hooks noting the weight dtype each LoRA A/B and base linear computes with."""
    seen: dict[str, set[str]] = {"lora": set(), "base": set()}

    def hook(kind):
        def note(module, args):
            seen[kind].add(str(module.weight.dtype).removeprefix("torch."))
        return note

    for name, module in model.named_modules():
        if name.endswith(("lora_A.default", "lora_B.default")):
            module.register_forward_pre_hook(hook("lora"))
        elif name.endswith("base_layer"):
            module.register_forward_pre_hook(hook("base"))
    return seen


def count_collectives() -> dict[str, int]:
    """Counts FSDP2's grouped all-gathers and reduce-scatters (torch 2.13's private module: a
    test's probe, nothing relies on it)."""
    from torch.distributed.fsdp._fully_shard import _fsdp_param_group as group

    counts = {"all_gather": 0, "reduce_scatter": 0}

    def counting(fn, key):
        def call(*args, **kwargs):
            counts[key] += 1
            return fn(*args, **kwargs)
        return call

    group.foreach_all_gather = counting(group.foreach_all_gather, "all_gather")
    group.foreach_reduce = counting(group.foreach_reduce, "reduce_scatter")
    return counts


def old_policy(model, compute_dtype):
    """The mixed precision before issue 28: every group cast to the compute dtype."""
    from torch.distributed.fsdp import MixedPrecisionPolicy

    return MixedPrecisionPolicy(param_dtype=compute_dtype, reduce_dtype=torch.float32)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("out")
    parser.add_argument("--dtype", default="bfloat16")
    parser.add_argument("--cast-adapters", action="store_true", help="the pre-fix layout (negative control)")
    parser.add_argument("--preset", default="tiny", help="saccade.models.presets preset")
    parser.add_argument("--repeat", type=int, default=1, help="timed forward+backward runs (after a warm-up if > 1)")
    args = parser.parse_args()

    import saccade.trainer.sharding as sharding
    from saccade.config import LoraConfig
    from saccade.distributed import (
        all_gather, all_reduce_sum, barrier, close_world, exit_rank, init_world,
    )
    from saccade.models.lm import apply_lora, load_policy_lm
    from saccade.models.presets import preset_path
    from saccade.run.setup import weights_dtype
    from saccade.trainer.forward import forward_logprobs
    from saccade.trainer.sharding import shard_model

    torch.set_num_threads(1)
    # Built (on first use) before the process group exists: transformers' save_pretrained writes
    # only on rank 0 of an initialised group, so a rank > 0 would publish a folder without weights.
    path = preset_path(args.preset, seed=0)
    world = init_world("cpu", timeout_s=300)
    dtype = getattr(torch, args.dtype)
    load = weights_dtype(dtype, sharded=world.sharded, lora=True)
    if args.cast_adapters:
        assert world.sharded, "--cast-adapters reproduces a sharded layout: run it under torchrun"
        load, sharding.mixed_precision = torch.float32, old_policy
    policy = load_policy_lm(path, dtype=load)
    torch.manual_seed(0)  # LoRA's A matrices: the same draw in every run (init_world may use the generator)
    model = apply_lora(policy, LoraConfig(rank=8))
    assert randomize_lora_b(model) > 0
    if world.sharded:
        shard_model(model, world, device=torch.device("cpu"), compute_dtype=dtype)
    seen = record_dtypes(model)
    counts = count_collectives()

    mine, batches, loss_tokens = micro_batches(300, world)  # ids below Qwen's special and vision tokens
    times = []
    for _ in range(args.repeat + (args.repeat > 1)):  # the first of several is a warm-up
        model.zero_grad(set_to_none=True)
        barrier(world)
        counts.update(all_gather=0, reduce_scatter=0)
        start = time.perf_counter()
        logprobs, loss_sum = {}, 0.0
        for index, mb in zip(mine + [None] * len(batches), batches):
            logprobs_N, _ = forward_logprobs(model, mb, only_loss_tokens=True)
            loss = -(logprobs_N * mb.advantages * mb.loss_mask).sum() / loss_tokens
            loss.backward()
            loss_sum += float(loss.detach())
            if index is not None:
                logprobs[index] = logprobs_N.detach()[mb.loss_mask].clone()
        times.append(time.perf_counter() - start)
    step_s = statistics.median(times[1:] if len(times) > 1 else times)
    loss_sum = all_reduce_sum([loss_sum], world, torch.device("cpu"))[0]
    grads = {}
    for name, p in sorted(model.named_parameters()):
        if p.requires_grad:
            g = p.grad.full_tensor() if hasattr(p.grad, "full_tensor") else p.grad  # a collective when sharded
            grads[name] = g.float().clone()
    local = [p.to_local() if hasattr(p, "to_local") else p for p in model.parameters()]
    param_bytes = sum(t.numel() * t.element_size() for t in local)
    gathered = all_gather({"logprobs": logprobs, "dtypes": seen, "param_bytes": param_bytes}, world)
    if world.is_main:
        torch.save({
            "logprobs": {k: v for g in gathered for k, v in g["logprobs"].items()},
            "loss": loss_sum, "grads": grads,
            "dtypes": {k: sorted(set().union(*(g["dtypes"][k] for g in gathered))) for k in seen},
            "world_size": world.size, "sharded": world.sharded, "step_s": step_s,
            "param_bytes": [g["param_bytes"] for g in gathered], "collectives": dict(counts),
        }, args.out)
    close_world(world)
    if world.sharded:
        exit_rank(0)  # as `saccade rl` does under torchrun: no gloo abort in the interpreter's teardown


if __name__ == "__main__":
    sys.exit(main())
