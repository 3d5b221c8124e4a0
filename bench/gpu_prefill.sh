#!/usr/bin/env bash
# One device call for prompt ingestion (issue 10, "Prefill at 2,048" in bench/NOTES-gpu.md):
# build the kernels, run the prefill cuda tests, write the synthetic Llama-3.1-8B folder
# (4.0 bpw, head 6 bits), measure our generator's prefill at 512 and 2048 tokens for each
# EXL3_PREFILL mode (old, fp32, fused, half) in one process with a kernel profile of a 2048-token
# prompt per mode, then ExLlamaV3 1.6.5's prefill on the same folder, and print the table last.
#
# Usage (repo root): bash bench/gpu_prefill.sh     carry: [".whl"] (the peer's wheels, its
# prebuilt extension *.so.xz and peer_exllamav3_speed.py: shared/tools/README.md).
# MODES="old,fp32,fused,half" LENGTHS="512,2048" REPS=5 STAGES="tests ours peer" TESTS="files".
set -u -o pipefail
OUT=${OUT:-/tmp/exl3-prefill-out}
mkdir -p "$OUT"
cd "$(dirname "$0")/.."
. bench/peer_install.sh
T0=$(date +%s)
stamp() { echo "[$(( $(date +%s) - T0 )) s] $*"; }
export PYTHONUNBUFFERED=1 EXL3_KERNEL_CACHE=${EXL3_KERNEL_CACHE:-/tmp/exl3-kernel-cache}
export MAX_JOBS=${MAX_JOBS:-16}
STAGES=${STAGES:-"tests ours peer"}
MODES=${MODES:-old,fp32,fused,half} LENGTHS=${LENGTHS:-512,2048} REPS=${REPS:-5}
M8=/tmp/exl3-llama3-8b-4.0

nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.mem --format=csv,noheader \
  | tee "$OUT/env.txt"
. bench/device_install.sh >"$OUT/install.log" 2>&1
[ -f "$M8/config.json" ] || python3 bench/synthetic_model.py llama3-8b -b 4.0 --head-bits 6 \
  --out "$M8" >"$OUT/synthetic-8b.log" 2>&1 &
if peer_wheels; then
  peer_install >"$OUT/peer-install.log" 2>&1 &
fi
python3 -c "
import time; t = time.time()
from exl3cli.ops import cuda_kernels as kernels
ok = kernels.available()
print('BUILD', 'ok' if ok else 'FAILED', kernels.unavailable_reason(), f'{time.time() - t:.1f} s')
print('mm out_dtype:', kernels.dense_sums_available('cuda'))
" >"$OUT/build.log" 2>&1
stamp "$(tr '\n' ' ' <"$OUT/build.log" | tail -c 300)"

if [[ " $STAGES " == *" tests "* ]]; then
  # The prefill tests, and those of the kernels this work touched (decode, output kernels).
  timeout 240 python3 -m pytest -q -m cuda -p no:randomly ${TESTS:-tests/kernels/test_prefill_gemm.py \
    tests/engine/test_fused_prefill.py tests/kernels/test_layer_kernels.py \
    tests/kernels/test_kernels.py::test_decode_kernel_bit_exact} >"$OUT/tests-cuda.log" 2>&1
  stamp "cuda tests: $(tail -1 "$OUT/tests-cuda.log")"
  grep -E "^(FAILED|ERROR)|Error" "$OUT/tests-cuda.log" | head -12
fi
wait
stamp "synthetic 8B: $(tail -1 "$OUT/synthetic-8b.log" 2>/dev/null || echo present)"

if [[ " $STAGES " == *" ours "* ]]; then
  timeout 300 python3 bench/prefill_bench.py "$M8" --modes "$MODES" --lengths "$LENGTHS" \
    --reps "$REPS" --json "$OUT/ours.json" >"$OUT/ours.log" 2>&1
  stamp "ours: rc $?"
fi
if [[ " $STAGES " == *" peer "* ]] && grep -q "peer install ok" "$OUT/peer-install.log" 2>/dev/null; then
  (cd /tmp && PYTHONPATH=/tmp/peer timeout 200 python3 "$OLDPWD/.whl/peer_exllamav3_speed.py" \
    "$M8") >"$OUT/peer.log" 2>&1
  stamp "peer: rc $?"
  grep '^{' "$OUT/peer.log" | tail -1 >"$OUT/peer.json"
fi

echo; cat "$OUT/ours.log" 2>/dev/null | tail -80
python3 - "$OUT" <<'PY'
import json, statistics, sys
from pathlib import Path
out = Path(sys.argv[1])
try:
    peer = json.loads((out / "peer.json").read_text())
except Exception as e:  # noqa: BLE001
    peer = {}
    print(f"\n(no peer figures: {e})")
pk = {512: peer.get("b1_prefill512_tok_s"), 2048: peer.get("prefill2048_tok_s")}
pk = {n: statistics.median(v) for n, v in pk.items() if v}
try:
    ours = json.loads((out / "ours.json").read_text())
except Exception as e:  # noqa: BLE001
    sys.exit(f"(no figures of ours: {e})")
print("\nprefill tok/s, synthetic Llama-3.1-8B 4.0 bpw, one prompt, same GPU run")
print(f"{'':10}{'512':>10}{'x peer':>8}{'2048':>10}{'x peer':>8}{'ms@2048':>9}")
for mode, row in ours["modes"].items():
    cells = ""
    for n in (512, 2048):
        v = row["tok_s"].get(str(n))
        cells += f"{v:>10,.0f}{v / pk[n]:>8.2f}" if v and n in pk else f"{v or 0:>10,.0f}{'-':>8}"
    v2 = row["tok_s"].get("2048")
    print(f"{mode:10}{cells}{(2048e3 / v2 if v2 else 0):>9.1f}")
if pk:
    print(f"{'ExLlamaV3':10}{pk.get(512, 0):>10,.0f}{'':8}{pk.get(2048, 0):>10,.0f}{'':8}"
          f"{(2048e3 / pk[2048] if 2048 in pk else 0):>9.1f}")
PY
