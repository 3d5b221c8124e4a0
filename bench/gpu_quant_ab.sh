#!/usr/bin/env bash
# Issue 20 on the H200, one call: SmolLM2-135M converted by `exl3 convert` under several
# quantizer settings (VARIANTS) at BITS, and by ExLlamaV3 1.6.5 (a zero-padded copy,
# hidden 640, bench/real_models/pad_hidden.py) at PEER_BITS, all evaluated by
# bench/convert_quality.py / bench/real_models/eval_folders.py against the same fp32
# reference on the same 100 wikitext-2 test windows of 2048 tokens. The variants and
# the peer's rates run as parallel processes spread over the visible GPUs (process i on
# GPU i mod N): on nvidia-h200-x4 each variant has a GPU of its own and shares it with
# one peer conversion (~46 s per conversion of ours, ~95 s of the peer's, alone), ~5 min
# in all; on one H200 they time-share it (a 135M model leaves it partly idle). Each
# runs under a deadline (BUDGET seconds from the start, default 510) and every result
# is written as soon as it exists, so a run cut short still reports what finished.
#
# Artefacts as for bench/gpu_real_quality.sh (bench/real_models/make_artefacts.sh, run
# here first). On one warm machine, calls back to back (the stash lives in its /tmp):
#   bash bench/gpu_real_models.sh stash      carry: [".real/s/c1"]
#   bash bench/gpu_real_models.sh stash      carry: [".real/s/c2"]
#   VARIANTS="final=" bash bench/gpu_quant_ab.sh        carry: [".whl"]   (ours + the peer)
#   PEER_BITS= VARIANTS="norefit=--set scale_refit=0;rms=--set scale_refit=0 --set out_scales=rms" \
#     TIMING=1 bash bench/gpu_quant_ab.sh                carry: []        (the ablations)
# (on nvidia-h200-x4 the last two are one call: `TIMING=1 bash bench/gpu_quant_ab.sh`).
# VARIANTS: "name=convert_quality.py arguments" separated by ';'. The default is the
# final default and each change of issue 20 switched off in turn:
#   final   defaults: measured allocation, Fisher output scales at strength 0.5, the
#           suh/svh refit (2 rounds, scale_refit.py)
#   norefit --set scale_refit=0               the refit's before/after: norefit -> final
#   rms     --set scale_refit=0 --set out_scales=rms   the Fisher scales': rms -> norefit
#   old     --allocation fixed --set out_scales=rms --set scale_refit=0   the first H200
#           table's settings; the measured allocation's before/after: old -> rms
# Conversion seconds come from processes running side by side: compare them with each
# other (same load), not with the 46 s of the first table. TIMING=1 adds, if time is
# left, one conversion of "final" and one of "norefit" (today's defaults before the
# refit) at 4.0 bpw alone (clean seconds: the 1.2x criterion); TIMING_VARIANTS picks others
# (`BITS= PEER_BITS= TIMING=1 TIMING_VARIANTS="final=;old=--allocation fixed ..."`: only
# the timings, today's defaults against the first table's settings).
# CUDA_TESTS="tests/..." runs those cuda tests after the install, before the conversions.
# Outputs ($OUT): quality-<variant>.json, quality-peer.json, table.txt, logs.tgz.
set -u -o pipefail
OUT=${OUT:-/tmp/exl3-quant-out}
mkdir -p "$OUT"
cd "$(dirname "$0")/.."
. bench/peer_install.sh
T0=$(date +%s)
stamp() { echo "[$(( $(date +%s) - T0 )) s] $*"; }
left() { echo $(( T0 + ${BUDGET:-510} - $(date +%s) )); }
STASH=${STASH:-/tmp/real-stash} REAL=${REAL:-/tmp/real}
BITS=${BITS-"4 3 2 5"} PEER_BITS=${PEER_BITS-"4 3 2 5"} WINDOWS=${WINDOWS:-100}
VARIANTS=${VARIANTS-"final=;norefit=--set scale_refit=0;rms=--set scale_refit=0 --set out_scales=rms;old=--allocation fixed --set out_scales=rms --set scale_refit=0"}
export PYTHONUNBUFFERED=1 EXL3_KERNEL_CACHE=${EXL3_KERNEL_CACHE:-/tmp/exl3-kernel-cache}
export MAX_JOBS=16 TOKENIZERS_PARALLELISM=false OMP_NUM_THREADS=2

. bench/real_models/smollm2_source.sh
[ -f "$SRC/config.json" ] && [ -f "$TEXT" ] || { echo "FAIL: source or text missing (stash calls?)"; exit 1; }
nvidia-smi --query-gpu=name,memory.used,memory.total --format=csv,noheader
# CUDA_TESTS: cuda test files run first (e.g. the Viterbi segment kernel before timing it).
[ -n "${CUDA_TESTS:-}" ] && { timeout 400 python3 -m pytest -q -m cuda -p no:randomly $CUDA_TESTS \
  2>&1 | tail -4 | sed "s/^/cuda tests: /"; stamp "cuda tests done"; }

NGPU=$(nvidia-smi -L 2>/dev/null | grep -c GPU); [ "$NGPU" -gt 0 ] || NGPU=1
slot=0 specs=()
next_gpu() { echo $(( slot % NGPU )); }
pids=()
# The peer first (its conversions are the longest): install, pad, convert in parallel.
if [ -n "$PEER_BITS" ] && peer_wheels; then
  peer_install >/dev/null || echo "FAIL: peer install"
  [ -f "$REAL/smollm2-pad640/config.json" ] || python3 bench/real_models/pad_hidden.py \
    "$SRC" "$REAL/smollm2-pad640" --hidden 640 >/dev/null
  (
    folders=() seconds=() cpids=()
    peer_slot=0
    for bits in $PEER_BITS; do
      gpu=$(( peer_slot % NGPU )); peer_slot=$((peer_slot + 1))
      (t=$(date +%s); cd /tmp && CUDA_VISIBLE_DEVICES=$gpu PYTHONPATH=/tmp/peer timeout $(( $(left) - 50 )) python3 -m \
        exllamav3.conversion.convert_model -i "$REAL/smollm2-pad640" -o "$REAL/peer-$bits" \
        -w "$REAL/peer-work-$bits" -b "$bits" -hb 6 >"$OUT/peer-convert-$bits.log" 2>&1 \
        && echo $(( $(date +%s) - t )) >"$REAL/peer-$bits.seconds") &
      cpids+=($!)
    done
    wait "${cpids[@]}"
    for bits in $PEER_BITS; do
      if [ -f "$REAL/peer-$bits.seconds" ]; then
        folders+=(--folder "peer-$bits=$REAL/peer-$bits")
        seconds+=(--seconds "peer-$bits=$(cat "$REAL/peer-$bits.seconds")")
        stamp "peer converted $bits bpw in $(cat "$REAL/peer-$bits.seconds") s"
      else
        echo "FAIL: peer convert $bits"; tail -3 "$OUT/peer-convert-$bits.log"
      fi
    done
    [ ${#folders[@]} -gt 0 ] && timeout $(( $(left) > 10 ? $(left) : 10 )) python3 \
      bench/real_models/eval_folders.py "$SRC" --text "$TEXT" --windows "$WINDOWS" \
      "${folders[@]}" "${seconds[@]}" --out "$OUT/quality-peer.json" 2>"$OUT/peer-eval.err" \
      || { echo "FAIL: peer eval"; tail -3 "$OUT/peer-eval.err"; }
  ) &
  pids+=($!)
elif [ -n "$PEER_BITS" ]; then
  echo "FAIL: peer wheels missing (carry .whl)"
fi

# Ours: kernels built once, then one process per variant.
python3 -m exl3cli kernels >"$OUT/kernels.log" 2>&1 || echo "FAIL: kernels"
stamp "kernels: $(grep -c ready "$OUT/kernels.log") ready"
if [ -n "$BITS" ]; then
  IFS=';' read -ra specs <<<"$VARIANTS"
  for spec in "${specs[@]}"; do
    name=${spec%%=*} args=${spec#*=}
    # shellcheck disable=SC2086
    CUDA_VISIBLE_DEVICES=$(next_gpu) timeout "$(left)" python3 bench/convert_quality.py "$SRC" \
      --bits $BITS --text "$TEXT" --calib "$CALIB" --windows "$WINDOWS" --work "/tmp/cq-$name" \
      --tag "$name" $args >"$OUT/ours-$name.log" 2>&1 &
    pids+=($!) slot=$((slot + 1))
  done
fi
while [ ${#pids[@]} -gt 0 ] && sleep 30; do
  running=0; for p in "${pids[@]}"; do kill -0 "$p" 2>/dev/null && running=$((running + 1)); done
  [ $running -eq 0 ] && break
  stamp "$running running; $(cat "$OUT"/ours-*.log 2>/dev/null | grep -c ' bpw: ppl') of ours done"
done
for spec in "${specs[@]}"; do
  name=${spec%%=*}
  cp "/tmp/cq-$name/results-$name.json" "$OUT/quality-$name.json" 2>/dev/null \
    || { echo "FAIL: ours $name"; tail -3 "$OUT/ours-$name.log"; }
done

if [ -n "${TIMING:-}" ]; then
  # TIMING_VARIANTS: the conversions timed alone, ';'-separated like VARIANTS.
  IFS=';' read -ra timed <<<"${TIMING_VARIANTS:-final=;norefit=--set scale_refit=0}"
  for spec in "${timed[@]}"; do
    name=${spec%%=*} args=${spec#*=}
    [ "$(left)" -lt 80 ] && { echo "timing: no time left for $name"; break; }
    # shellcheck disable=SC2086
    timeout "$(left)" python3 bench/convert_quality.py "$SRC" --bits 4 --text "$TEXT" \
      --calib "$CALIB" --windows 4 --work "/tmp/cq-time-$name" --tag "time-$name" $args \
      2>&1 | grep -E " bpw: ppl|sensitivity measured|conversion phases" | sed "s/^/timing alone, $name: /"
  done
fi

python3 - "$OUT" <<'EOF' | tee "$OUT/table.txt"
import json, sys
from pathlib import Path
print(f"{'who':<10}{'bpw':>5}{'ppl':>10}{'KL':>9}{'top-1':>8}{'convert s':>11}")
for path in sorted(Path(sys.argv[1]).glob("quality-*.json")):
    who = path.stem.removeprefix("quality-")
    for row in json.loads(path.read_text()):
        if row["model"] == "unquantized fp32":
            if who == "peer":
                print(f"{'fp32':<10}{'':>5}{row['ppl']:>10.4f}")
            continue
        bpw = row["model"].split()[1].split("-")[-1] if who != "peer" else row["model"][5:]
        if "error" in row:
            print(f"{who:<10}{bpw:>5} FAIL {row['error']}")
            continue
        conv = row.get("convert_s")
        print(f"{who:<10}{bpw:>5}{row['ppl']:>10.4f}{row['kl']:>9.4f}{row['top1']:>8.3f}"
              f"{(f'{float(conv):.0f}' if conv else '-'):>11}")
EOF
stamp "end"
tar -czf "$OUT/logs.tgz" -C "$OUT" $(cd "$OUT" && ls *.log *.err 2>/dev/null) 2>/dev/null
(cd "$OUT" && rm -f *.log *.err)
