"""Input statistics of a linear layer: H = E[x xᵀ], damping, and the rotated Hessian.

The proxy loss of quantizing ``W`` (in, out; ``y = x W``) to ``Q`` is
``tr((W-Q)ᵀ H (W-Q))`` with ``H`` the second moment of the layer's inputs. Layers that
read the same activations (q/k/v, gate/up) share one ``H``.

Public API:
- ``HessianAccumulator(features, device)``: ``.add(x[..., features])``, ``.hessian()``
  (float64, divided by the number of rows seen), ``.rows``.
- ``damp_hessian(h, fraction) -> Tensor``: ``h + fraction * mean(diag h) * I``.
- ``pad_hessian(h, size) -> Tensor``: zero rows/columns up to ``size``.
- ``rotate_hessian(h, suh) -> Tensor``: ``Hblk·diag(suh)·h·diag(suh)·Hblk``, the Hessian
  seen by the rotated weight ``Ŵ`` (EXL3-FORMAT.md section 4).
- ``proxy_error(h, w, q) -> float``: ``tr((W-Q)ᵀ H (W-Q)) / tr(Wᵀ H W)``.
"""

from __future__ import annotations

import torch

from exl3cli.codec import block_hadamard


class HessianAccumulator:
    """Running sum of x xᵀ over calibration rows, in float64 for large token counts."""

    def __init__(self, features: int, device: torch.device | str = "cpu"):
        self.features = features
        self.rows = 0
        self._sum = torch.zeros(features, features, dtype=torch.float64, device=device)

    def add(self, x: torch.Tensor) -> None:
        """Accumulate every row of ``x`` (any leading shape, last dim = features)."""
        flat = x.reshape(-1, self.features)
        # float32 products summed into float64: exact enough and fast on both devices.
        part = flat.to(torch.float32)
        self._sum += (part.T @ part).to(torch.float64)
        self.rows += flat.shape[0]

    def hessian(self) -> torch.Tensor:
        if self.rows == 0:
            raise ValueError("no calibration rows were accumulated")
        return self._sum / self.rows


def damp_hessian(h: torch.Tensor, fraction: float) -> torch.Tensor:
    """Add ``fraction`` of the mean diagonal to the diagonal (keeps H positive definite)."""
    mean_diag = h.diagonal().mean().clamp_min(1e-12)
    return h + fraction * mean_diag * torch.eye(h.shape[0], dtype=h.dtype, device=h.device)


def pad_hessian(h: torch.Tensor, size: int) -> torch.Tensor:
    """Zero-pad a square Hessian to ``size`` (padded inputs are always zero)."""
    extra = size - h.shape[0]
    if extra < 0:
        raise ValueError(f"cannot pad a {h.shape[0]}-square Hessian down to {size}")
    return torch.nn.functional.pad(h, (0, extra, 0, extra))


def rotate_hessian(h: torch.Tensor, suh: torch.Tensor) -> torch.Tensor:
    """The Hessian of the rotated weight: ``Hblk·diag(suh)·h·diag(suh)·Hblk``."""
    scaled = h * suh[:, None].to(h.dtype) * suh[None, :].to(h.dtype)
    return block_hadamard(block_hadamard(scaled, dim=0), dim=1)


def proxy_error(h: torch.Tensor, w: torch.Tensor, q: torch.Tensor) -> float:
    """Relative proxy loss ``tr((W-Q)ᵀ H (W-Q)) / tr(Wᵀ H W)`` (W, Q: (in, out))."""
    h = h.to(torch.float64)
    err = (w - q).to(torch.float64)
    w64 = w.to(torch.float64)
    num = (err * (h @ err)).sum()
    den = (w64 * (h @ w64)).sum().clamp_min(1e-30)
    return float(num / den)
