"""Packed rows that stay exact through linear-attention layers (Gated DeltaNet).

A hybrid language model (Qwen3.5: three Gated DeltaNet layers to one full-attention layer)
keeps, in each linear layer, a short causal convolution over the projected q, k and v (kernel
4: each token sees the 3 before it) and a recurrent state (per head, (d_k x d_v)) carried
from token to token. Run over a packed row, both carry over a sample boundary: the next
sample starts from the previous one's state and sees its last 3 tokens through the
convolution. The text row's restarting positions, which keep full attention inside a sample,
mean nothing to these layers.

`make_packing_exact(language_model)` (a family's `prepare_language_model` calls it once)
replaces each Gated DeltaNet layer's forward by one that, given the row's `PackedLayout`
(the kwarg `packed_layout`, which `PolicyLM.hidden_states` passes to every layer of a model
holding such layers, whatever its attention kernel), starts every sample from a zero recurrent
state and zero convolution history. Two paths, picked once per device by `choose_kernels` (logged):
- varlen: the row stays unpadded (1, N, ...); the projections, gates, norm and output projection
  run over it once, and the two token-mixing kernels (causal convolution, gated delta rule) take
  the segment boundaries (`cu_seqlens`) and a state per segment: flash-linear-attention's on CUDA
  when it imports, else `TORCH_VARLEN` (the same signatures, a loop over segments of transformers'
  reference kernels). A shared prompt (`PackedLayout`'s context) runs once: its final convolution
  inputs and recurrent state start every completion that continues it (`VarlenPlan`), as a cache
  would across a prefill; gradients flow through that state into the prompt's tokens.
- padded (no fla, no shared prompt in the row): the layer's own forward on the layout's
  right-padded batches of whole sequences (one batch row per sample) with no cache, the real
  tokens gathered back. The layer is causal end to end, so pads after a sample's end never reach
  its tokens. On the CPU the varlen loop is no slower (docs/packing.md); padded stays the choice
  there for rows without shared prompts as the layer's own forward, and on CUDA without fla as
  fewer, larger kernel calls than a loop over segments.
Without a layout (the embedded engine's prefill and decode, with a cache) the forward is
transformers' own, untouched.
"""

from __future__ import annotations

import functools
import importlib
import logging
import types
from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch import nn
from torch.nn import functional as F

from saccade.models.attention import PackedLayout

log = logging.getLogger("saccade.linear_attention")

LINEAR_ATTENTION = "linear_attention"  # transformers' layer type of a Gated DeltaNet layer (config.layer_types)

# Boundary arguments a packed row may carry, none of which means anything to one row of a
# padded batch (fla's chunk kernel would read cu_seq_lens_q as the batch's boundaries).
_ROW_BOUNDARY_KWARGS = ("packed_layout", "cu_seq_lens_q", "cu_seq_lens_k", "max_length_q", "max_length_k")


def make_packing_exact(language_model: nn.Module) -> int:
    """Make every Gated DeltaNet layer of `language_model` start each sample of a packed row from
    a zero recurrent state and convolution history. Idempotent; returns how many layers it made
    exact (0 for a model without linear attention). Names, parameters and state dicts unchanged."""
    layers = linear_attention_layers(language_model)
    for layer in layers:
        layer.forward = types.MethodType(_packing_exact_forward, layer)
    return len(layers)


def linear_attention_layers(language_model: nn.Module) -> list[nn.Module]:
    """The token mixers of the decoder layers whose config type is linear attention
    (transformers' `layer.linear_attn`, `config.layer_types`)."""
    layer_types = getattr(language_model.config, "layer_types", None) or []
    decoder_layers = getattr(language_model, "layers", [])
    return [layer.linear_attn for layer, kind in zip(decoder_layers, layer_types) if kind == LINEAR_ATTENTION]


def has_linear_attention(language_model: nn.Module) -> bool:
    """Whether a packed row needs sample boundaries beyond attention's: any linear-attention layer."""
    return LINEAR_ATTENTION in (getattr(language_model.config, "layer_types", None) or [])


def is_packing_exact(language_model: nn.Module) -> bool:
    """Whether every linear-attention layer resets at sample boundaries (`make_packing_exact` ran)."""
    return all(getattr(layer.forward, "__func__", None) is _packing_exact_forward
               for layer in linear_attention_layers(language_model))


def _packing_exact_forward(self: nn.Module, hidden_states: torch.Tensor, cache_params=None,
                           attention_mask: torch.Tensor | None = None, **kwargs) -> torch.Tensor:
    """A Gated DeltaNet layer's forward (transformers' signature) that, given `packed_layout`, runs
    each sample of the row (1, N, H) as its own sequence: the varlen path where `choose_kernels`
    gives kernels, else right-padded batches of whole sequences through the layer's own forward.
    Without a layout: the layer's own forward."""
    reference = type(self).forward
    layout: PackedLayout | None = kwargs.get("packed_layout")
    if layout is None and kwargs.get("cu_seq_lens_q") is not None:
        layout = PackedLayout.from_cu_seqlens(kwargs["cu_seq_lens_q"], hidden_states.device)  # reads cu on the host
    if layout is None:
        return reference(self, hidden_states, cache_params=cache_params, attention_mask=attention_mask, **kwargs)
    assert cache_params is None, "a packed row is a training forward: no cache"
    assert attention_mask is None, "a packed row has no padding to mask"
    assert hidden_states.shape[0] == 1, "packed rows come one per micro-batch"
    kernels = choose_kernels(hidden_states.device, shared_prompts=any(b > a for a, b in layout.context))
    if kernels is not None:
        return varlen_forward(self, hidden_states, layout, kernels)
    kwargs = {k: v for k, v in kwargs.items() if k not in _ROW_BOUNDARY_KWARGS}

    def run_alone(batch_SLH: torch.Tensor) -> torch.Tensor:
        return reference(self, batch_SLH, cache_params=None, attention_mask=None, **kwargs)

    return layout.map_padded(run_alone, hidden_states[0]).unsqueeze(0)


# --- The varlen path -------------------------------------------------------------------------------
# The row's tokens stay unpadded, (1, N, ...), and the two token-mixing kernels (the causal convolution
# and the gated delta rule) take the segment boundaries `cu_seqlens`, each segment from its own
# initial state: flash-linear-attention's kernels, or the pure-torch ones below with the same
# signatures. Everything else in the layer is per token and runs over the row once.


@dataclass(frozen=True)
class VarlenKernels:
    """Varlen token mixing with flash-linear-attention's signatures (x, q, k, v: (1, N, ...);
    `cu_seqlens` (S+1,); states per segment, (S, ...); each returns (output, final state or None)):
    - `causal_conv1d(x, weight (D, W), bias, initial_state (S, D, W), output_final_state, activation,
      cu_seqlens)`: a state's slot w holds input W - w back (slot 0 is not read);
    - `chunk_gated_delta_rule(q, k, v, g, beta, initial_state (S, Hv, Dk, Dv), output_final_state,
      use_qk_l2norm_in_kernel, cu_seqlens)`."""

    name: str
    causal_conv1d: Callable
    chunk_gated_delta_rule: Callable


def torch_varlen_causal_conv1d(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None,
                               initial_state: torch.Tensor | None = None, output_final_state: bool = False,
                               activation: str | None = None, cu_seqlens: torch.Tensor | None = None):
    """fla's `causal_conv1d`, varlen, as a loop over segments of transformers' reference convolution:
    each segment's last W - 1 inputs of history (zeros without `initial_state`) are put in front of
    it, and their outputs dropped."""
    from transformers.models.qwen3_5 import modeling_qwen3_5

    conv = getattr(modeling_qwen3_5.causal_conv1d_fn, "__wrapped__", modeling_qwen3_5.causal_conv1d_fn)
    width = weight.shape[-1]
    bounds = cu_seqlens.tolist()
    outs, finals = [], []
    for i, (a, b) in enumerate(zip(bounds, bounds[1:])):
        x_DL = x[0, a:b].transpose(0, 1)
        history_DW = (initial_state[i, :, 1:] if initial_state is not None
                      else x_DL.new_zeros(x_DL.shape[0], width - 1))
        inputs_1DL = torch.cat([history_DW, x_DL], 1).unsqueeze(0)
        outs.append(conv(inputs_1DL, weight, bias, activation=activation)[0, :, width - 1:])
        if output_final_state:  # the last W inputs (zeros before any)
            tail_DW = inputs_1DL[0, :, -width:]
            finals.append(F.pad(tail_DW, (width - tail_DW.shape[1], 0)))
    y_1LD = torch.cat(outs, 1).transpose(0, 1).unsqueeze(0)
    return y_1LD, torch.stack(finals) if output_final_state else None


def torch_varlen_chunk_gated_delta_rule(q, k, v, g, beta, initial_state: torch.Tensor | None = None,
                                        output_final_state: bool = False, use_qk_l2norm_in_kernel: bool = False,
                                        cu_seqlens: torch.Tensor | None = None):
    """fla's `chunk_gated_delta_rule`, varlen, as a loop over segments of transformers' reference
    (torch_chunk_gated_delta_rule), each from its row of `initial_state` (zeros without)."""
    from transformers.models.qwen3_5 import modeling_qwen3_5

    rule = getattr(modeling_qwen3_5.torch_chunk_gated_delta_rule, "__wrapped__",
                   modeling_qwen3_5.torch_chunk_gated_delta_rule)
    bounds = cu_seqlens.tolist()
    outs, finals = [], []
    for i, (a, b) in enumerate(zip(bounds, bounds[1:])):
        out, final = rule(q[:, a:b], k[:, a:b], v[:, a:b], g=g[:, a:b], beta=beta[:, a:b],
                          initial_state=None if initial_state is None else initial_state[i:i + 1],
                          output_final_state=output_final_state, use_qk_l2norm_in_kernel=use_qk_l2norm_in_kernel)
        outs.append(out)
        finals.append(final)
    return torch.cat(outs, 1), torch.cat(finals) if output_final_state else None


TORCH_VARLEN = VarlenKernels("torch reference, varlen (a loop over segments)", torch_varlen_causal_conv1d,
                             torch_varlen_chunk_gated_delta_rule)


def fla_kernels() -> VarlenKernels | None:
    """flash-linear-attention's varlen kernels (Triton, CUDA only), or None where fla does not import."""
    try:
        from fla.ops.gated_delta_rule import chunk_gated_delta_rule
        try:  # fla.modules.convolution: fla 0.2-0.4 and, as an alias, the newest; fla.modules.conv between
            from fla.modules.convolution import causal_conv1d
        except ImportError:
            from fla.modules.conv import causal_conv1d
    except Exception:  # ImportError, or Triton failing to load without a GPU
        return None
    return VarlenKernels("flash-linear-attention, varlen (cu_seqlens)", causal_conv1d, chunk_gated_delta_rule)


# fla 0.6's gated-delta forward solves its triangular system with
# `tl.dot(..., input_precision=SOLVE_TRIL_DOT_PRECISION)`, a module constant it sets to 'tf32' on
# sm >= 80. An explicit precision wins over TRITON_F32_DEFAULT, so the environment variable cannot
# make that solve IEEE fp32; the constant can, if it is set before Triton first compiles the kernel
# (Triton reads a jitted function's globals when it compiles, and refuses a changed one after).
FLA_PRECISION_MODULE = "fla.ops.gated_delta_rule.chunk_fwd"


def fla_solve_precision(precision: str | None = None) -> str:
    """fla's precision for the gated-delta forward's triangular solve ('tf32' or 'ieee'); with
    `precision`, set it first (before the first fla forward in this process: see above). Raises
    ImportError where fla does not import."""
    module = importlib.import_module(FLA_PRECISION_MODULE)
    if precision is not None:
        import triton.language as tl

        module.SOLVE_TRIL_DOT_PRECISION = tl.constexpr(precision)
    value = module.SOLVE_TRIL_DOT_PRECISION
    return str(getattr(value, "value", value))


_chosen: dict[tuple[str, bool], VarlenKernels | None] = {}


def choose_kernels(device: torch.device, shared_prompts: bool = False) -> VarlenKernels | None:
    """The kernels a packed row's linear layers run on this device; None for the padded path (the
    layer's own forward over right-padded batches). Logged once per choice:
    - CUDA with flash-linear-attention importable: fla's varlen kernels (no padding; shared prompts run once);
    - otherwise, a row with shared prompts: the torch varlen kernels, which run each prompt once;
    - otherwise the padded path: the layer's own forward (transformers' kernels) over batches.
    docs/packing.md has the figures behind the last two."""
    key = (torch.device(device).type, shared_prompts)
    if key not in _chosen:
        fla = fla_kernels() if key[0] == "cuda" else None
        if fla is not None:
            choice, why = fla, "flash-linear-attention imports and the row is on CUDA"
        elif shared_prompts:
            choice, why = TORCH_VARLEN, ("shared prompts run once, their final state carried into each "
                                         "completion" + ("; flash-linear-attention does not import" if key[0] == "cuda"
                                                         else f"; fla needs CUDA, the row is on {key[0]}"))
        else:
            choice, why = None, ("no flash-linear-attention on CUDA" if key[0] == "cuda"
                                 else f"fla needs CUDA, the row is on {key[0]}")
        name = choice.name if choice else "the layer's own forward over right-padded batches (reference kernels)"
        log.warning("linear attention, packed rows%s: %s (%s)", " with shared prompts" if shared_prompts else "",
                    name, why)
        _chosen[key] = choice
    return _chosen[key]


@dataclass(frozen=True)
class VarlenPlan:
    """A packed row cut into varlen pieces. With shared prompts, two passes: the prompts (each once,
    `prompt_index` the row positions, `prompt_cu` their boundaries), keeping their final states;
    then every other piece (`rest_index`, `rest_cu`) from its prompt's state (`rest_state[j]`: 1 + the
    prompt's number, 0 for zeros). A group's first sample is whole in the row: it splits into its
    prompt and its completion. `inverse` takes the outputs, prompts' then the rest's, back to row order.
    Without shared prompts: one pass over the row's segments, no gathers (the index fields are None)."""

    rest_cu: torch.Tensor
    rest_index: torch.Tensor | None = None
    rest_state: torch.Tensor | None = None
    prompt_index: torch.Tensor | None = None
    prompt_cu: torch.Tensor | None = None
    inverse: torch.Tensor | None = None

    @classmethod
    def of(cls, layout: PackedLayout, device: torch.device) -> VarlenPlan:
        assert layout.bounds, "the layout knows its row's boundaries (PackedLayout.from_cu_seqlens)"
        return _plan(layout.bounds, layout.context, device)


@functools.lru_cache(maxsize=8)  # one row's plan, built once and read by every linear layer of the forward
def _plan(bounds: tuple[int, ...], context: tuple[tuple[int, int], ...], device: torch.device) -> VarlenPlan:
    segments = list(zip(bounds, bounds[1:]))
    context = context or ((0, 0),) * len(segments)
    prompts = sorted({c for c in context if c[1] > c[0]})

    def cu(pieces):
        return torch.tensor([0, *(b - a for a, b in pieces)]).cumsum(0).to(device)

    if not prompts:
        return VarlenPlan(cu(segments))
    number = {c: p for p, c in enumerate(prompts)}
    head = {a: (a, b) for a, b in prompts}  # a prompt is the head of its group's first sample
    rest, state = [], []
    for (s, e), c in zip(segments, context):
        if c[1] > c[0]:
            assert s not in head, "a continuing sample holds no prompt of its own"
            rest.append((s, e)), state.append(1 + number[c])
        elif s in head:
            a, b = head.pop(s)
            assert b <= e, "a shared prompt lies inside one segment, at its start"
            if b < e:
                rest.append((b, e)), state.append(1 + number[(a, b)])
        else:
            rest.append((s, e)), state.append(0)
    assert not head, f"shared prompts {sorted(head.values())} start no segment"
    prompt_index = torch.cat([torch.arange(a, b) for a, b in prompts])
    rest_index = torch.cat([torch.arange(a, b) for a, b in rest])
    order = torch.cat([prompt_index, rest_index])
    assert len(order) == bounds[-1], "every token in one piece"
    inverse = torch.empty_like(order)
    inverse[order] = torch.arange(len(order))
    return VarlenPlan(cu(rest), rest_index.to(device), torch.tensor(state, device=device), prompt_index.to(device),
                      cu(prompts), inverse.to(device))


def varlen_forward(self: nn.Module, hidden_1NH: torch.Tensor, layout: PackedLayout,
                   kernels: VarlenKernels) -> torch.Tensor:
    """A Gated DeltaNet layer (transformers' `Qwen3_5GatedDeltaNet`, its parameters and sub-modules)
    over a packed row, unpadded: its forward without the cache and mask branches, the token mixing on
    `kernels` with the row's boundaries. Shared prompts (the layout's context) run once: their final
    convolution inputs and recurrent state start each completion that continues them."""
    N = hidden_1NH.shape[1]
    plan = VarlenPlan.of(layout, hidden_1NH.device)
    qkv_NC = self.in_proj_qkv(hidden_1NH)[0]
    z_1NV = self.in_proj_z(hidden_1NH)
    beta_NH = self.in_proj_b(hidden_1NH)[0].sigmoid()
    # In fp32, as the layer does (A_log.exp() would overflow in fp16).
    g_NH = -self.A_log.float().exp() * F.softplus(self.in_proj_a(hidden_1NH)[0].float() + self.dt_bias)
    if plan.prompt_index is None:
        core_NHD = _mix(self, kernels, qkv_NC, g_NH, beta_NH, plan.rest_cu)[0]
    else:
        def pick(index):  # the pieces' tokens of the per-token inputs
            return (t.index_select(0, index) for t in (qkv_NC, g_NH, beta_NH))

        prompt_core, conv_PDW, recurrent_PHKV = _mix(self, kernels, *pick(plan.prompt_index), plan.prompt_cu,
                                                     final=True)
        # Each further piece starts from its prompt's final state, or from zeros (row 0 put in front).
        conv_RDW, recurrent_RHKV = (torch.cat([s.new_zeros(1, *s.shape[1:]), s]).index_select(0, plan.rest_state)
                                    for s in (conv_PDW, recurrent_PHKV))
        rest_core = _mix(self, kernels, *pick(plan.rest_index), plan.rest_cu, conv_RDW, recurrent_RHKV)[0]
        core_NHD = torch.cat([prompt_core, rest_core]).index_select(0, plan.inverse)
    core_MD = self.norm(core_NHD.reshape(-1, self.head_v_dim), z_1NV.reshape(-1, self.head_v_dim))
    return self.out_proj(core_MD.reshape(1, N, -1))


def _mix(self: nn.Module, kernels: VarlenKernels, qkv_TC: torch.Tensor, g_TH: torch.Tensor, beta_TH: torch.Tensor,
         cu_seqlens: torch.Tensor, conv_state: torch.Tensor | None = None,
         recurrent_state: torch.Tensor | None = None, final: bool = False):
    """The layer's token mixing over varlen pieces (T tokens): the causal convolution over q, k, v,
    then the gated delta rule. Returns the core output (T, Hv, Dv) and, with `final`, each piece's
    final convolution inputs and recurrent state."""
    T = qkv_TC.shape[0]
    qkv_1TC, conv_final = kernels.causal_conv1d(
        qkv_TC.unsqueeze(0), self.conv1d.weight.squeeze(1), self.conv1d.bias, initial_state=conv_state,
        output_final_state=final, activation=self.activation, cu_seqlens=cu_seqlens)
    q, k, v = torch.split(qkv_1TC, [self.key_dim, self.key_dim, self.value_dim], dim=-1)
    q, k = (t.reshape(1, T, -1, self.head_k_dim).repeat_interleave(self.num_v_heads // self.num_k_heads, dim=2)
            for t in (q, k))
    core_1THD, recurrent_final = kernels.chunk_gated_delta_rule(
        q, k, v.reshape(1, T, -1, self.head_v_dim), g=g_TH.unsqueeze(0), beta=beta_TH.unsqueeze(0),
        initial_state=recurrent_state, output_final_state=final, use_qk_l2norm_in_kernel=True,
        cu_seqlens=cu_seqlens)
    return core_1THD[0], conv_final, recurrent_final
