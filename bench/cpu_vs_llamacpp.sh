#!/usr/bin/env bash
# EXL3 on the CPU next to llama.cpp, interleaved in one series (the machine is shared:
# read the ratios of neighbouring lines, bench/NOTES-cpu-exl3.md).
#
#   bash bench/cpu_vs_llamacpp.sh EXL3_FOLDER GGUF [EXL3_FOLDER GGUF ...]
#   ROUNDS=3 THREADS="1 2" PROMPT=512 NEW=64 REPEATS=2 NODE_PATH=/tmp/llama-node/node_modules
#
# llama.cpp runs through node-llama-cpp's prebuilt CPU binary
# ((cd /tmp/llama-node && npm i -E node-llama-cpp@3.21.1); bench/llamacpp_cpu.mjs).
set -u -o pipefail
cd "$(dirname "$0")/.."
export PYTHONPATH=${PYTHONPATH:-.} NODE_PATH=${NODE_PATH:-/tmp/llama-node/node_modules}
ROUNDS=${ROUNDS:-3} THREADS=${THREADS:-1} PROMPT=${PROMPT:-512} NEW=${NEW:-64}
REPEATS=${REPEATS:-2}
for round in $(seq "$ROUNDS"); do
  for threads in $THREADS; do
    set -- "${@}"
    args=("$@")
    for ((i = 0; i < ${#args[@]}; i += 2)); do
      folder=${args[i]} gguf=${args[i + 1]}
      echo "round $round load $(cut -d' ' -f1 /proc/loadavg) $(basename "$folder")"
      python3 bench/cpu_exl3.py "$folder" --modes exl3 --threads "$threads" \
        --prompt-tokens "$PROMPT" --new-tokens "$NEW" --repeats "$REPEATS" 2>&1 | tail -1
      node bench/llamacpp_cpu.mjs "$gguf" "$threads" "$PROMPT" "$NEW" "$REPEATS" 2>&1 | tail -1
    done
  done
done
