"""EXL3 linears on the CPU at their compressed size (``EXL3_CPU_WEIGHTS=exl3``).

The dense CPU modes (engine/layers/linear.py) expand every EXL3 layer to a float32, bfloat16
or int8 matrix at load. Here the packed trellis stays as it is in the file (K bits per
weight) and every forward decodes it inside the matmul: ``csrc/ops/cpu/exl3_gemm_cpu.cpp``
(tiles decoded in AVX-512 registers, fused with the multiply; the block Hadamards and
the suh/svh scales in the same op), or its PyTorch twin
``cpu_kernels.exl3_linear_reference`` when the CPU kernels are unavailable.

Public API:
- ``CpuExl3Linear(source: Exl3Linear)``: the layer, built from an ``Exl3Linear`` in
  trellis mode on the CPU; ``forward(x[..., in]) -> y[..., out]`` (float32 compute,
  returned in x's dtype); ``nbytes`` the bytes it holds.
- ``compressed_linear(parts, dense_packing="fp32") -> Linear``: what the loader builds
  for one (possibly fused) projection in this mode: EXL3 parts as ``CpuExl3Linear``,
  dense parts packed for the float32 GEMV kernel (float32 models).
- ``Exl3DecodePlan.of(qkv, o, gate_up, down) -> Exl3DecodePlan | None``: a plain layer's
  decode step in two op calls (ops/cpu_exl3_layer.py) when all four projections are
  ``CpuExl3Linear`` (or fused ones) of one codebook on the compiled kernels;
  ``norm_qkv_rope(rows, norm, cos, sin, dim, rot_heads)`` and ``out_mlp(rows, attended,
  norm)`` as ``DecoderLayer._decode_rows`` calls them. ``EXL3_CPU_LAYER=0`` turns it off.
"""

from __future__ import annotations

import os
from typing import NamedTuple

import torch

from exl3cli.engine.layers.linear import (
    Exl3Linear,
    FusedLinear,
    Linear,
    fuse_linears,
    pack_for_cpu,
)
from exl3cli.errors import ModelLoadError
from exl3cli.ops import cpu_kernels
from exl3cli.ops.cpu_exl3_layer import (
    Exl3LayerWeights,
    Exl3Part,
    exl3_norm_qkv_rope_cpu,
    exl3_out_mlp_cpu,
)


class CpuExl3Linear(Linear):
    """One EXL3 linear held as its packed trellis on the CPU (module docstring)."""

    def __init__(self, source: Exl3Linear):
        super().__init__()
        if source.mode != "trellis":
            raise ValueError("CpuExl3Linear needs an Exl3Linear in trellis mode")
        self.in_features, self.out_features = source.in_features, source.out_features
        self.k_bits, self.codebook = float(source.k), source.codebook
        self.padded_in, self.padded_out = source.padded_in, source.padded_out
        if self.padded_in % 128 or self.padded_out % 128:
            raise ModelLoadError(f"trellis covers {self.padded_in}x{self.padded_out}, "
                                 "not multiples of 128")
        # (kb, nb, words) -> (nb, kb, words): a 16-column strip's tiles side by side.
        self.register_buffer("trellis_t", source.trellis.to("cpu").transpose(0, 1).contiguous(),
                             persistent=False)
        self.register_buffer("suh", source.suh.to("cpu", torch.float32).contiguous(),
                             persistent=False)
        self.register_buffer("svh", source.svh.to("cpu", torch.float32).contiguous(),
                             persistent=False)
        bias = source.bias
        self.register_buffer("bias", None if bias is None else
                             bias.to("cpu", torch.float32).contiguous(), persistent=False)
        self._kernel = cpu_kernels.available()  # checked once: forward runs per token

    @property
    def nbytes(self) -> int:
        """Bytes held: trellis, scales and bias."""
        tensors = [self.trellis_t, self.suh, self.svh, self.bias]
        return sum(t.numel() * t.element_size() for t in tensors if t is not None)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        rows = x.reshape(-1, self.in_features).float().contiguous()
        linear = (cpu_kernels.exl3_linear_cpu if self._kernel
                  else cpu_kernels.exl3_linear_reference)
        y = linear(rows, self.trellis_t, self.suh, self.svh, self.bias, self.k_bits,
                   self.codebook, self.out_features)
        return y.to(x.dtype).view(*x.shape[:-1], self.out_features)

    def extra_repr(self) -> str:
        return (f"in={self.in_features}, out={self.out_features}, K={self.k_bits:g}, "
                f"codebook={self.codebook}, kernel={self._kernel}")


def compressed_linear(parts: list[Linear], dense_packing: str | None = "fp32") -> Linear:
    """One projection of the ``exl3`` CPU mode from its loaded parts (``Exl3Linear`` in
    trellis mode or ``DenseLinear``): EXL3 parts keep their trellis, dense ones are
    packed with ``dense_packing`` (the ``fp32`` mode's packing; None: left as they are)."""
    kept = [CpuExl3Linear(p) if isinstance(p, Exl3Linear) and p.mode == "trellis" else p
            for p in parts]
    fused = fuse_linears(kept)
    return pack_for_cpu(fused, dense_packing) if dense_packing else fused


def _parts(linear: Linear) -> tuple[CpuExl3Linear, ...] | None:
    parts = list(linear.parts) if isinstance(linear, FusedLinear) else [linear]
    if not all(type(p) is CpuExl3Linear and p._kernel for p in parts):
        return None
    return tuple(parts)  # type: ignore[arg-type]


class Exl3DecodePlan(NamedTuple):
    """See the module docstring."""

    weights: Exl3LayerWeights

    @staticmethod
    def of(qkv: Linear, o: Linear, gate_up: Linear, down: Linear) -> Exl3DecodePlan | None:
        if os.environ.get("EXL3_CPU_LAYER", "1") == "0":
            return None
        found = [_parts(lin) for lin in (qkv, o, gate_up, down)]
        if any(f is None for f in found):
            return None
        books = {p.codebook for f in found for p in f}  # type: ignore[union-attr]
        if len(books) != 1:
            return None
        groups = [tuple(Exl3Part(p.trellis_t, p.suh, p.svh, p.bias, p.k_bits, p.out_features)
                        for p in f) for f in found]  # type: ignore[union-attr]
        return Exl3DecodePlan(Exl3LayerWeights(*groups, codebook=books.pop()))

    def norm_qkv_rope(self, rows: torch.Tensor, norm: torch.nn.Module, cos: torch.Tensor,
                      sin: torch.Tensor, dim: int, rot_heads: int) -> torch.Tensor:
        return exl3_norm_qkv_rope_cpu(rows, norm.weight, norm.eps, self.weights, cos, sin,
                                      dim, rot_heads)

    def out_mlp(self, rows: torch.Tensor, attended: torch.Tensor,
                norm: torch.nn.Module) -> torch.Tensor:
        return exl3_out_mlp_cpu(rows, attended, norm.weight, norm.eps, self.weights)
