"""The fused GEMM that makes its own input side (``csrc/ops/cuda/gemm_pro.cuh``, the
``EXL3_LAYER_FOLD=pro`` fold of ``layer_fold``): at 1..8 rows every block of the GEMM
computes the float16 x of its own run of input columns (RMSNorm's sum of squares of the
whole rows read from L2, then norm + suh + the 128-point Hadamard of just its columns;
or the gate/up outputs + act(gate) * up + suh + Hadamard), so the launch of
``layer_kernels.norm_hadamard`` / ``glu_hadamard`` before each GEMM goes away. The x is
bit for bit what those kernels write (same element code, same sum order:
``csrc/ops/cuda/layer_prologue.cuh``), so the partial sums are too.

The pure-PyTorch twin, and the path wherever the kernel does not take the call (CPU,
more than 8 rows, K outside 2..6, float32 activations, float16 partials), is the two
steps: ``layer_kernels.norm_hadamard`` (or ``glu_hadamard``) then ``gemm_parts``.

Public API:
- ``PRO_MAX_ROWS`` (8), ``PRO_K2`` (the 2*K values built: K = 2..6).
- ``pro_rows() -> int``: the most rows a step may have for the fused layer to take the
  fold: ``EXL3_PRO_ROWS`` (1..8, default 8; read where a layer is built, ValueError
  for another value), so a device run can A/B the row limit without a rebuild.
- ``norm_gemm(x, norm_weight, eps, unit_offset, pres, width, trellises, k2, codebook,
  splits) -> list[float32 (splits, rows, 16*nb)]``: ``gemm_parts(norm_hadamard(x,
  norm_weight, eps, unit_offset, pres, width), trellises, k2, codebook, splits)``.
- ``glu_gemm(gate, up, post_gate, post_up, bias_gate, bias_up, inter, act, pre, dtype,
  trellis, k2, codebook, splits) -> float32 (splits, rows, 16*nb)``: ``gemm_parts([
  glu_hadamard(gate, up, ...)], [trellis], ...)[0]``.
- ``kernel_takes(rows, k2, dtype) -> bool``: whether a CUDA call of these shapes runs the
  one-launch kernel (it may still decline, e.g. too little shared memory: then the twin
  runs, same results).
"""

from __future__ import annotations

import os
from collections.abc import Sequence

import torch

from exl3cli.errors import InvalidSetting
from exl3cli.ops import cuda_kernels as kernels
from exl3cli.ops import layer_kernels

PRO_MAX_ROWS = 8  # exl3_ops.h kProMaxRows
PRO_K2 = (4, 6, 8, 10, 12)  # gemm_pro.cuh EXL3_FOR_PRO_K2
_DTYPES = {torch.float16: 0, torch.bfloat16: 1}


def pro_rows() -> int:
    """See the module docstring."""
    text = os.environ.get("EXL3_PRO_ROWS", "").strip() or str(PRO_MAX_ROWS)
    if not text.isdigit() or not 1 <= int(text) <= PRO_MAX_ROWS:
        raise InvalidSetting(f"EXL3_PRO_ROWS must be a whole number 1..{PRO_MAX_ROWS}, got {text!r}")
    return int(text)


def kernel_takes(rows: int, k2: int, dtype: torch.dtype) -> bool:
    """See the module docstring."""
    return 1 <= rows <= PRO_MAX_ROWS and k2 in PRO_K2 and dtype in _DTYPES


def _pro_ext(t: torch.Tensor):
    ext = layer_kernels._ext(t)
    return ext if ext is not None and hasattr(ext, "gemm_norm") else None


def _partials(trellises: Sequence[torch.Tensor], splits: int, rows: int,
              device: torch.device) -> list[torch.Tensor]:
    return [torch.empty(splits, rows, 16 * t.shape[1], dtype=torch.float32, device=device)
            for t in trellises]


def norm_gemm(x: torch.Tensor, norm_weight: torch.Tensor | None, eps: float, unit_offset: bool,
              pres: Sequence[torch.Tensor], width: int, trellises: Sequence[torch.Tensor],
              k2: int, codebook: str, splits: int) -> list[torch.Tensor]:
    """See the module docstring."""
    rows = x.shape[0]
    ext = _pro_ext(x)
    if (ext is not None and kernel_takes(rows, k2, x.dtype) and x.stride(-1) == 1
            and 16 * trellises[0].shape[0] == width):
        partials = _partials(trellises, splits, rows, x.device)
        if ext.gemm_norm(x, norm_weight, eps, unit_offset, list(pres), list(trellises), k2,
                         kernels._codebook_id(codebook, k2), partials):
            return partials
    xhs = layer_kernels.norm_hadamard(x, norm_weight, eps, unit_offset, pres, width)
    return layer_kernels.gemm_parts(xhs, trellises, k2, codebook, splits)


def glu_gemm(gate: torch.Tensor, up: torch.Tensor, post_gate: torch.Tensor | None,
             post_up: torch.Tensor | None, bias_gate: torch.Tensor | None,
             bias_up: torch.Tensor | None, inter: int, act: str, pre: torch.Tensor,
             dtype: torch.dtype, trellis: torch.Tensor, k2: int, codebook: str,
             splits: int) -> torch.Tensor:
    """See the module docstring."""
    rows = gate.shape[1]
    ext = _pro_ext(gate)
    if (ext is not None and kernel_takes(rows, k2, dtype) and gate.dtype == torch.float32
            and up.dtype == torch.float32 and gate.shape == up.shape
            and gate.shape[2] == 16 * trellis.shape[0]):
        partial = _partials([trellis], splits, rows, gate.device)[0]
        if ext.gemm_glu(gate, up, post_gate, post_up, bias_gate, bias_up, inter,
                        layer_kernels.ACTIVATIONS[act], pre, _DTYPES[dtype], trellis, k2,
                        kernels._codebook_id(codebook, k2), partial):
            return partial
    xd = layer_kernels.glu_hadamard(gate, up, post_gate, post_up, bias_gate, bias_up, inter,
                                    act, pre, dtype)
    return layer_kernels.gemm_parts([xd], [trellis], k2, codebook, splits)[0]
