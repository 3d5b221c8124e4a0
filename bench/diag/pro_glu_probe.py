"""Device diagnostic for tests/kernels/test_gemm_pro.py's glu_gemm cases (run 40: every one
differed from the two launches; NOTES-gpu "gemm-pro GLU: run 40's mismatch"): for a few
cases, the one-launch kernel's partials against glu_hadamard + the lean GEMM's, as
'equal' or where they differ (count, first (split, row, column), max abs diff, ulps).
Expected after the fix (__fmul_rn / __fadd_rn in layer_prologue.cuh): every line 'equal'.
    python bench/diag/pro_glu_probe.py"""

from __future__ import annotations

import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
from exl3cli.ops import cuda_kernels as kernels  # noqa: E402
from tests.fixtures.bits import describe_mismatch  # noqa: E402
from tests.kernels.test_gemm_pro import _glu_case, _glu_on_cuda  # noqa: E402

# (name, rows, inter, down input width, down output tiles, 2K, codebook, activation, dtype)
CASES = [
    ("smollm2 fp16 silu mul1 K4", 1, 1480, 1536, 36, 8, "mul1", "silu", torch.float16),
    ("smollm2 fp16 silu mul1 K4", 8, 1480, 1536, 36, 8, "mul1", "silu", torch.float16),
    ("smollm2 bf16 gelu mcg K2", 1, 1480, 1536, 36, 4, "mcg", "gelu_tanh", torch.bfloat16),
    ("smollm2 fp16 gelu 3inst K6", 3, 1480, 1536, 36, 12, "3inst", "gelu_tanh", torch.float16),
    ("8b down fp16 silu mul1 K4", 1, 14336, 14336, 256, 8, "mul1", "silu", torch.float16),
    ("8b down bf16 silu mul1 K4", 8, 14336, 14336, 256, 8, "mul1", "silu", torch.bfloat16),
]


def main() -> int:
    if not torch.cuda.is_available() or not kernels.available():
        print("needs CUDA and the extension")
        return 1
    bad = 0
    for name, rows, inter, width, nb, k2, codebook, act, dtype in CASES:
        case = _glu_case(rows, inter, width, nb, k2, rows + k2)
        splits = kernels.choose_splits(width // 16, nb, torch.device("cuda"), rows=rows)
        got, want, taken = _glu_on_cuda(case, inter, act, dtype, k2, codebook, splits)
        said = describe_mismatch(got, want, "src") if taken else "not taken"
        bad += bool(said)
        print(f"{name}, {rows} rows, {splits} splits: {said or 'equal'}")
    return 1 if bad else 0


if __name__ == "__main__":
    raise SystemExit(main())
