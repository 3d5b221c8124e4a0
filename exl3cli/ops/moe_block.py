"""A whole mixture-of-experts decode half-layer on the MoE kernels: ``h + experts(norm(h))``
with the RMSNorm, the router's linear, its softmax top-k and the routing plan in one
launch (``csrc/ops/cuda/moe_norm_route.cu``) and the residual added by the last kernel
(``moe_out``), so that a decode step runs six launches per MoE layer (norm-route, in,
gate|up GEMM, glu, down GEMM, out + residual) instead of the norm's PyTorch kernels, a
cuBLAS GEMV, seven MoE kernels and an add (bench/NOTES-gpu.md, "MoE one-job").

Each value is rounded to the activation dtype where the unfused path rounds it:
the norm as ``engine/layers/norm.py``'s RMSNorm, the router's logits as its linear's
output (``F.linear`` in the activation dtype), the experts as ``ops/moe_kernels.py``, the
residual add as ``h + out``.

Public API:
- ``reference_norm_route(x[R, H], norm_weight[H] float32, eps, unit_offset,
  router_weight[E, H], top_k, normalize, scale) -> (normed[R, H], logits[R, E] float32,
  weights[R, k] float32, chosen[R, k] int64)``: the kernel's steps in PyTorch (any
  device).
- ``runs_on_kernels(x, router_weight, top_k, tables) -> bool``: whether ``moe_block``
  runs the fused kernels for these rows (CUDA, 1..64 rows, a dense router of x's dtype
  with E <= 256 and H % 8 == 0), else its PyTorch twin.
- ``moe_block(x, norm_weight, eps, unit_offset, router_weight, top_k, normalize, scale,
  tables, counters, residual=True, combine=False) -> (out[R, H], normed[R, H],
  weights[R, k] float32, chosen[R, k] int64)``: out = x + experts(norm(x)) (without the
  ``+ x`` when ``residual`` is False). ``counters``: int32 on x's device, zero before the
  first call (the kernels set them back to 0 after each call), ``counters_for(tables)``
  of them, one set per block that may run concurrently with another. ``combine``: the
  down GEMM does moe_out's weighted sum itself at up to 16 pairs (``moe_gemm_combine``,
  one launch fewer: five in all).
- ``counters_for(tables) -> int``: 1 (the norm-route kernel) + padded hidden / 128.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from exl3cli.ops import moe_kernels

_MAX_SHARED = 48 * 1024  # csrc/ops/cuda/moe_norm_route.cu launch_moe_norm_route


def reference_norm_route(x: torch.Tensor, norm_weight: torch.Tensor, eps: float,
                         unit_offset: bool, router_weight: torch.Tensor, top_k: int,
                         normalize: bool, scale: float
                         ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """See the module docstring (RMSNorm.forward's roundings, then Router.forward's)."""
    dtype, hidden = x.dtype, x.shape[-1]
    w = norm_weight.float()
    if dtype == torch.float32:
        normed = F.rms_norm(x, (hidden,), w, eps)
    elif unit_offset:
        normed = (F.rms_norm(x.float(), (hidden,), None, eps) * w).to(dtype)
    else:
        normed = (F.rms_norm(x.float(), (hidden,), None, eps).to(dtype).float() * w).to(dtype)
    logits = (normed.float() @ router_weight.float().t()).to(dtype).float()
    probs = torch.softmax(logits, dim=-1)
    weights, chosen = torch.topk(probs, top_k, dim=-1)
    if normalize:
        weights = weights / weights.sum(dim=-1, keepdim=True)
    return normed, logits, weights * scale, chosen


def counters_for(tables: moe_kernels.ExpertTables) -> int:
    """See the module docstring."""
    return 1 + tables.svh[2].shape[1] // 128


def runs_on_kernels(x: torch.Tensor, router_weight: torch.Tensor, top_k: int,
                    tables: moe_kernels.ExpertTables) -> bool:
    """See the module docstring."""
    ext = moe_kernels._use_kernels(x, tables)
    if ext is None or not hasattr(ext, "moe_norm_route") or x.dim() != 2:
        return False
    rows, hidden = x.shape
    experts = router_weight.shape[0] if router_weight.dim() == 2 else 0
    pairs = rows * top_k
    return (router_weight.device == x.device and router_weight.dtype == x.dtype
            and router_weight.is_contiguous() and router_weight.shape[1] == hidden
            and router_weight.data_ptr() % 16 == 0 and hidden % 8 == 0
            and 1 <= top_k <= min(32, experts) and experts <= moe_kernels.ROUTER_MAX_EXPERTS
            and max(4 * hidden, 4 * (2 * experts + pairs)) <= _MAX_SHARED)


def moe_block(x: torch.Tensor, norm_weight: torch.Tensor, eps: float, unit_offset: bool,
              router_weight: torch.Tensor, top_k: int, normalize: bool, scale: float,
              tables: moe_kernels.ExpertTables, counters: torch.Tensor,
              residual: bool = True, combine: bool = False
              ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """See the module docstring."""
    if not runs_on_kernels(x, router_weight, top_k, tables):
        normed, _, weights, chosen = reference_norm_route(
            x, norm_weight, eps, unit_offset, router_weight, top_k, normalize, scale)
        out = moe_kernels.moe_experts(normed, weights, chosen, tables)
        return (x + out if residual else out), normed, weights, chosen
    ext = moe_kernels._use_kernels(x, tables)
    rows, experts = x.shape[0], router_weight.shape[0]
    if x.stride(-1) != 1:
        x = x.contiguous()
    device = x.device
    normed = torch.empty(rows, x.shape[1], dtype=x.dtype, device=device)
    logits = torch.empty(rows, experts, dtype=torch.float32, device=device)
    weights = torch.empty(rows, top_k, dtype=torch.float32, device=device)
    chosen = torch.empty(rows, top_k, dtype=torch.int64, device=device)
    plan = moe_kernels._new_plan(rows * top_k, tables, device)
    ext.moe_norm_route(x, norm_weight, float(eps), bool(unit_offset), router_weight, top_k,
                       bool(normalize), float(scale), normed, logits, weights, chosen, plan,
                       counters[:1])
    out = moe_kernels._run(ext, normed, weights, top_k, plan, tables, None,
                           residual=x if residual else None,
                           counters=counters[1:] if combine else None)
    return out, normed, weights, chosen
