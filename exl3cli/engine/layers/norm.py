"""RMSNorm, the normalisation every supported family uses."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from exl3cli.ops import cpu_kernels
from exl3cli.ops.batch_invariant import batch_invariant, row_blocks


class RMSNorm(nn.Module):
    """y = x / sqrt(mean(x^2) + eps) * weight over the last dimension.

    `weight` may have more than one dimension (e.g. [heads, head_dim] when the q and k
    norms of Qwen3 are applied to q and k heads together); it broadcasts over x.
    On CPU with float32 a 1-D norm runs as one fused op (cpu_kernels.rms_norm_cpu)
    instead of the six torch ops F.rms_norm decomposes into there; the fused ops have
    no backward, so an input that needs a gradient (the quantizer's sensitivity pass)
    takes the torch path.

    `unit_offset` (Gemma): the stored weight w scales by (1 + w), and the whole norm
    runs in float32 before rounding to the activation dtype. (1 + w) is formed once, in
    float32, here; for float32 activations that is the plain norm with that weight.
    """

    def __init__(self, weight: torch.Tensor, eps: float, unit_offset: bool = False):
        super().__init__()
        if unit_offset:
            weight = 1.0 + weight.float()
        self.register_buffer("weight", weight, persistent=False)
        self.eps = eps
        self.unit_offset = unit_offset
        # Checked once: forward runs twice per layer per token.
        self._fused = (weight.dim() == 1 and weight.dtype == torch.float32
                       and weight.device.type == "cpu" and cpu_kernels.available())

    def _use_fused(self, x: torch.Tensor) -> bool:
        return (self._fused and x.dtype == torch.float32 and x.device.type == "cpu"
                and x.is_contiguous() and self.weight.device.type == "cpu"
                and not x.requires_grad)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.is_cuda and batch_invariant():  # one shape of torch's kernel for every row count
            return row_blocks(self._forward, x, keep=max(1, self.weight.dim()))
        return self._forward(x)

    def _forward(self, x: torch.Tensor) -> torch.Tensor:
        dim = x.shape[-1]
        if self._use_fused(x):
            return cpu_kernels.rms_norm_cpu(x, self.weight, self.eps)
        if x.dtype == torch.float32 and self.weight.dim() == 1:
            return F.rms_norm(x, (dim,), self.weight, self.eps)  # one fused op
        if self.unit_offset:  # scale in float32, round once at the end
            return (F.rms_norm(x.float(), (dim,), None, self.eps) * self.weight).to(x.dtype)
        # Reduced precision: normalise in float32, round, then scale (as the reference
        # implementations do, so results match them bit for bit in most cases).
        normed = F.rms_norm(x.float(), (dim,), None, self.eps).to(x.dtype)
        return normed * self.weight

    def add_and_norm(self, x: torch.Tensor, residual: torch.Tensor
                     ) -> tuple[torch.Tensor, torch.Tensor]:
        """(x + residual, norm(x + residual)): a pre-norm block's residual add and the
        norm after it, one pass on the fused CPU path."""
        if (self._use_fused(x) and residual.dtype == torch.float32 and residual.is_contiguous()
                and not residual.requires_grad):
            return cpu_kernels.add_rms_norm_cpu(x, residual, self.weight, self.eps)
        total = x + residual
        return total, self(total)


class FullWidthQKNorm(nn.Module):
    """OLMo 2/3's q and k norms: RMS over all query heads together (and over all key
    heads), not per head. Called like the per-head norm on qk [..., heads + kv heads,
    head_dim]; `q_weight` [heads * head_dim], `k_weight` [kv heads * head_dim]."""

    def __init__(self, q_weight: torch.Tensor, k_weight: torch.Tensor, num_heads: int,
                 eps: float):
        super().__init__()
        self.register_buffer("q_weight", q_weight, persistent=False)
        self.register_buffer("k_weight", k_weight, persistent=False)
        self.num_heads = num_heads
        self.eps = eps

    def forward(self, qk: torch.Tensor) -> torch.Tensor:
        lead = qk.shape[:-2]
        q = qk[..., : self.num_heads, :].reshape(*lead, -1)
        k = qk[..., self.num_heads :, :].reshape(*lead, -1)
        q = RMSNorm(self.q_weight, self.eps)(q.contiguous())
        k = RMSNorm(self.k_weight, self.eps)(k.contiguous())
        return torch.cat([q, k], dim=-1).view(qk.shape)


class LayerNorm(nn.Module):
    """Cohere's norm: (x - mean) / sqrt(var + eps) * weight, no bias, in float32.
    `weight` may be [heads, head_dim] (per-head q/k norms) and broadcasts over x."""

    def __init__(self, weight: torch.Tensor, eps: float):
        super().__init__()
        self.register_buffer("weight", weight.float(), persistent=False)
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        normed = F.layer_norm(x.float(), (x.shape[-1],), None, None, self.eps)
        return (normed * self.weight).to(x.dtype)

    def add_and_norm(self, x: torch.Tensor, residual: torch.Tensor
                     ) -> tuple[torch.Tensor, torch.Tensor]:
        total = x + residual
        return total, self(total)
