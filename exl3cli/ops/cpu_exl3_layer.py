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
