"""Packed rows through a hybrid language model (Gated DeltaNet + full attention) give what each
sample gives alone: `saccade.models.linear_attention`, and `PolicyLM.hidden_states` handing the
linear layers their boundaries under every CPU kernel. A tiny random Qwen3.5 text model: linear
head dims 64 (the real ones are 128), the real 3-linear:1-full pattern, fp32.

`PolicyLM` takes the Qwen3.5 family (saccade.models.families.qwen3_5), whose
`prepare_language_model` calls `make_packing_exact`."""

from __future__ import annotations

import copy
import dataclasses

import pytest
import torch

from saccade.models import lm as lm_module
from saccade.models.attention import NO_MASK, PACKED_SDPA, PackedLayout
from saccade.models.families import qwen3_5
from saccade.models.families.interface import no_hooks
from saccade.models.linear_attention import has_linear_attention, is_packing_exact, make_packing_exact
from saccade.models.lm import PolicyLM

VOCAB = 97
TOL = 1e-5
# Gradients: the reference kernel's fp32 rounding alone moves A_log's gradient (a sum over every
# token and head) by up to 1.1e-5 when tokens are appended after each sample alone, which changes
# nothing in exact arithmetic (measured on ROWS["8 samples"]); packed rows append pads the same way.
GRAD_TOL = 5e-5
# Rows of mixed lengths, none a multiple of the chunk size 64, several longer than it.
ROWS = {
    "2 samples": [70, 30],
    "6 samples": [130, 5, 97, 33, 71, 12],
    "8 samples": [65, 66, 3, 140, 9, 50, 77, 21],
}


def text_config(layers: int = 8):
    from transformers.models.qwen3_5 import Qwen3_5TextConfig

    config = Qwen3_5TextConfig(
        vocab_size=VOCAB, hidden_size=64, intermediate_size=96, num_hidden_layers=layers,
        num_attention_heads=4, num_key_value_heads=2, head_dim=32,
        linear_key_head_dim=64, linear_value_head_dim=64, linear_num_key_heads=2, linear_num_value_heads=4,
        linear_conv_kernel_dim=4,
        rope_parameters={"rope_type": "default", "rope_theta": 10000.0, "mrope_section": [2, 3, 3],
                         "partial_rotary_factor": 0.25},
    )
    assert config.layer_types[:4] == ["linear_attention"] * 3 + ["full_attention"]
    return config


def text_model(seed: int = 0):
    from transformers.models.qwen3_5 import Qwen3_5TextModel

    torch.manual_seed(seed)
    config = text_config()
    config._attn_implementation = PACKED_SDPA
    model = Qwen3_5TextModel(config)
    # Random A_log spans decays up to exp(-16 * softplus): make them slow enough that a state
    # carried over a boundary shows (the trained model's decays are mostly slow).
    with torch.no_grad():
        for layer in model.layers:
            if hasattr(layer, "linear_attn"):
                layer.linear_attn.A_log.uniform_(-4.0, 0.0)
    return model.eval()


@pytest.fixture()
def policy():
    from transformers.models.qwen3_5 import Qwen3_5Config

    language_model = text_model()
    config = Qwen3_5Config(text_config=language_model.config.to_dict())
    config.text_config = language_model.config  # one config: switching the kernel switches the model's
    head = torch.nn.Linear(64, VOCAB, bias=False)
    return PolicyLM(config, language_model, head)


def positions(lengths: list[int], starts: list[int] | None = None) -> torch.Tensor:
    """(4, 1, N): every row 0.. per segment (text and M-RoPE alike: text only), from `starts`."""
    starts = starts or [0] * len(lengths)
    row = torch.cat([torch.arange(s, s + n) for s, n in zip(starts, lengths)])
    return row.view(1, 1, -1).expand(4, 1, -1)


def cu(lengths: list[int]) -> torch.Tensor:
    return torch.tensor([0, *lengths]).cumsum(0)


def hidden(policy: PolicyLM, ids: torch.Tensor, lengths: list[int], starts=None, context=None) -> torch.Tensor:
    return policy.hidden_states(ids, positions(lengths, starts), cu_seqlens=cu(lengths), context=context)[0]


def loss_and_grads(policy: PolicyLM, pieces: list[tuple[torch.Tensor, torch.Tensor]]) -> dict:
    """Sum of <hidden, weights> over each (hidden, its rows of weights), and the parameters' gradients."""
    policy.zero_grad()
    loss = sum((h * w).sum() for h, w in pieces)
    loss.backward()
    return {n: p.grad.clone() for n, p in policy.named_parameters() if p.grad is not None}


def max_diff(a: dict, b: dict) -> float:
    """The largest gradient difference, each parameter's relative to its largest entry where that
    is over 1 (gradients summed over ~500 tokens reach 20: fp32 rounding is relative)."""
    assert a.keys() == b.keys() and a
    return max(((a[k] - b[k]).abs().max() / b[k].abs().max().clamp(min=1)).item() for k in a)


@pytest.mark.parametrize("implementation", [PACKED_SDPA, "sdpa", "eager"])
@pytest.mark.parametrize("row", ROWS)
def test_packed_row_matches_each_sample_alone(policy, implementation, row):
    """Hidden states and parameter gradients of a packed row equal those of each sample alone."""
    policy.config.text_config._attn_implementation = implementation
    lengths = ROWS[row]
    torch.manual_seed(1)
    samples = [torch.randint(0, VOCAB, (1, n)) for n in lengths]
    weights_NH = torch.randn(sum(lengths), 64)
    alone = [hidden(policy, ids, [ids.shape[1]]) for ids in samples]
    bounds = cu(lengths).tolist()
    grads_alone = loss_and_grads(policy, [(h, weights_NH[a:b]) for h, a, b in zip(alone, bounds, bounds[1:])])
    packed = hidden(policy, torch.cat(samples, 1), lengths)
    grads_packed = loss_and_grads(policy, [(packed, weights_NH)])
    assert (packed - torch.cat(alone)).abs().max().item() <= TOL
    assert any("linear_attn" in n for n in grads_packed)
    assert max_diff(grads_packed, grads_alone) <= GRAD_TOL


def test_shared_prompts_match_whole_sequences(policy):
    """Completions continuing one shared prompt (PackedLayout's context) equal each prompt +
    completion run alone: the linear layers recompute the prompt's state per sequence."""
    torch.manual_seed(2)
    P, completions = 83, [20, 71, 9]  # prompt longer than a chunk; completion 71 crosses one too
    prompt = torch.randint(0, VOCAB, (1, P))
    outs = [torch.randint(0, VOCAB, (1, n)) for n in completions]
    weights = [torch.randn(P + n, 64) for n in completions]
    alone = [hidden(policy, torch.cat([prompt, o], 1), [P + o.shape[1]]) for o in outs]
    grads_alone = loss_and_grads(policy, [(h[P:] if i else h, w[P:] if i else w)
                                          for i, (h, w) in enumerate(zip(alone, weights))])
    # Row: prompt + completion 0 (whole), then completions 1 and 2 alone, continuing the prompt.
    lengths = [P + completions[0], *completions[1:]]
    row = torch.cat([prompt, *outs], 1)
    context = [(0, 0)] + [(0, P)] * (len(completions) - 1)
    packed = hidden(policy, row, lengths, starts=[0, P, P], context=context)
    expected = torch.cat([alone[0], *(h[P:] for h in alone[1:])])
    assert (packed - expected).abs().max().item() <= TOL
    grads_packed = loss_and_grads(policy, [(packed, torch.cat([weights[0], *(w[P:] for w in weights[1:])]))])
    assert max_diff(grads_packed, grads_alone) <= GRAD_TOL


def test_without_the_reset_the_state_leaks_across_samples():
    """The same packed row through a model whose linear layers were not made exact: the first
    sample is right, every later one is far off (the recurrent state and the convolution carry
    over). Full attention is kept inside each sample either way (packed_sdpa's layout)."""
    model = text_model()
    lengths = ROWS["6 samples"]
    torch.manual_seed(1)
    samples = [torch.randint(0, VOCAB, (1, n)) for n in lengths]

    def packed(m):
        return m(input_ids=torch.cat(samples, 1), position_ids=positions(lengths), attention_mask=NO_MASK,
                 use_cache=False, packed_layout=PackedLayout.from_cu_seqlens(cu(lengths))).last_hidden_state[0]

    with torch.no_grad():
        alone = torch.cat([model(input_ids=s, position_ids=positions([s.shape[1]]), use_cache=False)
                           .last_hidden_state[0] for s in samples])
        leaky = packed(model)
        assert make_packing_exact(model) == 6 and is_packing_exact(model)
        exact = packed(model)
    errors = [(leaky - alone)[a:b].abs().max().item() for a, b in zip(cu(lengths), cu(lengths)[1:])]
    assert errors[0] <= TOL and min(errors[1:]) > 1e-2, errors
    assert (exact - alone).abs().max().item() <= TOL


def test_a_family_that_skips_the_reset_is_refused(monkeypatch):
    """PolicyLM will not hold a hybrid model whose family did not make its packing exact."""
    from transformers.models.qwen3_5 import Qwen3_5Config

    monkeypatch.setattr(lm_module, "family_of", lambda config: dataclasses.replace(qwen3_5.FAMILY,
                                                                                   prepare_language_model=no_hooks))
    language_model = text_model()
    assert has_linear_attention(language_model) and not is_packing_exact(language_model)
    with pytest.raises(AssertionError, match="make_packing_exact"):
        PolicyLM(Qwen3_5Config(text_config=language_model.config.to_dict()), language_model,
                 torch.nn.Linear(64, VOCAB, bias=False))


def test_boundaries_from_flash_arguments():
    """Given flash-attention's varlen arguments and no layout (a caller outside PolicyLM), the
    layers build the layout themselves. Eager here: its mask comes from the text row."""
    model = text_model()
    model.config._attn_implementation = "eager"
    make_packing_exact(model)
    lengths = ROWS["2 samples"]
    torch.manual_seed(1)
    samples = [torch.randint(0, VOCAB, (1, n)) for n in lengths]
    with torch.no_grad():
        alone = torch.cat([model(input_ids=s, position_ids=positions([s.shape[1]]), use_cache=False)
                           .last_hidden_state[0] for s in samples])
        c = cu(lengths).to(torch.int32)
        packed = model(input_ids=torch.cat(samples, 1), position_ids=positions(lengths), use_cache=False,
                       cu_seq_lens_q=c, cu_seq_lens_k=c, max_length_q=max(lengths),
                       max_length_k=max(lengths)).last_hidden_state[0]
    assert (packed - alone).abs().max().item() <= TOL


@pytest.mark.parametrize("implementation", [PACKED_SDPA, "sdpa"])
def test_without_boundaries_the_layers_are_transformers_own(implementation):
    """The embedded engine's use: a left-padded batch prefilled into a cache, then decoded a token
    at a time. Bit for bit what the model gives without make_packing_exact."""
    reference = text_model()
    reference.config._attn_implementation = implementation
    exact = copy.deepcopy(reference)
    make_packing_exact(exact)
    assert is_packing_exact(exact) and not is_packing_exact(reference)
    assert is_packing_exact(copy.deepcopy(exact))  # a copy (a reference policy) keeps the reset
    torch.manual_seed(3)
    ids = torch.randint(0, VOCAB, (2, 70))
    mask = torch.ones(2, 70, dtype=torch.long)
    mask[1, :25] = 0  # row 1 is left-padded
    steps = torch.randint(0, VOCAB, (2, 3))

    def run(model):
        with torch.no_grad():
            out = model(input_ids=ids, attention_mask=mask, use_cache=True)
            states, cache, m = [out.last_hidden_state], out.past_key_values, mask
            for t in range(steps.shape[1]):
                m = torch.cat([m, torch.ones(2, 1, dtype=torch.long)], 1)
                out = model(input_ids=steps[:, t:t + 1], attention_mask=m, past_key_values=cache, use_cache=True)
                states.append(out.last_hidden_state)
        return torch.cat(states, 1)

    assert torch.equal(run(exact), run(reference))
