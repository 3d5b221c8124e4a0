"""Refit a quantized linear's float16 side scales (suh, svh) with its trellis held fixed.

The trellis search and LDLQ decide the rotated weight ``Ŵ``; the scales that turn it
back into ``W = diag(suh)·Hblk·Ŵ·Hblk·diag(svh)`` were fixed before the search. Once the
quantized weight ``Q`` is known, the scales can be corrected for free (the stored tensors
keep their shapes and the kernels their work): with ``W`` the original weight (in, out)
and ``H`` the (damped) Hessian of its input, minimise the proxy loss

    L(r, c) = tr((W - diag(r)·Q·diag(c))ᵀ · H · (W - diag(r)·Q·diag(c)))

over an input-side factor ``r`` and an output-side factor ``c``; ``suh·r`` and ``svh·c``
are stored. Both halves have closed forms, alternated for a few rounds:
- columns are independent: ``c_j = (q_jᵀ H w_j) / (q_jᵀ H q_j)``;
- with ``c`` folded into ``Q``, ``L`` is quadratic in ``r``:
  ``L = r ᵀ ((Q·G·Qᵀ) ∘ H) r - 2 rᵀ rowsum((Q·G) ∘ (H W)) + const``, solved by one
  (in x in) linear system. ``G = diag(g)`` weighs the output channels (the Fisher
  information, when the caller has it: an error in a costly channel counts more);
  the column step needs no weights (each column's loss is its own).

Public API:
- ``refit_scales(weight, quantized, hessian, rounds=2, column_weights=None)
  -> (r[in], c[out])``: the factors (float32, 1 where a fit is undefined or not
  positive); multiply ``suh`` by ``r`` and ``svh`` by ``c`` (padding entries: 1).
"""

from __future__ import annotations

import torch

# Ridge added to the row system's diagonal, relative to its mean: keeps dead inputs
# (an all-zero Hessian row) solvable, at factor 1, without moving any real row's fit.
_RIDGE = 1e-6
_FLOAT64_LIMIT = 1 << 24  # elements of the weight


def _usable(x: torch.Tensor) -> torch.Tensor:
    """Factors that are finite and positive; others (a fit of nothing) stay 1."""
    return torch.where(torch.isfinite(x) & (x > 0), x, torch.ones_like(x))


def refit_scales(
    weight: torch.Tensor,
    quantized: torch.Tensor,
    hessian: torch.Tensor,
    rounds: int = 2,
    column_weights: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Input- and output-side factors ``(r, c)`` that lower ``L`` (module docstring) for
    ``weight`` and ``quantized`` (in, out) under ``hessian`` (in, in)."""
    # float64 unless the matrices are large (a head of 100k+ columns): the sums below
    # are float64 either way, and the one solve is.
    work = torch.float64 if weight.numel() <= _FLOAT64_LIMIT else torch.float32
    h = hessian.to(weight.device, work)
    w = weight.to(work)
    q = quantized.to(work)
    in_f, out_f = w.shape
    f64 = torch.float64
    r = torch.ones(in_f, dtype=work, device=w.device)
    c = torch.ones(out_f, dtype=work, device=w.device)
    hw = h @ w
    g = None
    if column_weights is not None:
        g = column_weights.to(w.device, work).clamp_min(0)
        g = g / g.mean().clamp_min(1e-30)
    for _ in range(max(0, rounds)):
        current = q * r[:, None] * c[None, :]
        num = (current * hw).sum(0, dtype=f64)
        den = (current * (h @ current)).sum(0, dtype=f64)
        c = c * _usable(num / den.clamp_min(1e-30)).to(work)
        current = q * r[:, None] * c[None, :]  # rows: solve for a factor on top of r
        weighted = current if g is None else current * g[None, :]
        system = ((weighted @ current.T) * h).to(f64)
        rhs = (weighted * hw).sum(1, dtype=f64)
        # The ridge pulls towards "no change" (a step of 1), not towards 0.
        ridge = _RIDGE * system.diagonal().mean().clamp_min(1e-30)
        system.diagonal().add_(ridge)
        # solve_ex: linalg.solve without its error check, which syncs a GPU (a singular
        # system gives non-finite steps, which _usable turns into 1).
        step = torch.linalg.solve_ex(system, rhs + ridge)[0]
        r = r * _usable(step).to(work)
    return r.to(torch.float32), c.to(torch.float32)
