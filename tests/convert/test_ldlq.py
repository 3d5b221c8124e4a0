import torch

from exl3cli.convert.hessian import proxy_error
from exl3cli.convert.ldlq import (
    block_ldl_diagonal,
    block_ldl_feedback,
    ldlq,
    trellis_block_quantizer,
)


def _correlated_hessian(n: int, seed: int) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    mix = torch.randn(n, n, generator=gen, dtype=torch.float64)
    x = torch.randn(4 * n, n, generator=gen, dtype=torch.float64) @ mix
    return x.T @ x / x.shape[0]


def test_block_ldl_reconstructs_hessian_with_block_lower_feedback():
    h = _correlated_hessian(48, 0)
    a, d = block_ldl_feedback(h)
    m = torch.eye(48, dtype=torch.float64) + a
    assert torch.allclose(m.T @ torch.block_diag(*d) @ m, h, atol=1e-8 * h.abs().max())
    # Strictly block-lower: nothing on or above the 16x16 diagonal blocks.
    for k in range(3):
        assert a[16 * k : 16 * k + 16, 16 * k :].abs().max() == 0


def test_ldlq_beats_plain_rounding_on_correlated_hessian():
    h = _correlated_hessian(64, 1)
    w = torch.randn(64, 32, generator=torch.Generator().manual_seed(2))

    def rounding(rows):
        return (rows * 2).round() / 2, None

    q_ldlq, _ = ldlq(w, h, rounding)
    q_plain = (w * 2).round() / 2
    assert proxy_error(h, w, q_ldlq) < 0.8 * proxy_error(h, w, q_plain)


def test_ldlq_with_trellis_tiles_beats_tilewise_viterbi():
    h = _correlated_hessian(32, 3)
    w = torch.randn(32, 16, generator=torch.Generator().manual_seed(4))
    quantize = trellis_block_quantizer(2, "mul1")
    q_ldlq, payloads = ldlq(w, h, quantize)
    q_plain = torch.cat([quantize(w[i : i + 16])[0] for i in (0, 16)])
    assert [tuple(p.shape) for p in payloads] == [(1, 1, 32), (1, 1, 32)]
    assert proxy_error(h, w, q_ldlq) < proxy_error(h, w, q_plain)


def test_block_ldl_diagonal_is_the_feedbacks_d_exactly():
    # The sensitivity pass reads only D (its trace): the same bits without the solve.
    gen = torch.Generator().manual_seed(5)
    x = torch.randn(200, 96, generator=gen, dtype=torch.float64)
    h = x.T @ x + 0.1 * torch.eye(96, dtype=torch.float64)
    assert torch.equal(block_ldl_diagonal(h), block_ldl_feedback(h)[1])
