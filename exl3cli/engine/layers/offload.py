"""Offloaded layers: linears whose weights live in host memory and run on the CPU.

A layer past ``Placement.gpu_layers`` (engine/models/placement.py) keeps its norms, attention
and KV cache on the main device; each of its projections is a ``HostLinear``: the
activations go to the CPU, the projection runs there at the weights' compressed size
(``EXL3_CPU_WEIGHTS=exl3``, float32, engine/layers/cpu_exl3.py: the compiled kernels on all
of torch's threads), and the result comes back in the activations' dtype. A decode step
moves a few kilobytes per projection, never weights.

A forward of many rows (a prompt, a large batch: ``EXL3_OFFLOAD_DEVICE_ROWS``, default 9,
the first row count past the CPU's fused GEMV) goes the other way: the projection's
trellis (pinned host memory on a CUDA host, K bits a weight) is copied to the device and
multiplied there by the device kernel, as a resident layer would be (the memory plan holds
no room for the copies, ~2x the largest projection: a forward that finds the device full
runs on the CPU instead). On the CPU such a
forward decodes every tile to float32 and runs a float32 matrix product (~2 x weights x
rows flops); the copy costs the same whatever the rows (bench/NOTES-cpu-exl3.md).

Public API:
- ``HostLinear(inner, device_rows=0)``: ``inner`` (a CPU linear) behind a device hop;
  from ``device_rows`` rows on (0: never), EXL3 parts run on the activations' device.
- ``offload_linear(parts, device=None) -> HostLinear``: one (possibly fused) projection
  from its parts loaded on the CPU in trellis mode; with a CUDA ``device`` its trellises
  are pinned and prompts run there.
- ``offload_device_rows() -> int``: ``EXL3_OFFLOAD_DEVICE_ROWS`` (``InvalidOption`` for
  anything but a whole number >= 0).
"""

from __future__ import annotations

import os

import torch

from exl3cli.engine.layers.cpu_exl3 import CpuExl3Linear, compressed_linear
from exl3cli.engine.layers.linear import GEMV_MAX_ROWS, FusedLinear, Linear
from exl3cli.errors import InvalidOption
from exl3cli.ops import cuda_kernels

DEFAULT_DEVICE_ROWS = GEMV_MAX_ROWS + 1


def offload_device_rows() -> int:
    """See the module docstring."""
    value = os.environ.get("EXL3_OFFLOAD_DEVICE_ROWS", "").strip()
    if not value:
        return DEFAULT_DEVICE_ROWS
    if not value.isdigit():
        raise InvalidOption(f"EXL3_OFFLOAD_DEVICE_ROWS must be a row count (0: never), "
                            f"got {value!r}")
    return int(value)


class HostLinear(Linear):
    """``inner(x)`` computed on the CPU for activations on any device."""

    def __init__(self, inner: Linear, device_rows: int = 0):
        super().__init__()
        self.inner = inner
        self.in_features, self.out_features = inner.in_features, inner.out_features
        parts = list(inner.parts) if isinstance(inner, FusedLinear) else [inner]
        exl3 = all(type(p) is CpuExl3Linear for p in parts)
        self._device_parts = parts if exl3 and device_rows > 0 else None
        self.device_rows = device_rows if self._device_parts else 0

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.device.type == "cpu":
            return self.inner(x)
        rows = x.numel() // max(1, x.shape[-1])
        if self.device_rows and rows >= self.device_rows and x.is_cuda \
                and cuda_kernels.available():
            try:
                return self.on_device(x)
            except torch.cuda.OutOfMemoryError:
                pass  # the plan holds no room for the copies: this forward on the CPU
        return self.inner(x.to("cpu", torch.float32)).to(x.device, x.dtype)

    def on_device(self, x: torch.Tensor) -> torch.Tensor:
        """The EXL3 parts' product on x's device: each trellis copied there for this
        call (from pinned memory: asynchronous), then the resident layers' kernel."""
        device = x.device
        out = torch.empty(*x.shape[:-1], self.out_features, device=device, dtype=x.dtype)
        start = 0
        for part in self._device_parts or ():
            def there(t: torch.Tensor | None) -> torch.Tensor | None:
                return None if t is None else t.to(device, non_blocking=True)

            # (nb, kb, words) on the host -> the device kernel's (kb, nb, words).
            trellis = there(part.trellis_t).transpose(0, 1).contiguous()
            cuda_kernels.exl3_gemm(x, trellis, there(part.suh), there(part.svh), part.k_bits,
                                   part.codebook, bias=there(part.bias),
                                   out=out[..., start:start + part.out_features],
                                   out_features=part.out_features)
            start += part.out_features
        return out


def offload_linear(parts: list[Linear], device: torch.device | None = None) -> HostLinear:
    """EXL3 parts kept compressed, dense ones packed for the float32 CPU kernel; with a
    CUDA `device` the trellises pinned and many-row forwards run there."""
    inner = compressed_linear(parts, "fp32")
    on_cuda = device is not None and device.type == "cuda"
    if on_cuda:
        for module in inner.modules():
            if type(module) is CpuExl3Linear:
                module.trellis_t = module.trellis_t.pin_memory()
    return HostLinear(inner, offload_device_rows() if on_cuda else 0)
