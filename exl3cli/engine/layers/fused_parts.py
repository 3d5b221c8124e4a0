"""The projections of one input in the fused decode layer (``fused_layer.py``): ``Parts``
holds their trellises, suh/svh vectors and biases and runs them as one launch a step:
``gemm`` (the split sums, with an adapted projection's LoRA update), and for the
``EXL3_LAYER_FOLD=pro`` fold ``norm_gemm`` / ``glu_gemm`` (the input side inside the GEMM
launch, ``ops/gemm_pro.py``).

Public API:
- ``Parts.of(linears) -> Parts | None`` (every linear an ``Exl3Linear`` in trellis mode,
  one K, codebook and padded input, outputs padded to 128), ``parts.gemm(xhs, adapted=None,
  x_in=None) -> (partials, LowRank | None)``, ``parts.splits_for(rows)``,
  ``parts.norm_gemm(x, norm, weight)``, ``parts.glu_gemm(gate, up, gate_up, act, dtype)``,
  ``parts.half_sums()``, ``parts.posts_for(partials)``.
- ``f32_of(layer, name)``: a linear's ``suh``/``svh`` in float32 (the copy made at load).
"""

from __future__ import annotations

from typing import NamedTuple

import torch

from exl3cli.engine.layers.adapted_linear import AdaptedLinear
from exl3cli.engine.layers.linear import Exl3Linear, Linear
from exl3cli.engine.layers.norm import RMSNorm
from exl3cli.ops import cuda_kernels as kernels
from exl3cli.ops import gemm_pro, layer_kernels
from exl3cli.ops.batch_invariant import batch_invariant


class Parts(NamedTuple):
    """Projections of one input, run as one launch per step."""

    trellises: list[torch.Tensor]
    pres: list[torch.Tensor]
    posts: list[torch.Tensor]
    biases: list[torch.Tensor | None]
    widths: list[int]  # logical output columns
    k2: int
    codebook: str
    pad_in: int
    splits: dict[tuple[int, bool], int]  # by (row count, batch-invariant), filled on first use
    half: dict[str, list[torch.Tensor]]  # half_sums(), made on first use

    @staticmethod
    def of(layers: list[Linear]) -> Parts | None:
        if not layers or not all(isinstance(p, Exl3Linear) and p.mode == "trellis"
                                  for p in layers):
            return None
        parts: list[Exl3Linear] = layers  # type: ignore[assignment]
        k2s = {kernels._k2(p.k) for p in parts}
        if len(k2s) != 1 or len({p.codebook for p in parts}) != 1:
            return None
        if len({p.padded_in for p in parts}) != 1 or any(p.padded_out % 128 for p in parts):
            return None
        if parts[0].padded_in % 128:
            return None
        return Parts(
            trellises=[p.trellis.contiguous() for p in parts],
            pres=[f32_of(p, "suh") for p in parts], posts=[f32_of(p, "svh") for p in parts],
            biases=[None if p.bias is None else p.bias.float().contiguous() for p in parts],
            widths=[p.out_features for p in parts], k2=k2s.pop(), codebook=parts[0].codebook,
            pad_in=parts[0].padded_in, splits={}, half={})

    def half_sums(self) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
        """(scales, posts) of EXL3_PREFILL=half's float16 sums: each part's max|svh| in
        float16 (the decode multiplies Ŵ by it, as the unfused prompt path's fold does)
        and svh divided by it. Made on a prompt's first use, never in a graph capture."""
        if not self.half:
            scales = [p.abs().amax().clamp(2.0**-14, 65504.0).half().reshape(1)
                      for p in self.posts]
            self.half["scales"] = scales
            self.half["posts"] = [p / s.float() for p, s in zip(self.posts, scales, strict=True)]
        return self.half["scales"], self.half["posts"]

    def posts_for(self, partials: list[torch.Tensor]) -> list[torch.Tensor]:
        """The svh vectors that go with these sums (scaled ones for float16 sums)."""
        return self.half_sums()[1] if partials[0].dtype == torch.float16 else self.posts

    def gemm(self, xhs: list[torch.Tensor], adapted: AdaptedLinear | None = None,
             x_in: torch.Tensor | None = None
             ) -> tuple[list[torch.Tensor], layer_kernels.LowRank | None]:
        """The parts' split sums and, for an adapted projection, its LoRA update of the
        rows `x_in` (first product in the same launch where the kernel takes it)."""
        rows = xhs[0].shape[0]
        splits = self.splits_for(rows)
        if adapted is None or x_in is None:
            scales = None
            if rows > kernels.FUSED_MAX_ROWS and kernels.prefill_mode() == "half":
                scales = self.half_sums()[0]
            return layer_kernels.gemm_parts(xhs, self.trellises, self.k2, self.codebook,
                                            splits, scales), None
        partials, low = layer_kernels.gemm_parts_low(xhs, self.trellises, self.k2,
                                                     self.codebook, splits, x_in,
                                                     adapted.lora_a)
        return partials, adapted.low_rank_of(low)

    def splits_for(self, rows: int) -> int:
        """The GEMM's split count at `rows` rows (chosen once per count and mode)."""
        key = (rows, batch_invariant())  # the mode ignores the row count (choose_splits)
        splits = self.splits.get(key)
        if splits is None:
            device = self.trellises[0].device
            kb, nb = self.trellises[0].shape[0], sum(t.shape[1] for t in self.trellises)
            splits = (kernels.choose_splits(kb, nb, device, rows=rows)
                      if device.type == "cuda" else 1)
            self.splits[key] = splits
        return splits

    def norm_gemm(self, x: torch.Tensor, norm: RMSNorm | None,
                  weight: torch.Tensor | None) -> list[torch.Tensor]:
        """The "pro" fold: the split sums of norm(x)'s rotated rows (norm None: x's), the
        input side inside the GEMM launch where ops/gemm_pro.py takes it (no adapter)."""
        eps, unit_offset = (norm.eps, norm.unit_offset) if norm is not None else (0.0, False)
        return gemm_pro.norm_gemm(x, weight, eps, unit_offset, self.pres, self.pad_in,
                                  self.trellises, self.k2, self.codebook,
                                  self.splits_for(x.shape[0]))

    def glu_gemm(self, gate: torch.Tensor, up: torch.Tensor, gate_up: Parts, act: str,
                 dtype: torch.dtype) -> torch.Tensor:
        """The "pro" fold for down: its split sums from gate_up's, act(gate) * up and the
        input side inside the GEMM launch where ops/gemm_pro.py takes it."""
        posts = gate_up.posts_for([gate])
        return gemm_pro.glu_gemm(gate, up, posts[0], posts[1], gate_up.biases[0],
                                 gate_up.biases[1], gate_up.widths[0], act, self.pres[0], dtype,
                                 self.trellises[0], self.k2, self.codebook,
                                 self.splits_for(gate.shape[1]))


def f32_of(layer: Exl3Linear, name: str) -> torch.Tensor:
    cached = getattr(layer, f"{name}32", None)  # made at load on CUDA
    return cached if cached is not None else getattr(layer, name).float().contiguous()
