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
from saccade.models import linear_attention as la
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


# Rows with shared prompts: (prompt length, completion lengths) per group, then lone samples. A prompt
# longer than a chunk (64); completions crossing one; a prompt of 2 tokens, shorter than the
# convolution's history of 3.
SHARED_ROWS = {
    "one group": ([(83, [20, 71, 9])], []),
    "two groups and a lone sample": ([(70, [12, 5]), (2, [9, 30, 4])], [40]),
}


@pytest.mark.parametrize("row", SHARED_ROWS)
def test_shared_prompts_match_whole_sequences(policy, monkeypatch, row):
    """Completions continuing a shared prompt (PackedLayout's context) equal each prompt + completion
    run alone, gradients included: on the CPU the varlen path runs each prompt once and starts each
    completion from its final state. Every token of the row goes through the linear layers once."""
    groups, lone = SHARED_ROWS[row]
    counted = []

    def counting_rule(q, *args, **kwargs):
        counted.append(q.shape[1])
        return la.torch_varlen_chunk_gated_delta_rule(q, *args, **kwargs)

    monkeypatch.setattr(la, "TORCH_VARLEN", dataclasses.replace(la.TORCH_VARLEN, chunk_gated_delta_rule=counting_rule))
    monkeypatch.setattr(la, "_chosen", {})
    torch.manual_seed(2)
    pieces, lengths, starts, context, expected, alone_pieces = [], [], [], [], [], []
    for P, completions in groups:
        prompt = torch.randint(0, VOCAB, (1, P))
        at = sum(lengths)
        for i, n in enumerate(completions):
            out = torch.randint(0, VOCAB, (1, n))
            h = hidden(policy, torch.cat([prompt, out], 1), [P + n])
            w = torch.randn(P + n, 64)
            own = slice(0 if i == 0 else P, None)  # a group's first sample is whole in the row
            pieces.append(torch.cat([prompt, out], 1)[:, own])
            lengths.append(P + n if i == 0 else n)
            starts.append(0 if i == 0 else P)
            context.append((0, 0) if i == 0 else (at, at + P))
            expected.append(h[own])
            alone_pieces.append((h[own], w[own]))
    for n in lone:
        ids = torch.randint(0, VOCAB, (1, n))
        h, w = hidden(policy, ids, [n]), torch.randn(n, 64)
        pieces.append(ids), lengths.append(n), starts.append(0), context.append((0, 0))
        expected.append(h), alone_pieces.append((h, w))
    grads_alone = loss_and_grads(policy, alone_pieces)
    counted.clear()
    packed = hidden(policy, torch.cat(pieces, 1), lengths, starts=starts, context=context)
    assert sum(counted) == sum(lengths) * len(la.linear_attention_layers(policy.language_model))
    assert (packed - torch.cat(expected)).abs().max().item() <= TOL
    grads_packed = loss_and_grads(policy, [(packed, torch.cat([w for _, w in alone_pieces]))])
    assert max_diff(grads_packed, grads_alone) <= GRAD_TOL


@pytest.mark.parametrize("row", ["8 samples"])
def test_the_varlen_path_matches_the_padded_path(policy, monkeypatch, row):
    """The varlen path (the row unpadded, the torch kernels with fla's signatures, a loop over
    segments) gives the padded path's hidden states and gradients."""
    lengths = ROWS[row]
    torch.manual_seed(1)
    ids = torch.randint(0, VOCAB, (1, sum(lengths)))
    weights_NH = torch.randn(sum(lengths), 64)
    results = {}
    for kernels in (None, la.TORCH_VARLEN):
        monkeypatch.setattr(la, "choose_kernels", lambda device, shared_prompts=False, k=kernels: k)
        h = hidden(policy, ids, lengths)
        results[kernels] = h, loss_and_grads(policy, [(h, weights_NH)])
    (padded, padded_grads), (varlen, varlen_grads) = results.values()
    assert (varlen - padded).abs().max().item() <= TOL
    assert max_diff(varlen_grads, padded_grads) <= GRAD_TOL


def test_the_torch_varlen_kernels_carry_state_as_one_sequence():
    """fla's state conventions, kept by the torch kernels: a sequence cut in two, the second part
    started from the first's final states (convolution inputs, recurrent state), equals the whole;
    so does a first part shorter than the convolution's history. Two sequences at once (cu_seqlens)."""
    torch.manual_seed(4)
    D, W, H, K, V = 12, 4, 2, 8, 8
    weight = torch.randn(D, W)
    for cut in (50, 2):
        T = 90
        x = torch.randn(1, 2 * T, D)
        q, k = torch.randn(2, 1, 2 * T, H, K).unbind(0)
        v, g, beta = torch.randn(1, 2 * T, H, V), -torch.rand(1, 2 * T, H), torch.rand(1, 2 * T, H)
        whole = torch.tensor([0, T, 2 * T])
        heads = [torch.arange(0, cut), torch.arange(T, T + cut)]
        tails = [torch.arange(cut, T), torch.arange(T + cut, 2 * T)]
        first, rest = torch.cat(heads), torch.cat(tails)
        cu_first, cu_rest = torch.tensor([0, cut, 2 * cut]), torch.tensor([0, T - cut, 2 * (T - cut)])

        def part(t, index):
            return t.index_select(1, index)

        conv_whole, _ = la.torch_varlen_causal_conv1d(x, weight, activation="silu", cu_seqlens=whole)
        _, state = la.torch_varlen_causal_conv1d(part(x, first), weight, activation="silu", output_final_state=True,
                                                 cu_seqlens=cu_first)
        conv_rest, _ = la.torch_varlen_causal_conv1d(part(x, rest), weight, initial_state=state, activation="silu",
                                                     cu_seqlens=cu_rest)
        assert state.shape == (2, D, W)
        assert (conv_rest - part(conv_whole, rest)).abs().max() <= 1e-6

        args = dict(use_qk_l2norm_in_kernel=True)
        out_whole, _ = la.torch_varlen_chunk_gated_delta_rule(q, k, v, g, beta, cu_seqlens=whole, **args)
        _, state = la.torch_varlen_chunk_gated_delta_rule(*(part(t, first) for t in (q, k, v, g, beta)),
                                                          output_final_state=True, cu_seqlens=cu_first, **args)
        out_rest, _ = la.torch_varlen_chunk_gated_delta_rule(*(part(t, rest) for t in (q, k, v, g, beta)),
                                                             initial_state=state, cu_seqlens=cu_rest, **args)
        assert state.shape == (2, H, K, V)
        assert (out_rest - part(out_whole, rest)).abs().max() <= 1e-5


def test_the_kernel_choice_is_logged_once(monkeypatch, caplog):
    """fla's varlen kernels on CUDA where fla imports; else the torch varlen kernels for a row with
    shared prompts (they run each prompt once), the padded path for the rest. Each choice logged once."""
    fla = dataclasses.replace(la.TORCH_VARLEN, name="fla (stand-in)")
    monkeypatch.setattr(la, "_chosen", {})
    monkeypatch.setattr(la, "fla_kernels", lambda: fla)
    with caplog.at_level("WARNING", logger="saccade.linear_attention"):
        for _ in range(2):
            assert la.choose_kernels(torch.device("cpu")) is None
            assert la.choose_kernels(torch.device("cpu"), shared_prompts=True) is la.TORCH_VARLEN
            assert la.choose_kernels(torch.device("cuda", 0)) is fla
    assert len(caplog.records) == 3
    assert "fla needs CUDA" in caplog.records[0].message and "fla (stand-in)" in caplog.records[2].message
    monkeypatch.setattr(la, "_chosen", {})
    monkeypatch.setattr(la, "fla_kernels", lambda: None)  # CUDA without fla: as the CPU
    assert la.choose_kernels(torch.device("cuda")) is None
    assert la.choose_kernels(torch.device("cuda"), shared_prompts=True) is la.TORCH_VARLEN


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
