"""The default fused-GEMM variant the Python side reports (cuda_kernels.DEFAULT_GEMM_VARIANT,
which the cuda variant test compares with the built one) is the one the header compiles
when no EXL3_NVCC_FLAGS names a variant. Runs on the CPU: it reads the source."""

from __future__ import annotations

import re
from pathlib import Path

from exl3cli.ops import cuda_kernels as kernels

HEADER = Path(__file__).resolve().parents[2] / "csrc" / "ops" / "cuda" / "gemm_lean.cuh"


def test_the_header_default_is_the_reported_default() -> None:
    found = re.findall(r"#define EXL3_GEMM_VARIANT (\d+)", HEADER.read_text())
    assert found == [str(kernels.DEFAULT_GEMM_VARIANT)]


def test_the_header_accepts_every_variant_up_to_the_default() -> None:
    limit = re.search(r"EXL3_GEMM_VARIANT > (\d+)", HEADER.read_text())
    assert limit is not None and int(limit.group(1)) >= kernels.DEFAULT_GEMM_VARIANT
