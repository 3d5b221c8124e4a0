"""Batch-invariant mode: a row's arithmetic must not depend on the other rows of a step.

With the mode on (``EXL3_BATCH_INVARIANT=1``, ``exl3 serve --batch-invariant``, or
``set_batch_invariant(True)``), the kernels a row goes through are chosen and shaped
without looking at how many rows share the launch:

- the fused EXL3 GEMM (``cuda_kernels.choose_splits``) takes one split count per weight
  shape, the one it uses at 9-64 rows, at every row count (the split sums are the only
  row-count-dependent order in it: the lean loop's instances at 1-8 and 9-64 rows
  decode the same float16 weights and run the same mma sequence per row);
- an EXL3 linear of more than ``cuda_kernels.FUSED_MAX_ROWS`` rows runs the fused GEMM
  per block of ``ROW_BLOCK`` rows instead of decode + cuBLAS (whose kernel, tiling and
  split-K follow the row count), and the fused layer's many-row prompt path is refused;
- a dense (cuBLAS) product on CUDA, e.g. a tied float16 head, runs on blocks of exactly
  ``ROW_BLOCK`` rows, zero-padded (``padded_linear``): one shape, one cuBLAS kernel, and
  a row's dot products do not depend on its neighbours.

The generator (engine/generation/generator.py) adds the scheduling half: prompt chunks
ride on the fixed-shape decode step, one row per token, like decode rows and drafts.
bench/NOTES-gpu.md ("Batch invariance") lists every place a row's result could depend
on its batch and what the mode does about each.
"""

from __future__ import annotations

import os

import torch
import torch.nn.functional as F

ROW_BLOCK = 64  # rows of every cuBLAS product and fused-GEMM block in the mode
_TRUE = ("1", "true", "on", "yes")
_FALSE = ("", "0", "false", "off", "no")
_forced: bool | None = None  # set_batch_invariant's override of the environment


def parse_flag(text: str) -> bool:
    """``EXL3_BATCH_INVARIANT``'s value as a bool (ValueError for anything else)."""
    value = text.strip().lower()
    if value in _TRUE:
        return True
    if value in _FALSE:
        return False
    raise ValueError(f"EXL3_BATCH_INVARIANT must be 1 or 0, got {text!r}")


def batch_invariant() -> bool:
    """Whether the mode is on: ``set_batch_invariant``'s value when set, else
    ``EXL3_BATCH_INVARIANT`` read now (so one process can A/B it, like EXL3_PREFILL)."""
    if _forced is not None:
        return _forced
    return parse_flag(os.environ.get("EXL3_BATCH_INVARIANT", ""))


def set_batch_invariant(on: bool | None) -> None:
    """Turn the mode on or off for this process (None: follow the environment again).
    Graphs captured before a change keep the shapes they were captured with."""
    global _forced
    _forced = on


def padded_linear(x: torch.Tensor, weight: torch.Tensor,
                  bias: torch.Tensor | None = None) -> torch.Tensor:
    """``F.linear(x, weight, bias)`` computed on blocks of exactly ``ROW_BLOCK`` rows
    (the last one zero-padded), so every row goes through the same cuBLAS kernel
    whatever the number of rows beside it. Up to ``ROW_BLOCK`` rows: one pad and one
    product (a decode step's head), the output a view of its first rows."""
    lead = x.shape[:-1]
    rows = x.reshape(-1, x.shape[-1])
    count = rows.shape[0]
    if count <= ROW_BLOCK:
        padded = F.pad(rows, (0, 0, 0, ROW_BLOCK - count))
        return F.linear(padded, weight, bias)[:count].view(*lead, weight.shape[0])
    out = torch.empty(count, weight.shape[0], dtype=x.dtype, device=x.device)
    for start in range(0, count, ROW_BLOCK):
        block = rows[start : start + ROW_BLOCK]
        size = block.shape[0]
        if size < ROW_BLOCK:
            block = F.pad(block, (0, 0, 0, ROW_BLOCK - size))
        out[start : start + size] = F.linear(block, weight, bias)[:size]
    return out.view(*lead, weight.shape[0])
