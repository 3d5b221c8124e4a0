#!/usr/bin/env bash
# Tensor parallel on two GPUs (issue 19), one device call on nvidia-h200-x2: write the
# synthetic Llama-3.1-8B-shaped EXL3 folder (4.0 bpw, head 6 bits), then
#   1. ours: TP=1 vs TP=2 greedy tokens for 64 tokens (must be equal), aggregate tok/s at
#      1/16/64 jobs for TP=1 and TP=2, the all-reduce share of a 64-job run
#      (bench/tp_bench.py);
#   2. the peer (ExLlamaV3 1.6.5) on the same folder: one GPU, then EX3_TP=native
#      (its own TP backend) and EX3_TP=nccl, via .whl/peer_exllamav3_speed.py;
# and print the table last.
#
# Usage (repo root): bash bench/gpu_tp.sh      carry: [".whl"]
# Dry run on a CPU (gloo, tiny shape, no peer): DRY=1 bash bench/gpu_tp.sh
set -u -o pipefail
OUT=${OUT:-/tmp/exl3-tp-out}
mkdir -p "$OUT"
cd "$(dirname "$0")/.."
. bench/peer_install.sh
T0=$(date +%s)
stamp() { echo "[$(( $(date +%s) - T0 )) s] $*"; }
export PYTHONUNBUFFERED=1 EXL3_KERNEL_CACHE=${EXL3_KERNEL_CACHE:-/tmp/exl3-kernel-cache}
export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH}
if [ "${DRY:-0}" = 1 ]; then
  SHAPE=tiny M=/tmp/exl3-tp-tiny DEVICE=cpu JOBS=${JOBS:-1,2} GEN=${GEN:-8} PROMPT=16
else
  SHAPE=llama3-8b M=/tmp/exl3-llama3-8b-4.0 DEVICE=cuda JOBS=${JOBS:-1,16,64} GEN=64 PROMPT=128
  nvidia-smi --query-gpu=name,driver_version --format=csv,noheader | tee "$OUT/env.txt"
  nvidia-smi topo -m >"$OUT/topo.txt" 2>&1
  . bench/device_install.sh >"$OUT/install.log" 2>&1
  if peer_wheels; then
    peer_install >"$OUT/peer-install.log" 2>&1 &
  fi
fi
if [ "${DRY:-0}" = 1 ]; then
  # The synthetic "tiny" shape's heads (6 x 32) do not cut on 128-wide blocks (refused):
  # the dry run uses the tests' tiny Llama with 128-wide heads as a random EXL3 folder.
  [ -f "$M/config.json" ] || python3 -c "
from tests.fixtures.tiny_store import write_tiny_chat_model
from tests.fixtures.tiny_exl3 import random_exl3_folder
src = write_tiny_chat_model('$M-src', 'llama', hidden_size=128, num_attention_heads=2,
                            num_key_value_heads=2, head_dim=128, intermediate_size=256)
random_exl3_folder(src, '$M')" >"$OUT/synthetic.log" 2>&1 || { echo "FAIL: tiny"; tail -5 "$OUT/synthetic.log"; }
else
  [ -f "$M/config.json" ] || python3 bench/synthetic_model.py "$SHAPE" -b 4.0 --head-bits 6 \
    --out "$M" >"$OUT/synthetic.log" 2>&1 || { echo "FAIL: synthetic"; tail -5 "$OUT/synthetic.log"; }
fi
stamp "model ready: $M"
wait

timeout 480 python3 bench/tp_bench.py "$M" --tp 2 --device "$DEVICE" --jobs "$JOBS" \
  --gen "$GEN" --prompt "$PROMPT" >"$OUT/ours-tp.json" 2>"$OUT/ours-tp.err" \
  || { echo "FAIL: ours"; tail -15 "$OUT/ours-tp.err"; }
stamp "ours done"

if [ "${DRY:-0}" != 1 ] && grep -q "peer install ok" "$OUT/peer-install.log" 2>/dev/null; then
  for tp in "" native nccl; do
    (cd /tmp && PYTHONPATH=/tmp/peer EX3_TP=$tp timeout 240 python3 \
      "$OLDPWD/.whl/peer_exllamav3_speed.py" "$M") >"$OUT/peer-tp${tp:-1}.json" \
      2>"$OUT/peer-tp${tp:-1}.err" || { echo "FAIL: peer tp=${tp:-1}"; \
      tail -5 "$OUT/peer-tp${tp:-1}.err"; }
    stamp "peer tp=${tp:-1} done"
  done
fi

echo "=== ours (tokens/s aggregate; bench/tp_bench.py) ==="
grep -v "^\[" "$OUT/ours-tp.err" | tail -8
for f in "$OUT"/peer-tp*.json; do
  [ -s "$f" ] || continue
  python3 - "$f" <<'EOF'
import json, sys
r = json.load(open(sys.argv[1]))
keys = [k for k in r if "tok_s" in k or k == "tp_backend"]
print(sys.argv[1].rsplit("/", 1)[-1], {k: r[k] for k in keys})
EOF
done
