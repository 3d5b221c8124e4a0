#!/usr/bin/env bash
# Speculative decoding with verification passes on the fixed-shape (CUDA-graph) step, on
# a synthetic SmolLM2-135M-shaped EXL3 folder (4.0 bpw): the cuda tests of the change,
# then bench/real_models/speculative_bench.py twice: with the cost back-off off
# (EXL3_DRAFT_COST=0: the raw verify pass cost against a plain step) and on (the
# default: drafting pauses where it does not pay). A synthetic model's text is noise, so
# acceptance differs from SmolLM2's; the pass cost is the number to read. No peer run:
# ExLlamaV3's generator has no n-gram drafter to compare with.
#
# Usage (repo root): bash bench/gpu_spec_verify.sh      carry: none. Logs/JSON in $OUT.
set -u -o pipefail
OUT=${OUT:-/tmp/exl3-spec}
mkdir -p "$OUT"
cd "$(dirname "$0")/.."
T0=$(date +%s)
stamp() { echo "[$(( $(date +%s) - T0 )) s] $*"; }
export PYTHONUNBUFFERED=1 EXL3_KERNEL_CACHE=${EXL3_KERNEL_CACHE:-/tmp/exl3-kernel-cache}
export MAX_JOBS=${MAX_JOBS:-16}
MODEL=${MODEL:-/tmp/exl3-smollm2-135m-4.0}
. bench/device_install.sh >"$OUT/install.log" 2>&1
python3 -c "
import time; t = time.time()
from exl3cli.ops import cuda_kernels as kernels
print('BUILD', 'ok' if kernels.available() else 'FAILED', kernels.unavailable_reason(), f'{time.time() - t:.1f} s')
" >"$OUT/build.log" 2>&1
stamp "$(grep BUILD "$OUT/build.log" || echo 'FAIL: kernel build crashed')"
[ -f "$MODEL/config.json" ] || python3 bench/synthetic_model.py smollm2-135m -b 4.0 \
  --out "$MODEL" >"$OUT/synthetic.log" 2>&1 || echo "FAIL: synthetic model"
stamp "model: $(tail -1 "$OUT/synthetic.log" 2>/dev/null)"
if [ "${SPEC_TESTS:-1}" = 1 ]; then  # SPEC_TESTS=0: the caller ran them
  timeout 240 python3 -m pytest -q -p no:randomly -m cuda tests/engine/test_fixed_verify.py \
    tests/engine/test_generator_cuda.py >"$OUT/tests-cuda.log" 2>&1
  stamp "cuda tests: $(tail -1 "$OUT/tests-cuda.log")"
  grep -E "^(FAILED|ERROR)" "$OUT/tests-cuda.log" | head -20
fi
for cost in ${COSTS:-0 1}; do
  EXL3_DRAFT_COST=$cost timeout 150 python3 bench/real_models/speculative_bench.py "$MODEL" \
    --jobs 1,16 --tokens 64 --k 4 --device cuda --out "$OUT/spec-cost$cost.json" \
    >"$OUT/spec-cost$cost.txt" 2>"$OUT/spec-cost$cost.err"
  stamp "bench EXL3_DRAFT_COST=$cost: rc $?"
done
python3 - "$OUT" <<'PY'
import json, sys
from pathlib import Path
out = Path(sys.argv[1])
print(f"{'cost':<5}{'set':<10}{'jobs':>4}  {'plain':>8} {'drafted':>8} {'x':>6} "
      f"{'kept/pass':>9} {'pass cost':>9}  same")
for cost in (0, 1):  # the runs COSTS chose; the others print "no result"
    path = out / f"spec-cost{cost}.json"
    if not path.exists():
        print(f"{cost:<5}(no result: see spec-cost{cost}.err)")
        continue
    for r in json.loads(path.read_text())["rows"]:
        print(f"{cost:<5}{r['set']:<10}{r['jobs']:>4}  {r['plain_tok_s']:>8} {r['tok_s']:>8} "
              f"{r['speedup']:>6} {r['kept_per_pass']:>9} {r['pass_cost_vs_plain']:>9}  "
              f"{r['same_text']}")
PY
