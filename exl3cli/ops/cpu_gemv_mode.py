"""The CPU EXL3 GEMV mode: "exact" (default) or "fast" (``EXL3_CPU_GEMV``).

The 1-2 row product of an EXL3 layer (csrc/ops/cpu/exl3_step_gemv.h) has two forms on
AVX-512 BW builds (the step-order GEMV; with or without AVX512-FP16):
- exact: every weight is the codec's float16 value (bit for bit), x stays float32;
- fast (mul1 layers only; 3inst/mcg layers stay exact): the weight's float16 rounding is
  left out (w = S a + c from the hash's byte sum S) and x is rounded to int16 with one
  scale per row, so one vpdpwssd multiplies 32 weights: ~1.7x the exact rate in cache,
  1.2-1.5x a decode token; ~2e-4 of |y| per product, logits within 1.2e-2 of exact on
  SmolLM2 (over the 1e-4 the CPU path is held to against the dequantized model, so not
  the default; greedy text was identical there): bench/NOTES-cpu-exl3.md.

Public API:
- ``EXL3_GEMV_MODES``; ``set_exl3_gemv_mode(mode=None) -> str``: the process-wide mode
  (None reads ``EXL3_CPU_GEMV``; ValueError on anything but the modes); returns the mode in
  force ("exact" on builds without the step-order GEMV).
- ``exl3_matmul_fast_reference(xh, trellis_t, k_bits) -> xh @ Ŵ`` as the fast mode
  computes it (mul1), in PyTorch.
"""

from __future__ import annotations

import os
from functools import cache

import torch

from exl3cli.codec.bitstream import unpack_states
from exl3cli.codec.codebooks import MARKER_VALUES
from exl3cli.codec.tiles import position_to_step
from exl3cli.errors import InvalidSetting
from exl3cli.ops import cpu_kernels

EXL3_GEMV_MODES = ("exact", "fast")


def set_exl3_gemv_mode(mode: str | None = None) -> str:
    """See the module docstring."""
    chosen = (os.environ.get("EXL3_CPU_GEMV", "") if mode is None else mode) or "exact"
    if chosen not in EXL3_GEMV_MODES:
        raise InvalidSetting(f"EXL3_CPU_GEMV must be one of {', '.join(EXL3_GEMV_MODES)}, "
                             f"got {chosen!r}")
    return cpu_kernels._ops().exl3_set_gemv_mode(chosen)


@cache
def _mul1_unrounded() -> torch.Tensor:
    """(1024 + S) a + b for all 65536 states, float64 (mul1 before its float16 rounding)."""
    mult = MARKER_VALUES["mul1"] & 0xFFFFFFFF
    x = (torch.arange(65536, dtype=torch.int64) * mult) & 0xFFFFFFFF
    s = (x & 0xFF) + ((x >> 8) & 0xFF) + ((x >> 16) & 0xFF) + ((x >> 24) & 0xFF)
    a = torch.tensor([0x1EEE], dtype=torch.int16).view(torch.float16).double()
    b = torch.tensor([0xC931 - 0x10000], dtype=torch.int16).view(torch.float16).double()
    return (1024 + s).double() * a + b


def exl3_matmul_fast_reference(xh: torch.Tensor, trellis_t: torch.Tensor,
                               k_bits: float) -> torch.Tensor:
    """xh (M, 16 kb) @ Ŵ of a mul1 (nb, kb, words) trellis as the fast mode computes it:
    Ŵ unrounded, each row of x rounded to int16 by 32767 / max|x|, float32 out."""
    trellis = trellis_t.transpose(0, 1)
    kb, nb = trellis.shape[:2]
    states = unpack_states(trellis, k_bits)[..., position_to_step()]
    w = _mul1_unrounded()[states].view(kb, nb, 16, 16).permute(0, 2, 1, 3).reshape(
        16 * kb, 16 * nb)
    x = xh.float()
    amax = x.abs().amax(dim=1, keepdim=True)
    inv = torch.where(amax > 0, torch.tensor(32767.0) / amax, torch.zeros_like(amax))
    xq = torch.round(x * inv).double()
    return ((xq @ w) * (amax.double() / 32767.0)).float()
