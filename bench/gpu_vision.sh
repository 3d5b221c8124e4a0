#!/usr/bin/env bash
# One device call for images in, text out (issue 17): build the kernels, run the cuda
# tests of the vision paths, write a synthetic Qwen2.5-VL-7B-shaped EXL3 folder (4.0 bpw,
# head 6 bits, tower at 16 bits under "visual."), then for one 1024 x 1024 image: our
# load / preprocess / vision encode / TTFT / decode through the path `exl3 run --image`
# takes (bench/vision_bench.py), and ExLlamaV3 1.6.5 on the same folder and image in
# the same call (bench/peer_vision.py); the table prints last.
#
# Usage (repo root): bash bench/gpu_vision.sh      carry: [".whl"] where .whl/ holds the
# peer's wheels and its prebuilt extension (*.so.xz) (shared/tools/README.md).
# STAGES (default "tests ours off peer"; the kernel build and the folder always run):
#   tests   pytest -m cuda tests/engine/test_vision_cuda.py tests/engine/test_generator_cuda.py
#           (CUDA_TESTS: other files)
#   ours    bench/vision_bench.py -> ours.json
#   off     the same with EXL3_DECODE_MODE=off (the general paged decode path, how
#           Qwen2.5-VL decoded before its rows carried M-RoPE offsets) -> ours-off.json
#   peer    bench/peer_vision.py from /tmp with PYTHONPATH=/tmp/peer -> peer.json
# Dry run on a CPU (the tiny shape, no install, no peer; cuda tests only collected;
# "ours" decodes in static mode):
#   DRY=1 CUDA_VISIBLE_DEVICES= bash bench/gpu_vision.sh
# Small outputs land in $OUT (JSON, table.txt, logs.tgz).
set -u -o pipefail
OUT=${OUT:-/tmp/exl3-vision-out}
mkdir -p "$OUT"
cd "$(dirname "$0")/.."
. bench/peer_install.sh
REPO=$PWD
T0=$(date +%s)
stamp() { echo "[$(( $(date +%s) - T0 )) s] $*" | tee -a "$OUT/status.txt"; }
: >"$OUT/status.txt"
export PYTHONUNBUFFERED=1 EXL3_KERNEL_CACHE=${EXL3_KERNEL_CACHE:-/tmp/exl3-kernel-cache}
export MAX_JOBS=${MAX_JOBS:-16} TOKENIZERS_PARALLELISM=false
STAGES=${STAGES:-"tests ours off peer"}
DRY=${DRY:-}
has() { [[ " $STAGES " == *" $1 "* ]]; }
SHAPE=qwen2.5-vl-7b DEVICE=cuda IMAGE=${IMAGE:-1024} GEN=${GEN:-64}
[ -n "$DRY" ] && SHAPE=qwen2.5-vl-tiny DEVICE=cpu
M=${MODEL_DIR:-/tmp/exl3-$SHAPE-4.0}
[ -n "$DRY" ] && OURS_TIMEOUT=${OURS_TIMEOUT:-900}  # a shared CPU is slow

nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader 2>/dev/null \
  | tee "$OUT/env.txt"
if [ -n "$DRY" ]; then
  export PYTHONPATH="$REPO${PYTHONPATH:+:$PYTHONPATH}"  # this checkout's exl3cli
else
  . bench/device_install.sh >"$OUT/install.log" 2>&1
fi
# The synthetic folder (CPU work, threads) and the peer's install while the kernels build.
if [ ! -f "$M/config.json" ]; then
  python3 bench/synthetic_model.py "$SHAPE" -b 4.0 --head-bits 6 --out "$M" \
    >"$OUT/synthetic.log" 2>&1 &
  WRITER=$!
fi
if [ -z "$DRY" ] && has peer && peer_wheels; then
  peer_install >"$OUT/peer-install.log" 2>&1 &
fi
if [ -z "$DRY" ]; then
  python3 -c "
import time; t = time.time()
from exl3cli.ops import cuda_kernels as kernels
ok = kernels.available()
print('BUILD', 'ok' if ok else 'FAILED', kernels.unavailable_reason(), f'{time.time() - t:.1f} s')
" >"$OUT/build.log" 2>&1
  stamp "$(grep BUILD "$OUT/build.log" || { echo 'FAIL: build crashed'; tail -20 "$OUT/build.log"; })"
fi

if has tests; then
  # The vision paths, and the text generator's graph decode (its step buffer changed).
  TESTS=${CUDA_TESTS:-tests/engine/test_vision_cuda.py tests/engine/test_generator_cuda.py}
  if [ -n "$DRY" ]; then  # no GPU: only check that they collect
    timeout 120 python3 -m pytest -q --collect-only -m cuda -p no:randomly $TESTS \
      >"$OUT/tests-cuda.log" 2>&1
  else
    timeout 300 python3 -m pytest -q -m cuda -p no:randomly $TESTS >"$OUT/tests-cuda.log" 2>&1
  fi
  stamp "cuda tests${DRY:+ (dry: collected)}: $(tail -1 "$OUT/tests-cuda.log")"
  grep -E "^(FAILED|ERROR)|Error" "$OUT/tests-cuda.log" | head -12
fi
if [ -n "${WRITER:-}" ]; then
  wait "$WRITER" || { stamp "FAIL: synthetic folder"; tail -5 "$OUT/synthetic.log"; }
fi
stamp "model: $(tail -1 "$OUT/synthetic.log" 2>/dev/null || echo "$M (kept)")"

ours() {  # name, env...
  local name=$1; shift
  env "$@" timeout "${OURS_TIMEOUT:-240}" python3 bench/vision_bench.py "$M" --device "$DEVICE" \
    --image-size "$IMAGE" --gen "$GEN" --json >"$OUT/$name.json" 2>"$OUT/$name.err" \
    || { stamp "FAIL: $name"; tail -8 "$OUT/$name.err"; rm -f "$OUT/$name.json"; return 1; }
  stamp "$name done"
}
# Dry: the fixed-shape decode step run eagerly ("static", what the GPU's graphs replay).
if [ -n "$DRY" ]; then has ours && ours ours EXL3_DECODE_MODE=static; else has ours && ours ours; fi
has off && ours ours-off EXL3_DECODE_MODE=off

if has peer && [ -z "$DRY" ]; then
  wait  # the peer's install
  if grep -q "peer install ok" "$OUT/peer-install.log" 2>/dev/null; then
    (cd /tmp && PYTHONPATH=/tmp/peer timeout "${PEER_TIMEOUT:-240}" python3 \
      "$REPO/bench/peer_vision.py" "$M" --image-size "$IMAGE" --gen "$GEN" --json) \
      >"$OUT/peer.json" 2>"$OUT/peer.err" \
      || { stamp "FAIL: peer"; tail -8 "$OUT/peer.err"; rm -f "$OUT/peer.json"; }
    stamp "peer done"
  else
    stamp "FAIL: peer install"; tail -5 "$OUT/peer-install.log"
  fi
fi

stamp "end"
python3 bench/vision_table.py "$OUT" | tee "$OUT/table.txt"
# Only a few files come back: the table, the JSON and one tarball of the logs.
tar -czf "$OUT/logs.tgz" -C "$OUT" $(cd "$OUT" && ls *.log *.err *.txt 2>/dev/null) 2>/dev/null
(cd "$OUT" && rm -f *.log *.err env.txt status.txt)
