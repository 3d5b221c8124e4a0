#!/usr/bin/env bash
# One device call for the EXL3 CUDA kernels: build the extension, run the cuda tests
# (and the plain kernel tests), run the benchmark, print a short summary last.
# Logs go to $OUT (the device tool's output folder; /tmp/exl3-gpu-out elsewhere).
# Usage: bash bench/gpu_run.sh [--quick]
set -u -o pipefail
OUT=${OUT:-/tmp/exl3-gpu-out}
mkdir -p "$OUT"
cd "$(dirname "$0")/.."
export PYTHONUNBUFFERED=1 PYTHONPATH=.${PYTHONPATH:+:$PYTHONPATH}
export EXL3_KERNEL_CACHE=${EXL3_KERNEL_CACHE:-/tmp/exl3-kernel-cache}
export MAX_JOBS=${MAX_JOBS:-16}

{ nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.mem --format=csv
  python3 -c "import torch; print('torch', torch.__version__, 'cuda', torch.version.cuda)"
  nvcc --version | tail -2; which ninja; } 2>&1 | tee "$OUT/env.txt"

EXL3_EXT_VERBOSE=1 python3 -c "
import time; t = time.time()
from exl3cli.ops import cuda_kernels as kernels
ok = kernels.available()
print('BUILD', 'ok' if ok else 'FAILED', kernels.unavailable_reason(), f'{time.time() - t:.1f} s')
" >"$OUT/build.log" 2>&1
grep -E "error|BUILD" "$OUT/build.log" | head -30
if ! grep -q "BUILD ok" "$OUT/build.log"; then tail -60 "$OUT/build.log"; exit 1; fi

python3 -m pytest -m cuda -q tests/kernels >"$OUT/tests-cuda.log" 2>&1
python3 -m pytest -q tests/kernels >"$OUT/tests-plain.log" 2>&1
grep -E "^(FAILED|ERROR)|Error|assert" "$OUT/tests-cuda.log" | head -40

timeout 300 python3 bench/gpu_kernels.py --json "$OUT/bench.json" "$@" >"$OUT/bench.log" 2>&1
echo "=== summary ==="
grep BUILD "$OUT/build.log"
echo "cuda tests: $(tail -1 "$OUT/tests-cuda.log")"
echo "plain tests: $(tail -1 "$OUT/tests-plain.log")"
tail -40 "$OUT/bench.log"
