"""Shared prompts in packed micro-batches: a GRPO group's prompt is computed once, and every
completion's logprobs and gradients are those of the sample packed whole."""

from __future__ import annotations

import pytest
import torch

from saccade.models.lm import load_policy_lm, set_full_finetune
from saccade.tools.parity import prepare
from saccade.trainer.forward import forward_logprobs
from saccade.trainer.packing import pack, prompt_groups
from saccade.trainer.samples import make_sample

TOLERANCE = 1e-5  # fp32, per-token logprob and gradient (relative to its largest entry)


def groups_of(cases, encoder, G: int = 3, completion: int = 5, seed: int = 0):
    """G samples per parity conversation: its tokens as the prompt, then G different completions."""
    gen = torch.Generator().manual_seed(seed)
    samples = []
    for c in cases:
        prompt_ids, types = c.inputs.input_ids, c.inputs.mm_token_type_ids
        for g in range(G):
            length = completion + g  # different completion lengths within a group
            ids = torch.cat([prompt_ids, torch.randint(10, 200, (length,), generator=gen)])
            loss = torch.cat([torch.zeros(len(prompt_ids), dtype=torch.bool), torch.ones(length, dtype=torch.bool)])
            samples.append(make_sample(
                f"{c.name}/{g}", ids, torch.cat([types, torch.zeros(length, dtype=torch.long)]),
                c.inputs.image_grid_thw, c.sample.image_keys, positions=encoder.positions, loss_mask=loss,
                advantage=float(g) - 1.0))
    return samples


@pytest.fixture()
def samples(processor, encoder, limits):
    return groups_of(prepare(processor, encoder, limits), encoder)


def _per_sample(model, micro_batches, ids):
    """Each sample's loss-token logprobs, by sample id."""
    out = {}
    for mb in micro_batches:
        logprobs, _ = forward_logprobs(model, mb, only_loss_tokens=True)
        for k, sid in enumerate(mb.sample_ids):
            lo, hi = int(mb.cu_seqlens[k]), int(mb.cu_seqlens[k + 1])
            out[sid] = logprobs[lo:hi][mb.loss_mask[lo:hi]]
    assert set(out) == set(ids)
    return out


def _pack(samples, encoder, policy, share, max_tokens=4096):
    return pack(samples, encoder.cache.get, max_tokens=max_tokens, image_token_id=policy.image_token_id,
                spatial_merge_size=encoder.merge, share_prompts=share)


def test_groups_share_their_prompt_once(samples, encoder, tiny_path):
    policy = load_policy_lm(tiny_path)
    whole, shared = _pack(samples, encoder, policy, False), _pack(samples, encoder, policy, True)
    n_whole = sum(mb.num_tokens for mb in whole)
    n_shared = sum(mb.num_tokens for mb in shared)
    prompts = sum(int(s.loss_mask.nonzero()[0]) for s in samples)
    assert n_shared == n_whole - prompts + prompts // 3  # each prompt of a group of 3 kept once
    assert sum(mb.num_sample_tokens for mb in shared) == n_whole
    # Images of a shared prompt are gathered once too.
    assert sum(len(mb.image_grid_thw) for mb in shared) * 3 == sum(len(mb.image_grid_thw) for mb in whole)


def test_shared_prompts_give_the_same_logprobs_and_gradients(samples, encoder, tiny_path):
    ids = [s.sample_id for s in samples]
    results = {}
    for share in (False, True):
        model = set_full_finetune(load_policy_lm(tiny_path))
        micro_batches = _pack(samples, encoder, model, share)
        logprobs = _per_sample(model, micro_batches, ids)
        loss = sum((lp * float(i % 3 - 1)).sum() for i, lp in enumerate(logprobs[k] for k in ids))
        loss.backward()
        results[share] = (logprobs, {n: p.grad.clone() for n, p in model.named_parameters()})
    (whole, whole_grads), (shared, shared_grads) = results[False], results[True]
    assert max(float((whole[k] - shared[k]).detach().abs().max()) for k in ids) <= TOLERANCE
    for name, grad in whole_grads.items():
        assert (shared_grads[name] - grad).abs().max() <= TOLERANCE * grad.abs().max() + 1e-12, name


def test_a_group_larger_than_a_micro_batch_repeats_its_prompt(samples, encoder, tiny_path):
    policy = load_policy_lm(tiny_path).eval()
    longest = max(s.num_tokens for s in samples)
    # Room for the prompt and about two completions: groups split, each part with its own prompt copy.
    micro_batches = _pack(samples, encoder, policy, True, max_tokens=longest + 7)
    assert all(mb.num_tokens <= longest + 7 for mb in micro_batches)
    ids = [s.sample_id for s in samples]
    whole = _per_sample(policy, _pack(samples, encoder, policy, False), ids)
    shared = _per_sample(policy, micro_batches, ids)
    assert max(float((whole[k] - shared[k]).detach().abs().max()) for k in ids) <= TOLERANCE


def test_samples_without_a_common_prompt_are_not_grouped(samples, encoder):
    image_token_id = 0  # no sample has it: only the ids decide
    distinct = [samples[0], samples[3]]  # different conversations
    assert prompt_groups(distinct, 4096, image_token_id=image_token_id, spatial_merge_size=encoder.merge) == [[0], [1]]
    same = samples[:3]
    assert prompt_groups(same, 4096, image_token_id=image_token_id, spatial_merge_size=encoder.merge) == [[0, 1, 2]]


def test_shared_prompts_need_packed_sdpa(samples, encoder, tiny_path):
    policy = load_policy_lm(tiny_path, attn_implementation="sdpa")
    mb = _pack(samples, encoder, policy, True)[0]
    with pytest.raises(ValueError, match="packed_sdpa"):
        forward_logprobs(policy, mb)
