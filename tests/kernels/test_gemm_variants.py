"""The fused decode-GEMM at shapes the model layers never produce, for whichever build-time
variant is built (``EXL3_NVCC_FLAGS=-DEXL3_GEMM_VARIANT=N``, csrc/ops/cuda/gemm_lean.cuh):
column groups narrower than four tiles, runs of tile rows that leave splits empty, parts
of different widths in one launch. ``bench/gpu_generator.sh``'s ``ab`` stage runs the GEMM
test files once per variant (``AB_TESTS``); this file also checks that the variant asked
for is the one that was built, so a flag lost on the way cannot pass as the default.

Partial sums are poisoned with NaN; every split must be written (an empty one with
zeros) and their sum must match float64 ``xh @ decode_tiles(...)``.
"""

from __future__ import annotations

import os
import re

import pytest
import torch

from exl3cli.codec import decode_tiles
from exl3cli.ops import cuda_kernels as kernels

pytestmark = pytest.mark.cuda

CASES = [(4, "mul1"), (2, "mul1"), (3, "mul1"), (6, "mul1"), (8, "mul1"), (2.5, "mul1"),
         (3, "mcg"), (8, "mcg"), (4, "3inst"), (5, "3inst")]


def requested_variant() -> int:
    """The variant EXL3_NVCC_FLAGS asks for (the last -DEXL3_GEMM_VARIANT=N; else the
    default)."""
    found = re.findall(r"-DEXL3_GEMM_VARIANT=(\d+)", os.environ.get("EXL3_NVCC_FLAGS", ""))
    return int(found[-1]) if found else kernels.DEFAULT_GEMM_VARIANT


def _ext():
    assert torch.cuda.is_available(), "cuda tests need a GPU"
    assert kernels.available(), f"extension did not load: {kernels.unavailable_reason()}"
    return kernels._extension()


def test_the_requested_variant_is_built() -> None:
    _ext()
    assert kernels.gemm_variant() == requested_variant()


@pytest.mark.parametrize(("k", "codebook"), CASES)
@pytest.mark.parametrize("rows", [1, 3, 8, 9, 16, 40])
def test_odd_shapes_and_empty_splits(k: float, codebook: str, rows: int) -> None:
    ext = _ext()
    gen = torch.Generator().manual_seed(rows * 131 + int(4 * k) + len(codebook))
    kb, nbs = 10, (13, 5, 2)  # 13 = 3 full column groups + 1 tile; 5 = 4 + 1; 2
    k2 = int(2 * k)
    trellises = [torch.randint(-32768, 32768, (kb, nb, 8 * k2), dtype=torch.int16,
                               generator=gen) for nb in nbs]
    xhs = [torch.randn(rows, 16 * kb, generator=gen).half() for _ in nbs]
    expected = [xh.double() @ decode_tiles(t, k, codebook).double()
                for xh, t in zip(xhs, trellises, strict=True)]
    for splits in (1, 3, 7):  # 7: runs of 2 tile rows, the last two splits empty
        partials = [torch.full((splits, rows, 16 * nb), float("nan"), device="cuda")
                    for nb in nbs]
        ext.gemm_parts([x.cuda() for x in xhs], [t.cuda() for t in trellises], k2,
                       kernels._CODEBOOK_IDS[codebook], partials)
        run = -(-kb // splits)
        for partial, want in zip(partials, expected, strict=True):
            got = partial.double().cpu()
            assert torch.isfinite(got).all(), "a partial sum was not written"
            for s in range(splits):
                if s * run >= kb:
                    assert torch.equal(got[s], torch.zeros_like(got[s])), (splits, s)
            err = float((got.sum(0) - want).norm() / want.norm())
            assert err < 1e-5, (splits, err)
