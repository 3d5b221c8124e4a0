"""Gated MLP (SwiGLU and its GELU cousin): down(act(gate(x)) * up(x))."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from exl3cli.errors import UnsupportedArchitecture

ACTIVATIONS = {
    "silu": F.silu,
    "swish": F.silu,
    "gelu": F.gelu,
    "gelu_pytorch_tanh": lambda x: F.gelu(x, approximate="tanh"),
}


class GatedMLP(nn.Module):
    """gate and up share one fused weight [2 * intermediate, hidden] (one matmul)."""

    def __init__(
        self,
        gate_up_weight: torch.Tensor,
        gate_up_bias: torch.Tensor | None,
        down_weight: torch.Tensor,
        down_bias: torch.Tensor | None,
        activation: str,
    ):
        super().__init__()
        if activation not in ACTIVATIONS:
            raise UnsupportedArchitecture(f"unsupported activation {activation!r}")
        self.register_buffer("gate_up_weight", gate_up_weight, persistent=False)
        self.register_buffer("gate_up_bias", gate_up_bias, persistent=False)
        self.register_buffer("down_weight", down_weight, persistent=False)
        self.register_buffer("down_bias", down_bias, persistent=False)
        self.act = ACTIVATIONS[activation]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate, up = F.linear(x, self.gate_up_weight, self.gate_up_bias).chunk(2, dim=-1)
        return F.linear(self.act(gate) * up, self.down_weight, self.down_bias)
