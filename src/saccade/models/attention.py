"""Attention over packed rows that never computes the blocks packing masks out.

A packed row holds S samples back to back (N tokens). Attention must stay inside each
sample: a block-diagonal causal mask. transformers' sdpa path builds that mask (N x N) and
hands it to `scaled_dot_product_attention`, whose CPU kernel (and the GPU's efficient
kernel) computes every block, masked ones included: N^2 work for sum(L_i^2) useful, and a
mask defeats the flash kernels. `packed_sdpa` instead lays the row's samples out as
batches of whole sequences, each right-padded to its longest (a row gather of q, k and v),
runs causal sdpa over them (`is_causal=True`, no mask: the fast kernel on CPU and GPU), and
gathers the real tokens back. Samples of very different lengths go in different batches
(`length_buckets`), so the work stays close to sum(L_i^2). Pads sit after each sample's last
token, so causal attention never lets a real query see one; the pads' own outputs are dropped.

Registered with transformers' `AttentionInterface` as "packed_sdpa"; without sample
boundaries (the engine's prefill and decode, padded batches) it is transformers' own sdpa
with the usual mask, so one model serves the trainer and the embedded engine.
The layout (`PackedLayout`) is built once per forward from the micro-batch's host-side
`cu_seqlens` and passed to every layer as `packed_layout`, so no layer waits on the device.
docs/packing.md has the measurements that made it the default.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch.nn import functional as F

PACKED_SDPA = "packed_sdpa"

# A 4-D attention mask of no size: transformers passes a 4-D mask through untouched instead of
# building the (N x N) block mask that packed_sdpa would not read. Anything else fed this
# placeholder fails on its shape, loudly.
NO_MASK = torch.ones(1, 1, 0, 0, dtype=torch.bool)


@dataclass
class PackedLayout:
    """Where each sample of a packed row goes in the padded batches attention runs on.

    Samples are grouped by length (`length_buckets`); bucket b is a (S_b, L_b) batch, right-
    padded to its longest sample. `gathers[b]` (S_b * L_b,) picks the row's tokens for it (pads
    repeat the sample's last token); `scatter_N` picks every real token back out of the
    buckets' outputs, concatenated. Built once per forward on the host (no device sync) and
    read by every layer."""

    gathers: list[torch.Tensor]
    shapes: list[tuple[int, int]]  # (S_b, L_b)
    scatter_N: torch.Tensor
    # The row as the layout was built from it, on the host: segment boundaries (S+1,) and, per
    # segment, the row range of the shared prompt it continues ((0, 0): none). Read by layers that
    # lay the row out their own way (linear attention's varlen kernels).
    bounds: tuple[int, ...] = ()
    context: tuple[tuple[int, int], ...] = ()

    @classmethod
    def from_cu_seqlens(cls, cu_seqlens: torch.Tensor, device: torch.device | str = "cpu",
                        context: list[tuple[int, int]] | None = None) -> PackedLayout:
        """The layout of a row with these segment boundaries. `context[i]` (a row range, (0, 0)
        for none) is a shared prompt segment i continues: its sequence is then row[context] +
        row[segment], and only the segment's own tokens take their output from it."""
        cu = cu_seqlens.detach().to("cpu", torch.long)
        starts, lengths = cu[:-1].tolist(), (cu[1:] - cu[:-1]).tolist()
        spans = context or [(0, 0)] * len(starts)
        sequence_lengths = [n + (b - a) for n, (a, b) in zip(lengths, spans, strict=True)]
        total = int(cu[-1])
        gathers, shapes = [], []
        scatter_N = torch.empty(total, dtype=torch.long)
        offset = 0
        for bucket in length_buckets(sequence_lengths):
            longest = max(sequence_lengths[i] for i in bucket)
            gather_SL = torch.empty(len(bucket), longest, dtype=torch.long)
            for row, i in enumerate(bucket):
                a, b = spans[i]
                own = torch.arange(starts[i], starts[i] + lengths[i])
                sequence = torch.cat([torch.arange(a, b), own])
                # Pads repeat the sequence's last token, after it: causal attention never reaches them.
                gather_SL[row] = sequence[torch.arange(longest).clamp(max=len(sequence) - 1)]
                scatter_N[own] = offset + row * longest + (b - a) + torch.arange(lengths[i])
            gathers.append(gather_SL.flatten().to(device, non_blocking=True))
            shapes.append((len(bucket), longest))
            offset += len(bucket) * longest
        return cls(gathers, shapes, scatter_N.to(device, non_blocking=True), tuple(cu.tolist()),
                   tuple((int(a), int(b)) for a, b in spans))

    def map_padded(self, fn, *tensors_N: torch.Tensor) -> torch.Tensor:
        """Run `fn` on each bucket's padded batch and gather the real tokens back in row order.
        `tensors_N` are (N, ...) over the row's tokens; `fn` gets each as (S_b, L_b, ...) and
        returns (S_b, L_b, ...). Returns (N, ...)."""
        outs = []
        for gather, (S, L) in zip(self.gathers, self.shapes, strict=True):
            batches = (t.index_select(0, gather).view(S, L, *t.shape[1:]) for t in tensors_N)
            outs.append(fn(*batches).flatten(0, 1))
        return (outs[0] if len(outs) == 1 else torch.cat(outs)).index_select(0, self.scatter_N)


def length_buckets(lengths: list[int]) -> list[list[int]]:
    """Sample indices grouped so that padding each group to its longest costs little: longest
    first, a sample joins the current group while it is longer than half the group's longest
    (so its attention area is at least a quarter of what it is padded to). Same-length
    samples, a GRPO group's usual case, make one group."""
    order = sorted(range(len(lengths)), key=lambda i: -lengths[i])
    buckets: list[list[int]] = []
    for i in order:
        if buckets and 2 * lengths[i] > lengths[buckets[-1][0]]:
            buckets[-1].append(i)
        else:
            buckets.append([i])
    return buckets


def packed_sdpa_attention(
    module: torch.nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    dropout: float = 0.0,
    scaling: float | None = None,
    packed_layout: PackedLayout | None = None,
    cu_seq_lens_q: torch.Tensor | None = None,
    **kwargs,
) -> tuple[torch.Tensor, None]:
    """transformers' attention-function signature: query (1, Hq, N, D), key/value (1, Hkv, N, D);
    returns (1, N, Hq, D). Without sample boundaries it is transformers' sdpa, mask and all."""
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    if packed_layout is None and cu_seq_lens_q is not None:
        packed_layout = PackedLayout.from_cu_seqlens(cu_seq_lens_q, query.device)  # reads cu on the host
    if packed_layout is None:
        return sdpa_attention_forward(module, query, key, value, attention_mask, dropout=dropout, scaling=scaling,
                                      **kwargs)
    assert query.shape[0] == 1, "packed rows come one per micro-batch"
    # (1, H, N, D) is a view of the projections' (N, H, D): whole tokens are contiguous rows.
    q_NHD, k_NHD, v_NHD = (t[0].transpose(0, 1) for t in (query, key, value))
    gqa = query.shape[1] != key.shape[1]

    def attend(q_SLHD, k_SLHD, v_SLHD):
        out_SHLD = F.scaled_dot_product_attention(
            q_SLHD.transpose(1, 2), k_SLHD.transpose(1, 2), v_SLHD.transpose(1, 2), is_causal=True,
            dropout_p=dropout if module.training else 0.0, scale=scaling, enable_gqa=gqa)
        return out_SHLD.transpose(1, 2)

    return packed_layout.map_padded(attend, q_NHD, k_NHD, v_NHD).unsqueeze(0), None


ATTENTION_CHOICES = ("auto", PACKED_SDPA, "sdpa", "eager", "flash_attention_2")


def resolve_attention(name: str, device: torch.device | str) -> str:
    """The kernel "auto" stands for: packed_sdpa on every device. Measured on the CPU (docs/packing.md):
    it beats the masked sdpa path at every micro-batch size and eager by far. On a GPU it runs torch's
    flash kernel (causal, no mask) without the flash-attn package; flash_attention_2 (varlen, no
    padding at all) stays a choice for where flash-attn is installed. Other names pass through."""
    if name not in ATTENTION_CHOICES:
        raise ValueError(f"unknown attention implementation {name!r}; choose one of {ATTENTION_CHOICES}")
    return PACKED_SDPA if name == "auto" else name


def register() -> None:
    """Make "packed_sdpa" a transformers attention implementation (masks as for sdpa). Idempotent."""
    from transformers import AttentionInterface
    from transformers.masking_utils import AttentionMaskInterface, sdpa_mask

    AttentionInterface.register(PACKED_SDPA, packed_sdpa_attention)
    AttentionMaskInterface.register(PACKED_SDPA, sdpa_mask)


register()
