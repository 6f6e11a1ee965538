"""The LM-only forward on cached image embeddings reproduces the full Qwen3-VL (fp32)."""

from __future__ import annotations

import pytest
import torch

from saccade.config import LoraConfig
from saccade.models.lm import apply_lora, assert_no_vision_tower, load_policy_lm, set_full_finetune
from saccade.tools.parity import full_model_logprobs, lm_logprobs, max_abs, parity_conversations, prepare
from saccade.trainer.forward import forward_logprobs
from saccade.trainer.packing import collate

TOLERANCE = 1e-5  # fp32, per-token logprob, max |Δ|
# A real mistake moves the logprobs by orders of magnitude more than float noise.
MISTAKE_FLOOR = 1e-2


@pytest.fixture()
def cases(processor, encoder, limits):
    return prepare(processor, encoder, limits)


def _case(cases, name):
    return [c for c in cases if c.name == name]


@pytest.mark.parametrize("name", list(parity_conversations()))
def test_lm_only_matches_full_model(name, cases, full_model, policy, encoder):
    chosen = _case(cases, name)
    reference = [full_model_logprobs(full_model, c.inputs) for c in chosen]
    ours = lm_logprobs(policy, chosen, encoder, image_token_id=policy.image_token_id, merge=encoder.merge, packed=False)
    assert ours[0].shape == reference[0].shape
    assert max_abs(ours, reference) <= TOLERANCE
    # Not vacuous: the logprobs are real, varied numbers.
    assert reference[0][1:].std() > 0.01


def test_packed_matches_per_sample_on_a_mixed_micro_batch(cases, full_model, policy, encoder):
    assert {c.sample.num_images for c in cases} >= {0, 1, 3}
    common = dict(image_token_id=policy.image_token_id, merge=encoder.merge)
    single = lm_logprobs(policy, cases, encoder, packed=False, **common)
    packed = lm_logprobs(policy, cases, encoder, packed=True, **common)
    assert max_abs(packed, single) <= TOLERANCE
    reference = [full_model_logprobs(full_model, c.inputs) for c in cases]
    assert max_abs(packed, reference) <= TOLERANCE


@pytest.mark.parametrize("mistake", ["drop_deepstack", "positions_1d"])
def test_classic_mistakes_are_caught(mistake, cases, full_model, policy, encoder):
    """Dropping DeepStack, or 1-D positions in place of M-RoPE, moves logprobs far past tolerance."""
    with_images = [c for c in cases if c.sample.num_images]
    reference = [full_model_logprobs(full_model, c.inputs) for c in with_images]
    common = dict(image_token_id=policy.image_token_id, merge=encoder.merge)
    broken = lm_logprobs(policy, with_images, encoder, packed=False, **{mistake: True}, **common)
    assert max_abs(broken, reference) > MISTAKE_FLOOR


def test_packing_without_restarting_positions_leaks_across_samples(tiny_path, cases, encoder):
    """The guard behind packing under transformers' sdpa: if the text row did not restart,
    samples would see each other (packed_sdpa's guard, the boundaries, is in test_attention)."""
    policy = load_policy_lm(tiny_path, attn_implementation="sdpa").eval()
    mb = collate([c.sample for c in cases], encoder.cache.get, image_token_id=policy.image_token_id,
                 spatial_merge_size=encoder.merge)
    with torch.no_grad():
        good, _ = forward_logprobs(policy, mb)
        mb.position_ids[0, 0] = torch.arange(mb.num_tokens)  # one running text row: no sample boundaries
        leaky, _ = forward_logprobs(policy, mb)
    first = mb.sample_slices()[0]
    assert torch.equal(good[first], leaky[first])  # the first sample sees nothing before it either way
    assert (good - leaky).abs().max() > MISTAKE_FLOOR


def test_trainer_model_holds_no_vision_tower(policy):
    assert_no_vision_tower(policy)
    names = [n for n, _ in policy.named_parameters()]
    assert not any("visual" in n for n in names)
    assert any(n.startswith("model.language_model.layers.0.self_attn.q_proj") for n in names)
    with pytest.raises(AssertionError, match="vision tower"):
        assert_no_vision_tower(torch.nn.ModuleDict({"visual": torch.nn.Linear(2, 2)}))


def test_image_token_count_mismatch_is_an_error(policy):
    ids = torch.tensor([[1, policy.image_token_id, policy.image_token_id, 2]])
    pos = torch.arange(4).expand(4, 1, 4)
    with pytest.raises(ValueError, match="2 image-pad tokens but 3"):
        policy.hidden_states(ids, pos, torch.zeros(3, policy.config.text_config.hidden_size))


def _loss(model, mb):
    logprobs, _ = forward_logprobs(model, mb, only_loss_tokens=True)
    return -(logprobs * mb.loss_mask).sum() / mb.loss_mask.sum()


def _training_batch(cases, encoder, policy):
    samples = [c.sample for c in cases]
    for s in samples:  # train on the last 5 tokens of each conversation
        s.loss_mask[:] = False
        s.loss_mask[-5:] = True
    return collate(samples, encoder.cache.get, image_token_id=policy.image_token_id, spatial_merge_size=encoder.merge)


def test_lora_gradients_reach_only_lora_and_a_step_changes_them(tiny_path, cases, encoder):
    model = apply_lora(load_policy_lm(tiny_path), LoraConfig(rank=4, alpha=8))
    trainable = {n for n, p in model.named_parameters() if p.requires_grad}
    assert trainable and all("lora_" in n for n in trainable)
    assert all(".language_model." in n for n in trainable)
    # peft initialises lora_B to zero; a step must move the adapters off it.
    before = {n: p.detach().clone() for n, p in model.named_parameters() if p.requires_grad}
    mb = _training_batch(cases, encoder, model.base_model.model)
    loss = _loss(model, mb)
    assert torch.isfinite(loss)
    loss.backward()
    for n, p in model.named_parameters():
        if p.requires_grad:
            assert p.grad is not None, n
        else:
            assert p.grad is None, n
    assert any(p.grad.abs().sum() > 0 for n, p in model.named_parameters() if "lora_A" in n or "lora_B" in n)
    opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-3)
    opt.step()
    changed = [n for n, p in model.named_parameters() if p.requires_grad and not torch.equal(p, before[n])]
    assert any("lora_B" in n for n in changed)
    with torch.no_grad():
        assert torch.isfinite(_loss(model, mb))


def test_lora_targets_are_configurable(tiny_path):
    model = apply_lora(load_policy_lm(tiny_path), LoraConfig(rank=2, target_modules=["q_proj", "v_proj"]))
    trainable = [n for n, p in model.named_parameters() if p.requires_grad]
    assert trainable and all(("q_proj" in n or "v_proj" in n) for n in trainable)


def test_full_finetune_trains_every_lm_parameter(tiny_path, cases, encoder):
    model = set_full_finetune(load_policy_lm(tiny_path))
    mb = _training_batch(cases, encoder, model)
    loss = _loss(model, mb)
    loss.backward()
    assert torch.isfinite(loss)
    grads = {n: p.grad for n, p in model.named_parameters()}
    assert all(g is not None for g in grads.values())
    assert grads["model.language_model.layers.0.mlp.down_proj.weight"].abs().sum() > 0


@pytest.mark.parametrize("lora", [False, True])
def test_activation_checkpointing_gives_the_same_gradients(tiny_path, cases, encoder, lora):
    """Per-layer recomputation changes memory, not the gradients (fp32: within 1e-6; in fact
    bit for bit on this CPU). Images with DeepStack are in the batch."""

    def gradients(checkpointing: bool) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        torch.manual_seed(0)  # the same LoRA initialisation both times
        policy = load_policy_lm(tiny_path)
        if checkpointing:
            policy.enable_activation_checkpointing()
        model = apply_lora(policy, LoraConfig(rank=4, alpha=8)) if lora else set_full_finetune(policy)
        if lora:  # lora_B starts at 0: move it so that lora_A gets a gradient too
            with torch.no_grad():
                for n, p in model.named_parameters():
                    if "lora_B" in n:
                        p.normal_(0, 0.02)
        model.train()
        mb = _training_batch(cases, encoder, policy)
        loss = _loss(model, mb)
        loss.backward()
        return loss.detach(), {n: p.grad for n, p in model.named_parameters() if p.requires_grad}

    plain_loss, plain = gradients(False)
    checkpointed_loss, checkpointed = gradients(True)
    assert mb_has_images(cases)
    assert torch.equal(plain_loss, checkpointed_loss)
    assert plain.keys() == checkpointed.keys() and len(plain) > 10
    worst = max(float((plain[n] - checkpointed[n]).abs().max()) for n in plain)
    assert worst <= 1e-6, worst
    assert all(plain[n].abs().sum() > 0 for n in plain if "layers.0." in n)  # not vacuous


def test_activation_checkpointing_recomputes_in_backward(tiny_path, cases, encoder):
    """It is really on: fewer tensors are kept for backward, and each layer runs twice."""
    from torch.autograd.graph import saved_tensors_hooks

    def kept_bytes_and_layer_calls(checkpointing: bool) -> tuple[int, int]:
        policy = load_policy_lm(tiny_path)
        if checkpointing:
            policy.enable_activation_checkpointing()
        model = set_full_finetune(policy).train()
        calls = []
        # A pre-hook: the recomputation stops early (torch's checkpoint early stop), before any post-hook.
        policy.language_model.layers[0].register_forward_pre_hook(lambda *_: calls.append(1))
        kept = []
        with saved_tensors_hooks(lambda t: kept.append(t.numel() * t.element_size()) or t, lambda t: t):
            loss = _loss(model, _training_batch(cases, encoder, policy))
        loss.backward()
        return sum(kept), len(calls)

    plain_bytes, plain_calls = kept_bytes_and_layer_calls(False)
    ckpt_bytes, ckpt_calls = kept_bytes_and_layer_calls(True)
    assert (plain_calls, ckpt_calls) == (1, 2)
    assert ckpt_bytes < plain_bytes / 2


def mb_has_images(cases) -> bool:
    return any(c.sample.num_images for c in cases)


def test_lora_on_a_bf16_base_keeps_float32_adapters(tiny_path):
    model = apply_lora(load_policy_lm(tiny_path, dtype=torch.bfloat16), LoraConfig(rank=4))
    dtypes = {("lora_" in n, p.dtype) for n, p in model.named_parameters()}
    assert dtypes == {(True, torch.float32), (False, torch.bfloat16)}
