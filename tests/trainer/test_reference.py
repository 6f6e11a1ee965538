"""The KL term's reference for full fine-tuning (`saccade.trainer.reference`): a frozen copy of
the policy's weights, scoring the distribution the policy scores, on the policy's micro-batches
(image embeddings from the cache included). At the start it is the policy, token for token, so
the KL is exactly 0; as the policy trains the KL rises, and the copy never moves."""

from __future__ import annotations

import pytest
import torch

from saccade.config import LoraConfig, PpoClipLossConfig, ReinforceLossConfig
from saccade.models.lm import apply_lora, ban_bias, load_policy_lm, set_full_finetune, unwrap_policy
from saccade.models.sampling import SampledDistribution
from saccade.trainer.forward import forward_logprobs
from saccade.trainer.reference import adapter_free_reference, frozen_copy, frozen_reference
from saccade.trainer.step import build_optimizer, optimized_params, train_step

# What the engine sampled from: the reference must score the same truncated, banned distribution.
DISTRIBUTION = SampledDistribution(temperature=0.8, top_k=50, top_p=0.95)
BANNED = [5, 6]
DTYPES = [torch.float32, torch.bfloat16]


@pytest.fixture()
def micro_batches(processor, encoder, limits, tiny_path):
    """Three parity conversations (one image, three images, text only) as prompts, each with a
    5-token completion (advantages +1, -1, +1), one micro-batch each, the image embeddings read
    from the encoder's cache."""
    from saccade.tools.parity import prepare
    from saccade.trainer.packing import pack
    from saccade.trainer.samples import make_sample

    gen = torch.Generator().manual_seed(7)
    cases = {c.name: c for c in prepare(processor, encoder, limits)}
    samples = []
    for name, advantage in (("one_image", 1.0), ("several_images", -1.0), ("text_only", 1.0)):
        case = cases[name]
        prompt, types = case.inputs.input_ids, case.inputs.mm_token_type_ids
        ids = torch.cat([prompt, torch.randint(10, 200, (5,), generator=gen)])
        loss_mask = torch.cat([torch.zeros(len(prompt), dtype=torch.bool), torch.ones(5, dtype=torch.bool)])
        samples.append(make_sample(
            name, ids, torch.cat([types, torch.zeros(5, dtype=torch.long)]), case.inputs.image_grid_thw,
            case.sample.image_keys, positions=encoder.positions, loss_mask=loss_mask,
            inference_logprobs=torch.where(loss_mask, -3.0, 0.0), advantage=advantage))
    image_token_id = load_policy_lm(tiny_path).image_token_id
    out = pack(samples, encoder.cache.get, max_tokens=64, image_token_id=image_token_id,
               spatial_merge_size=encoder.merge)
    assert len(out) == 3 and sum(mb.image_embeds is not None for mb in out) == 2
    return out


def _full(tiny_path, dtype):
    return set_full_finetune(load_policy_lm(tiny_path, dtype=dtype))


def _policy_logprobs(model, mb):
    bias_V = ban_bias(unwrap_policy(model).lm_head, BANNED)
    with torch.no_grad():
        return forward_logprobs(model, mb, distribution=DISTRIBUTION, only_loss_tokens=True, ban_bias_V=bias_V)[0]


@pytest.mark.parametrize("dtype", DTYPES, ids=["float32", "bfloat16"])
def test_the_copy_is_frozen_and_scores_exactly_as_the_policy_at_the_start(tiny_path, micro_batches, dtype):
    model = _full(tiny_path, dtype)
    copy = frozen_copy(model, str(tiny_path), compute_dtype=dtype)
    assert not copy.training and not any(p.requires_grad for p in copy.parameters())
    assert all(p.dtype == dtype for p in copy.parameters())
    policy_params = dict(model.named_parameters())
    assert dict(copy.named_parameters()).keys() == policy_params.keys()
    for name, param in copy.named_parameters():
        assert torch.equal(param, policy_params[name]), name
        assert param.data_ptr() != policy_params[name].data_ptr(), name  # a copy, not the policy's tensors
    reference = frozen_reference(copy, distribution=DISTRIBUTION, banned_token_ids=BANNED)
    for mb in micro_batches:
        assert torch.equal(reference(mb), _policy_logprobs(model, mb))  # token for token: the KL is exactly 0


def test_the_copy_holds_the_policys_current_weights_not_the_checkpoints(tiny_path):
    """A policy trained in this process first (the demos' SFT warm start) is what the copy holds:
    its weights, not those at model.path."""
    model = _full(tiny_path, torch.float32)
    with torch.no_grad():
        unwrap_policy(model).language_model.norm.weight.mul_(1.5)
    copy = frozen_copy(model, str(tiny_path), compute_dtype=torch.float32)
    assert torch.equal(copy.language_model.norm.weight, unwrap_policy(model).language_model.norm.weight)
    assert not torch.equal(copy.language_model.norm.weight, load_policy_lm(tiny_path).language_model.norm.weight)


@pytest.mark.slow
@pytest.mark.parametrize("dtype", DTYPES, ids=["float32", "bfloat16"])
def test_full_finetuning_kl_is_0_at_step_1_then_rises_and_the_reference_never_moves(tiny_path, micro_batches, dtype):
    """Four train steps on the same micro-batches with the KL term on: the `kl` metric is 0 at step
    1 (the policy is the reference), then rises step by step as the policy moves away; the copy's
    weights are bit for bit what they were, and no optimizer holds them."""
    torch.manual_seed(0)
    model = _full(tiny_path, dtype)
    optimizer, scheduler = build_optimizer(model, lr=1e-3, weight_decay=0.0, schedule=lambda s: 1.0)
    copy = frozen_copy(model, str(tiny_path), compute_dtype=dtype)
    start = {n: p.detach().clone() for n, p in copy.named_parameters()}
    reference = frozen_reference(copy, distribution=DISTRIBUTION, banned_token_ids=BANNED)
    loss = ReinforceLossConfig(kl_coef=0.05)
    kls = []
    for _ in range(4):
        metrics = train_step(model, optimizer, scheduler, micro_batches, loss=loss, num_iterations=1, grad_clip=1.0,
                             distribution=DISTRIBUTION, banned_token_ids=BANNED, reference=reference)
        assert metrics["skipped_steps"] == 0
        kls.append(metrics["kl"])
    print(f"{dtype} kl by step:", kls)
    assert kls[0] == 0.0
    assert all(a < b for a, b in zip(kls, kls[1:])), kls
    assert all(torch.equal(p, start[n]) for n, p in copy.named_parameters())
    assert not any(p.requires_grad or p.grad is not None for p in copy.parameters())
    held = {id(t) for t in optimized_params(optimizer)} | {id(t) for t in optimizer.state}
    assert not held & {id(p) for p in copy.parameters()}
    moved = [n for n, p in model.named_parameters() if not torch.equal(p.detach(), start[n])]
    assert len(moved) > 10  # the policy trained


def test_each_model_kind_gets_its_own_reference(tiny_path):
    """LoRA keeps the adapters-off reference (no copy); a full model has no adapters to switch off;
    a copy of a LoRA model is refused; the KL term without a reference is refused."""
    lora = apply_lora(load_policy_lm(tiny_path), LoraConfig(rank=4))
    with pytest.raises(ValueError, match="adapter_free_reference"):
        frozen_copy(lora, str(tiny_path), compute_dtype=torch.float32)
    assert callable(adapter_free_reference(lora, distribution=DISTRIBUTION, banned_token_ids=BANNED))
    full = _full(tiny_path, torch.float32)
    with pytest.raises(ValueError, match="frozen copy"):
        adapter_free_reference(full, distribution=DISTRIBUTION, banned_token_ids=BANNED)
    optimizer, scheduler = build_optimizer(full, lr=1e-3, weight_decay=0.0, schedule=lambda s: 1.0)
    with pytest.raises(ValueError, match="needs a reference policy"):
        train_step(full, optimizer, scheduler, [], loss=PpoClipLossConfig(kl_coef=0.1), num_iterations=1, grad_clip=1.0,
                   distribution=DISTRIBUTION, banned_token_ids=[])
