"""Gated MLP (SwiGLU and its GELU cousin): down(act(gate(x)) * up(x)).

"swiglu_clamped" is gpt-oss's variant: gate clamped above and up clamped on both sides
at `limit`, then (up + 1) * gate * sigmoid(alpha * gate)."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from exl3cli.engine.layers.linear import Linear
from exl3cli.errors import UnsupportedArchitecture
from exl3cli.ops import cpu_kernels

ACTIVATIONS = {
    "silu": F.silu,
    "swish": F.silu,
    "gelu": F.gelu,
    "gelu_pytorch_tanh": lambda x: F.gelu(x, approximate="tanh"),
}


CLAMPED_SWIGLU = "swiglu_clamped"


def clamped_swiglu(gate: torch.Tensor, up: torch.Tensor, limit: float,
                   alpha: float) -> torch.Tensor:
    """gpt-oss's gated activation (module docstring)."""
    gate = gate.clamp(max=limit)
    up = up.clamp(min=-limit, max=limit)
    return (up + 1) * gate * torch.sigmoid(gate * alpha)


class GatedMLP(nn.Module):
    """gate and up are one fused Linear (outputs [gate | up]; one matmul when dense).
    `limit` and `alpha` are the clamped SwiGLU's (activation "swiglu_clamped")."""

    def __init__(self, gate_up: Linear, down: Linear, activation: str, *,
                 limit: float = 7.0, alpha: float = 1.702):
        super().__init__()
        if activation not in ACTIVATIONS and activation != CLAMPED_SWIGLU:
            raise UnsupportedArchitecture(f"unsupported activation {activation!r}")
        self.gate_up = gate_up
        self.down = down
        self.activation = activation
        self.act = ACTIVATIONS.get(activation)
        self.clamp = (limit, alpha) if activation == CLAMPED_SWIGLU else None
        self._silu = activation in ("silu", "swish")
        self._fused_silu: bool | None = None  # decided on the first CPU float32 call

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate_up = self.gate_up(x)
        if (self._silu and gate_up.dtype == torch.float32 and gate_up.device.type == "cpu"
                and gate_up.is_contiguous() and not gate_up.requires_grad):  # no backward
            if self._fused_silu is None:  # SiLU(gate) * up in one pass
                self._fused_silu = cpu_kernels.available()
            if self._fused_silu:
                return self.down(cpu_kernels.silu_mul_cpu(gate_up))
        return self.down(self.gated(gate_up))

    def gated(self, gate_up: torch.Tensor) -> torch.Tensor:
        """The activation between the projections: [gate | up] -> act(gate) * up."""
        gate, up = gate_up.chunk(2, dim=-1)
        if self.clamp is not None:
            return clamped_swiglu(gate, up, *self.clamp)
        return self.act(gate) * up
