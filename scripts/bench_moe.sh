#!/usr/bin/env bash
# One GPU-machine call (issue #20): a mixture-of-experts preset, truncated with --layers to fit this host's
# memory, at >= 64K tokens per step, against the same truncated model whole on the GPU (--baseline native)
# in the same invocation; first the PCIe link's ceiling (pinned H2D / D2H) and which experts code runs.
# Usage (on the GPU machine, repository root): bash scripts/bench_moe.sh [more bench args, e.g. --steps 6]
# Shape: MODEL (qwen3-30b-a3b), LAYERS (10 of 48: ~96 GiB of host state at 14 B/param), SEQ (4096),
# BATCH (4), ACCUM (4) -> 64K tokens per step. gpt-oss has no native SDPA baseline (HF: eager only).
# Logs and JSON go to $OUT (or ./gpu-logs): moe-env.txt, moe.log, moe.json, moe-summary.txt.
set -u
OUT=${OUT:-gpu-logs}; mkdir -p "$OUT"
MODEL=${MODEL:-qwen3-30b-a3b} LAYERS=${LAYERS:-10} SEQ=${SEQ:-4096} BATCH=${BATCH:-4} ACCUM=${ACCUM:-4}
export PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True PYTHONUNBUFFERED=1
python3 -m pip install -q --no-deps --no-build-isolation -e . >"$OUT/install.log" 2>&1 || { tail -20 "$OUT/install.log"; exit 1; }

python3 - <<'EOF' 2>&1 | tee "$OUT/moe-env.txt"
import time, torch, transformers
from transformers.integrations import moe
dev = torch.device("cuda")
print("torch", torch.__version__, "transformers", transformers.__version__, torch.cuda.get_device_name(dev))
w = torch.empty(8, 64, 32, device=dev, dtype=torch.bfloat16)
x = torch.empty(16, 64, device=dev, dtype=torch.bfloat16)
offs = torch.arange(2, 17, 2, device=dev, dtype=torch.int32)
print("experts: transformers grouped_mm ->", "torch grouped_mm kernel" if moe._can_use_grouped_mm(x, w, offs)
      else "FALLBACK (a Python loop over experts)")
n = 1 << 30
host, gpu = torch.empty(n, dtype=torch.uint8, pin_memory=True), torch.empty(n, dtype=torch.uint8, device=dev)
for name, dst, src in (("H2D", gpu, host), ("D2H", host, gpu)):
    dst.copy_(src, non_blocking=True); torch.cuda.synchronize()
    t = time.perf_counter()
    for _ in range(10):
        dst.copy_(src, non_blocking=True)
    torch.cuda.synchronize()
    print(f"link ceiling {name}: {10 * n / (time.perf_counter() - t) / 1e9:.1f} GB/s (pinned, 1 GiB copies)")
EOF

echo "=== megatrain bench --model $MODEL --layers $LAYERS: ${BATCH}x${SEQ} x ${ACCUM} micro-batches vs native" | tee "$OUT/moe.log"
timeout "${BENCH_TIMEOUT:-480}" megatrain bench --model "$MODEL" --layers "$LAYERS" --seq "$SEQ" --batch "$BATCH" \
    train.grad_accum="$ACCUM" engine.grad_slabs=4 engine.checkpoint_interval=2 --baseline native --steps 4 \
    --output "$OUT/moe.json" "$@" 2>&1 | tee -a "$OUT/moe.log" | grep -v "^\[bench\] step\|^\[native\] step" | tail -25

python3 - "$OUT" <<'EOF' 2>&1 | tee "$OUT/moe-summary.txt"
import json, re, sys
out = sys.argv[1]
rows = {r["name"]: r for r in json.load(open(f"{out}/moe.json"))}
env = open(f"{out}/moe-env.txt").read()
ceiling = {k: float(v) for k, v in re.findall(r"link ceiling (\w+): ([\d.]+)", env)}
ours = next(r for n, r in rows.items() if n != "native")
print(f"{ours['model']}: {ours['batch']} x {ours['seq']} tokens/step")
for name, r in rows.items():
    # Both runs do the same model FLOPs per token; ours counts ACTIVE parameters (metrics/flops.py), so the
    # native row's active-parameter TFLOPS follows from its tokens/s.
    active = ours["model_tflops"] * r["tokens_per_s"] / ours["tokens_per_s"]
    line = (f"  {name:>9}: {r['tokens_per_s']:9,.0f} tokens/s  {active:6.1f} active-param model TFLOPS  "
            f"peak device {r['peak_device_bytes'] / 2**30:6.1f} GiB")
    if r.get("h2d_gbps"):
        line += (f"  H2D {r['h2d_gbps']:.1f} GB/s ({r['h2d_gbps'] / ceiling.get('H2D', float('nan')):.0%} of the link)"
                 f"  D2H {r['d2h_gbps'] or 0:.1f} GB/s")
    print(line)
if "native" in rows:
    print(f"  ratio: {ours['tokens_per_s'] / rows['native']['tokens_per_s']:.2f}x native tokens/s (goal >= 0.9x)")
EOF
