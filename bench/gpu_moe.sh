#!/usr/bin/env bash
# One device call for mixture-of-experts decode (issue 14): build the kernels, run the
# MoE cuda tests, write synthetic Qwen3-30B-A3B and Mixtral-8x7B shaped EXL3 folders
# (4.0 bpw, head 6 bits; skipped when present), measure our generator at 1/16/64 jobs
# (fp16 cache), then ExLlamaV3 1.6.5's generator on the same folders in the same call,
# and print the table last.
#
# Usage (repo root): bash bench/gpu_moe.sh        carry: [".whl"] (the peer's wheels, its
# prebuilt extension *.so.xz; the peer runs through bench/peer_jobs.py).
# SHAPES="qwen3 mixtral" picks the models (one per call if both do not fit in 10 min),
# STAGES="tests ours peer" the stages (and "profile": one job's decode step under
# torch.profiler per variant), JOBS=1,16,64 the job counts, KV=fp16 our caches.
# MOE_VARIANTS="new:EXL3_MOE_DECODE=new ...": more runs of ours in the same call, each
# NAME:ENV=VALUE[,ENV=VALUE], at VARIANT_JOBS (default 1) jobs; the table prints each
# against the default run. PROFILE_VARIANTS (same form, default "default:") picks the
# profile stage's runs.
# DRY=1: the same script on the CPU with the tiny MoE shapes (tiny-qwen3-moe,
# tiny-mixtral), no build, tests or peer: checks the plumbing before device time is spent.
set -u -o pipefail
OUT=${OUT:-/tmp/exl3-moe-out}
mkdir -p "$OUT"
cd "$(dirname "$0")/.."
. bench/peer_install.sh
T0=$(date +%s)
stamp() { echo "[$(( $(date +%s) - T0 )) s] $*"; }
export PYTHONUNBUFFERED=1 EXL3_KERNEL_CACHE=${EXL3_KERNEL_CACHE:-/tmp/exl3-kernel-cache}
export MAX_JOBS=${MAX_JOBS:-16}
DRY=${DRY:-0}
SHAPES=${SHAPES:-"qwen3 mixtral"}
STAGES=${STAGES:-"tests ours peer"}
JOBS=${JOBS:-1,16,64}
KV=${KV:-fp16}
REPEAT=${REPEAT:-3}
if [ "$DRY" = 1 ]; then
  DEVICE=cpu; JOBS=${DRY_JOBS:-1,4}; REPEAT=1; STAGES=${STAGES/tests/}; STAGES=${STAGES/peer/}
  declare -A SHAPE=([qwen3]=tiny-qwen3-moe [mixtral]=tiny-mixtral)
  ROOT=${ROOT:-/tmp/exl3-moe-dry}
  export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
else
  DEVICE=cuda
  declare -A SHAPE=([qwen3]=qwen3-30b-a3b [mixtral]=mixtral-8x7b)
  ROOT=${ROOT:-/tmp}
fi
folder() { echo "$ROOT/exl3-${SHAPE[$1]}-4.0"; }

if [ "$DRY" != 1 ]; then
  nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.mem,memory.total \
    --format=csv,noheader | tee "$OUT/env.txt"
  df -h /tmp | tail -1 | tee -a "$OUT/env.txt"
  . bench/device_install.sh >"$OUT/install.log" 2>&1
  if peer_wheels; then
    peer_install >"$OUT/peer-install.log" 2>&1 &
  fi
  # The kernels build while the folders are written (random words on the GPU, shards
  # written by threads); the folders are written one after the other (disk bandwidth).
  python3 -c "
import time; t = time.time()
from exl3cli.ops import cuda_kernels as kernels
ok = kernels.available()
print('BUILD', 'ok' if ok else 'FAILED', kernels.unavailable_reason(), f'{time.time() - t:.1f} s')
" >"$OUT/build.log" 2>&1 &
  BUILD_PID=$!
fi
(
  for s in $SHAPES; do
    f=$(folder "$s")
    [ -f "$f/config.json" ] || python3 bench/synthetic_model.py "${SHAPE[$s]}" -b 4.0 \
      --head-bits 6 --out "$f" --device "$DEVICE" --workers 6 >"$OUT/synthetic-$s.log" 2>&1 \
      || echo "FAIL: synthetic $s" >>"$OUT/synthetic-$s.log"
  done
) &
WRITE_PID=$!
if [ "$DRY" != 1 ]; then
  wait $BUILD_PID
  stamp "$(grep BUILD "$OUT/build.log" || { echo 'FAIL: build crashed'; tail -20 "$OUT/build.log"; })"
fi

if [[ " $STAGES " == *" tests "* ]]; then
  timeout 300 python3 -m pytest -q -m cuda -p no:randomly ${CUDA_TESTS:-tests/kernels/test_moe_kernels.py tests/kernels/test_moe_block.py \
    tests/kernels/test_layer_kernels.py tests/engine/test_moe.py} \
    >"$OUT/tests-cuda.log" 2>&1
  stamp "cuda tests: $(tail -1 "$OUT/tests-cuda.log")"
  grep -E "^(FAILED|ERROR)|Error" "$OUT/tests-cuda.log" | head -12
fi
wait $WRITE_PID
for s in $SHAPES; do
  stamp "folder $s: $(tail -1 "$OUT/synthetic-$s.log" 2>/dev/null || echo present)"
done

if [[ " $STAGES " == *" ours "* ]]; then
  for s in $SHAPES; do
    timeout ${OURS_TIMEOUT:-200} python3 bench/generator_throughput.py "$(folder "$s")" \
      --device "$DEVICE" --jobs "$JOBS" --prompt 128 --gen 64 --kv "$KV" --repeat "$REPEAT" \
      --stacks "${STACKS:-0}" --json >"$OUT/ours-$s.json" 2>"$OUT/ours-$s.err" \
      || { echo "FAIL: ours $s"; tail -40 "$OUT/ours-$s.err"; }
    grep "^\[" "$OUT/ours-$s.err" | tail -12
    grep -i "graph capture failed" "$OUT/ours-$s.err" | head -2
    stamp "ours $s done"
    for variant in ${MOE_VARIANTS:-}; do
      name=${variant%%:*} envs=${variant#*:}
      env ${envs//,/ } timeout ${OURS_TIMEOUT:-200} python3 bench/generator_throughput.py \
        "$(folder "$s")" --device "$DEVICE" --jobs "${VARIANT_JOBS:-1}" --prompt 128 --gen 64 \
        --kv "$KV" --repeat "$REPEAT" --json >"$OUT/ours-$s-moe-$name.json" \
        2>"$OUT/ours-$s-moe-$name.err" || { echo "FAIL: ours $s $name"; tail -20 "$OUT/ours-$s-moe-$name.err"; }
      grep -i "graph capture failed" "$OUT/ours-$s-moe-$name.err" | head -2
      stamp "ours $s variant $name ($envs) done"
    done
  done
fi

if [[ " $STAGES " == *" profile "* ]] && [ "$DRY" != 1 ]; then
  for s in $SHAPES; do
    for variant in ${PROFILE_VARIANTS:-default:}; do
      name=${variant%%:*} envs=${variant#*:}
      env ${envs//,/ } timeout 150 python3 bench/decode_profile.py "$(folder "$s")" --jobs 1 \
        --kv "$KV" --json >"$OUT/profile-$s-moe-$name.json" 2>"$OUT/profile-$s-moe-$name.err" \
        || { echo "FAIL: profile $s $name"; tail -5 "$OUT/profile-$s-moe-$name.err"; }
    done
    stamp "profile $s done"
  done
fi

if [[ " $STAGES " == *" peer "* ]] && grep -q "peer install ok" "$OUT/peer-install.log" 2>/dev/null; then
  PEER_JOBS=$(echo "$JOBS" | sed 's/\([0-9]*\)/\1,\1,\1/g')
  for s in $SHAPES; do
    (cd /tmp && PYTHONPATH=/tmp/peer timeout ${PEER_TIMEOUT:-200} python3 \
      "$OLDPWD/bench/peer_jobs.py" "$(folder "$s")" "$PEER_JOBS" 128 64) \
      >"$OUT/peer-$s-kv16.log" 2>&1 || { echo "FAIL: peer $s"; tail -5 "$OUT/peer-$s-kv16.log"; }
    stamp "peer $s done"
  done
fi

python3 bench/generator_table.py "$OUT" "$(echo $SHAPES | tr ' ' ',')" | tee "$OUT/table.txt"
stamp "end"
# Only a few files come back: keep the table, the JSON and one tarball of the logs.
tar -czf "$OUT/logs.tgz" -C "$OUT" $(cd "$OUT" && ls *.log *.err *.txt 2>/dev/null) 2>/dev/null
(cd "$OUT" && rm -f *.log *.err env.txt)
