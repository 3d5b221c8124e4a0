"""Block Hadamard rotations used by EXL3 (EXL3-FORMAT.md sections 4 and 6).

``H`` is the Sylvester Hadamard matrix in natural order (``H_1 = [1]``,
``H_2n = [[H, H], [H, -H]]``) divided by ``sqrt(n)``: orthogonal and symmetric, so it
is its own inverse. Weights use 128-point blocks, the KV cache 32-point blocks.

Public API:
- ``hadamard_matrix(n, dtype=torch.float32) -> Tensor[(n, n)]`` (normalised, cached)
- ``block_hadamard(x, dim, block=128) -> Tensor``: ``H`` applied to every run of
  ``block`` consecutive entries along ``dim`` (its size must be a multiple of ``block``).
  Computed in float32 (float64 stays float64) and returned in ``x``'s dtype.
"""

from __future__ import annotations

import math
from functools import cache

import torch

from exl3cli.codec.device_tables import on_device


@cache
def _sylvester(n: int, dtype: torch.dtype) -> torch.Tensor:
    if n < 1 or n & (n - 1):
        raise ValueError(f"Hadamard size must be a power of two, got {n}")
    h = torch.ones(1, 1, dtype=torch.float64)
    while h.shape[0] < n:
        h = torch.cat((torch.cat((h, h), 1), torch.cat((h, -h), 1)), 0)
    return (h / math.sqrt(n)).to(dtype)


def hadamard_matrix(n: int, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """The normalised ``n x n`` Sylvester Hadamard matrix (cached; do not modify)."""
    return _sylvester(n, dtype)


def block_hadamard(x: torch.Tensor, dim: int, block: int = 128) -> torch.Tensor:
    """Apply the normalised ``block``-point Hadamard along ``dim`` in blocks."""
    dim = dim % x.dim()
    size = x.shape[dim]
    if size % block:
        raise ValueError(f"dimension {dim} has size {size}, not a multiple of {block}")
    work_dtype = torch.float64 if x.dtype == torch.float64 else torch.float32
    h = on_device(hadamard_matrix(block, work_dtype), x.device)
    moved = x.to(work_dtype).movedim(dim, -1)
    blocks = moved.reshape(*moved.shape[:-1], size // block, block)
    # H is symmetric, so right-multiplying each row vector by H applies H to it.
    rotated = (blocks @ h).reshape(moved.shape)
    return rotated.movedim(-1, dim).to(x.dtype)
