#!/usr/bin/env bash
# Item 3 of issue 11: SmolLM2-135M quality side by side on the GPU. `exl3 convert` at
# OURS_BITS (bench/convert_quality.py: ppl, mean KL, top-1 vs the fp32 reference over
# 100 wikitext-2 test windows of 2048 tokens, conversion seconds), and ExLlamaV3 1.6.5
# converting a zero-padded copy (hidden 640, bench/real_models/pad_hidden.py) at
# PEER_BITS, evaluated on the same windows against the same reference by our engine
# (bench/real_models/eval_folders.py).
#
# It needs what gpu_real_models.sh's calls left in /tmp/real-stash on the same warm
# machine (the SmolLM2 GGUF parts, wikitext, wheels) and .whl/ (the peer's wheels and
# its .so.xz, shared/tools/README.md; 21 MB): .whl and .real/s/c2 together exceed one
# call's 64 MiB, so from a cold machine first `bash bench/gpu_real_models.sh stash` with
# carry [".real/s/c1"], then the same with [".real/s/c2"], then
#   bash bench/gpu_real_quality.sh        carry: [".whl"]
# ExLlamaV3 takes ~95 s per bpw and ours ~45 s: all four of each (~10 min) overrun one
# call, so split: OURS_BITS="2 3 4 5" PEER_BITS="2" in one call, then OURS_BITS=""
# PEER_BITS="3 4 5" in the next (same warm machine; the padded copy and reference stay
# in /tmp). Outputs: $OUT/quality-ours.json, quality-peer.json, table.txt.
set -u -o pipefail
OUT=${OUT:-/tmp/exl3-quality-out}
mkdir -p "$OUT"
cd "$(dirname "$0")/.."
. bench/peer_install.sh
T0=$(date +%s)
stamp() { echo "[$(( $(date +%s) - T0 )) s] $*"; }
STASH=${STASH:-/tmp/real-stash} REAL=${REAL:-/tmp/real}
OURS_BITS=${OURS_BITS-"2 3 4 5"} PEER_BITS=${PEER_BITS-"2"}
WINDOWS=${WINDOWS:-100}
export PYTHONUNBUFFERED=1 EXL3_KERNEL_CACHE=${EXL3_KERNEL_CACHE:-/tmp/exl3-kernel-cache}
. bench/real_models/smollm2_source.sh

# The peer: install (no compile: its prebuilt extension) and the padded copy.
if [ -n "$PEER_BITS" ] && peer_wheels; then
  peer_install >/dev/null || echo "FAIL: peer install"
  [ -f "$REAL/smollm2-pad640/config.json" ] || python3 bench/real_models/pad_hidden.py \
    "$SRC" "$REAL/smollm2-pad640" --hidden 640
elif [ -n "$PEER_BITS" ]; then
  echo "FAIL: peer wheels missing (carry .whl)"; PEER_BITS=""
fi

if [ -n "$OURS_BITS" ]; then
  timeout 560 python3 bench/convert_quality.py "$SRC" --bits $OURS_BITS --text "$TEXT" \
    --calib "$CALIB" --windows "$WINDOWS" --work "$REAL/cq" 2>&1 | tee "$OUT/ours.log" \
    | grep -E "unquantized|bpw:"
  cp "$REAL/cq/results.json" "$OUT/quality-ours.json" 2>/dev/null || echo "FAIL: ours"
  stamp "ours done"
fi

if [ -n "$PEER_BITS" ]; then
  folders=() seconds=()
  for bits in $PEER_BITS; do
    t=$(date +%s)
    (cd /tmp && PYTHONPATH=/tmp/peer timeout 300 python3 -m exllamav3.conversion.convert_model \
      -i "$REAL/smollm2-pad640" -o "$REAL/peer-$bits" -w "$REAL/peer-work-$bits" -b "$bits" \
      -hb 6) >"$OUT/peer-convert-$bits.log" 2>&1 \
      || { echo "FAIL: peer convert $bits"; tail -5 "$OUT/peer-convert-$bits.log"; continue; }
    stamp "peer converted $bits bpw in $(( $(date +%s) - t )) s"
    folders+=(--folder "peer-$bits=$REAL/peer-$bits")
    seconds+=(--seconds "peer-$bits=$(( $(date +%s) - t ))")
  done
  [ ${#folders[@]} -gt 0 ] && timeout 200 python3 bench/real_models/eval_folders.py "$SRC" \
    --text "$TEXT" --windows "$WINDOWS" "${folders[@]}" "${seconds[@]}" \
    --out "$OUT/quality-peer-$(echo $PEER_BITS | tr ' ' '_').json" 2>"$OUT/peer-eval.err" \
    || { echo "FAIL: peer eval"; tail -5 "$OUT/peer-eval.err"; }
fi

python3 - "$OUT" <<'EOF' | tee "$OUT/table.txt"
import json, sys
from pathlib import Path
rows = []
for path in sorted(Path(sys.argv[1]).glob("quality-*.json")):
    side = "ours" if "ours" in path.name else "ExLlamaV3 (padded 640)"
    for row in json.loads(path.read_text()):
        if row["model"] != "unquantized fp32" or side == "ours":
            rows.append((side, row))
print(f"{'who':<24}{'model':<24}{'ppl':>10}{'KL':>9}{'top-1':>8}{'convert s':>11}")
for side, row in rows:
    if "error" in row:
        print(f"{side:<24}{row['model']:<24} FAIL {row['error']}")
        continue
    conv = row.get("convert_s")
    print(f"{side:<24}{row['model']:<24}{row['ppl']:>10.4f}{row['kl']:>9.4f}{row['top1']:>8.3f}"
          f"{(f'{conv:.0f}' if conv else '-'):>11}")
EOF
stamp "end"
tar -czf "$OUT/logs.tgz" -C "$OUT" $(cd "$OUT" && ls *.log *.err 2>/dev/null) 2>/dev/null
(cd "$OUT" && rm -f *.log *.err)
