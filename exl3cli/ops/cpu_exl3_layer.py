"""A decoder layer's decode step in two CPU calls with EXL3 weights kept compressed
(``csrc/ops/cpu/exl3_layer_cpu.cpp``), each with its PyTorch twin.

The EXL3 counterpart of ``cpu_kernels.norm_qkv_rope_cpu`` / ``out_mlp_cpu`` (packed dense
weights): per token and layer two op calls instead of about 25 (seven linears behind
their Python modules, the norms, rotary, SiLU, residual adds and the concatenations of
fused projections), the products being ``cpu_kernels.exl3_linear_cpu`` each.

Public API:
- ``Exl3Part`` (trellis_t, suh, svh, bias, k_bits, n): one EXL3 linear as the kernel
  reads it (``engine/layers/cpu_exl3.CpuExl3Linear``'s buffers).
- ``Exl3LayerWeights`` (qkv, o, gate_up, down: tuples of parts, codebook).
- ``exl3_norm_qkv_rope_reference`` / ``exl3_norm_qkv_rope_cpu(x, norm_weight, eps,
  weights, cos, sin, head_dim, rot_heads) -> [M, qkv width]``.
- ``exl3_out_mlp_reference`` / ``exl3_out_mlp_cpu(x, attn, norm_weight, eps, weights)
  -> [M, E]``.
- ``Exl3StackWeights`` and ``exl3_decode_stack_reference`` / ``exl3_decode_stack_cpu(x,
  stack, cos, sin, keys, values, write_slots, decode_slots, lengths) -> [M, E]``: a whole
  stack's decode step (one new token per sequence, paged cache written and read) in one
  op call (``stack_args`` builds its flat arguments once).
"""

from __future__ import annotations

from typing import NamedTuple

import torch

from exl3cli.ops import cpu_kernels


class Exl3Part(NamedTuple):
    trellis_t: torch.Tensor
    suh: torch.Tensor
    svh: torch.Tensor
    bias: torch.Tensor | None
    k_bits: float
    n: int


class Exl3LayerWeights(NamedTuple):
    qkv: tuple[Exl3Part, ...]
    o: tuple[Exl3Part, ...]
    gate_up: tuple[Exl3Part, ...]
    down: tuple[Exl3Part, ...]
    codebook: str


def _project_reference(x: torch.Tensor, parts: tuple[Exl3Part, ...], codebook: str) -> torch.Tensor:
    return torch.cat([cpu_kernels.exl3_linear_reference(x, p.trellis_t, p.suh, p.svh, p.bias,
                                                        p.k_bits, codebook, p.n)
                      for p in parts], dim=-1)


def exl3_norm_qkv_rope_reference(x: torch.Tensor, norm_weight: torch.Tensor, eps: float,
                                 weights: Exl3LayerWeights, cos: torch.Tensor,
                                 sin: torch.Tensor, head_dim: int, rot_heads: int) -> torch.Tensor:
    """rms_norm(x [M, E]) through the q|k|v parts, heads 0..rot_heads-1 rotated."""
    normed = cpu_kernels.rms_norm_reference(x, norm_weight, eps)
    out = _project_reference(normed, weights.qkv, weights.codebook)
    cpu_kernels.rotary_reference(out.view(x.shape[0], -1, head_dim), cos, sin, rot_heads)
    return out


def exl3_out_mlp_reference(x: torch.Tensor, attn: torch.Tensor, norm_weight: torch.Tensor,
                           eps: float, weights: Exl3LayerWeights) -> torch.Tensor:
    """h = x + o(attn); h + down(silu_mul(gate|up(rms_norm(h))))."""
    book = weights.codebook
    mid, normed = cpu_kernels.add_rms_norm_reference(
        x, _project_reference(attn, weights.o, book), norm_weight, eps)
    hidden = cpu_kernels.silu_mul_reference(_project_reference(normed, weights.gate_up, book))
    return mid + _project_reference(hidden, weights.down, book)


def _flat(parts: tuple[Exl3Part, ...]) -> tuple[list, list, list, list, list, list]:
    return ([p.trellis_t for p in parts], [p.suh for p in parts], [p.svh for p in parts],
            [p.bias for p in parts], [float(p.k_bits) for p in parts], [p.n for p in parts])


def exl3_norm_qkv_rope_cpu(x: torch.Tensor, norm_weight: torch.Tensor, eps: float,
                           weights: Exl3LayerWeights, cos: torch.Tensor, sin: torch.Tensor,
                           head_dim: int, rot_heads: int) -> torch.Tensor:
    """``exl3_norm_qkv_rope_reference`` in one op (float32, contiguous)."""
    book = weights.codebook
    return cpu_kernels._ops().exl3_norm_qkv_rope(
        x, norm_weight, eps, *_flat(weights.qkv), cpu_kernels._codebook_id(book),
        cpu_kernels._scalar_lut(book), cos.contiguous(), sin.contiguous(), head_dim, rot_heads)


def exl3_out_mlp_cpu(x: torch.Tensor, attn: torch.Tensor, norm_weight: torch.Tensor,
                     eps: float, weights: Exl3LayerWeights) -> torch.Tensor:
    """``exl3_out_mlp_reference`` in one op (float32, contiguous)."""
    book, parts = weights.codebook, weights.o + weights.gate_up + weights.down
    counts = [len(weights.o), len(weights.gate_up), len(weights.down)]
    return cpu_kernels._ops().exl3_out_mlp(
        x, attn.contiguous(), norm_weight, eps, *_flat(parts),
        cpu_kernels._codebook_id(book), cpu_kernels._scalar_lut(book), counts)


class Exl3StackWeights(NamedTuple):
    """A stack of plain layers for ``exl3_decode_stack_*``: per layer its two norms
    (input, post-attention) with their eps, its ``Exl3LayerWeights`` and attention window
    (None: all of the history); one codebook, heads x head_dim queries, kv_heads keys."""

    norms: tuple[tuple[torch.Tensor, float, torch.Tensor, float], ...]
    layers: tuple[Exl3LayerWeights, ...]
    windows: tuple[int | None, ...]
    heads: int
    kv_heads: int
    head_dim: int


def exl3_decode_stack_reference(x: torch.Tensor, stack: Exl3StackWeights, cos: torch.Tensor,
                                sin: torch.Tensor, keys: list[torch.Tensor],
                                values: list[torch.Tensor], write_slots: torch.Tensor,
                                decode_slots: torch.Tensor, lengths: torch.Tensor) -> torch.Tensor:
    """One decode step (x [M, E]: one new token per sequence) through every layer: q|k|v,
    the new keys/values written into the paged stores keys[l]/values[l] [slots, KV, D] at
    write_slots [M], attention of row m over decode_slots[m, :lengths[m]], o and the MLP."""
    heads, kv_heads, dim = stack.heads, stack.kv_heads, stack.head_dim
    q_width, kv_width = heads * dim, kv_heads * dim
    for (w_in, eps_in, w_post, eps_post), layer, window, kc, vc in zip(
            stack.norms, stack.layers, stack.windows, keys, values, strict=True):
        qkv = exl3_norm_qkv_rope_reference(x, w_in, eps_in, layer, cos, sin, dim, heads + kv_heads)
        rows = x.shape[0]
        kc.index_copy_(0, write_slots, qkv[:, q_width:q_width + kv_width].reshape(rows, kv_heads, dim))
        vc.index_copy_(0, write_slots, qkv[:, q_width + kv_width:].reshape(rows, kv_heads, dim))
        query = qkv[:, :q_width].reshape(rows, heads, dim)
        attn = cpu_kernels.attend_decode_reference(query, kc, vc, decode_slots, lengths, window)
        x = exl3_out_mlp_reference(x, attn.reshape(rows, q_width), w_post, eps_post, layer)
    return x


def exl3_decode_stack_cpu(x: torch.Tensor, stack: Exl3StackWeights, cos: torch.Tensor,
                          sin: torch.Tensor, keys: list[torch.Tensor], values: list[torch.Tensor],
                          write_slots: torch.Tensor, decode_slots: torch.Tensor,
                          lengths: torch.Tensor, flat: tuple | None = None) -> torch.Tensor:
    """``exl3_decode_stack_reference`` in one op call for the whole stack (float32);
    `flat`: ``stack_args(stack)``, built once by a caller that runs the stack per token."""
    flat = flat if flat is not None else stack_args(stack)
    return cpu_kernels._ops().exl3_decode_stack(
        x.contiguous(), *flat, cos.contiguous(), sin.contiguous(), stack.head_dim, stack.heads,
        stack.kv_heads, keys, values, write_slots, decode_slots, lengths,
        [0 if w is None else int(w) for w in stack.windows])


def stack_args(stack: Exl3StackWeights) -> tuple:
    """The op's flat weight arguments (norms, eps, the parts' lists, counts, codebook)."""
    norms, eps, parts, counts = [], [], [], []
    books = {layer.codebook for layer in stack.layers}
    if len(books) != 1:
        raise ValueError("a decode stack runs one codebook")
    book = books.pop()
    for (w_in, eps_in, w_post, eps_post), layer in zip(stack.norms, stack.layers, strict=True):
        norms += [w_in, w_post]
        eps += [float(eps_in), float(eps_post)]
        groups = (layer.qkv, layer.o, layer.gate_up, layer.down)
        counts += [len(g) for g in groups]
        parts += [p for g in groups for p in g]
    return (norms, eps, *_flat(tuple(parts)), counts, cpu_kernels._codebook_id(book),
            cpu_kernels._scalar_lut(book))
