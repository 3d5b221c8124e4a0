"""Block Hadamard rotation against an explicit block-diagonal matrix."""

from __future__ import annotations

import math

import pytest
import torch

from exl3cli.codec.hadamard import block_hadamard, hadamard_matrix


def _sylvester_entry(i: int, j: int) -> int:
    # Natural-order Sylvester: H[i, j] = (-1)^popcount(i & j).
    return -1 if bin(i & j).count("1") % 2 else 1


@pytest.mark.parametrize("n", [32, 128])
def test_matrix_is_normalised_sylvester(n: int) -> None:
    h = hadamard_matrix(n, torch.float64)
    expected = torch.tensor(
        [[_sylvester_entry(i, j) for j in range(n)] for i in range(n)], dtype=torch.float64
    ) / math.sqrt(n)
    assert torch.equal(h, expected)
    assert torch.allclose(h @ h, torch.eye(n, dtype=torch.float64), atol=1e-12)


@pytest.mark.parametrize("dim", [0, 1])
def test_block_hadamard_equals_block_diagonal_product(dim: int) -> None:
    x = torch.randn(256, 384, dtype=torch.float64)
    h = hadamard_matrix(128, torch.float64)
    blocks = torch.block_diag(*([h] * (x.shape[dim] // 128)))
    expected = blocks @ x if dim == 0 else x @ blocks
    assert torch.allclose(block_hadamard(x, dim), expected, atol=1e-12)


def test_block_hadamard_is_involution_and_keeps_dtype() -> None:
    x = torch.randn(3, 64, dtype=torch.float16)
    y = block_hadamard(x, dim=-1, block=32)
    assert y.dtype == torch.float16
    back = block_hadamard(y.float(), dim=1, block=32)
    assert torch.allclose(back, x.float(), atol=2e-3)


def test_block_hadamard_rejects_partial_blocks() -> None:
    with pytest.raises(ValueError, match="multiple of 128"):
        block_hadamard(torch.zeros(100, 4), dim=0)
