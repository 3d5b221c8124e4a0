#!/usr/bin/env bash
# One device call, end to end on the GPU: install exl3 (editable, offline), build the
# kernels, run the cuda tests (kernels + CUDA-graph decode), write a synthetic
# Llama-3.1-8B-shaped model at 4.0 bpw (head 6 bits), run `exl3 bench` on it, then run
# the ExLlamaV3 peer on the same folder when its wheels travelled in .whl/, and print a
# short table last. Never stops at the first failure: every step prints a FAIL line.
#
# Usage (repo root): bash bench/gpu_e2e.sh      carry: [".whl"] (optional: peer wheels and
# peer_exllamav3_speed.py copied from /work/shared/tools/ into .whl/)
# Logs and JSON land in $OUT (the device tool's output folder; /tmp/exl3-e2e elsewhere).
set -u -o pipefail
OUT=${OUT:-/tmp/exl3-e2e}
mkdir -p "$OUT"
cd "$(dirname "$0")/.."
REPO=$(pwd)
T0=$(date +%s)
stamp() { echo "[$(( $(date +%s) - T0 )) s] $*"; }
export PYTHONUNBUFFERED=1
export EXL3_KERNEL_CACHE=${EXL3_KERNEL_CACHE:-/tmp/exl3-kernel-cache}
export MAX_JOBS=${MAX_JOBS:-16}
MODEL=${MODEL:-/tmp/exl3-llama3-8b-4.0}
PEER_JSON="$OUT/peer.json"; OURS_JSON="$OUT/bench.json"

{ nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.mem,memory.total --format=csv
  python3 -c "import torch; print('torch', torch.__version__, 'cuda', torch.version.cuda)"
  nvcc --version | tail -1; } 2>&1 | tee "$OUT/env.txt"

# --- 1. the peer's install and compile (~265 s, CPU only) in the background ----------
PEER_SCRIPT=""
for candidate in "${PEER_SCRIPT_PATH:-}" .whl/peer_exllamav3_speed.py \
                 shared/tools/peer_exllamav3_speed.py ../shared/tools/peer_exllamav3_speed.py; do
  if [ -n "$candidate" ] && [ -f "$candidate" ]; then PEER_SCRIPT=$(realpath "$candidate"); break; fi
done
PEER_PID=""
if ls .whl/exllamav3-*.whl >/dev/null 2>&1 && [ -n "$PEER_SCRIPT" ]; then
  stamp "peer: installing and compiling ExLlamaV3 in the background"
  ( python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
      --target /tmp/site .whl/*.whl \
    && cd /tmp && PYTHONPATH=/tmp/site TORCH_EXTENSIONS_DIR=/tmp/ext MAX_JOBS=12 \
       TORCH_CUDA_ARCH_LIST=9.0 python3 -c "import time; t=time.time(); import exllamav3; \
print('PEER BUILD ok', round(time.time()-t), 's')" ) >"$OUT/peer-build.log" 2>&1 &
  PEER_PID=$!
else
  stamp "peer: SKIPPED (needs .whl/exllamav3-*.whl and peer_exllamav3_speed.py in .whl/)"
fi

# --- 2. install exl3 (entry points register the architectures) ---------------------
if [ -n "${EXL3_E2E_SKIP_INSTALL:-}" ]; then
  stamp "install: skipped (EXL3_E2E_SKIP_INSTALL)"
elif python3 -m pip install -q -e . --no-deps --no-build-isolation >"$OUT/install.log" 2>&1; then
  stamp "install: pip install -e . ok"
else
  # Fallback: a hand-made dist-info carries the entry points; plugins/ is exl3_plugins.
  stamp "install: pip -e failed (see install.log); using PYTHONPATH + a dist-info"
  mkdir -p /tmp/exl3-site/exl3-0.1.0.dist-info
  ln -sfn "$REPO/plugins" /tmp/exl3-site/exl3_plugins
  printf 'Metadata-Version: 2.1\nName: exl3\nVersion: 0.1.0\n' \
    >/tmp/exl3-site/exl3-0.1.0.dist-info/METADATA
  printf '[exl3cli]\narchitectures = exl3_plugins.architectures\nsamplers = exl3_plugins.samplers\nsources = exl3_plugins.sources\n' \
    >/tmp/exl3-site/exl3-0.1.0.dist-info/entry_points.txt
  export PYTHONPATH="$REPO:/tmp/exl3-site${PYTHONPATH:+:$PYTHONPATH}"
fi
python3 -c "from exl3cli.engine.spec.architecture import get_architecture; \
get_architecture('LlamaForCausalLM'); print('architectures ok')" || echo "FAIL: architectures not registered"
EXL3="python3 -m exl3cli"

# --- 3. kernels ----------------------------------------------------------------------
python3 -c "
import time; t = time.time()
from exl3cli.ops import cuda_kernels as kernels
ok = kernels.available()
print('BUILD', 'ok' if ok else 'FAILED', kernels.unavailable_reason(), f'{time.time() - t:.1f} s')
" >"$OUT/build.log" 2>&1
stamp "$(grep BUILD "$OUT/build.log" || echo 'FAIL: kernel build crashed')"
grep -q "BUILD ok" "$OUT/build.log" || { echo "FAIL: kernels unavailable"; tail -30 "$OUT/build.log"; }

# --- 4. synthetic model --------------------------------------------------------------
if [ ! -f "$MODEL/config.json" ]; then
  python3 bench/synthetic_model.py llama3-8b -b 4.0 --head-bits 6 --out "$MODEL" \
    >"$OUT/synthetic.log" 2>&1 || echo "FAIL: synthetic model (see synthetic.log)"
fi
stamp "model: $(tail -1 "$OUT/synthetic.log" 2>/dev/null)"

# --- 5. cuda tests -------------------------------------------------------------------
timeout 300 python3 -m pytest -q -m cuda tests/kernels tests/engine/test_cuda_graphs.py \
  >"$OUT/tests-cuda.log" 2>&1
stamp "cuda tests: $(tail -1 "$OUT/tests-cuda.log")"
grep -E "^(FAILED|ERROR)" "$OUT/tests-cuda.log" | head -20

# --- 6. our benchmark ----------------------------------------------------------------
timeout 300 $EXL3 bench "$MODEL" --prompt-lengths 512,2048 --gen-tokens 128 --batch 1,16 \
  --memory-context 8192 --json >"$OURS_JSON" 2>"$OUT/bench.err"
[ -s "$OURS_JSON" ] && python3 -c "import json,sys; json.load(open(sys.argv[1]))" "$OURS_JSON" \
  2>/dev/null || { echo "FAIL: exl3 bench (see bench.err)"; tail -20 "$OUT/bench.err"; }
stamp "exl3 bench done"

# --- 7. the peer, on the same folder, after ours (one GPU user at a time) ------------
if [ -n "$PEER_PID" ]; then
  wait "$PEER_PID"
  stamp "$(grep 'PEER BUILD' "$OUT/peer-build.log" || echo 'FAIL: peer build')"
  if grep -q "PEER BUILD ok" "$OUT/peer-build.log"; then
    (cd /tmp && PYTHONPATH=/tmp/site TORCH_EXTENSIONS_DIR=/tmp/ext timeout 240 \
      python3 "$PEER_SCRIPT" "$MODEL") >"$OUT/peer.log" 2>&1
    grep '^{' "$OUT/peer.log" | tail -1 >"$PEER_JSON"
    [ -s "$PEER_JSON" ] || { echo "FAIL: peer run"; tail -15 "$OUT/peer.log"; }
  else
    tail -15 "$OUT/peer-build.log"
  fi
  stamp "peer done"
fi

# --- 8. table ------------------------------------------------------------------------
python3 - "$OURS_JSON" "$PEER_JSON" <<'EOF'
import json, statistics, sys
def load(path):
    try:
        with open(path) as f:
            return json.load(f)
    except (OSError, ValueError):
        return None
ours, peer = load(sys.argv[1]), load(sys.argv[2])
if ours is None:
    print("FAIL: no exl3 bench report"); sys.exit(0)
gen = {(r["batch"], r["context"]): r for r in ours["generation"]}
pre = {(r["batch"], r["tokens"]): r for r in ours["prompt"]}
med = lambda v: statistics.median(v) if isinstance(v, list) and v else v
def row(name, mine, theirs, extra=""):
    ratio = f"{mine / theirs:.2f}" if mine and theirs else "-"
    fmt = lambda v: f"{v:.1f}" if isinstance(v, (int, float)) else "-"
    print(f"{name:<34}{fmt(mine):>10}{fmt(theirs):>10}{ratio:>7}  {extra}")
p = peer or {}
print(f"\n=== exl3 vs ExLlamaV3: {ours['model']} on {ours['device']} "
      f"(decode {ours['decode_mode']}, kernels {ours['kernels']}) ===")
print(f"{'':<34}{'ours':>10}{'peer':>10}{'ratio':>7}")
for ctx in (512, 2048):
    g = gen.get((1, ctx))
    if g:
        extra = (f"{100 * g['fraction_of_limit']:.0f}% of limit {g['limit_tok_s']:.0f} tok/s "
                 f"({g['bytes_per_token'] / 1e9:.2f} GB/token)")
        row(f"gen tok/s batch 1, ctx {ctx}", g["tok_s"],
            med(p.get("b1_gen_tok_s")) if ctx == 512 else None, extra)
row("prefill tok/s, 2048 tokens", pre.get((1, 2048), {}).get("tok_s"),
    med(p.get("prefill2048_tok_s")))
row("prefill tok/s, 512 tokens", pre.get((1, 512), {}).get("tok_s"),
    med(p.get("b1_prefill512_tok_s")))
b16 = gen.get((16, 512))
peer16 = med(p.get("b16_gen_tok_s_per_job"))
row("gen tok/s batch 16 (sum), ctx 512", b16 and b16["tok_s"], peer16 and 16 * peer16)
g = gen.get((16, 2048))
row("gen tok/s batch 16 (sum), ctx 2048", g and g["tok_s"], None)
m = ours.get("memory")
if m:
    G = 2**30
    print(f"peak memory, {m['context']}-token cache: {m['peak_bytes'] / G:.2f} GiB vs weights "
          f"{m['weights_bytes'] / G:.2f} + cache {m['cache_bytes'] / G:.2f} + stated workspace "
          f"{m['stated_workspace_bytes'] / G:.2f} = {m['expected_bytes'] / G:.2f} GiB "
          f"(ratio {m['peak_over_expected']:.3f}; peer peak {p.get('peak_alloc_GiB', '-')} GiB "
          f"with its 32k-token cache)")
else:
    print("FAIL: no memory run")
print(f"copy bandwidth: ours {ours['copy_bandwidth_Bps'] / 1e12:.2f} TB/s, "
      f"peer {p.get('copy_TBps', float('nan')):.2f} TB/s (read + write)")
print(ours["summary"])
EOF
stamp "end"
