"""scale_refit: suh/svh refitted to the searched trellis lower the proxy loss."""

from __future__ import annotations

import torch

from exl3cli.codec import dequantize_linear
from exl3cli.convert.hessian import proxy_error
from exl3cli.convert.quantize_layer import QuantSettings, quantize_group
from exl3cli.convert.scale_refit import refit_scales


def _correlated_inputs(features: int, rows: int, seed: int) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    mix = torch.randn(features, features, generator=gen) / features**0.5
    scale = torch.logspace(-1, 1, features)[torch.randperm(features, generator=gen)]
    return torch.randn(rows, features, generator=gen) @ mix * scale


def test_exact_weights_need_no_refit():
    gen = torch.Generator().manual_seed(1)
    w = torch.randn(64, 48, generator=gen)
    x = _correlated_inputs(64, 512, 1)
    r, c = refit_scales(w, w, (x.T @ x / 512).double())
    assert torch.allclose(r, torch.ones(64), atol=1e-5) and torch.allclose(c, torch.ones(48), atol=1e-5)
    # A weight off by up to 10% per row and column is put back, closer every round.
    rows = torch.rand(64, generator=gen) * 0.2 + 0.9
    cols = torch.rand(48, generator=gen) * 0.2 + 0.9
    off = w / rows[:, None] / cols[None, :]
    left = []
    for rounds in (1, 2, 4, 8):
        r, c = refit_scales(w, off, (x.T @ x / 512).double(), rounds=rounds)
        left.append(float((off * r[:, None] * c[None, :] - w).norm() / w.norm()))
    assert left == sorted(left, reverse=True) and left[-1] < 1e-4, left


def test_refit_lowers_the_proxy_error_and_stores_what_it_measured():
    gen = torch.Generator().manual_seed(0)
    w = torch.randn(128, 256, generator=gen) * 0.05
    x = _correlated_inputs(128, 2048, 0)
    h = (x.T @ x / x.shape[0]).double()
    errors = {}
    for rounds in (0, 2):
        (q,) = quantize_group(["t"], [w], [None], h, QuantSettings(3, scale_search_tiles=8,
                                                                   refit_rounds=rounds))
        # The weight handed on is the stored tensors' decode.
        assert torch.equal(q.weight, dequantize_linear(q.tensors, 128, 256))
        errors[rounds] = proxy_error(h, w, q.weight)
        trellis = q.tensors["trellis"]
        if rounds == 0:
            base_trellis = trellis
    assert torch.equal(trellis, base_trellis)  # the search is untouched
    assert errors[2] < 0.99 * errors[0], errors
