"""The kernels between the EXL3 GEMMs of a decode layer (``csrc/ops/cuda/layer_fused.cu``), each
with its pure-PyTorch twin (the path on CPU, and what the ``cuda`` tests compare with).

A decode layer of ``engine/layers/fused_layer.py`` runs its linears as three steps each:
the input side (norm, suh, 128-point Hadamard -> float16 ``xh``), the fused
decode-GEMM (``gemm_parts``: split partial sums), and the output side (split sum,
Hadamard, svh, bias, then rotary or the residual add, or for gate/up the activation and
the down projection's input side). Several projections of one input (q/k/v, gate/up)
share each launch.

An adapted projection (``engine/adapters/lora.py``) adds its LoRA update in the output
side, where ``AdaptedLinear`` adds it: ``y = round(round(H128(sum) * svh + bias) +
delta)``, then rotary, the activation or the residual; ``delta`` comes from a
``LowRank`` (``low = x_in @ A^T``, made inside the input's GEMM launch by
``gemm_parts_low``, and B^T of all the input's parts), with the masking by the rows'
adapter slots done in the kernel.

Public API (``x``: activations in the model dtype; ``partials``: float32
(splits, rows, width); every list has one entry per part):
- ``LowRank(low, bt, columns, slots)`` and ``low_rank_delta(lora) -> (rows, cols)``:
  row r gains ``(low[r] * (columns == slots[r])) @ bt`` in ``low``'s dtype (exact zeros
  for slot 0); ``bt`` covers the parts of one call side by side, in order.
- ``norm_hadamard(x[rows, cols], norm_weight|None, eps, unit_offset, pres, width,
  normed=None) -> list[float16 (rows, width)]``: ``H128(norm(x) * pre)``; ``norm`` is
  RMSNorm as ``engine/layers/norm.py`` computes it (``norm_weight`` float32;
  ``unit_offset``: Gemma's single rounding), or the identity when ``norm_weight`` is
  None; ``normed`` (rows, cols) in x's dtype receives ``norm(x)`` (a LoRA's input).
- ``gemm_parts(xhs, trellises, k2, codebook, splits) -> list[partials]``: ``xh @ Ŵ``
  (the reference returns one split; so does CUDA past ``FUSED_MAX_ROWS`` rows, a
  prompt: ``cuda_kernels.dense_sums``, decode + cuBLAS; with ``scales=`` (one float16 per
  part) float16 sums of ``Ŵ * scale``: ``hadamard_out`` and ``glu_hadamard`` read
  float16 (1, rows, width) partials too).
- ``gemm_parts_low(xhs, trellises, k2, codebook, splits, x, a) -> (partials, low)``:
  ``gemm_parts`` and ``low = x @ a^T`` (an adapted projection's first LoRA product, in
  a's dtype), in the GEMM's own launch on CUDA when ``low_in_gemm(x, a)`` (its own blocks
  of the grid, csrc/ops/cuda/gemm_lora.cuh; off with ``EXL3_LORA_GEMM=0``), else
  ``gemm_parts`` then ``lora_low``; x/A that do not fit the parts: ValueError first.
- ``hadamard_out(partials, posts, biases, outs, rope_cols, residual=None, cos=None,
  sin=None, head_dim=0, lora=None)``: writes ``outs[p] = H128(sum partial) * post +
  bias`` (rounded to the output dtype) plus part p's columns of the LoRA delta, its
  first ``rope_cols[p]`` columns rotated per head (rotate-half with ``cos``/``sin``
  (rows, head_dim)), plus ``residual`` when given.
- ``glu_hadamard(gate, up, post_gate, post_up, bias_gate, bias_up, inter, act, pre,
  dtype, lora=None, product=None) -> float16 (rows, width)``: ``H128((act(g) * u) *
  pre)`` with ``g``/``u`` the gate/up outputs as ``hadamard_out`` makes them (``lora``
  covers [gate | up]; act "silu" or "gelu_tanh"); ``product`` (rows, inter) in
  ``dtype`` receives ``act(g) * u`` (the down projection's LoRA input).
- ``qk_norm_rope(qk[rows, heads, head_dim], weight[heads, head_dim], eps, cos=None,
  sin=None) -> qk``: per-head RMSNorm (``engine/layers/norm.py``'s rounding for a 2-D
  weight) then rotate-half rotary with ``cos``/``sin`` (rows, head_dim); in place on
  CUDA (one launch, ``csrc/ops/cuda/qk_norm_rope.cu``), a new tensor from the twin.
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from typing import NamedTuple

import torch
import torch.nn.functional as F

from exl3cli.codec import block_hadamard, decode_tiles
from exl3cli.ops import cuda_kernels as kernels
from exl3cli.ops import reference
from exl3cli.ops.reference import apply_rotary

ACTIVATIONS = {"silu": 0, "gelu_tanh": 1}
_DTYPES = {torch.float16: 0, torch.bfloat16: 1, torch.float32: 2}


class LowRank(NamedTuple):
    """The LoRA update of one output-kernel call (module docstring)."""

    low: torch.Tensor  # (rows, R) in the activation dtype: x_in @ A^T
    bt: torch.Tensor  # (R, columns of the call's parts) in the activation dtype: B^T
    columns: torch.Tensor  # (R,) int64: the adapter slot of each rank column
    slots: torch.Tensor  # (rows,) int64: the adapter slot of each row (0: none)

    def args(self) -> tuple[torch.Tensor, ...]:
        return (self.low, self.bt, self.columns, self.slots)


_NO_LORA = (None, None, None, None)


def low_rank_delta(lora: LowRank) -> torch.Tensor:
    """(rows, columns of bt): each row's own adapter's update, as AdaptedLinear makes it."""
    mask = (lora.columns[None, :] == lora.slots[: lora.low.shape[0], None]).to(lora.low.dtype)
    return (lora.low * mask) @ lora.bt


# EXL3_LORA_LOW=torch: the first LoRA product by torch's matmul (A/B of lora_low.cu).
_LORA_LOW_KERNEL = os.environ.get("EXL3_LORA_LOW", "kernel") != "torch"
_LORA_MAX_SPLITS, _LORA_MAX_RANK = 16, 128
# Rows the kernel takes: past a few rows the library GEMM's tiles win (H200, NOTES-gpu run 18).
_LORA_KERNEL_ROWS = 4
_lora_workspaces: dict[torch.device, tuple[torch.Tensor, torch.Tensor]] = {}


def lora_workspace(device: torch.device) -> None:
    """Allocate `device`'s lora_low workspace now (outside any CUDA graph capture)."""
    device = torch.device(device)
    if device.type != "cuda":
        return
    if device.index is None:
        device = torch.device("cuda", torch.cuda.current_device())
    if device not in _lora_workspaces:  # never replaced: captured graphs hold its pointers
        _lora_workspaces[device] = (
            torch.empty(_LORA_MAX_SPLITS * kernels.FUSED_MAX_ROWS * _LORA_MAX_RANK,
                        dtype=torch.float32, device=device),
            torch.zeros(1, dtype=torch.int32, device=device))


def lora_low(x: torch.Tensor, a: torch.Tensor) -> torch.Tensor:
    """``x @ a^T`` (rows, rank) in a's dtype: the first LoRA product (lora_low.cu for a
    decode step's rows on CUDA, one launch; else torch's matmul)."""
    x = x.to(a.dtype)
    ext = _ext(x) if _LORA_LOW_KERNEL else None
    rows, rank = x.shape[0], a.shape[0]
    workspace = _lora_workspaces.get(x.device)
    if (ext is not None and workspace is not None
            and x.dtype in (torch.float16, torch.bfloat16)
            and 1 <= rows <= min(_LORA_KERNEL_ROWS, kernels.FUSED_MAX_ROWS)
            and rank <= _LORA_MAX_RANK
            and x.stride(-1) == 1 and a.is_contiguous()
            and x.data_ptr() % 16 == 0 and a.data_ptr() % 16 == 0):  # 16-byte loads
        low = torch.empty(rows, rank, dtype=a.dtype, device=x.device)
        if ext.lora_low(x, a, low, *workspace):
            return low
    return x @ a.t()


# The first LoRA product inside the projection's GEMM launch (NOTES-gpu "LoRA, session 8"),
# the default since its cuda tests passed on the H200 (run 40) and it measured 0.92x the
# bare model at 1 and 16 jobs against 0.78x / 0.80x for its own launch (run 41).
# EXL3_LORA_GEMM=0: the product as its own launch (lora_low / torch's matmul).
_LORA_IN_GEMM = os.environ.get("EXL3_LORA_GEMM", "1") != "0"
_GEMM_LORA_MAX_RANK = 128  # exl3_ops.h kGemmLoraMaxRank


def low_in_gemm(x: torch.Tensor, a: torch.Tensor) -> bool:
    """Whether ``x @ a^T`` can ride in the GEMM launch (gemm_parts_low): CUDA, float16
    or bfloat16 in one dtype, 1..64 rows, rank <= 128, whole aligned 16-byte loads."""
    if not (_LORA_IN_GEMM and x.is_cuda and a.device == x.device):
        return False
    if x.dtype not in (torch.float16, torch.bfloat16) or a.dtype != x.dtype:
        return False
    rows, k_dim = x.shape
    return (1 <= rows <= kernels.FUSED_MAX_ROWS and 1 <= a.shape[0] <= _GEMM_LORA_MAX_RANK
            and k_dim >= 8 and k_dim % 8 == 0 and x.stride(1) == 1 and x.stride(0) % 8 == 0
            and a.is_contiguous() and x.data_ptr() % 16 == 0 and a.data_ptr() % 16 == 0)


def _check_low_inputs(xhs: Sequence[torch.Tensor], x: torch.Tensor, a: torch.Tensor) -> None:
    """ValueError (before any launch) unless x (rows, K) and a (rank, K) fit the parts."""
    if x.dim() != 2 or a.dim() != 2:
        raise ValueError(f"LoRA product: x and A must be 2-D, got {tuple(x.shape)} and "
                         f"{tuple(a.shape)}")
    if x.shape[0] != xhs[0].shape[0]:
        raise ValueError(f"LoRA product: x has {x.shape[0]} rows, the projection's input "
                         f"{xhs[0].shape[0]}")
    if a.shape[1] != x.shape[1] or a.shape[0] < 1:
        raise ValueError(f"LoRA product: A is {tuple(a.shape)} (rank, K), x has K = "
                         f"{x.shape[1]} columns")
    if x.device != xhs[0].device or a.device != x.device:
        raise ValueError(f"LoRA product: x on {x.device}, A on {a.device}, the projection "
                         f"on {xhs[0].device}")


def gemm_parts_low(xhs: Sequence[torch.Tensor], trellises: Sequence[torch.Tensor], k2: int,
                   codebook: str, splits: int, x: torch.Tensor, a: torch.Tensor
                   ) -> tuple[list[torch.Tensor], torch.Tensor]:
    """``gemm_parts`` and an adapted projection's ``low = x @ a^T`` (``lora_low``'s
    result): one launch on CUDA when ``low_in_gemm`` takes it, else both as before."""
    _check_low_inputs(xhs, x, a)
    x = x.to(a.dtype)
    ext = _ext(xhs[0])
    rows = xhs[0].shape[0]
    if ext is not None and hasattr(ext, "gemm_parts_low") and low_in_gemm(x, a):
        partials = [torch.empty(splits, rows, 16 * t.shape[1], dtype=torch.float32,
                                device=xhs[0].device) for t in trellises]
        low = torch.empty(rows, a.shape[0], dtype=a.dtype, device=x.device)
        ext.gemm_parts_low(list(xhs), list(trellises), k2, kernels._codebook_id(codebook, k2),
                           partials, x, a, low)
        return partials, low
    return gemm_parts(xhs, trellises, k2, codebook, splits), lora_low(x, a)


def _ext(*tensors: torch.Tensor):
    ext = kernels._use_ext(*tensors)
    return ext if ext is not None and hasattr(ext, "norm_hadamard") else None


def _normed(x: torch.Tensor, weight: torch.Tensor | None, eps: float,
            unit_offset: bool) -> torch.Tensor:
    if weight is None:
        return x
    if x.dtype == torch.float32:
        return F.rms_norm(x, (x.shape[-1],), weight, eps)
    normed = F.rms_norm(x.float(), (x.shape[-1],), None, eps)
    if unit_offset:
        return (normed * weight).to(x.dtype)
    return (normed.to(x.dtype).float() * weight).to(x.dtype)


def norm_hadamard(x: torch.Tensor, norm_weight: torch.Tensor | None, eps: float,
                  unit_offset: bool, pres: Sequence[torch.Tensor], width: int,
                  normed: torch.Tensor | None = None) -> list[torch.Tensor]:
    """See the module docstring."""
    rows = x.shape[0]
    ext = _ext(x)
    if ext is not None and x.dtype in _DTYPES and x.stride(-1) == 1 and rows > 0:
        outs = [torch.empty(rows, width, dtype=torch.float16, device=x.device) for _ in pres]
        ext.norm_hadamard(x, norm_weight, eps, unit_offset, list(pres), outs, width, normed)
        return outs
    n = _normed(x, norm_weight, eps, unit_offset)
    if normed is not None:
        normed.copy_(n)
    padded = F.pad(n.float(), (0, width - x.shape[1]))
    return [block_hadamard(padded * pre[:width].float(), dim=-1).half() for pre in pres]


def gemm_parts(xhs: Sequence[torch.Tensor], trellises: Sequence[torch.Tensor], k2: int,
               codebook: str, splits: int,
               scales: Sequence[torch.Tensor] | None = None) -> list[torch.Tensor]:
    """See the module docstring; every part has the same rows, input width and K."""
    ext = _ext(xhs[0])
    rows = xhs[0].shape[0]
    if scales is not None and rows > kernels.FUSED_MAX_ROWS:  # float16 sums of Ŵ * scale
        if ext is not None:
            cb = kernels._codebook_id(codebook, k2)
            half = [kernels.dense_sums(xh, t, k2, cb, s)
                    for xh, t, s in zip(xhs, trellises, scales, strict=True)]
        else:
            half = [reference.dense_sums(xh, t, k2 / 2, codebook, s)
                    for xh, t, s in zip(xhs, trellises, scales, strict=True)]
        if all(s is not None for s in half):
            return [s.unsqueeze(0) for s in half]  # type: ignore[union-attr]
    if ext is not None and rows > kernels.FUSED_MAX_ROWS:  # a prompt: decode + cuBLAS
        cb = kernels._codebook_id(codebook, k2)
        sums = [kernels.dense_sums(xh, t, k2, cb) for xh, t in zip(xhs, trellises, strict=True)]
        if all(s is not None for s in sums):
            return [s.unsqueeze(0) for s in sums]  # type: ignore[union-attr]
    if ext is not None and 1 <= rows <= kernels.FUSED_MAX_ROWS:
        partials = [torch.empty(splits, rows, 16 * t.shape[1], dtype=torch.float32,
                                device=xhs[0].device) for t in trellises]
        ext.gemm_parts(list(xhs), list(trellises), k2, kernels._codebook_id(codebook, k2),
                       partials)
        return partials
    return [(xh.float() @ decode_tiles(t, k2 / 2, codebook).float()).unsqueeze(0)
            for xh, t in zip(xhs, trellises, strict=True)]


def _rotate(y: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, head_dim: int) -> torch.Tensor:
    """Rotate-half per head of y (rows, n*head_dim) in y's dtype: ops/reference.py's apply_rotary."""
    heads = y.view(y.shape[0], -1, head_dim)
    return apply_rotary(heads, cos.view(-1, 1, head_dim), sin.view(-1, 1, head_dim)).view_as(y)


def _output(partial: torch.Tensor, post: torch.Tensor | None, bias: torch.Tensor | None,
            cols: int) -> torch.Tensor:
    """float32 (rows, cols): H128 of the split sum, times post, plus bias."""
    y = block_hadamard(partial.float().sum(0), dim=-1)
    if post is not None:
        y = y * post[: y.shape[-1]].float()
    y = y[:, :cols]
    return y + bias[:cols].float() if bias is not None else y


def hadamard_out(partials: Sequence[torch.Tensor], posts: Sequence[torch.Tensor | None],
                 biases: Sequence[torch.Tensor | None], outs: Sequence[torch.Tensor],
                 rope_cols: Sequence[int], residual: torch.Tensor | None = None,
                 cos: torch.Tensor | None = None, sin: torch.Tensor | None = None,
                 head_dim: int = 0, lora: LowRank | None = None) -> None:
    """See the module docstring."""
    ext = _ext(partials[0])
    if ext is not None and head_dim in (0, 64, 128) and outs[0].dtype in _DTYPES:
        ext.hadamard_out(list(partials), list(posts), list(biases), list(outs),
                         [int(c) for c in rope_cols], residual, cos, sin, head_dim,
                         *(lora.args() if lora is not None else _NO_LORA))
        return
    delta = low_rank_delta(lora) if lora is not None else None
    start = 0
    for partial, post, bias, out, rope in zip(partials, posts, biases, outs, rope_cols,
                                              strict=True):
        cols = out.shape[1]
        y = _output(partial, post, bias, cols).to(out.dtype)
        if delta is not None:
            y = y + delta[:, start : start + cols].to(y.dtype)
        start += cols
        if rope > 0 and cos is not None and sin is not None:
            y = torch.cat([_rotate(y[:, :rope], cos, sin, head_dim), y[:, rope:]], dim=1)
        if residual is not None:
            y = residual[:, :cols] + y
        out.copy_(y)


def glu_hadamard(gate: torch.Tensor, up: torch.Tensor, post_gate: torch.Tensor | None,
                 post_up: torch.Tensor | None, bias_gate: torch.Tensor | None,
                 bias_up: torch.Tensor | None, inter: int, act: str, pre: torch.Tensor,
                 dtype: torch.dtype, lora: LowRank | None = None,
                 product: torch.Tensor | None = None) -> torch.Tensor:
    """See the module docstring."""
    rows, width = gate.shape[1], gate.shape[2]
    ext = _ext(gate)
    if ext is not None and dtype in _DTYPES:
        out = torch.empty(rows, width, dtype=torch.float16, device=gate.device)
        ext.glu_hadamard(gate, up, post_gate, post_up, bias_gate, bias_up, inter,
                         ACTIVATIONS[act], pre, out, _DTYPES[dtype],
                         *(lora.args() if lora is not None else _NO_LORA), product)
        return out
    g = _output(gate, post_gate, bias_gate, inter).to(dtype)
    u = _output(up, post_up, bias_up, inter).to(dtype)
    if lora is not None:
        delta = low_rank_delta(lora).to(dtype)
        g, u = g + delta[:, :inter], u + delta[:, inter : 2 * inter]
    a = F.silu(g) if act == "silu" else F.gelu(g, approximate="tanh")
    au = a * u
    if product is not None:
        product.copy_(au)
    padded = F.pad(au.float(), (0, width - inter))
    return block_hadamard(padded * pre[:width].float(), dim=-1).half()


def qk_norm_rope(qk: torch.Tensor, weight: torch.Tensor, eps: float,
                 cos: torch.Tensor | None = None, sin: torch.Tensor | None = None
                 ) -> torch.Tensor:
    """See the module docstring."""
    rows, heads, dim = qk.shape
    flat = qk.view(rows, heads * dim) if qk.stride(2) == 1 and qk.stride(1) == dim else None
    ext = _ext(qk)
    if (ext is not None and hasattr(ext, "qk_norm_rope") and flat is not None
            and qk.dtype in _DTYPES and dim in (64, 128, 256)):
        ext.qk_norm_rope(flat, heads, dim, weight.float().contiguous(), eps,
                         None if cos is None else cos.contiguous(),
                         None if sin is None else sin.contiguous())
        return qk
    normed = F.rms_norm(qk.float(), (dim,), None, eps).to(qk.dtype)
    normed = normed * weight.to(qk.dtype)
    if cos is None or sin is None:
        return normed
    return apply_rotary(normed, cos.view(rows, 1, dim), sin.view(rows, 1, dim))
