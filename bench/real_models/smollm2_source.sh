# Sourced by bench/gpu_quant_ab.sh and bench/gpu_real_quality.sh (needs STASH, REAL, OUT):
# stash what this call carried, install the wheels the image lacks and exl3 itself,
# assemble the SmolLM2 GGUF from its parts, make its dequantized source folder; sets
# SRC, TEXT (wikitext-2 test) and CALIB (wikitext-2 valid).
[ -d .real/s ] && python3 bench/real_models/pack.py stash .real/s "$STASH"
if ls "$STASH"/wheels/*.whl >/dev/null 2>&1; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
    --target /tmp/site "$STASH"/wheels/*.whl >"$OUT/wheels.log" 2>&1 || echo "FAIL: wheels"
  export PYTHONPATH=/tmp/site${PYTHONPATH:+:$PYTHONPATH}
fi
. bench/device_install.sh >"$OUT/install.log" 2>&1
python3 bench/real_models/pack.py assemble "$STASH" "$REAL" | grep smollm2
SRC=$REAL/smollm2-hf
[ -f "$SRC/config.json" ] || python3 bench/real_models/source_folder.py "$REAL/smollm2.gguf" "$SRC"
TEXT=$STASH/text/test.txt CALIB=$STASH/text/valid.txt
