"""Folds that take launches out of a decode layer (bench/NOTES-gpu.md "Launches per layer
(issue 10, session 8)"), each with its pure-PyTorch twin (the CPU path, and what the
``cuda`` tests compare with):

- the cache write in the q/k/v output kernel: ``hadamard_out_kv`` also stores the step's
  new keys and values (after rotary) in a float16/bfloat16 page pool at the rows' write
  slots, in place of the pool's two ``index_copy_`` launches;
- the attention's chunk combine in the o projection's input side: ``combine_hadamard``
  reads the chunks' partial results that ``paged_attention(parts=...)`` leaves and makes
  the o projection's rotated input, in place of the combine kernel and ``norm_hadamard``.

- the o projection's output side and the MLP's input side in one launch: ``out_norm``
  (h = residual + the o output, then RMSNorm + suh + H128 for gate and up; the row's
  last block, by an integer ticket, runs the second half), in place of ``hadamard_out``
  and ``norm_hadamard``.

- the input side inside the GEMM (``ops/gemm_pro.py``): "pro" has the q/k/v and gate/up
  GEMMs make their own RMSNorm + suh + H128 input and the down GEMM its act(gate) * up
  + suh + H128 input, block by block, in place of ``norm_hadamard`` and ``glu_hadamard``
  (1..8 rows, K 2..6, no adapter on the projection; else the two launches).

``EXL3_LAYER_FOLD`` picks them: "kv", "combine", "norm", "pro", a list "kv,combine", or
"all" (kv, combine and norm; "pro" measured slower, run 44); unset or "": ``DEFAULT``
("kv,combine": 1.05x at one 8B job, 1.04x at 16, run 49); "0", "none" or "off": none
(the path of runs 10-48). Any other name: ValueError where a layer is built.

Public API:
- ``active_folds()`` (the names on; ``FOLDS`` overrides the environment), ``fold_names(text)
  -> frozenset``.
- ``KvStore(keys, values, slots, ranges)``; ``kv_ranges(widths, heads, kv_heads, dim)
  -> list[int] | None``: per part (k_lo, k_hi, v_lo, v_hi), the part's columns holding
  the keys / values (each from the pool row's first column), or None where a range would
  not start at a pool row's first column.
- ``hadamard_out_kv(partials, posts, biases, outs, rope_cols, cos, sin, head_dim, kv,
  lora=None)``: ``layer_kernels.hadamard_out`` (no residual) plus the stores.
- ``out_norm_counters(device)`` (at load) and ``out_norm(partial, post, bias, residual,
  h, norm_weight, eps, unit_offset, pres, width, counters) -> list[float16 (rows,
  width)]`` (counters None: the two twins).
- ``combine_reference(part_acc, part_ml, dtype) -> (rows, heads * head_dim)``: the chunk
  combine in ``dtype``; ``combine_hadamard(part_acc, part_ml, attended, pre, width)
  -> float16 (rows, width)``: ``H128(a * pre)`` with a the combine (more than one chunk)
  or ``attended`` (one chunk).
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from typing import NamedTuple

import torch
import torch.nn.functional as F

from exl3cli.codec import block_hadamard
from exl3cli.errors import InvalidSetting
from exl3cli.ops import cuda_kernels as kernels
from exl3cli.ops import layer_kernels
from exl3cli.ops.layer_kernels import LowRank

NAMES = ("kv", "combine", "norm", "pro")
ALL = ("kv", "combine", "norm")  # what "all" turns on
DEFAULT = frozenset(("kv", "combine"))  # EXL3_LAYER_FOLD unset (bench/NOTES-gpu.md run 49)
_DTYPES = {torch.float16: 0, torch.bfloat16: 1}


def fold_names(text: str) -> frozenset[str]:
    """The folds an ``EXL3_LAYER_FOLD`` value names (module docstring)."""
    text = text.strip().lower()
    if text in ("", "0", "none", "off"):
        return frozenset()
    if text in ("all", "1"):
        return frozenset(ALL)
    names = frozenset(n.strip() for n in text.split(",") if n.strip())
    unknown = sorted(names - set(NAMES))
    if unknown:
        raise InvalidSetting(f"EXL3_LAYER_FOLD: unknown fold(s) {unknown}; choose from {NAMES}, "
                             "'all' or '0'")
    return names


FOLDS: frozenset[str] | None = None  # set (tests, benchmarks) to override EXL3_LAYER_FOLD


def active_folds() -> frozenset[str]:
    """The folds on: ``FOLDS`` when set, else ``EXL3_LAYER_FOLD`` read now (a bad value is
    a ValueError where a layer is built, not when this module is imported), else
    ``DEFAULT``."""
    if FOLDS is not None:
        return FOLDS
    text = os.environ.get("EXL3_LAYER_FOLD", "")
    return fold_names(text) if text.strip() else DEFAULT


class KvStore(NamedTuple):
    """Where an output kernel stores a decode step's new keys/values (module docstring)."""

    keys: torch.Tensor  # (slots, kv_heads, head_dim), the activation dtype
    values: torch.Tensor
    slots: torch.Tensor  # (>= rows,) int64: each row's write slot
    ranges: list[int]  # 4 per part: k_lo, k_hi, v_lo, v_hi


def kv_ranges(widths: Sequence[int], heads: int, kv_heads: int, dim: int) -> list[int] | None:
    """See the module docstring (q | k | v columns side by side over the parts)."""
    regions = ((heads * dim, (heads + kv_heads) * dim),
               ((heads + kv_heads) * dim, (heads + 2 * kv_heads) * dim))
    ranges, start = [], 0
    for width in widths:
        for lo, hi in regions:
            a, b = max(lo, start), min(hi, start + width)
            if a >= b:
                ranges += [0, 0]
                continue
            if a != lo:  # the region began in an earlier part: no pool-row-aligned range
                return None
            ranges += [a - start, b - start]
        start += width
    return ranges


def hadamard_out_kv(partials: Sequence[torch.Tensor], posts: Sequence[torch.Tensor | None],
                    biases: Sequence[torch.Tensor | None], outs: Sequence[torch.Tensor],
                    rope_cols: Sequence[int], cos: torch.Tensor | None, sin: torch.Tensor | None,
                    head_dim: int, kv: KvStore, lora: LowRank | None = None) -> None:
    """See the module docstring."""
    ext = layer_kernels._ext(partials[0])
    if ext is not None and head_dim in (0, 64, 128) and outs[0].dtype in layer_kernels._DTYPES:
        ext.hadamard_out(list(partials), list(posts), list(biases), list(outs),
                         [int(c) for c in rope_cols], None, cos, sin, head_dim,
                         *(lora.args() if lora is not None else (None,) * 4),
                         kv.keys, kv.values, kv.slots, [int(r) for r in kv.ranges])
        return
    layer_kernels.hadamard_out(partials, posts, biases, outs, rope_cols, cos=cos, sin=sin,
                               head_dim=head_dim, lora=lora)
    rows = outs[0].shape[0]
    slots = kv.slots[:rows]
    keys, values = kv.keys.view(kv.keys.shape[0], -1), kv.values.view(kv.values.shape[0], -1)
    for p, out in enumerate(outs):
        k_lo, k_hi, v_lo, v_hi = kv.ranges[4 * p : 4 * p + 4]
        if k_hi > k_lo:
            keys[:, : k_hi - k_lo].index_copy_(0, slots, out[:, k_lo:k_hi])
        if v_hi > v_lo:
            values[:, : v_hi - v_lo].index_copy_(0, slots, out[:, v_lo:v_hi])


def combine_reference(part_acc: torch.Tensor, part_ml: torch.Tensor,
                      dtype: torch.dtype) -> torch.Tensor:
    """See the module docstring: chunks with a zero sum (no position) are left out."""
    rows, heads, _, dim = part_acc.shape
    m_c, l_c = part_ml[..., 0], part_ml[..., 1]
    live = l_c > 0
    m = torch.where(live, m_c, -torch.inf).amax(-1, keepdim=True)
    w = torch.where(live, torch.exp(m_c - m), 0.0)
    total = (l_c * w).sum(-1, keepdim=True)
    acc = torch.where(live[..., None], part_acc * w[..., None], 0.0).sum(-2)  # skip unread
    out = torch.where(total > 0, acc / torch.where(total > 0, total, 1.0), 0.0)
    return out.to(dtype).reshape(rows, heads * dim)


def combine_hadamard(part_acc: torch.Tensor, part_ml: torch.Tensor, attended: torch.Tensor,
                     pre: torch.Tensor, width: int) -> torch.Tensor:
    """See the module docstring."""
    rows = attended.shape[0]
    ext = layer_kernels._ext(attended)
    if (ext is not None and hasattr(ext, "combine_hadamard") and attended.dtype in _DTYPES
            and rows > 0):
        out = torch.empty(rows, width, dtype=torch.float16, device=attended.device)
        ext.combine_hadamard(part_acc, part_ml, attended, pre, out, _DTYPES[attended.dtype])
        return out
    a = (combine_reference(part_acc, part_ml, attended.dtype) if part_acc.shape[2] > 1
         else attended)
    padded = F.pad(a.float(), (0, width - a.shape[1]))
    return block_hadamard(padded * pre[:width].float(), dim=-1).half()


_OUT_NORM_MAX_ROWS, _OUT_NORM_MAX_COLS = 64, 12288  # exl3_ops.h kOutNorm*


def out_norm_counters(device: torch.device) -> torch.Tensor | None:
    """New per-row tickets for out_norm on a CUDA `device` (zero; the kernel leaves them
    zero), None elsewhere. Make them outside any graph capture (a decode layer makes its
    own at load, so launches on other streams never share them)."""
    device = torch.device(device)
    if device.type != "cuda":
        return None
    return torch.zeros(_OUT_NORM_MAX_ROWS, dtype=torch.int32, device=device)


def out_norm(partial: torch.Tensor, post: torch.Tensor | None, bias: torch.Tensor | None,
             residual: torch.Tensor, h: torch.Tensor, norm_weight: torch.Tensor, eps: float,
             unit_offset: bool, pres: Sequence[torch.Tensor], width: int,
             counters: torch.Tensor | None) -> list[torch.Tensor]:
    """``h = residual + hadamard_out(partial)`` (written to h) and the next input's
    ``norm_hadamard(h, norm_weight, ...)`` outputs: one launch on CUDA (the row's last
    block runs the second half), the two twins elsewhere."""
    rows, cols = h.shape
    ext = layer_kernels._ext(partial)
    if (ext is not None and counters is not None and counters.device == h.device
            and hasattr(ext, "out_norm") and h.dtype in layer_kernels._DTYPES
            and 1 <= rows <= _OUT_NORM_MAX_ROWS and cols <= _OUT_NORM_MAX_COLS):
        outs = [torch.empty(rows, width, dtype=torch.float16, device=h.device) for _ in pres]
        ext.out_norm(partial, post, bias, residual, h, norm_weight, eps, unit_offset,
                     list(pres), outs, width, counters)
        return outs
    layer_kernels.hadamard_out([partial], [post], [bias], [h], [0], residual=residual)
    return layer_kernels.norm_hadamard(h, norm_weight, eps, unit_offset, pres, width)


def attention_parts(rows: int, heads: int, pages: int, page_size: int, dim: int,
                    device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """Scratch for paged_attention's uncombined chunks: (rows, heads, chunks, dim), (.., 2)."""
    chunks = kernels.attention_chunks(pages, page_size)
    return (torch.empty(rows, heads, chunks, dim, dtype=torch.float32, device=device),
            torch.empty(rows, heads, chunks, 2, dtype=torch.float32, device=device))
