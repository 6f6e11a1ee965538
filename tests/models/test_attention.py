"""packed_sdpa: attention over packed rows that skips the masked blocks, and is the default."""

from __future__ import annotations

import pytest
import torch

from saccade.config import RunConfig
from saccade.models import attention
from saccade.models.attention import NO_MASK, PACKED_SDPA, PackedLayout, length_buckets, resolve_attention
from saccade.models.lm import load_policy_lm, set_full_finetune
from saccade.tools.parity import full_model_logprobs, lm_logprobs, max_abs, prepare
from saccade.trainer.forward import forward_logprobs
from saccade.trainer.packing import collate

TOLERANCE = 1e-5  # fp32, per-token logprob, max |Δ| (measured 4.8e-7 against per-sample, 9.5e-7 against the full model)
GRAD_TOLERANCE = 1e-5  # fp32, relative to the gradient's largest entry


@pytest.fixture()
def cases(processor, encoder, limits):
    return prepare(processor, encoder, limits)


def test_layout_round_trips_every_token_through_length_buckets():
    cu = torch.tensor([0, 3, 4, 9, 11, 31], dtype=torch.int32)  # lengths 3, 1, 5, 2, 20
    row = torch.arange(31) * 10
    layout = PackedLayout.from_cu_seqlens(cu)
    # 20 alone (5 is not over half of it); then 5 and 3 (over 2.5); then 2; then 1.
    assert layout.shapes == [(1, 20), (2, 5), (1, 2), (1, 1)]
    padded = [row[g].view(S, L) for g, (S, L) in zip(layout.gathers, layout.shapes)]
    assert padded[1][0].tolist() == [40, 50, 60, 70, 80]
    # Pads repeat the sample's last token and sit after it: causal attention never reaches them.
    assert padded[1][1].tolist() == [0, 10, 20, 20, 20]
    flat = torch.cat([p.flatten() for p in padded])
    assert torch.equal(flat[layout.scatter_N], row)


def test_length_buckets_keep_padding_under_a_factor_of_two():
    lengths = [300, 300, 60, 61, 64, 140, 151, 48]
    buckets = length_buckets(lengths)
    assert sorted(i for b in buckets for i in b) == list(range(len(lengths)))
    for bucket in buckets:
        assert all(2 * lengths[i] > max(lengths[j] for j in bucket) for i in bucket)
    assert length_buckets([48] * 64) == [list(range(64))]  # a GRPO micro-batch of equal lengths: one batch


def test_packed_sdpa_matches_per_sample_and_the_full_model(tiny_path, cases, full_model, encoder):
    policy = load_policy_lm(tiny_path, attn_implementation=PACKED_SDPA).eval()
    assert {c.sample.num_images for c in cases} >= {0, 1, 3}
    common = dict(image_token_id=policy.image_token_id, merge=encoder.merge)
    packed = lm_logprobs(policy, cases, encoder, packed=True, **common)
    single = lm_logprobs(policy, cases, encoder, packed=False, **common)
    reference = [full_model_logprobs(full_model, c.inputs) for c in cases]
    assert max_abs(packed, single) <= TOLERANCE
    assert max_abs(packed, reference) <= TOLERANCE


def _packed_gradients(tiny_path, cases, encoder, implementation):
    policy = set_full_finetune(load_policy_lm(tiny_path, attn_implementation=implementation))
    mb = collate([c.sample for c in cases], encoder.cache.get, image_token_id=policy.image_token_id,
                 spatial_merge_size=encoder.merge)
    logprobs, _ = forward_logprobs(policy, mb)
    logprobs.sum().backward()  # every token (these conversations have no loss tokens)
    return logprobs.detach(), {n: p.grad for n, p in policy.named_parameters()}


def test_packed_sdpa_gradients_equal_the_masked_path(tiny_path, cases, encoder):
    """Backward through the gather and the per-sample causal attention gives the block-mask
    path's gradients: nothing flows through the pads."""
    ours, ours_grads = _packed_gradients(tiny_path, cases, encoder, PACKED_SDPA)
    masked, masked_grads = _packed_gradients(tiny_path, cases, encoder, "sdpa")
    assert (ours - masked).abs().max() <= TOLERANCE
    for name, grad in masked_grads.items():
        scale = grad.abs().max()
        assert (ours_grads[name] - grad).abs().max() <= GRAD_TOLERANCE * scale + 1e-12, name
    assert sum(g.abs().sum() for g in masked_grads.values()) > 0


def test_a_missing_boundary_leaks_across_samples(tiny_path, cases, encoder):
    """The guard behind packed_sdpa: the boundaries. Merging two samples into one lets the second
    attend to the first, moving its logprobs far beyond tolerance; the first is unchanged."""
    policy = load_policy_lm(tiny_path, attn_implementation=PACKED_SDPA).eval()
    mb = collate([c.sample for c in cases], encoder.cache.get, image_token_id=policy.image_token_id,
                 spatial_merge_size=encoder.merge)
    with torch.no_grad():
        good, _ = forward_logprobs(policy, mb)
        mb.cu_seqlens = torch.cat([mb.cu_seqlens[:1], mb.cu_seqlens[2:]])  # samples 0 and 1 as one
        leaky, _ = forward_logprobs(policy, mb)
    lengths = (mb.cu_seqlens[1:] - mb.cu_seqlens[:-1]).tolist()
    first_len = int(collate([cases[0].sample], encoder.cache.get, image_token_id=policy.image_token_id,
                            spatial_merge_size=encoder.merge).num_tokens)
    assert lengths[0] > first_len  # the merged sample really spans two
    assert (good[:first_len] - leaky[:first_len]).abs().max() <= TOLERANCE  # attends to the same tokens
    assert (good - leaky).abs().max() > 1e-2


def test_packed_sdpa_is_the_default_and_runs_without_a_mask(tiny_path, cases, encoder, monkeypatch):
    """The default config and load_policy_lm pick packed_sdpa, and a packed forward reaches it
    with the sample boundaries and no (N x N) mask built by transformers."""
    assert RunConfig().model.attn_implementation == "auto"
    assert resolve_attention("auto", "cpu") == PACKED_SDPA == resolve_attention("auto", "cuda")
    policy = load_policy_lm(tiny_path).eval()
    assert policy.config.text_config._attn_implementation == PACKED_SDPA
    calls = []
    real = attention.packed_sdpa_attention

    def spy(module, query, key, value, attention_mask, **kwargs):
        calls.append((attention_mask, kwargs.get("packed_layout")))
        return real(module, query, key, value, attention_mask, **kwargs)

    from transformers import AttentionInterface

    monkeypatch.setitem(AttentionInterface._global_mapping, PACKED_SDPA, spy)
    mb = collate([c.sample for c in cases], encoder.cache.get, image_token_id=policy.image_token_id,
                 spatial_merge_size=encoder.merge)
    with torch.no_grad():
        forward_logprobs(policy, mb)
    assert len(calls) == policy.config.text_config.num_hidden_layers
    assert all(mask is NO_MASK or mask.numel() == 0 for mask, _ in calls)
    layouts = [layout for _, layout in calls]
    assert layouts[0] is not None and all(layout is layouts[0] for layout in layouts)  # built once per forward
    assert sum(S for S, _ in layouts[0].shapes) == mb.num_samples


def test_unknown_attention_is_refused():
    with pytest.raises(ValueError, match="packed_sdpa"):
        resolve_attention("flex", "cpu")
