"""Offloaded layers: linears whose weights live in host memory and run on the CPU.

A layer past ``Placement.gpu_layers`` (engine/models/placement.py) keeps its norms, attention
and KV cache on the main device; each of its projections is a ``HostLinear``: the
activations go to the CPU, the projection runs there at the weights' compressed size
(``EXL3_CPU_WEIGHTS=exl3``, float32, engine/layers/cpu_exl3.py), and the result comes back in
the activations' dtype. A decode step moves a few kilobytes per projection, never
weights.

Public API:
- ``HostLinear(inner)``: ``inner`` (a CPU linear) behind a device hop.
- ``offload_linear(parts) -> HostLinear``: one (possibly fused) projection from its
  parts loaded on the CPU in trellis mode.
"""

from __future__ import annotations

import torch

from exl3cli.engine.layers.cpu_exl3 import compressed_linear
from exl3cli.engine.layers.linear import Linear


class HostLinear(Linear):
    """``inner(x)`` computed on the CPU for activations on any device."""

    def __init__(self, inner: Linear):
        super().__init__()
        self.inner = inner
        self.in_features, self.out_features = inner.in_features, inner.out_features

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.device.type == "cpu":
            return self.inner(x)
        return self.inner(x.to("cpu", torch.float32)).to(x.device, x.dtype)


def offload_linear(parts: list[Linear]) -> HostLinear:
    """EXL3 parts kept compressed, dense ones packed for the float32 CPU kernel."""
    return HostLinear(compressed_linear(parts, "fp32"))
