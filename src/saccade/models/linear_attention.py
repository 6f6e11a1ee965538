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
holding such layers, whatever its attention kernel), runs the layer's own forward on the
layout's right-padded batches of whole sequences (one batch row per sample: zero state,
zero convolution history at its first token) with no cache, and gathers the real tokens back
in row order. The layer is causal end to end (projections per token, a causal convolution,
a causal recurrence, a per-token gated norm and output projection), so pads after a sample's
end never reach its tokens. A shared prompt (`PackedLayout`'s context) is gathered in front
of each completion that continues it, so its state is recomputed per sequence: exact, at the
price of running the prompt's tokens through every linear layer once per continuing sample
(docs/packing.md). Without a layout (the embedded engine's prefill and decode, with a cache)
the forward is transformers' own, untouched.

The layer's own forward is what runs, so its kernels are whatever transformers picked:
flash-linear-attention's when installed (a batch of rows, no `cu_seqlens`), the torch
reference otherwise. A varlen path (fla's `cu_seqlens`, no padding) is not built: no GPU here
to test it on.
"""

from __future__ import annotations

import types

import torch
from torch import nn

from saccade.models.attention import PackedLayout

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
    each sample of the row (1, N, H) as its own sequence: right-padded batches of whole sequences,
    the layer's own forward on each, the real tokens gathered back. Without it: the layer's own."""
    reference = type(self).forward
    layout: PackedLayout | None = kwargs.get("packed_layout")
    if layout is None and kwargs.get("cu_seq_lens_q") is not None:
        layout = PackedLayout.from_cu_seqlens(kwargs["cu_seq_lens_q"], hidden_states.device)  # reads cu on the host
    if layout is None:
        return reference(self, hidden_states, cache_params=cache_params, attention_mask=attention_mask, **kwargs)
    assert cache_params is None, "a packed row is a training forward: no cache"
    assert attention_mask is None, "a packed row has no padding to mask"
    assert hidden_states.shape[0] == 1, "packed rows come one per micro-batch"
    kwargs = {k: v for k, v in kwargs.items() if k not in _ROW_BOUNDARY_KWARGS}
    def run_alone(batch_SLH: torch.Tensor) -> torch.Tensor:
        return reference(self, batch_SLH, cache_params=None, attention_mask=None, **kwargs)

    return layout.map_padded(run_alone, hidden_states[0]).unsqueeze(0)
