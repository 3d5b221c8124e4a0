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
  a row's dot products do not depend on its neighbours; RMSNorm on CUDA likewise
  (``row_blocks``: one shape, one reduction layout of torch's kernel).

The generator (engine/generation/generator.py) adds the scheduling half: prompt chunks
ride on the fixed-shape decode step, one row per token, like decode rows and drafts.
bench/NOTES-gpu.md ("Batch invariance") lists every place a row's result could depend
on its batch and what the mode does about each.
"""

from __future__ import annotations

import os
from collections.abc import Callable

import torch
import torch.nn.functional as F

from exl3cli.envvars import parse_switch

ROW_BLOCK = 64  # rows of every cuBLAS product and fused-GEMM block in the mode
_forced: bool | None = None  # set_batch_invariant's override of the environment


def parse_flag(text: str) -> bool:
    """``EXL3_BATCH_INVARIANT``'s value as a bool (empty: off; InvalidSetting, a
    ValueError, for anything but envvars' on and off words)."""
    return bool(text.strip()) and parse_switch("EXL3_BATCH_INVARIANT", text)


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


def row_blocks(fn: Callable[[torch.Tensor], torch.Tensor], x: torch.Tensor,
               keep: int = 1) -> torch.Tensor:
    """``fn(x)`` for a row-wise ``fn`` (each row's output depends on that row alone),
    computed on blocks of exactly ``ROW_BLOCK`` rows, the last one zero-padded: one
    input shape, hence one kernel and one reduction layout, whatever the number of rows
    beside a row. Rows are the leading dims of x flattened; the last `keep` dims are a
    row. Up to ``ROW_BLOCK`` rows: one pad and one call, the output a view of its first
    rows."""
    row = x.shape[x.dim() - keep :]
    lead = x.shape[: x.dim() - keep]
    rows = x.reshape(-1, *row)
    count = rows.shape[0]
    pad = (0, 0) * keep
    if count <= ROW_BLOCK:
        out = fn(F.pad(rows, (*pad, 0, ROW_BLOCK - count)))[:count]
        return out.reshape(*lead, *out.shape[1:])
    pieces = []
    for start in range(0, count, ROW_BLOCK):
        block = rows[start : start + ROW_BLOCK]
        size = block.shape[0]
        if size < ROW_BLOCK:
            block = F.pad(block, (*pad, 0, ROW_BLOCK - size))
        pieces.append(fn(block)[:size])
    out = torch.cat(pieces)
    return out.reshape(*lead, *out.shape[1:])


def padded_linear(x: torch.Tensor, weight: torch.Tensor,
                  bias: torch.Tensor | None = None) -> torch.Tensor:
    """``F.linear(x, weight, bias)`` on blocks of exactly ``ROW_BLOCK`` rows
    (``row_blocks``): every row goes through the same cuBLAS kernel."""
    return row_blocks(lambda block: F.linear(block, weight, bias), x)
