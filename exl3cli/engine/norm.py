"""RMSNorm, the normalisation every supported family uses."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn


class RMSNorm(nn.Module):
    """y = x / sqrt(mean(x^2) + eps) * weight over the last dimension.

    `weight` may have more than one dimension (e.g. [heads, head_dim] when the q and k
    norms of Qwen3 are applied to q and k heads together); it broadcasts over x.
    """

    def __init__(self, weight: torch.Tensor, eps: float):
        super().__init__()
        self.register_buffer("weight", weight, persistent=False)
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        dim = x.shape[-1]
        if x.dtype == torch.float32 and self.weight.dim() == 1:
            return F.rms_norm(x, (dim,), self.weight, self.eps)  # one fused op
        # Reduced precision: normalise in float32, round, then scale (as the reference
        # implementations do, so results match them bit for bit in most cases).
        normed = F.rms_norm(x.float(), (dim,), None, self.eps).to(x.dtype)
        return normed * self.weight
