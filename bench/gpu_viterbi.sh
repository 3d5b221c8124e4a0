#!/usr/bin/env bash
# One device call for the Viterbi encoder kernels: build the CUDA (and CPU) kernels,
# run the cuda + CPU kernel tests, run the speed benchmark, print a short table last.
# Logs go to $OUT (the device tool's output folder; /tmp/exl3-viterbi-out elsewhere).
# Usage: bash bench/gpu_viterbi.sh
set -u -o pipefail
OUT=${OUT:-/tmp/exl3-viterbi-out}
mkdir -p "$OUT"
cd "$(dirname "$0")/.."
export PYTHONUNBUFFERED=1 PYTHONPATH=.${PYTHONPATH:+:$PYTHONPATH}
export EXL3_KERNEL_CACHE=${EXL3_KERNEL_CACHE:-/tmp/exl3-kernel-cache}
export MAX_JOBS=${MAX_JOBS:-16}

{ nvidia-smi --query-gpu=name,driver_version --format=csv
  python3 -c "import torch; print('torch', torch.__version__, 'cuda', torch.version.cuda)"
  nvcc --version | tail -1; } 2>&1 | tee "$OUT/env.txt"

EXL3_EXT_VERBOSE=1 python3 -c "
import time
from exl3cli.ops import cpu_kernels, cuda_viterbi
t = time.time(); ok = cuda_viterbi.available()
print('BUILD cuda', 'ok' if ok else 'FAILED', cuda_viterbi.unavailable_reason(), f'{time.time() - t:.1f} s')
t = time.time(); ok = cpu_kernels.available()
print('BUILD cpu', 'ok' if ok else 'FAILED', cpu_kernels.unavailable_reason(), f'{time.time() - t:.1f} s')
" >"$OUT/build.log" 2>&1
grep -E "error|BUILD" "$OUT/build.log" | head -30
grep -q "BUILD cuda ok" "$OUT/build.log" || tail -60 "$OUT/build.log"

timeout 400 python3 -m pytest -m cuda -q tests/engine/quant/test_viterbi_kernels.py \
  >"$OUT/tests-cuda.log" 2>&1
timeout 200 python3 -m pytest -q tests/engine/quant/test_viterbi_kernels.py \
  >"$OUT/tests-cpu.log" 2>&1
grep -E "^(FAILED|ERROR)|Error|assert" "$OUT/tests-cuda.log" | head -40

timeout 300 python3 bench/viterbi_speed.py --k 2 4 6 --tiles 64 --gpu-tiles 4096 \
  --json "$OUT/viterbi_speed.json" >"$OUT/bench.log" 2>&1
echo "=== summary ==="
grep BUILD "$OUT/build.log"
echo "cuda tests: $(tail -1 "$OUT/tests-cuda.log")"
echo "cpu tests:  $(tail -1 "$OUT/tests-cpu.log")"
tail -20 "$OUT/bench.log"
