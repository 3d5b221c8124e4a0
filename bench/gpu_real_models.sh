#!/usr/bin/env bash
# Real models on the GPU, end to end (issue 11): SmolLM2-135M-Instruct and, when its
# parts travelled, Gemma 3 270M. Artefacts come from bench/real_models/make_artefacts.sh
# (run here first): .real/s/c1 (SmolLM2 part 1), .real/s/c2 (part 2, wheels, CPU
# references, wikitext), .real/g/c1..c5 (Gemma 3, optional). Every call but the last
# only stashes what it carries in /tmp/real-stash (the machine must stay warm: make the
# next call within 30 s):
#   bash bench/gpu_real_models.sh stash       carry: [".real/s/c1"]   (or .real/g/cN)
#   bash bench/gpu_real_models.sh             carry: [".real/s/c2"]   the stages
# Stages (STAGES, default "greedy tests serve spec"; all need `convert`, which is implied;
# STAGES=spec converts only the 2.0 bpw draft, greedy/serve the 4.0 folders):
#   convert  source folders from the GGUFs; EXL3 4.0 bpw of each model, 2.0 bpw SmolLM2
#   greedy   item 1: `exl3 run`-path greedy 64 tokens, fp16 and EXL3 4.0, vs CPU refs
#            (fp16: shipped refs computed on the dev CPU; EXL3: refs computed on this
#            machine's CPU from the same folder, while the GPU works); the fp16 weights
#            also in GREEDY_DTYPES on the GPU (default float32); GREEDY_EXL3=0 leaves the
#            EXL3 4.0 rows (and their conversions) out
#   tests    item 5: the cuda tests of the Gemma paths (tests/engine/test_gemma_cuda.py)
#   serve    item 2: `exl3 serve`, 64 streaming clients through ollama and openai, models
#            in turns then together (EXL3_MAX_LOADED_MODELS=2), plus `exl3 bench --server`;
#            SERVE_INVARIANT="0 1" runs them without and with EXL3_BATCH_INVARIANT=1;
#            SERVE_APIS="openai ollama" swaps the order the APIs take in each phase
#   spec     item 4: ngram and SmolLM2 2.0 bpw drafting for SmolLM2 fp16, 1 and 16 jobs
# ONLY="smollm2" restricts the run to the models named (default: all that assembled).
# Dry run on a CPU (same stages, models cut to DRY_LAYERS layers, head unquantized,
# small calibration): DRY=1 CUDA_VISIBLE_DEVICES= bash bench/gpu_real_models.sh
# Small outputs land in $OUT (JSON + table.txt + logs.tgz); the table prints last.
set -u -o pipefail
OUT=${OUT:-/tmp/exl3-real-out}
mkdir -p "$OUT"
cd "$(dirname "$0")/.."
T0=$(date +%s)
stamp() { echo "[$(( $(date +%s) - T0 )) s] $*"; }
STASH=${STASH:-/tmp/real-stash}
REAL=${REAL:-/tmp/real}
for carried in .real/s .real/g; do
  [ -d "$carried" ] && python3 bench/real_models/pack.py stash "$carried" "$STASH"
done
[ "${1:-run}" = stash ] && { ls -la "$STASH"; exit 0; }

export PYTHONUNBUFFERED=1 EXL3_KERNEL_CACHE=${EXL3_KERNEL_CACHE:-/tmp/exl3-kernel-cache}
export MAX_JOBS=${MAX_JOBS:-16} TOKENIZERS_PARALLELISM=false
STAGES=${STAGES:-"greedy tests serve spec"}
DRY=${DRY:-}
DEVICE=cuda; [ -n "$DRY" ] && DEVICE=cpu
GPU_DTYPE=${GPU_DTYPE:-float16}; [ -n "$DRY" ] && GPU_DTYPE=float32
CLIENTS=${CLIENTS:-64}
EXL3="python3 -m exl3cli"
# BUDGET_S: a stage (or a serve pass) that would start past this many seconds is skipped,
# so the script still ends with its table and tarballs inside the device call's limit
# (a `timeout` around it would kill it before it bundles what came back).
BUDGET_S=${BUDGET_S:-100000}
in_budget() {
  (( $(date +%s) - T0 < BUDGET_S )) && return 0
  echo "SKIPPED (BUDGET_S=$BUDGET_S reached): $1"; return 1
}
has() { [[ " $STAGES " == *" $1 "* ]] && in_budget "$1"; }

nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader 2>/dev/null \
  | tee "$OUT/env.txt"
# --- install: wheels the image lacks, then exl3 itself ------------------------------
if ls "$STASH"/wheels/*.whl >/dev/null 2>&1 && [ -z "$DRY" ]; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
    --target /tmp/site "$STASH"/wheels/*.whl >"$OUT/wheels.log" 2>&1 || echo "FAIL: wheels"
  export PYTHONPATH=/tmp/site${PYTHONPATH:+:$PYTHONPATH}
fi
[ -n "$DRY" ] || . bench/device_install.sh >"$OUT/install.log" 2>&1
python3 bench/real_models/pack.py assemble "$STASH" "$REAL" | tee "$OUT/assemble.txt"
MODELS=""
for m in smollm2 gemma3; do
  grep -q "^$m.gguf: ok" "$OUT/assemble.txt" && [[ " ${ONLY:-$m} " == *" $m "* ]] \
    && MODELS="$MODELS $m"
done
stamp "models:$MODELS"
[ -n "$MODELS" ] || { echo "FAIL: no model assembled (stash calls missing?)"; exit 1; }

# --- kernels (GPU) and source folders (CPU), side by side ----------------------------
if [ -z "$DRY" ]; then
  python3 -c "
import time; t = time.time()
from exl3cli.ops import cuda_kernels as kernels
print('BUILD', 'ok' if kernels.available() else 'FAILED', kernels.unavailable_reason(),
      f'{time.time() - t:.1f} s')" >"$OUT/build.log" 2>&1 &
fi
for m in $MODELS; do
  src="$REAL/$m-hf"
  [ -f "$src/config.json" ] || python3 bench/real_models/source_folder.py "$REAL/$m.gguf" \
    "$src" >"$OUT/source-$m.log" 2>&1 || { echo "FAIL: source $m"; tail -5 "$OUT/source-$m.log"; }
  # the tokenizer made with the references (make_artefacts.sh), not this image's rebuild
  if [ -f "$STASH/tokenizer-$m.tar.xz" ] && [ -f "$src/config.json" ]; then
    tar xJf "$STASH/tokenizer-$m.tar.xz" -C "$src" && echo "tokenizer of $m: shipped" \
      >>"$OUT/source-$m.log"
  fi
  if [ -n "$DRY" ]; then  # cut to a few layers: the CPU converts in minutes, not hours
    python3 bench/real_models/truncate_layers.py "$src" "$REAL/$m-dry" \
      --layers "${DRY_LAYERS:-2}" >/dev/null && rm -rf "$src" && mv "$REAL/$m-dry" "$src"
  fi
done
wait
[ -n "$DRY" ] || stamp "$(grep BUILD "$OUT/build.log" || echo 'FAIL: kernel build crashed')"

# --- convert: EXL3 4.0 bpw of each model, 2.0 bpw SmolLM2 (the draft) ----------------
CONVERT_ARGS=(--calib "$STASH/text/valid.txt")
CONVERT_TIMEOUT=${CONVERT_TIMEOUT:-240}; [ -n "$DRY" ] && CONVERT_TIMEOUT=1800
[ -n "$DRY" ] && CONVERT_ARGS+=(--head-bits 16 --calib-rows 2 --calib-cols 64 --device cpu)
convert() {  # model bits
  local out="$REAL/$1-$2"
  [ -f "$out/config.json" ] && return 0
  local t=$(date +%s)
  timeout "$CONVERT_TIMEOUT" $EXL3 convert "$REAL/$1-hf" -b "$2" --out "$out" --work "$REAL/work-$1-$2" \
    "${CONVERT_ARGS[@]}" >"$OUT/convert-$1-$2.log" 2>&1 \
    || { echo "FAIL: convert $1 $2"; tail -5 "$OUT/convert-$1-$2.log"; return 1; }
  echo "{\"model\": \"$1\", \"bits\": $2, \"seconds\": $(( $(date +%s) - t ))}" \
    >"$OUT/convert-$1-$2.json"
  stamp "converted $1 at $2 bpw in $(( $(date +%s) - t )) s"
}
raw_of() { [ "$1" = gemma3 ] && echo --raw || true; }
cpu_reference() {  # the CPU reference of an EXL3 folder, on this machine's CPU, meanwhile
  { has greedy && [ "$GREEDY_EXL3" != 0 ]; } || return 0
  CUDA_VISIBLE_DEVICES= OMP_NUM_THREADS=${REF_THREADS:-6} timeout 500 python3 \
    bench/real_models/greedy_check.py reference "$REAL/$1-4.0" --device cpu --dtype float32 \
    $(raw_of "$1") --out "$OUT/ref-$1-4.0.json" >"$OUT/ref-$1-4.0.log" 2>&1 &
}
GREEDY_EXL3=${GREEDY_EXL3:-1}
if { has greedy && [ "$GREEDY_EXL3" != 0 ]; } || has serve; then  # 4.0: items 1 and 2 only
  for m in $MODELS; do convert "$m" 4.0 && cpu_reference "$m"; done
fi
# SPEC_DRAFT=0: the spec stage without the draft model (n-gram rows only, no 2.0 convert)
[[ " $MODELS " == *" smollm2 "* ]] && has spec && [ "${SPEC_DRAFT:-1}" != 0 ] && convert smollm2 2.0

# --- item 1: greedy text, GPU vs CPU (fp16 here; EXL3 last, once its CPU refs are in) --
if has greedy; then
  for m in $MODELS; do
    ref="$STASH/refs/$m.json"
    if [ -n "$DRY" ]; then  # the shipped refs are of the whole model: make cut ones
      python3 bench/real_models/greedy_check.py reference "$REAL/$m-hf" --device cpu \
        --dtype float32 $(raw_of "$m") --tokens 16 --prompts 1 --out "$REAL/dryref-$m.json" \
        >/dev/null 2>&1; ref="$REAL/dryref-$m.json"
    fi
    timeout 200 python3 bench/real_models/greedy_check.py check "$REAL/$m-hf" --ref "$ref" \
      --device "$DEVICE" --dtype "$GPU_DTYPE" --out "$OUT/greedy-$m-fp16.json" 2>"$OUT/greedy-$m-fp16.err" \
      || { echo "NOTE: greedy $m fp16 not identical (or failed)"; tail -2 "$OUT/greedy-$m-fp16.err"; }
    # The same weights in other dtypes on the GPU (GREEDY_DTYPES, default float32): where
    # float16 diverges, does the GPU path itself agree with the CPU reference?
    for dt in ${GREEDY_DTYPES-float32}; do
      [ -n "$DRY" ] && break
      timeout 200 python3 bench/real_models/greedy_check.py check "$REAL/$m-hf" --ref "$ref" \
        --device "$DEVICE" --dtype "$dt" --out "$OUT/greedy-$m-$dt.json" 2>"$OUT/greedy-$m-$dt.err" \
        || { echo "NOTE: greedy $m $dt not identical (or failed)"; tail -2 "$OUT/greedy-$m-$dt.err"; }
    done
  done
  # What a user types: `exl3 run` on the SmolLM2 folder, greedy, 64 tokens.
  export EXL3_MODELS=/tmp/exl3-real-store
  printf 'FROM %s\nPARAMETER temperature 0\nPARAMETER num_predict 64\n' "$REAL/smollm2-hf" \
    >/tmp/Modelfile.smol
  if [[ " $MODELS " == *" smollm2 "* ]]; then
    $EXL3 create smol-fp16 -f /tmp/Modelfile.smol >/dev/null 2>&1
    timeout 120 $EXL3 run smol-fp16 "Name three primary colours and say one thing about each." \
      >"$OUT/exl3-run-smollm2.txt" 2>"$OUT/exl3-run-smollm2.err" || echo "FAIL: exl3 run"
  fi
  stamp "greedy fp16 done"
fi

# --- item 5: the Gemma paths under CUDA ----------------------------------------------
if has tests && [ -z "$DRY" ]; then
  timeout 240 python3 -m pytest -q -m cuda -p no:randomly tests/engine/test_gemma_cuda.py \
    >"$OUT/tests-gemma-cuda.log" 2>&1
  stamp "gemma cuda tests: $(tail -1 "$OUT/tests-gemma-cuda.log")"
  grep -E "^(FAILED|ERROR)" "$OUT/tests-gemma-cuda.log" | head -10
elif has tests; then
  timeout 240 python3 -m pytest -q -p no:randomly tests/engine/test_gemma_cuda.py \
    >"$OUT/tests-gemma-cuda.log" 2>&1
  stamp "gemma cuda tests (dry: collected, deselected): $(tail -1 "$OUT/tests-gemma-cuda.log")"
fi

# --- item 2: the daemon --------------------------------------------------------------
serve_phase() {  # name max_loaded extra-args...
  local name=$1 loaded=$2; shift 2
  local port=$((11500 + RANDOM % 400))
  EXL3_HOST=127.0.0.1:$port EXL3_MAX_LOADED_MODELS=$loaded EXL3_NUM_PARALLEL=$CLIENTS \
    EXL3_LOG_LEVEL=debug EXL3_MODELS=/tmp/exl3-real-store setsid $EXL3 serve >"$OUT/serve-$name.log" 2>&1 &
  local pid=$!
  for _ in $(seq 60); do
    python3 -c "import urllib.request as u; u.urlopen('http://127.0.0.1:$port/api/version', timeout=2)" \
      2>/dev/null && break; sleep 1
  done
  timeout 300 python3 bench/real_models/serve_clients.py --host "http://127.0.0.1:$port" \
    $SERVE_MODELS $API_ARGS --clients "$CLIENTS" --tokens 64 "$@" --out "$OUT/clients-$name.json" \
    2>"$OUT/clients-$name.err" | tee "$OUT/clients-$name.txt" || echo "FAIL: clients $name"
  tail -3 "$OUT/clients-$name.err"
  # Loads, evictions, per-model steps / jobs per step / step ms / graph captures and
  # failures (runtime/diagnostics.py): what tells why two models together are slow.
  python3 -c "import urllib.request as u; print(u.urlopen('http://127.0.0.1:$port/api/stats', timeout=5).read().decode())" \
    >"$OUT/stats-$name.json" 2>&1 || echo "FAIL: stats $name"
  python3 -c "import json,sys; r=json.load(open(sys.argv[1]))['runner']; print('stats $name: loads', r['loads'], 'evictions', r['evictions']); [print(' ', {k: m[k] for k in ('name','steps','jobs_per_step','step_mean_ms','step_slowest_ms','decode_mode','graphs','captures','capture_s','capture_failures')}) for m in r['models']]" \
    "$OUT/stats-$name.json" || true
  grep -c "captured decode graph" "$OUT/serve-$name.log" | sed "s/^/graph captures logged ($name): /"
  grep -m3 "capture failed" "$OUT/serve-$name.log" || true
  if [[ "$name" == turns* ]]; then
    local tag=${name#turns}
    for m in $SERVE_NAMES; do
      timeout 120 $EXL3 bench --server "http://127.0.0.1:$port" --model "$m" \
        --concurrency "$CLIENTS" --requests "$CLIENTS" --num-predict 64 --json \
        >"$OUT/bench-server-$m$tag.json" 2>"$OUT/bench-server-$m$tag.err" \
        || echo "FAIL: bench --server $m$tag"
    done
  fi
  kill -- -"$pid" 2>/dev/null || kill "$pid" 2>/dev/null; wait "$pid" 2>/dev/null
}
if has serve; then
  export EXL3_MODELS=/tmp/exl3-real-store
  SERVE_MODELS="" SERVE_NAMES="" API_ARGS=""
  # SERVE_APIS: the clients' APIs in the order each phase runs them (default ollama, openai)
  for api in ${SERVE_APIS:-ollama openai}; do API_ARGS="$API_ARGS --api $api"; done
  for m in $MODELS; do  # the EXL3 4.0 folders (the fp16 source when a conversion failed)
    folder="$REAL/$m-4.0"; [ -f "$folder/config.json" ] || folder="$REAL/$m-hf"
    printf 'FROM %s\n' "$folder" >"/tmp/Modelfile.$m"
    $EXL3 create "$m" -f "/tmp/Modelfile.$m" >"$OUT/create-$m.log" 2>&1 || echo "FAIL: create $m"
    SERVE_MODELS="$SERVE_MODELS --model $m" SERVE_NAMES="$SERVE_NAMES $m"
  done
  # SERVE_INVARIANT="0 1": the phases once per EXL3_BATCH_INVARIANT value (names -inv0,
  # -inv1); unset: once, with the environment as it is.
  for inv in ${SERVE_INVARIANT:-keep}; do
    in_budget "serve inv=$inv" || break
    tag=""; [ "$inv" = keep ] || tag="-inv$inv"
    if [ "$inv" = keep ]; then serve_phase turns 1; else EXL3_BATCH_INVARIANT=$inv serve_phase "turns$tag" 1; fi
    if [ "$(echo $MODELS | wc -w)" -gt 1 ]; then
      if [ "$inv" = keep ]; then serve_phase together 2 --together
      else EXL3_BATCH_INVARIANT=$inv serve_phase "together$tag" 2 --together; fi
    fi
  done
  stamp "serve done"
fi

# --- item 4: speculative decoding ----------------------------------------------------
if has spec && [[ " $MODELS " == *" smollm2 "* ]]; then
  draft=(); [ -f "$REAL/smollm2-2.0/config.json" ] && [ "${SPEC_DRAFT:-1}" != 0 ] \
    && draft=(--draft-model "$REAL/smollm2-2.0")
  # The CPU references (cpu_reference, 2 x REF_THREADS cores) must be done first: the
  # generator is host-bound at these sizes, and in run 53 the spec rows ran beside them
  # (plain and drafted runs measured under different loads). SPEC_QUIET=0: don't wait.
  [ "${SPEC_QUIET:-1}" = 1 ] && { wait; stamp "CPU references done (spec on a quiet host)"; }
  # DRAFT_STEPS=1 (default, as in the product): the draft model's one-token forwards as
  # graphed steps (plugins/drafters.py); 0: run 53's eager path. SPEC_REPEATS rounds of
  # plain and drafted runs, the median kept (run 58: single runs swing +-5-9% here).
  EXL3_DRAFT_STEPS=${DRAFT_STEPS:-1} timeout 300 python3 bench/real_models/speculative_bench.py "$REAL/smollm2-hf" "${draft[@]}" \
    --jobs "${SPEC_JOBS:-1,16,16x48}" --tokens "${SPEC_TOKENS:-64}" --device "$DEVICE" \
    --repeats "${SPEC_REPEATS:-3}" \
    --dtype "$GPU_DTYPE" --out "$OUT/spec.json" 2>"$OUT/spec.err" | tee "$OUT/spec.txt" \
    || { echo "NOTE: speculative bench: a text differed or it failed"; tail -3 "$OUT/spec.err"; }
  stamp "spec done"
fi

if has greedy && [ "$GREEDY_EXL3" != 0 ]; then  # item 1, EXL3 4.0: vs the CPU refs started after convert
  wait
  for m in $MODELS; do
    [ -f "$OUT/ref-$m-4.0.json" ] || { echo "FAIL: CPU reference $m 4.0"; tail -3 "$OUT/ref-$m-4.0.log"; continue; }
    timeout 200 python3 bench/real_models/greedy_check.py check "$REAL/$m-4.0" \
      --ref "$OUT/ref-$m-4.0.json" --device "$DEVICE" --dtype "$GPU_DTYPE" \
      --out "$OUT/greedy-$m-4.0.json" 2>"$OUT/greedy-$m-4.0.err" \
      || { echo "NOTE: greedy $m 4.0 not identical (or failed)"; tail -2 "$OUT/greedy-$m-4.0.err"; }
  done
  stamp "greedy EXL3 done"
fi

python3 bench/real_models/table.py "$OUT" | tee "$OUT/table.txt"
stamp "end"
# At most 8 files come back: the table, the JSON reports in one tarball, the logs in another.
tar -czf "$OUT/results.tgz" -C "$OUT" $(cd "$OUT" && ls *.json) 2>/dev/null
tar -czf "$OUT/logs.tgz" -C "$OUT" $(cd "$OUT" && ls *.log *.err *.txt | grep -v '^table.txt$') \
  2>/dev/null
(cd "$OUT" && rm -f *.json *.log *.err env.txt assemble.txt clients-*.txt spec.txt exl3-run-*.txt)
