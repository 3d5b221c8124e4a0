#!/usr/bin/env bash
# One device call for the generator (the path `run`, `serve` and the Python API take):
# build the kernels, run the cuda tests, write synthetic Llama-3.1-8B and Llama-3.2-1B
# shaped EXL3 folders (4.0 bpw, head 6 bits), measure our generator at 1/16/64 jobs
# with an fp16 and a q4 cache, profile one job's decode step, then ExLlamaV3 1.6.5's
# generator on the same folders in the same call, and print the table last.
#
# Usage (repo root): bash bench/gpu_generator.sh        carry: [".whl"] where .whl/ holds
# the peer's wheels, its prebuilt extension (*.so.xz) and peer_exllamav3_jobs.py
# (shared/tools/README.md). STAGES="tests ours unfused peer profile cli" (also fold, lora, async, ab, ...) picks stages
# ("unfused": the 1/16-job points again with EXL3_FUSED_LAYER=0, the before of the
# fused decode layer; "ab": kernel build variants, see below). OURS_KV="fp16": the "ours"
# stage's caches (default fp16,q4).
set -u -o pipefail
OUT=${OUT:-/tmp/exl3-gen-out}
mkdir -p "$OUT"
cd "$(dirname "$0")/.."
. bench/peer_install.sh
T0=$(date +%s)
stamp() { echo "[$(( $(date +%s) - T0 )) s] $*"; }
export PYTHONUNBUFFERED=1 EXL3_KERNEL_CACHE=${EXL3_KERNEL_CACHE:-/tmp/exl3-kernel-cache}
export MAX_JOBS=${MAX_JOBS:-16}
STAGES=${STAGES:-"tests ours unfused peer profile cli"}
PEER_KV=${PEER_KV:-"16"}  # "16 4": also the peer with a 4-bit cache
PROFILE_JOBS=${PROFILE_JOBS:-"1 64"}
JOBS=${JOBS:-1,16,64}
MODELS=${MODELS:-"8b 1b"}  # which synthetic shapes are written and measured
M8=/tmp/exl3-llama3-8b-4.0 M1=/tmp/exl3-llama3.2-1b-4.0

nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.mem --format=csv,noheader \
  | tee "$OUT/env.txt"
. bench/device_install.sh >"$OUT/install.log" 2>&1
# The synthetic folders (CPU work) while the kernels build.
for spec in "8b llama3-8b $M8" "1b llama3.2-1b $M1"; do
  set -- $spec
  [[ " $MODELS " == *" $1 "* ]] || continue  # MODELS=8b: no 1B folder (and no 1B stages)
  shift
  [ -f "$2/config.json" ] || python3 bench/synthetic_model.py "$1" -b 4.0 --head-bits 6 \
    --out "$2" >"$OUT/synthetic-$1.log" 2>&1 &
done
if peer_wheels; then
  peer_install >"$OUT/peer-install.log" 2>&1 &
fi
python3 -c "
import time; t = time.time()
from exl3cli.ops import cuda_kernels as kernels
ok = kernels.available()
print('BUILD', 'ok' if ok else 'FAILED', kernels.unavailable_reason(), f'{time.time() - t:.1f} s')
" >"$OUT/build.log" 2>&1
stamp "$(grep BUILD "$OUT/build.log" || { echo 'FAIL: build crashed'; tail -20 "$OUT/build.log"; })"

if [[ " $STAGES " == *" tests "* ]]; then
  # Every file with cuda-marked tests (the others may import packages this image lacks).
  # CUDA_TESTS="files": only those (default: every file with cuda-marked tests).
  timeout ${TESTS_TIMEOUT:-420} python3 -m pytest -q -m cuda -p no:randomly ${CUDA_TESTS:-$(grep -rl "mark.cuda" tests | sort)} \
    >"$OUT/tests-cuda.log" 2>&1
  stamp "cuda tests: $(tail -1 "$OUT/tests-cuda.log")"
  grep -E "^(FAILED|ERROR)|Error" "$OUT/tests-cuda.log" | head -12
  # The same kernels launched with programmatic dependent launch (csrc/ops/cuda/exl3_launch.cuh).
  # FOLD_TESTS="files": those again with every fold on (EXL3_LAYER_FOLD=all, ops/layer_fold.py).
  if [ -n "${FOLD_TESTS:-}" ]; then
    EXL3_LAYER_FOLD=all timeout 200 python3 -m pytest -q -m cuda -p no:randomly $FOLD_TESTS \
      >"$OUT/tests-cuda-fold.log" 2>&1
    stamp "cuda tests, EXL3_LAYER_FOLD=all: $(tail -1 "$OUT/tests-cuda-fold.log")"
    grep -E "^(FAILED|ERROR)|Error" "$OUT/tests-cuda-fold.log" | head -12
  fi
  [ "${PDL_TESTS:-0}" = 1 ] && EXL3_PDL=1 timeout 200 python3 -m pytest -q -m cuda -p no:randomly tests/kernels \
    tests/engine/test_generator_cuda.py >"$OUT/tests-cuda-pdl.log" 2>&1
  [ "${PDL_TESTS:-0}" = 1 ] && stamp "cuda tests, EXL3_PDL=1: $(tail -1 "$OUT/tests-cuda-pdl.log")"
  [ "${PDL_TESTS:-0}" = 1 ] && grep -E "^(FAILED|ERROR)|Error" "$OUT/tests-cuda-pdl.log" | head -12
fi
wait
stamp "models: $(ls $M8 $M1 2>/dev/null | grep -c safetensors) shards"

if [[ " $STAGES " == *" ours "* ]]; then
  for m in "8b $M8" "1b $M1"; do
    set -- $m
    [[ " $MODELS " == *" $1 "* ]] || continue
    timeout 200 python3 bench/generator_throughput.py "$2" --device cuda --jobs "$JOBS" \
      --prompt 128 --gen 64 --kv "${OURS_KV:-fp16,q4}" --repeat 3 --json >"$OUT/ours-$1.json" \
      2>"$OUT/ours-$1.err" || { echo "FAIL: ours $1"; tail -8 "$OUT/ours-$1.err"; }
    stamp "ours $1 done"
  done
fi

if [[ " $STAGES " == *" pdl "* ]]; then
  # Programmatic dependent launch (EXL3_PDL=1) against the plain launches of "ours".
  for m in "8b $M8" "1b $M1"; do
    set -- $m
    [[ " $MODELS " == *" $1 "* ]] || continue
    EXL3_PDL=1 timeout 200 python3 bench/generator_throughput.py "$2" --device cuda \
      --jobs "$JOBS" --prompt 128 --gen 64 --kv fp16,q4 --repeat 3 --json \
      >"$OUT/ours-$1-pdl.json" 2>"$OUT/ours-$1-pdl.err" \
      || { echo "FAIL: pdl $1"; tail -8 "$OUT/ours-$1-pdl.err"; }
  done
  stamp "pdl done"
fi

if [[ " $STAGES " == *" lora "* ]]; then
  # One random rank-16 LoRA adapter on all projections, every job using it (issue 16).
  # LORA_VARIANTS="gemm:EXL3_LORA_GEMM=1 ...": more runs, each NAME:ENV=VALUE[,ENV=VALUE]
  # (EXL3_LORA_GEMM=0: the first product as its own launch; EXL3_LORA_LOW=torch: by cuBLAS).
  for variant in "lora:" ${LORA_VARIANTS:-}; do
    name=${variant%%:*} envs=${variant#*:}
    [ "$name" = lora ] || name="lora-$name"
    env ${envs//,/ } timeout 200 python3 bench/generator_throughput.py "$M8" --device cuda \
      --jobs 1,16 --prompt 128 --gen 64 --kv fp16 --repeat 2 --lora-rank 16 --json \
      >"$OUT/ours-8b-$name.json" 2>"$OUT/ours-8b-$name.err" \
      || { echo "FAIL: $name"; tail -8 "$OUT/ours-8b-$name.err"; }
  done
  stamp "lora done"
fi

if [[ " $STAGES " == *" fold "* ]]; then
  # The decode layer's folds (exl3cli/ops/layer_fold.py; NOTES-gpu "Launches per layer
  # (issue 10, session 8)"): FOLD_VARIANTS="NAME:ENV=VALUE[,ENV=VALUE] ..." (default
  # "all:EXL3_LAYER_FOLD=all"), each the 8B generator at FOLD_JOBS (default JOBS) with the
  # FOLD_KV caches (default fp16); "ours" in the same call is the baseline (the default
  # folds, kv,combine since run 52; "off:EXL3_LAYER_FOLD=0" measures none).
  # FOLD_PROFILE="NAME ...": those variants' one-job profile too (default: all of them).
  for variant in ${FOLD_VARIANTS:-"all:EXL3_LAYER_FOLD=all"}; do
    name=${variant%%:*} envs=${variant#*:}
    env ${envs//,EXL3_/ EXL3_} timeout 200 python3 bench/generator_throughput.py "$M8" \
      --device cuda --jobs "${FOLD_JOBS:-$JOBS}" --prompt 128 --gen 64 --kv "${FOLD_KV:-fp16}" \
      --repeat 3 --json >"$OUT/ours-8b-fold-$name.json" 2>"$OUT/ours-8b-fold-$name.err" \
      || { echo "FAIL: fold $name"; tail -8 "$OUT/ours-8b-fold-$name.err"; }
    if [[ " ${FOLD_PROFILE:-$name} " == *" $name "* ]]; then
      env ${envs//,EXL3_/ EXL3_} timeout 90 python3 bench/decode_profile.py "$M8" --jobs 1 \
        --kv fp16 --json >"$OUT/profile-8b-fold-$name.json" 2>"$OUT/profile-8b-fold-$name.err" \
        || echo "FAIL: fold profile $name"
    fi
  done
  stamp "fold done"
fi

if [[ " $STAGES " == *" async "* ]]; then
  # Decode steps launched ahead of the previous read-back (engine/generation/ahead_step.py;
  # NOTES-gpu "Host time between decode steps"): ASYNC_VARIANTS="NAME:ENV=VALUE[,ENV=VALUE]
  # ..." (default: "sync", this script's timing before session 9, the device synchronized
  # after every step; "off", EXL3_ASYNC_STEP=0; "argmax", EXL3_STEP_ARGMAX=1; "sampled" /
  # "sampledoff": temperature 0.8, top_k 40, top_p 0.9, launched ahead / not), each at
  # ASYNC_JOBS (default JOBS) with the
  # ASYNC_KV caches (default fp16); "ours" in the same call is the default (launched
  # ahead, no sync). ASYNC_PROFILE="NAME ...": those variants' one-job profile too
  # (default "off"; "profile" in the same call is the default's).
  for m in "8b $M8" "1b $M1"; do
    set -- $m
    [[ " $MODELS " == *" $1 "* ]] || continue
    for variant in ${ASYNC_VARIANTS:-"sync:EXL3_BENCH_SYNC_STEPS=1 off:EXL3_ASYNC_STEP=0
        argmax:EXL3_STEP_ARGMAX=1 sampled:EXL3_BENCH_TEMPERATURE=0.8
        sampledoff:EXL3_BENCH_TEMPERATURE=0.8,EXL3_ASYNC_STEP=0"}; do
      name=${variant%%:*} envs=${variant#*:}
      env ${envs//,/ } timeout 200 python3 bench/generator_throughput.py "$2" --device cuda \
        --jobs "${ASYNC_JOBS:-$JOBS}" --prompt 128 --gen 64 --kv "${ASYNC_KV:-fp16}" --repeat 3 \
        --json >"$OUT/ours-$1-async-$name.json" 2>"$OUT/ours-$1-async-$name.err" \
        || { echo "FAIL: async $1 $name"; tail -8 "$OUT/ours-$1-async-$name.err"; }
      if [ "$1" = 8b ] && [[ " ${ASYNC_PROFILE:-off} " == *" $name "* ]]; then
        env ${envs//,/ } timeout 90 python3 bench/decode_profile.py "$M8" --jobs 1 --kv fp16 \
          --json >"$OUT/profile-8b-async-$name.json" 2>"$OUT/profile-8b-async-$name.err" \
          || echo "FAIL: async profile $name"
      fi
    done
  done
  stamp "async done"
fi

if [[ " $STAGES " == *" attn "* ]]; then
  timeout 120 python3 bench/attention_bench.py --json "$OUT/attention.json" \
    >"$OUT/attention.txt" 2>"$OUT/attention.err" || { echo "FAIL: attention bench"; \
    tail -5 "$OUT/attention.err"; }
  cat "$OUT/attention.txt"
  stamp "attention bench done"
fi

if [[ " $STAGES " == *" ab "* ]]; then
  # A/B of kernel builds in one call: AB_FLAGS="|-DEXL3_PA_UNPACK=1" (variants split by
  # "|", empty = the default build; each is its own EXL3_NVCC_FLAGS build, all built in
  # parallel first). AB_BENCH picks what runs per variant: "attention" (default;
  # bench/attention_bench.py --quick), "gemm" (bench/gemm_sweep.py at AB_ROWS rows and
  # AB_KS bits, default splits), each AB_ROUNDS times (default 2) with the variants in
  # turn; then AB_TESTS (pytest arguments: cuda test files, -k ...) on every variant (the
  # variants' test processes run at the same time);
  # "gen": the 8B generator at AB_GEN_JOBS jobs (fp16 cache) for the variant indexes in
  # AB_GEN (default all). Tables last (attention below, bench/gemm_ab_table.py for gemm).
  IFS='|' read -ra variants <<< "${AB_FLAGS:-|}"
  AB_BENCH=${AB_BENCH:-attention}
  for i in "${!variants[@]}"; do
    EXL3_NVCC_FLAGS="${variants[$i]}" MAX_JOBS=$(( MAX_JOBS / ${#variants[@]} + 1 )) python3 -c "
from exl3cli.ops import cuda_kernels as k
print('BUILD', k.available(), k.unavailable_reason(), 'gemm variant', k.gemm_variant())
" >"$OUT/ab-build-$i.log" 2>&1 &
  done
  wait
  for i in "${!variants[@]}"; do
    stamp "ab variant $i ('${variants[$i]}') build: $(tail -1 "$OUT/ab-build-$i.log")"
  done
  for round in $(seq 1 "${AB_ROUNDS:-2}"); do
    for i in "${!variants[@]}"; do
      if [[ " $AB_BENCH " == *" attention "* ]]; then
        EXL3_NVCC_FLAGS="${variants[$i]}" timeout 200 python3 bench/attention_bench.py --quick \
          --json "$OUT/ab-$i-$round.json" >"$OUT/ab-$i-$round.txt" 2>"$OUT/ab-$i-$round.err" \
          || { echo "FAIL: ab variant $i round $round"; tail -5 "$OUT/ab-$i-$round.err"; }
      fi
      if [[ " $AB_BENCH " == *" gemm "* ]]; then
        EXL3_NVCC_FLAGS="${variants[$i]}" timeout 200 python3 bench/gemm_sweep.py --warps 0 \
          --rows "${AB_ROWS:-1,16}" --ks "${AB_KS:-2,3,4,5,6}" --json "$OUT/ab-gemm-$i-$round.json" \
          >"$OUT/ab-gemm-$i-$round.txt" 2>"$OUT/ab-gemm-$i-$round.err" \
          || { echo "FAIL: ab gemm variant $i round $round"; tail -5 "$OUT/ab-gemm-$i-$round.err"; }
      fi
    done
    stamp "ab round $round done"
  done
  # The variants' tests at once (correctness only; the timings above ran alone).
  for i in "${!variants[@]}"; do
    [ -n "${AB_TESTS:-}" ] || break
    EXL3_NVCC_FLAGS="${variants[$i]}" timeout 200 python3 -m pytest -q -m cuda -p no:randomly \
      $AB_TESTS >"$OUT/ab-tests-$i.log" 2>&1 &
  done
  wait
  for i in "${!variants[@]}"; do
    [ -n "${AB_TESTS:-}" ] || break
    stamp "ab variant $i ('${variants[$i]}') tests: $(tail -1 "$OUT/ab-tests-$i.log")"
    grep -E "^(FAILED|ERROR)" "$OUT/ab-tests-$i.log" | head -6
  done
  if [[ " $AB_BENCH " == *" gen "* ]]; then
    for i in ${AB_GEN:-${!variants[@]}}; do
      EXL3_NVCC_FLAGS="${variants[$i]}" timeout 150 python3 bench/generator_throughput.py "$M8" \
        --device cuda --jobs "${AB_GEN_JOBS:-1,16}" --prompt 128 --gen 64 --kv fp16 --repeat 2 \
        --json >"$OUT/ab-gen-$i.json" 2>"$OUT/ab-gen-$i.err" \
        || { echo "FAIL: ab gen variant $i"; tail -5 "$OUT/ab-gen-$i.err"; }
      stamp "ab gen variant $i done"
    done
  fi
  if [[ " $AB_BENCH " == *" attention "* ]]; then
    python3 - "$OUT" "${#variants[@]}" <<'PY'
import json, sys
out, n = sys.argv[1], int(sys.argv[2])
runs = {(i, r): json.load(open(f"{out}/ab-{i}-{r}.json")) for i in range(n) for r in (1, 2)
        if __import__("os").path.exists(f"{out}/ab-{i}-{r}.json")}
keys = [(c["kv"], c.get("dim", 128), c["batch"], c["context"]) for c in next(iter(runs.values()), [])]
print("attention us per call, variant/round:", " ".join(f"v{i}r{r}" for i, r in sorted(runs)))
for k, key in enumerate(keys):
    print(f"{key[0]:5}{key[1]:>4}{key[2]:>4}{key[3]:>6}",
          " ".join(f"{runs[ir][k]['attention_us']:7.1f}" for ir in sorted(runs)))
PY
  fi
  python3 bench/gemm_ab_table.py "$OUT" | tee "$OUT/gemm-ab.txt"
  stamp "ab done"
fi

if [[ " $STAGES " == *" unfused "* ]]; then
  # Before/after of the fused decode layer (engine/layers/fused_layer.py), same call.
  for m in "8b $M8" "1b $M1"; do
    set -- $m
    [[ " $MODELS " == *" $1 "* ]] || continue
    EXL3_FUSED_LAYER=0 timeout 120 python3 bench/generator_throughput.py "$2" --device cuda \
      --jobs "${UNFUSED_JOBS:-1,16}" --prompt 128 --gen 64 --kv fp16 --repeat 2 --json \
      >"$OUT/ours-$1-unfused.json" 2>"$OUT/ours-$1-unfused.err" \
      || { echo "FAIL: unfused $1"; tail -8 "$OUT/ours-$1-unfused.err"; }
  done
  stamp "unfused done"
fi

if [[ " $STAGES " == *" peer "* ]] && grep -q "peer install ok" "$OUT/peer-install.log" 2>/dev/null; then
  PEER_JOBS=$(echo "$JOBS" | sed 's/\([0-9]*\)/\1,\1,\1/g')
  for m in "8b $M8" "1b $M1"; do
    set -- $m
    [[ " $MODELS " == *" $1 "* ]] || continue
    for kv in $PEER_KV; do
      bits=$([ "$kv" = 16 ] && echo "" || echo "$kv")
      (cd /tmp && PYTHONPATH=/tmp/peer EX3_KV_BITS=$bits timeout 150 python3 \
        "$OLDPWD/.whl/peer_exllamav3_jobs.py" "$2" "$PEER_JOBS" 128 64) \
        >"$OUT/peer-$1-kv$kv.log" 2>&1 || { echo "FAIL: peer $1 kv$kv"; \
        tail -5 "$OUT/peer-$1-kv$kv.log"; }
      stamp "peer $1 kv$kv done"
    done
  done
fi

if [[ " $STAGES " == *" cli "* ]]; then
  # What a user sees: `exl3 run --verbose` and `exl3 bench` on the 8B folder, one job.
  export EXL3_MODELS=/tmp/exl3-store
  printf 'FROM %s\nPARAMETER temperature 0\nPARAMETER num_predict 256\n' "$M8" >/tmp/Modelfile
  timeout 60 python3 -m exl3cli create syn8b -f /tmp/Modelfile >"$OUT/create.log" 2>&1
  timeout 90 python3 -m exl3cli run syn8b "Tell me a story about trellis codes." --verbose \
    >/dev/null 2>"$OUT/run-verbose.log" || { echo "FAIL: exl3 run"; tail -5 "$OUT/run-verbose.log"; }
  grep -E "^eval (count|rate)" "$OUT/run-verbose.log" | sed 's/^/exl3 run --verbose: /'
  timeout 120 python3 -m exl3cli bench "$M8" --prompt-lengths 128 --gen-tokens 256 --batch 1 \
    --memory-context 0 >"$OUT/exl3-bench.txt" 2>"$OUT/exl3-bench.err" \
    || { echo "FAIL: exl3 bench"; tail -5 "$OUT/exl3-bench.err"; }
  grep -A3 "^generate" "$OUT/exl3-bench.txt" | sed 's/^/exl3 bench: /'
  stamp "cli done"
fi

if [[ " $STAGES " == *" profile "* ]]; then
  for jobs in $PROFILE_JOBS; do
    for kv in ${PROFILE_KV:-fp16}; do
      suffix=$([ "$kv" = fp16 ] && echo "" || echo "-$kv")
      # PROFILE_BARE=0: only the adapted step (PROFILE_LORA), not the bare one.
      [ "${PROFILE_BARE:-1}" = 1 ] && { timeout 90 python3 bench/decode_profile.py "$M8" \
        --jobs "$jobs" --kv "$kv" --json \
        >"$OUT/profile-$jobs$suffix.json" 2>"$OUT/profile-$jobs$suffix.err" \
        || { echo "FAIL: profile $jobs jobs $kv"; tail -5 "$OUT/profile-$jobs$suffix.err"; }; }
      # PROFILE_LORA=R: the same step with every job on a random rank-R adapter (issue 16).
      [ -n "${PROFILE_LORA:-}" ] && timeout 90 python3 bench/decode_profile.py "$M8" \
        --jobs "$jobs" --kv "$kv" --lora-rank "$PROFILE_LORA" --json \
        >"$OUT/profile-$jobs$suffix-lora.json" 2>"$OUT/profile-$jobs$suffix-lora.err" \
        || { [ -n "${PROFILE_LORA:-}" ] && echo "FAIL: lora profile $jobs"; }
    done
  done
  stamp "profile done"
fi

if [[ " $STAGES " == *" sweep "* ]]; then
  # The fused GEMM per decode group, K = 2..6, split heuristics (bench/gemm_sweep.py).
  timeout 200 python3 bench/gemm_sweep.py --warps "${SWEEP_WARPS:-0,16,64}" --json "$OUT/gemm-sweep.json" \
    >"$OUT/gemm-sweep.txt" 2>"$OUT/gemm-sweep.err" || { echo "FAIL: sweep"; \
    tail -5 "$OUT/gemm-sweep.err"; }
  cat "$OUT/gemm-sweep.txt"
  stamp "sweep done"
fi

python3 bench/generator_table.py "$OUT" | tee "$OUT/table.txt"
stamp "end"
# Only a few files come back: keep the table, the JSON and one tarball of the logs.
tar -czf "$OUT/logs.tgz" -C "$OUT" $(cd "$OUT" && ls *.log *.err *.txt 2>/dev/null) 2>/dev/null
(cd "$OUT" && rm -f *.log *.err env.txt)
