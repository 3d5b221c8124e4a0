#!/usr/bin/env bash
# One device call for GPU + CPU offload (issue 15): build the kernels (CUDA and CPU),
# run the offload tests, write a synthetic Llama-3.1-8B-shaped EXL3 folder (4.0 bpw,
# head 6 bits), then one process per placement (bench/offload_bench.py): every layer on
# the GPU (num_gpu 32), half offloaded to the CPU (16), all on the CPU (0), half and all
# streamed from pinned host memory (EXL3_OFFLOAD=stream), and a forced small budget
# (EXL3_GPU_MEMORY: fixed part + 3/8 of the layers) that must split instead of failing.
# The table (bench/offload_table.py) comes last: decode and prefill tok/s, GPU memory,
# and the greedy text of each placement against the full-GPU one.
#
# Usage (repo root): bash bench/gpu_offload.sh          carry: none (no peer here: ExLlamaV3
# has no CPU offload; the full-GPU row is the baseline)
# Dry run on a CPU: DRY=1 CUDA_VISIBLE_DEVICES= bash bench/gpu_offload.sh (tiny shape,
# 4 layers, a forced budget so the planner splits on the CPU device too).
# STAGES="tests bench ps" picks stages ("ps": `exl3 serve`, a model with PARAMETER num_gpu
# HALF loaded by one request, then `exl3 ps`: its PROCESSOR column shows the split;
# "threads": the CPU kernels at THREADS=1,2,4,8,16 on this host); PLACEMENTS="full half
# cpu stream-half stream-all budget".
set -u -o pipefail
OUT=${OUT:-/tmp/exl3-offload-out}
mkdir -p "$OUT"
cd "$(dirname "$0")/.."
T0=$(date +%s)
stamp() { echo "[$(( $(date +%s) - T0 )) s] $*"; }
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
export PYTHONUNBUFFERED=1 EXL3_KERNEL_CACHE=${EXL3_KERNEL_CACHE:-/tmp/exl3-kernel-cache}
export MAX_JOBS=${MAX_JOBS:-16}
STAGES=${STAGES:-"tests bench ps"}
PLACEMENTS=${PLACEMENTS:-"full half cpu stream-half stream-all budget"}
if [ "${DRY:-0}" = 1 ]; then
  SHAPE=tiny LAYERS=4 MODEL=/tmp/exl3-offload-tiny
  export EXL3_GPU_MEMORY=${EXL3_GPU_MEMORY:-1GiB}  # a budget for the CPU device's plan
  ARGS="--prompt 32 --gen 16 --repeat 1 --greedy 12 --prefill 64"
  CPU_ARGS=$ARGS
else
  SHAPE=llama3-8b LAYERS=32 MODEL=/tmp/exl3-llama3-8b-4.0
  ARGS="--prompt 128 --gen 64 --repeat 2 --greedy 32 --prefill 256"
  CPU_ARGS="--prompt 128 --gen 32 --repeat 1 --greedy 32 --prefill 128"  # CPU-bound rows
fi
HALF=$((LAYERS / 2))

command -v nvidia-smi >/dev/null && nvidia-smi --query-gpu=name,driver_version,memory.total \
  --format=csv,noheader | tee "$OUT/env.txt"
nproc | sed 's/^/cpu cores: /'
. bench/device_install.sh >"$OUT/install.log" 2>&1
[ -f "$MODEL/config.json" ] || python3 bench/synthetic_model.py "$SHAPE" -b 4.0 --head-bits 6 \
  --layers "$LAYERS" --out "$MODEL" >"$OUT/synthetic.log" 2>&1 &
python3 -c "
import time, torch; t = time.time()
from exl3cli.ops import cpu_kernels
ok = cpu_kernels.available()
print('CPU BUILD', 'ok' if ok else 'FAILED', f'{time.time() - t:.1f} s', cpu_kernels.simd_level()
      if ok else '', f'kernel threads {cpu_kernels.parallel_threads(256)}/{torch.get_num_threads()}'
      if ok else '')
" >"$OUT/build-cpu.log" 2>&1 &
python3 -c "
import time, torch; t = time.time()
if not torch.cuda.is_available():
    print('CUDA BUILD skipped (no GPU)'); raise SystemExit
from exl3cli.ops import cuda_kernels as kernels
ok = kernels.available()
print('CUDA BUILD', 'ok' if ok else 'FAILED', kernels.unavailable_reason(), f'{time.time() - t:.1f} s')
" >"$OUT/build.log" 2>&1
wait
stamp "$(grep BUILD "$OUT/build.log" || tail -3 "$OUT/build.log") / $(grep BUILD "$OUT/build-cpu.log" \
  || tail -3 "$OUT/build-cpu.log") / model: $(ls "$MODEL" 2>/dev/null | grep -c safetensors) shards"

if [[ " $STAGES " == *" tests "* ]]; then
  if [ "${CPU_TESTS:-0}" = 1 ]; then  # they run on the dev machine; 1 here too
    timeout 240 python3 -m pytest -q -p no:randomly tests/engine/test_streamed.py \
      tests/engine/test_placement.py tests/engine/test_cpu_threads.py >"$OUT/tests-cpu.log" 2>&1
    stamp "offload tests (CPU): $(tail -1 "$OUT/tests-cpu.log")"
  fi
  collect=$(python3 -c "import torch; print('' if torch.cuda.is_available() else '--collect-only')")
  timeout 240 python3 -m pytest -q -m cuda -p no:randomly $collect tests/engine/test_streamed_cuda.py \
    >"$OUT/tests-cuda.log" 2>&1
  stamp "offload tests (cuda): $(tail -1 "$OUT/tests-cuda.log")"
  grep -E "^(FAILED|ERROR)|Error" "$OUT"/tests-*.log | head -12
fi

place() {  # name, timeout, argument set, offload_bench arguments
  local name=$1 limit=$2 args=$3
  shift 3
  timeout "$limit" python3 bench/offload_bench.py "$MODEL" $args "$@" \
    --json "$OUT/offload-$name.json" 2>"$OUT/offload-$name.err" \
    || { echo "FAIL: $name"; tail -6 "$OUT/offload-$name.err"; }
  stamp "$name done"
}
if [[ " $STAGES " == *" bench "* ]]; then
  for p in $PLACEMENTS; do
    case $p in
      full) place 1-full 90 "$ARGS" --num-gpu "$LAYERS" --label "num_gpu $LAYERS (all GPU)" ;;
      half) place 2-half 100 "$CPU_ARGS" --num-gpu "$HALF" --label "num_gpu $HALF, CPU offload" ;;
      cpu) place 3-cpu 150 "$CPU_ARGS" --num-gpu 0 --label "num_gpu 0 (all CPU)" ;;
      stream-half) place 4-stream-half 80 "$ARGS" --num-gpu "$HALF" \
        --offload stream --label "num_gpu $HALF, streamed" ;;
      stream-all) place 5-stream-all 80 "$ARGS" --num-gpu 0 --offload stream \
        --label "num_gpu 0, all streamed" ;;
      budget) place 6-budget 100 "$CPU_ARGS" --num-gpu -1 --budget-fraction 0.375 \
        --label "auto, EXL3_GPU_MEMORY 3/8 of layers" ;;
    esac
  done
fi

# "threads": the CPU kernels' scaling on this host (bench/cpu_threads.py, one 8B layer's
# projections x 4 layers, M=1 and 128): run 57's all-CPU row (5.5 tok/s, 16 threads) and
# half row (10.9) imply ~2.8 G weights/s a thread, under half of one thread on the dev
# VM (6-10): thread scaling, memory bandwidth, or SMT siblings counted as cores?
if [[ " $STAGES " == *" threads "* ]]; then
  lscpu | grep -E "^(Model name|Socket|Core|Thread|CPU\(s\)|NUMA node\(s\)|L3)" >"$OUT/lscpu.txt" 2>&1
  cat "$OUT/lscpu.txt"
  timeout 240 python3 bench/cpu_threads.py --threads "${THREADS:-1,2,4,8,16}" --rows 1,128 \
    --layers 4 --rounds 3 2>&1 | tee "$OUT/cpu-threads.txt" | tail -12
  stamp "threads done"
fi

if [[ " $STAGES " == *" ps "* ]]; then
  port=$((11500 + RANDOM % 400))
  export EXL3_MODELS=/tmp/exl3-offload-store EXL3_HOST=127.0.0.1:$port
  printf 'FROM %s\nPARAMETER num_gpu %s\n' "$MODEL" "$HALF" >/tmp/Modelfile.offload
  python3 -m exl3cli create offload-split -f /tmp/Modelfile.offload >"$OUT/create.log" 2>&1 \
    || { echo "FAIL: create"; tail -3 "$OUT/create.log"; }
  setsid python3 -m exl3cli serve >"$OUT/serve.log" 2>&1 &
  pid=$!
  for _ in $(seq 60); do
    python3 -c "import urllib.request as u; u.urlopen('http://$EXL3_HOST/api/version', timeout=2)" \
      2>/dev/null && break; sleep 1
  done
  timeout 90 python3 -c "
import json, urllib.request as u
body = json.dumps({'model': 'offload-split', 'prompt': 'Hello', 'stream': False,
                   'options': {'num_predict': 8, 'temperature': 0}}).encode()
answer = json.load(u.urlopen(u.Request('http://$EXL3_HOST/api/generate', body), timeout=85))
print('generate:', answer.get('eval_count'), 'tokens')" 2>&1 | tail -1
  timeout 30 python3 -m exl3cli ps 2>&1 | tee "$OUT/ps.txt"
  kill -- -"$pid" 2>/dev/null || kill "$pid" 2>/dev/null; wait "$pid" 2>/dev/null
  stamp "ps done"
fi

python3 bench/offload_table.py "$OUT" | tee "$OUT/table.txt"
stamp "end"
tar -czf "$OUT/logs.tgz" -C "$OUT" $(cd "$OUT" && ls *.log *.err 2>/dev/null) 2>/dev/null
(cd "$OUT" && rm -f *.log *.err)
