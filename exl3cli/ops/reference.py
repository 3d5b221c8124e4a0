"""The PyTorch twins of the kernels' arithmetic, one of each: the CUDA and CPU kernels
are tested against these, and every device without a kernel runs them.

- ``exl3_linear(x, trellis, suh, svh, k_bits, codebook)``: an EXL3 linear's
  ``H(H(pad(x) * suh) @ Ŵ) * svh`` in float32 over the padded output (the caller trims
  and adds the bias); ``trellis`` is ``(kb, nb, words)`` as stored.
- ``dense_sums(xh, trellis, k_bits, codebook, scale=None)``: ``xh @ Ŵ`` in float32 (the
  prompt GEMM), or with a float16 scale ``xh @ (Ŵ * scale)`` in float16.
- ``apply_rotary(x, cos, sin)``: rotate-half rotary embedding.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from exl3cli.codec.dequant import decode_tiles
from exl3cli.codec.hadamard import block_hadamard


def exl3_linear(x: torch.Tensor, trellis: torch.Tensor, suh: torch.Tensor, svh: torch.Tensor,
                k_bits: float, codebook: str) -> torch.Tensor:
    """x (M, in <= 16 kb) -> (M, 16 nb) float32; suh/svh may be shorter than the padded
    sides (zero padding)."""
    kb, nb = trellis.shape[0], trellis.shape[1]
    pad_in, pad_out = 16 * kb, 16 * nb
    xs = F.pad(x.float(), (0, pad_in - x.shape[-1])) * F.pad(suh.float(), (0, pad_in - suh.numel()))
    y = block_hadamard(xs, dim=-1) @ decode_tiles(trellis, k_bits, codebook).float()
    return block_hadamard(y, dim=-1) * F.pad(svh.float(), (0, pad_out - svh.numel()))


def dense_sums(xh: torch.Tensor, trellis: torch.Tensor, k_bits: float, codebook: str,
               scale: torch.Tensor | None = None) -> torch.Tensor:
    """xh (M, 16 kb) @ Ŵ in float32: the twin of cuda_kernels.dense_sums; with a float16
    ``scale``, xh @ float16(Ŵ * scale) rounded to float16."""
    weight = decode_tiles(trellis, k_bits, codebook)
    if scale is None:
        return xh.float() @ weight.float()
    weight = (weight.float() * scale.float()).half()  # one rounding, as the kernel
    return (xh.float() @ weight.float()).half()


def apply_rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate pairs (i, i + d/2) of the last dimension; cos/sin broadcast against x."""
    half = x.shape[-1] // 2
    rotated = torch.cat((-x[..., half:], x[..., :half]), dim=-1)
    return x * cos + rotated * sin
