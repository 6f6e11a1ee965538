"""The memory estimator: activation bytes equal what autograd saves for backward, and the arithmetic
behaves (monotone, LoRA below full, a hand case). The dimensions it counts: tests/test_memory_dims.py."""

from __future__ import annotations

import re
import shlex
from pathlib import Path

import pytest
import torch

from saccade.tools.memory import GiB, activation_bytes_per_token, server_memory, trainer_memory
from saccade.tools.memory_dims import LINEARS, ModelDims, TextDims, VisionDims, model_dims

# Qwen3-VL's published sizes (their config.json: saccade.models.presets' hub configs).
QWEN3_VL = {hub_id: model_dims(hub_id) for hub_id in
            ("Qwen/Qwen3-VL-2B-Instruct", "Qwen/Qwen3-VL-4B-Instruct", "Qwen/Qwen3-VL-8B-Instruct")}


@pytest.fixture(scope="module")
def tiny_dims(tiny_path):
    return model_dims(tiny_path)


def saved_activation_bytes(tiny_path, dtype, lora: bool, n_tokens: int, n_image_tokens: int = 0,
                           with_loss: bool = False, checkpointing: bool = False):
    """Bytes of every tensor autograd saves for backward in the trainer's forward (the model's
    parameters excluded), each storage counted once: the activation memory of one micro-batch.
    `with_loss` includes the policy loss (PPO clip with TIS) on top of the logprobs.
    With `checkpointing`: (what autograd saves, the layers' inputs among it; what the
    checkpoints hold besides, in the keyword arguments of their recompute), each storage
    counted once."""
    from saccade.config import PpoClipLossConfig
    from saccade.config import LoraConfig
    from saccade.models.lm import apply_lora, load_policy_lm, set_full_finetune
    from saccade.trainer.forward import forward_logprobs
    from saccade.trainer.loss import LossInputs, policy_loss
    from saccade.trainer.samples import MicroBatch

    torch.manual_seed(0)
    # The formula models transformers' sdpa (and flash); packed_sdpa's extra copies are described there.
    policy = load_policy_lm(tiny_path, dtype=dtype, attn_implementation="sdpa")
    held: dict[int, int] = {}
    if checkpointing:
        policy.enable_activation_checkpointing()
        for layer in policy.language_model.layers:
            original = layer._gradient_checkpointing_func

            def recording(fn, *args, _original=original, **kwargs):
                for value in fn.keywords.values():
                    for t in value if isinstance(value, tuple) else (value,):
                        if isinstance(t, torch.Tensor) and t.is_floating_point():
                            held[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
                return _original(fn, *args, **kwargs)

            layer._gradient_checkpointing_func = recording
    model = apply_lora(policy, LoraConfig(rank=8)) if lora else set_full_finetune(policy)
    model.train()
    hidden, levels = policy.config.text_config.hidden_size, policy.num_deepstack_levels
    ids = torch.randint(0, 500, (1, n_tokens))
    ids[0, 4 : 4 + n_image_tokens] = policy.image_token_id
    loss_mask = torch.zeros(n_tokens, dtype=torch.bool)
    loss_mask[n_tokens // 2 :] = True  # completion: the second half
    mb = MicroBatch(
        input_ids=ids, position_ids=torch.arange(n_tokens).expand(4, 1, n_tokens).clone(), loss_mask=loss_mask,
        inference_logprobs=torch.zeros(n_tokens), advantages=torch.ones(n_tokens),
        cu_seqlens=torch.tensor([0, n_tokens], dtype=torch.int32),
        image_embeds=torch.randn(n_image_tokens, hidden, dtype=dtype) if n_image_tokens else None,
        deepstack=torch.randn(levels, n_image_tokens, hidden, dtype=dtype) if n_image_tokens else None,
        image_grid_thw=torch.zeros(0, 3, dtype=torch.long), sample_ids=["a"],
    )
    params = {p.untyped_storage().data_ptr() for p in model.parameters()}
    saved: dict[int, int] = {}

    def pack(t):
        storage = t.untyped_storage()
        if storage.data_ptr() not in params:
            saved[storage.data_ptr()] = max(saved.get(storage.data_ptr(), 0), storage.nbytes())
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        logprobs, entropy = forward_logprobs(model, mb, only_loss_tokens=True)
        if with_loss:
            inputs = LossInputs(
                logprobs_N=logprobs, old_logprobs_N=logprobs.detach(), advantages_N=mb.advantages,
                loss_mask_N=mb.loss_mask, cu_seqlens=mb.cu_seqlens, inference_logprobs_N=mb.inference_logprobs,
                entropy_N=entropy, total_loss_tokens=float(loss_mask.sum()), total_sequences=1.0,
            )
            loss, _ = policy_loss(inputs, PpoClipLossConfig(tis_cap=2.0))
            assert loss.requires_grad
    assert logprobs.requires_grad
    if checkpointing:
        return sum(saved.values()), sum(held.values())
    return sum(saved.values())


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=["bf16", "fp32"])
@pytest.mark.parametrize("lora", [True, False], ids=["lora", "full"])
def test_activations_equal_autograds_saved_tensors(tiny_path, tiny_dims, dtype, lora):
    # torch has no peak-memory counter on CPU; what autograd keeps for backward is the
    # activation memory itself, and it is counted exactly. The formula must match to the byte
    # without images; DeepStack's index masks add a few bytes per image token, not modelled.
    n = 192
    per_token = activation_bytes_per_token(
        tiny_dims.text, dtype_bytes=torch.finfo(dtype).bits // 8, lora_rank=8 if lora else None, loss_fraction=0.5
    )
    assert saved_activation_bytes(tiny_path, dtype, lora, n) == n * per_token
    with_images = saved_activation_bytes(tiny_path, dtype, lora, n, n_image_tokens=48)
    assert 0 <= with_images - n * per_token <= 48 * 16
    # The loss's own per-token tensors (ratio, clip masks, TIS weights): a few dozen bytes.
    with_loss = saved_activation_bytes(tiny_path, dtype, lora, n, with_loss=True)
    assert 0 <= with_loss - n * per_token <= n * 64


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=["bf16", "fp32"])
@pytest.mark.parametrize("lora", [True, False], ids=["lora", "full"])
def test_checkpointed_activations_equal_what_autograd_and_the_checkpoints_hold(tiny_path, tiny_dims, dtype, lora):
    """Per-layer checkpointing: autograd saves each layer's input (the checkpoint's) and exactly
    the formula's terms outside the layers; the recompute's arguments hold RoPE's cos and sin
    (shared by every layer), to the byte. The formula adds one layer's activations, alive while
    that layer's backward runs."""
    from saccade.tools.memory import outside_layers_bytes_per_token

    n, b, text = 192, torch.finfo(dtype).bits // 8, tiny_dims.text
    rank = 8 if lora else None
    saved, held = saved_activation_bytes(tiny_path, dtype, lora, n, checkpointing=True)
    outside = outside_layers_bytes_per_token(text, dtype_bytes=b, full=not lora, loss_fraction=0.5)
    inputs = text.num_hidden_layers * b * text.hidden_size
    assert saved == n * (inputs + outside)
    assert held == n * 2 * b * text.head_dim
    inputs_and_rope = inputs + 2 * b * text.head_dim
    plain = activation_bytes_per_token(text, dtype_bytes=b, lora_rank=rank, loss_fraction=0.5)
    checkpointed = activation_bytes_per_token(text, dtype_bytes=b, lora_rank=rank, loss_fraction=0.5,
                                              checkpointing=True)
    # plain = L * layer - (LoRA: layer 0's input norm) + rope + outside; checkpointed adds one layer.
    layer_0_norm = 0 if not lora else 4 * text.hidden_size + 4
    one_layer = (plain - 2 * b * text.head_dim - outside + layer_0_norm) / text.num_hidden_layers
    assert checkpointed == pytest.approx(inputs_and_rope + one_layer + outside)
    assert checkpointed < plain


def test_checkpointing_shrinks_the_real_models_activations():
    for name, dims in QWEN3_VL.items():
        plain = activation_bytes_per_token(dims.text, dtype_bytes=2, lora_rank=32)
        checkpointed = activation_bytes_per_token(dims.text, dtype_bytes=2, lora_rank=32, checkpointing=True)
        assert checkpointed < plain / 5, name  # 28-36 layers: about one layer's worth plus the inputs


def test_activations_formula_by_hand():
    # One bf16 layer, LoRA r=2 on all seven linears, every loss term off (loss_fraction 0):
    # 28h + 12q + 8kv + 10I + 28r + 8 heads + 4 kv_heads + 8 per layer, less layer 0's input
    # norm (4h + 4), plus RoPE (2*2*head_dim) and the final norm (4h + 4).
    text = TextDims(vocab_size=100, hidden_size=8, num_hidden_layers=2, num_attention_heads=2,
                    num_key_value_heads=1, head_dim=4, intermediate_size=16, tie_word_embeddings=True)
    h, q, kv, inter, r = 8, 8, 4, 16, 2
    layer = 28 * h + 12 * q + 8 * kv + 10 * inter + 28 * r + 8 * 2 + 4 * 1 + 8
    expected = 2 * layer - (4 * h + 4) + 2 * 2 * 4 + (4 * h + 4)
    assert activation_bytes_per_token(text, dtype_bytes=2, lora_rank=r, loss_fraction=0) == expected == 1208
    full = 16 * h + 10 * q + 10 * kv + 8 * inter + 8 * 2 + 4 * 1 + 8
    assert activation_bytes_per_token(text, dtype_bytes=2, lora_rank=None, loss_fraction=0) == (
        2 * full + 2 * 2 * 4 + (4 * h + 4 + 2 * h) + 8
    )


def test_trainer_estimate_by_hand():
    # The hand-computable rows of Qwen3-VL-2B, LoRA r=32 on all linears, bf16.
    d = QWEN3_VL["Qwen/Qwen3-VL-2B-Instruct"]
    est = trainer_memory(d, lora_rank=32, max_tokens=1000)
    lm = 151936 * 2048 + 28 * (2048 * 2048 * 2 + 2048 * 1024 * 2 + 3 * 2048 * 6144 + 2 * 2048 + 2 * 128) + 2048
    lora = 28 * 32 * (2 * (2048 + 2048) + 2 * (2048 + 1024) + 3 * (2048 + 6144))
    assert est.get("weights") == pytest.approx(lm * 2 / GiB)
    assert est.get("LoRA adapters") == est.get("gradients") == pytest.approx(lora * 4 / GiB)
    assert est.get("AdamW states") == pytest.approx(2 * lora * 4 / GiB)
    # two (1024 x vocab) fp32 chunks and the fp32 copy of the bf16 lm_head
    # two (chunk x vocab) float32 buffers; no float32 copy of the bf16 lm_head on a GPU (saccade.models.head)
    assert est.get("logprob buffers") == pytest.approx(2 * 1024 * 151936 * 4 / GiB)
    # the micro-batch being computed and the next one (saccade.trainer.step.on_device)
    assert est.get("image embeddings") == pytest.approx(2 * 1000 * 2048 * 4 * 2 / GiB)
    assert est.total == pytest.approx(sum(i.gib for i in est.items))


def test_monotone_and_lora_below_full():
    for d in QWEN3_VL.values():
        totals = [trainer_memory(d, lora_rank=32, max_tokens=n).total for n in (1024, 2048, 4096, 8192)]
        assert totals == sorted(totals) and len(set(totals)) == 4
        ranks = [trainer_memory(d, lora_rank=r, max_tokens=2048).total for r in (8, 32, 128)]
        assert ranks == sorted(ranks) and len(set(ranks)) == 3
        for n in (512, 4096):
            lora, full = trainer_memory(d, lora_rank=64, max_tokens=n), trainer_memory(d, lora_rank=None, max_tokens=n)
            assert lora.total < full.total
            assert lora.get("gradients") + lora.get("AdamW states") < full.get("gradients") + full.get("AdamW states")
        assert trainer_memory(d, holds_vision_tower=True).total > trainer_memory(d).total
    by_size = [trainer_memory(m, lora_rank=32, max_tokens=4096).total for m in QWEN3_VL.values()]
    assert by_size == sorted(by_size)


def test_full_finetuning_of_few_tokens_peaks_at_the_optimizer_step():
    d = QWEN3_VL["Qwen/Qwen3-VL-8B-Instruct"]
    est = trainer_memory(d, lora_rank=None, max_tokens=16)
    assert est.get("optimizer step temporaries") == pytest.approx(d.text.params * 4 / GiB)  # fp32 masters
    assert est.get("activations") == 0


def test_server_kv_cache_is_what_is_left():
    d = QWEN3_VL["Qwen/Qwen3-VL-8B-Instruct"]
    s = server_memory(d, gpu_memory_utilization=0.9, gpu_gib=80.0)
    assert s.total == pytest.approx(72.0)
    assert s.get("weights") == pytest.approx(d.params * 2 / GiB)
    assert d.text.kv_bytes_per_token() == 2 * 36 * 8 * 128 * 2  # K and V, 36 layers, 8 heads of 128, bf16
    lora = server_memory(d, gpu_memory_utilization=0.9, gpu_gib=80.0, max_lora_rank=32)
    assert lora.get("KV cache") < s.get("KV cache")
    with pytest.raises(ValueError, match="gpu-memory-utilization"):
        server_memory(d, gpu_memory_utilization=0.2, gpu_gib=80.0)


def test_hand_built_dims_need_no_files():
    tiny = ModelDims("hand", TextDims(10, 4, 1, 1, 1, 4, 8, True), VisionDims(4, 1, 8, 4, 4, deepstack_levels=1))
    assert trainer_memory(tiny, lora_rank=1, max_tokens=16).total > 0


# ---------------------------------------------------------------------------------------------
# --world-size: per rank under FSDP2 full sharding
# ---------------------------------------------------------------------------------------------

SHARDED = ("weights", "LoRA adapters", "gradients", "AdamW states")
UNSHARDED = ("unsharded layers", "unsharded root")
PER_RANK = ("activations", "logprob buffers", "image embeddings", "CUDA context")


@pytest.mark.parametrize("dtype", ["bfloat16", "float32"])
@pytest.mark.parametrize("lora_rank", [32, None], ids=["lora", "full"])
@pytest.mark.parametrize("name", list(QWEN3_VL))
def test_world_size_two_halves_the_sharded_parts_exactly(name, lora_rank, dtype):
    d = QWEN3_VL[name]
    kw = {"dtype": dtype, "lora_rank": lora_rank, "max_tokens": 4096}
    one, two = trainer_memory(d, fsdp=True, **kw), trainer_memory(d, world_size=2, **kw)
    assert [i.name for i in one.items] == [i.name for i in two.items]
    for a, b in zip(one.items, two.items):
        if a.name in SHARDED:
            assert b.gib == a.gib / 2, a.name  # exactly: dividing by 2 is exact in floating point
        else:
            assert a.name in UNSHARDED + PER_RANK
            assert b.gib == a.gib, a.name  # not divided
    assert "master weights" not in [i.name for i in two.items]  # FSDP: the fp32 shards are what AdamW steps
    plain = trainer_memory(d, **kw)  # world size 1 without FSDP: no unsharded copies
    assert not any(plain.get(n) for n in UNSHARDED)
    for n in PER_RANK:
        assert two.get(n) == plain.get(n), n
    if dtype == "float32" or lora_rank is not None:
        # the same dtypes with and without FSDP (a LoRA base stays in model.dtype, the adapters
        # float32): world 2 is world 1's state halved, item by item
        for n in SHARDED:
            assert two.get(n) == plain.get(n) / 2, n
    else:
        # bf16 full fine-tuning: bf16 weights + fp32 masters (18 bytes a parameter) become
        # fp32 shards (16 bytes over N), the bf16 copies transient
        p = d.text.params
        assert plain.get("weights") + plain.get("master weights") == pytest.approx(p * 6 / GiB)
        assert two.get("weights") + two.get("gradients") + two.get("AdamW states") == pytest.approx(16 * p / 2 / GiB)


@pytest.mark.parametrize("name", list(QWEN3_VL))
def test_unsharded_copies_by_hand(name):
    d = QWEN3_VL[name]
    t = d.text
    h, q, kv, inter = t.hidden_size, t.q_dim, t.kv_dim, t.intermediate_size
    layer = h * q + 2 * h * kv + q * h + 3 * h * inter + 2 * h + 2 * t.head_dim
    root = t.vocab_size * h * (1 if t.tie_word_embeddings else 2) + h  # embedding, (lm_head), final norm
    for n in (2, 4, 8):
        full = trainer_memory(d, lora_rank=None, world_size=n, max_tokens=4096)
        assert full.get("unsharded layers") == pytest.approx(2 * layer * 2 / GiB)  # two bf16 layers in flight
        assert full.get("unsharded root") == pytest.approx(root * 2 / GiB)
        assert full.get("weights") == pytest.approx(t.params * 4 / n / GiB)  # fp32 shards
        assert full.get("gradients") == pytest.approx(t.params * 4 / n / GiB)
        assert full.get("AdamW states") == pytest.approx(t.params * 8 / n / GiB)
        lora = trainer_memory(d, lora_rank=32, world_size=n, max_tokens=4096)
        adapters = 32 * (2 * (h + q) + 2 * (h + kv) + 3 * (h + inter))  # one layer's seven A + B
        # the base gathered in bf16, the adapters in float32 (as stored: nothing cast)
        assert lora.get("unsharded layers") == pytest.approx(2 * (layer * 2 + adapters * 4) / GiB)
        assert lora.get("weights") == pytest.approx(t.params * 2 / n / GiB)  # the frozen base: bf16 shards
        assert lora.get("LoRA adapters") == pytest.approx(t.lora_params(32, LINEARS) * 4 / n / GiB)


@pytest.mark.parametrize("lora", [True, False], ids=["lora", "full"])
def test_unsharded_copies_count_the_real_modules(tiny_path, tiny_dims, lora):
    # What FSDP2 gathers as a unit (shard_model: each decoder layer, then the root's own
    # parameters, those outside every layer), counted on the tiny model's real modules.
    from saccade.config import LoraConfig
    from saccade.models.lm import apply_lora, load_policy_lm, set_full_finetune, unwrap_policy

    policy = load_policy_lm(tiny_path)
    model = apply_lora(policy, LoraConfig(rank=8)) if lora else set_full_finetune(policy)
    layers = unwrap_policy(model).language_model.layers
    in_layers = {id(p) for layer in layers for p in layer.parameters()}
    root = sum(p.numel() for p in model.parameters() if id(p) not in in_layers)
    largest = max(sum(p.numel() for p in layer.parameters()) for layer in layers)
    est = trainer_memory(tiny_dims, dtype="float32", lora_rank=8 if lora else None, world_size=2, max_tokens=4096)
    assert est.get("unsharded root") * GiB == pytest.approx(root * 4, rel=1e-12)
    assert est.get("unsharded layers") * GiB == pytest.approx(2 * largest * 4, rel=1e-12)


@pytest.mark.parametrize("lora_rank", [32, None], ids=["lora", "full"])
@pytest.mark.parametrize("name", list(QWEN3_VL))
def test_per_rank_total_decreases_with_the_world_size(name, lora_rank):
    d = QWEN3_VL[name]
    # the FSDP path, torchrun --nproc-per-node 1, 2, 4, 8, 16
    ests = [trainer_memory(d, lora_rank=lora_rank, world_size=n, max_tokens=4096, fsdp=True) for n in (1, 2, 4, 8, 16)]
    totals = [e.total for e in ests]
    assert totals == sorted(totals, reverse=True) and len(set(totals)) == len(totals), totals
    one_process = trainer_memory(d, lora_rank=lora_rank, max_tokens=4096)
    if lora_rank is None:
        assert one_process.total > totals[1]  # 18 bytes a parameter in one process, 16 / N sharded
    else:
        # LoRA: the gathered copies are added, so FSDP at world 1 holds more than one process;
        # the bf16 base is halved at two ranks, which then hold less (docs/qwen3vl.md)
        assert totals[0] > one_process.total > totals[1]
    for e in ests[1:]:
        for n in PER_RANK:
            assert e.get(n) == ests[0].get(n), n  # activations and buffers are per rank, never divided
    # above world size 1, what shrinks is exactly the state over N; the rest stays
    sharded = [e.total - sum(e.get(n) for n in PER_RANK + UNSHARDED) for e in ests[1:]]
    assert [sharded[0] / s for s in sharded] == pytest.approx([1, 2, 4, 8])


def test_optimizer_step_temporaries_are_sharded_too():
    d = QWEN3_VL["Qwen/Qwen3-VL-8B-Instruct"]
    est = trainer_memory(d, lora_rank=None, max_tokens=16, world_size=2)
    assert est.get("optimizer step temporaries") == pytest.approx(d.text.params * 4 / 2 / GiB)  # one fp32 shard
    assert est.get("activations") == est.get("unsharded root") == 0  # gathered copies are freed before the step


# -- the KL term's reference (loss.kl_coef > 0) ----------------------------------------------------

@pytest.mark.parametrize("world_size", [1, 2, 8])
@pytest.mark.parametrize("name", list(QWEN3_VL))
def test_full_finetuning_with_kl_holds_one_more_copy_of_the_language_model(name, world_size):
    """Full fine-tuning with the KL term holds a frozen copy of the language model + lm_head in
    model.dtype, over N when sharded, and nothing else changes; LoRA's reference is its own base."""
    d = QWEN3_VL[name]
    for dtype, b in (("bfloat16", 2), ("float32", 4)):
        kw = {"dtype": dtype, "max_tokens": 4096, "world_size": world_size}
        plain = trainer_memory(d, lora_rank=None, **kw)
        kl = trainer_memory(d, lora_rank=None, kl_reference=True, **kw)
        assert kl.get("KL reference") == pytest.approx(d.text.params * b / world_size / GiB)
        assert kl.total == pytest.approx(plain.total + kl.get("KL reference"))
        assert [i for i in kl.items if i.name != "KL reference"] == list(plain.items)
        assert trainer_memory(d, lora_rank=32, kl_reference=True, **kw) == trainer_memory(d, lora_rank=32, **kw)


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_the_kl_reference_counts_the_real_copy(tiny_path, tiny_dims, dtype):
    from saccade.models.lm import load_policy_lm, set_full_finetune
    from saccade.trainer.reference import frozen_copy

    torch_dtype = getattr(torch, dtype)
    copy = frozen_copy(set_full_finetune(load_policy_lm(tiny_path, dtype=torch_dtype)), str(tiny_path),
                       compute_dtype=torch_dtype)
    held = sum(p.numel() * p.element_size() for p in copy.parameters())  # the tied head once
    est = trainer_memory(tiny_dims, dtype=dtype, lora_rank=None, kl_reference=True)
    assert est.get("KL reference") * GiB == pytest.approx(held, rel=1e-12)


def test_the_memory_command_counts_the_kl_reference_for_full_finetuning(capsys):
    from saccade.cli import main

    path = str(_configs() / "qwen3vl-8b-8gpu.toml")
    full = ["--world-size", "4", "--lora", "false", "--engine.weight_sync.kind", "files"]
    without = _estimate(f"saccade memory configs/qwen3vl-8b-8gpu.toml {' '.join(full)}")
    with_kl = _estimate(f"saccade memory configs/qwen3vl-8b-8gpu.toml {' '.join(full)} --loss.kl_coef 0.05")
    reference = QWEN3_VL["Qwen/Qwen3-VL-8B-Instruct"].text.params * 2 / 4 / GiB  # bf16 shards over 4
    assert without.trainer.get("KL reference") == 0
    assert with_kl.trainer.get("KL reference") == pytest.approx(reference)
    assert with_kl.trainer.total == pytest.approx(without.trainer.total + reference)
    lora = "saccade memory configs/qwen3vl-8b-8gpu.toml --world-size 4"
    assert _estimate(f"{lora} --loss.kl_coef 0.05").trainer == _estimate(lora).trainer  # adapters off: no copy
    main(["memory", path, *full, "--loss.kl_coef", "0.05"])
    assert "KL reference" in capsys.readouterr().out


def test_a_world_size_below_one_is_refused():
    with pytest.raises(ValueError, match="world size"):
        trainer_memory(QWEN3_VL["Qwen/Qwen3-VL-2B-Instruct"], world_size=0)


# -- from a run config, the CLI and the shipped 8-GPU configs -------------------------------------

def _configs():
    import saccade

    return Path(saccade.__file__).parent / "configs"


def _estimate(command: str):
    """The RunEstimate of a `saccade memory CONFIG ...` command line, --world-size included."""
    from saccade.cli import build_parser
    from saccade.config import RunConfig, load_config, split_overrides
    from saccade.tools.memory import estimate_run

    argv = shlex.split(command)
    assert argv[:2] == ["saccade", "memory"], command
    known, overrides = split_overrides(argv[1:])
    args = build_parser().parse_args(known)
    cfg = load_config(RunConfig, _configs() / Path(args.config).name, overrides)
    return estimate_run(cfg, gpu_memory_utilization=args.gpu_memory_utilization, gpu_gib=args.gpu_gib,
                        shared_gpu=args.shared_gpu, world_size=args.world_size)


def test_the_server_does_not_depend_on_the_trainers_world_size():
    from saccade.config import RunConfig, load_config
    from saccade.tools.memory import estimate_run

    cfg = load_config(RunConfig, _configs() / "qwen3vl-8b-8gpu.toml")
    one, four = estimate_run(cfg, world_size=1), estimate_run(cfg, world_size=4)
    assert one.server == four.server and four.world_size == 4
    assert four.trainer.total < one.trainer.total


def test_header_lines_state_the_world_size():
    from saccade.tools.memory import header_lines

    base = "saccade memory configs/qwen3vl-8b-8gpu.toml --lora false --engine.weight_sync.kind files"
    one, four = header_lines(_estimate(base)), header_lines(_estimate(base + " --world-size 4"))
    assert one[0].startswith("#   trainer GPU: ") and one[-1].startswith("#   trainer alone on a 79 GiB GPU: ")
    assert one[-1].endswith("DOES NOT FIT")  # 8B full fine-tuning on one GPU
    assert four[0].startswith("#   trainer GPU, per rank of 4 (FSDP2): ")
    assert "weight shards" in four[0] and "unsharded layers" in four[0] and "unsharded root" in four[0]
    assert four[-1].startswith("#   each of the 4 trainer ranks alone on a 79 GiB GPU: ")
    assert four[-1].endswith(", fits")
    assert one[1] == four[1]  # the server's line


def test_memory_command_world_size(capsys):
    from saccade.cli import main
    from saccade.tools.memory import header_lines

    path = str(_configs() / "qwen3vl-8b-8gpu.toml")
    full = ["--lora", "false", "--engine.weight_sync.kind", "files"]
    assert main(["memory", path, "--world-size", "4", "--header", *full]) == 0
    printed = capsys.readouterr().out.splitlines()
    command = f"saccade memory configs/qwen3vl-8b-8gpu.toml --world-size 4 {' '.join(full)}"
    assert printed == header_lines(_estimate(command))
    assert main(["memory", path, *full]) == 1  # 8B full fine-tuning does not fit one GPU...
    out = capsys.readouterr().out
    assert "world size 1" in out and "DOES NOT FIT" in out
    assert main(["memory", path, "--world-size", "4", *full]) == 0  # ...and fits sharded over four
    out = capsys.readouterr().out
    assert "per rank at world size 4" in out and "unsharded root" in out and "activations" in out
    assert "each of the 4 trainer ranks alone" in out and "fits" in out
    assert main(["memory", path, "--world-size", "0"]) == 2  # a ValueError, said plainly
    assert "world size" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        main(["memory", path, "--world-size", "four"])


def _joined_commands(header: str) -> list[str]:
    """The header's comment lines with shell continuations (a trailing backslash) joined."""
    out, current = [], ""
    for line in header.splitlines():
        text = line.removeprefix("#").strip()
        current = f"{current} {text}".strip() if current else text
        if current.endswith("\\"):
            current = current[:-1].rstrip()
        else:
            out.append(current)
            current = ""
    return out


EIGHT_GPU = ["qwen3vl-2b-8gpu.toml", "qwen3vl-4b-8gpu.toml", "qwen3vl-8b-8gpu.toml"]


@pytest.mark.parametrize("name", EIGHT_GPU)
def test_eight_gpu_headers_say_how_they_shard(name):
    """Every `reproduce:` line of an 8-GPU config's header, at the world size it names, gives
    lines that are in the header; every sharded `saccade launch` layout has a reproduce line at
    its trainer ranks with the same estimate, and its GPUs plus its servers' are at most eight,
    none shared; every "(X GiB) ... `saccade memory ...`" figure is that command's total."""
    from saccade.config import RunConfig, load_config, split_overrides
    from saccade.tools.memory import estimate_run, header_lines

    path = _configs() / name
    header = path.read_text().split("\n[", 1)[0]
    lines = header.splitlines()
    reproduce = re.findall(r"#   reproduce: (saccade memory .+)", header)
    assert len(reproduce) >= 2, "the shipped layout and a sharded one"
    by_world: dict[int, list] = {}
    for command in reproduce:
        est = _estimate(command)
        for line in header_lines(est):
            assert line in lines, f"{name}: header out of date; expected line:\n{line}"
        assert est.fits, command
        by_world.setdefault(est.world_size, []).append(est)
    assert 1 in by_world and any(n > 1 for n in by_world)
    assert "world size 1" in header and "--world-size K" in header

    # The sharded layouts the header gives as `saccade launch CONFIG ... --launch.nodes '[...]'`.
    launches = [c for c in _joined_commands(header) if c.startswith("saccade launch ") and "--launch.nodes" in c]
    assert launches, f"{name}: no sharded saccade launch command"
    for launch in launches:
        argv = shlex.split(launch)
        assert argv[2] == f"configs/{name}", launch
        _, overrides = split_overrides(argv[3:])
        cfg = load_config(RunConfig, path, overrides)
        [node] = cfg.launch.nodes
        trainer_gpus, server_gpus = set(node.trainer_gpus), {g for gpus in node.server_gpus for g in gpus}
        k = cfg.launch.world_size
        assert k == len(trainer_gpus) > 1
        assert not trainer_gpus & server_gpus and trainer_gpus | server_gpus <= set(range(8)), launch
        assert k in by_world, f"{name}: no reproduce line at --world-size {k}"
        est = estimate_run(cfg)  # the layout's world size and GPU share
        assert est.world_size == k
        assert any(e.trainer == est.trainer and e.server == est.server for e in by_world[k]), launch

    prose = " ".join(_joined_commands(header))
    claims = re.findall(r"\((\d+\.\d) GiB\)[^`]*`(saccade memory [^`]+)`", prose)
    assert claims
    for figure, command in claims:
        assert f"{_estimate(command).trainer.total:.1f}" == figure, command


def test_eight_b_full_finetuning_needs_sharding():
    """The README's case: Qwen3-VL-8B full fine-tuning does not fit one 80 GB GPU, and fits
    sharded over four (each rank next to nothing: the servers have the other four GPUs)."""
    base = "saccade memory configs/qwen3vl-8b-8gpu.toml --lora false --engine.weight_sync.kind files"
    fits = {n: _estimate(f"{base} --world-size {n}").fits for n in (1, 2, 4, 8)}
    assert fits == {1: False, 2: False, 4: True, 8: True}


def test_documented_world_size_table_equals_the_estimator():
    # docs/qwen3vl.md: per-rank totals of full fine-tuning at --world-size 1, 2, 4, 8.
    doc = Path(__file__).parents[2] / "docs" / "qwen3vl.md"
    if not doc.exists():
        pytest.skip("docs/qwen3vl.md is not shipped with the package")
    rows = [r for r in doc.read_text().splitlines() if r.startswith("| full FT, ")]
    assert len(rows) == 3, rows
    for row in rows:
        size = re.match(r"\| full FT, (\d+B), ", row).group(1).lower()
        figures = re.findall(r"\b\d+\.\d\b", row)
        base = f"saccade memory configs/qwen3vl-{size}-8gpu.toml --lora false --engine.weight_sync.kind files"
        assert figures == [f"{_estimate(f'{base} --world-size {n}').trainer.total:.1f}" for n in (1, 2, 4, 8)], row


# ----------------------------------------------------------------------------- clips (memory_video)


def tower_saved_bytes(preset: str, dtype, frames: int = 4, side: int = 128) -> tuple[int, int, int]:
    """(patches, bytes autograd saves in block 1, in the whole tower) for the tower of `preset`
    trained on a clip (every tower parameter requiring grad), each storage counted once, the
    parameters and the pixel values left out."""
    import numpy as np

    from saccade.config import ImagesConfig, VideoConfig
    from saccade.data.messages import messages_to_inputs
    from saccade.models.loading import load_processor, load_vision_tower
    from saccade.models.presets import preset_path

    path = preset_path(preset)
    processor, tower = load_processor(path), load_vision_tower(path, dtype=dtype)
    for p in tower.parameters():
        p.requires_grad_(True)
    per_clip = model_dims(str(path)).vision.video_pixels_per_clip
    limits = ImagesConfig(min_pixels=32 * 32, max_pixels=256 * 256,
                          video=VideoConfig(min_pixels=32 * 32, max_pixels=side * side * (frames if per_clip else 1)))
    clip = np.random.default_rng(0).integers(0, 255, (frames, side, side, 3), dtype=np.uint8)  # frames, h, w, rgb
    inputs = messages_to_inputs([{"role": "user", "content": [{"type": "video", "video": clip}]}], processor,
                                limits=limits)
    pixels = inputs.pixel_values_videos.to(dtype)
    skip = {p.untyped_storage().data_ptr() for p in tower.parameters()} | {pixels.untyped_storage().data_ptr()}
    where, block, whole = ["out"], {}, {}
    tower.blocks[1].register_forward_pre_hook(lambda *a: where.__setitem__(0, "in"))
    tower.blocks[1].register_forward_hook(lambda *a: where.__setitem__(0, "out"))

    def pack(t):
        ptr = t.untyped_storage().data_ptr()
        if ptr not in skip:
            whole[ptr] = max(whole.get(ptr, 0), t.untyped_storage().nbytes())
            if where[0] == "in" and ptr not in block:
                block[ptr] = t.untyped_storage().nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        tower(pixels, grid_thw=inputs.videos.grid_thw)
    # the rotary cos and sin are made once and read by every block: the tower's, not a block's
    head_dim = tower.config.hidden_size // tower.config.num_heads
    shared = 2 * 4 * head_dim * pixels.shape[0]
    return pixels.shape[0], sum(block.values()) - shared, sum(whole.values())


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=["bf16", "fp32"])
@pytest.mark.parametrize("preset", ["tiny", "qwen2.5vl-tiny"])
def test_a_trained_towers_block_keeps_what_the_formula_says(preset, dtype):
    """A ViT block's saved activations per patch, exactly (on the CPU: the attention runs frame group
    by frame group, `split_attention`, and LayerNorm keeps its statistics in the input's dtype);
    the whole tower's within 10% (the mergers and the patch embedding are estimated)."""
    from saccade.models.presets import preset_path

    vision = model_dims(str(preset_path(preset))).vision
    b = torch.finfo(dtype).bits // 8
    patches, block, whole = tower_saved_bytes(preset, dtype)
    assert block == patches * vision.block_activation_bytes(b, stats_bytes=b, split_attention=True)
    estimate = patches * vision.tower_activation_bytes(b, stats_bytes=b, split_attention=True)
    assert abs(estimate - whole) <= 0.1 * whole


def test_a_clip_of_256_frames_at_448_px_on_qwen3_vl_8b():
    """By hand: 128 temporal patches of 28 x 28 patches; 196 tokens each after the 2 x 2 merge."""
    from saccade.config import RunConfig, load_config
    from saccade.tools.memory import estimate_run
    from saccade.tools.memory_video import TIMESTAMP_TOKENS, clip_shape, config_clip, tower_trainer_memory

    dims = QWEN3_VL["Qwen/Qwen3-VL-8B-Instruct"]
    clip = clip_shape(dims.vision, 256, 448 * 448)
    assert (clip.side, clip.temporal_patches, clip.patches, clip.tokens) == (448, 128, 100_352, 25_088)
    assert clip.text_tokens == 128 * (TIMESTAMP_TOKENS + 2)
    cfg = load_config(RunConfig, Path(__file__).parents[2] / "configs" / "qwen3vl-8b-8gpu.toml",
                      ["--images.video.num_frames", "256", "--images.video.max_pixels", str(256 * 448 * 448)])
    assert config_clip(cfg, dims) == clip  # Qwen3-VL's processor bounds all the frames together
    assert config_clip(load_config(RunConfig, Path(__file__).parents[2] / "configs" / "qwen3vl-8b-8gpu.toml"),
                       dims) is None  # the processor's own bounds: not known here
    ours = estimate_run(cfg, dims=dims).trainer
    frozen = tower_trainer_memory(dims, ours, clip, trained=False)
    trained = tower_trainer_memory(dims, ours, clip, trained=True)
    assert ours.total < frozen.total < trained.total
    assert frozen.get("pixel values") == pytest.approx(100_352 * 1536 * 6 / GiB)
    assert trained.get("tower activations") == pytest.approx(100_352 * dims.vision.tower_activation_bytes(2) / GiB)
    qwen25 = model_dims("Qwen/Qwen2.5-VL-7B-Instruct").vision  # Qwen2-VL's processor: each frame's bound
    # Video-R1's 16 frames of at most 128 x 28 x 28 px: square, 308 x 308 (11 x 11 tokens a frame group)
    assert clip_shape(qwen25, 16, 128 * 28 * 28).tokens == 8 * 121 and not qwen25.video_pixels_per_clip
