#!/usr/bin/env bash
# One device call: install, the GPU tests, then the benchmarks given as arguments.
# Usage (on the GPU machine): bash scripts/gpu_session.sh "bench --model 7b --seq 4096 --batch 8 --baseline native" ...
# Logs go to $OUT (or ./gpu-logs).
set -u
OUT=${OUT:-gpu-logs}; mkdir -p "$OUT"
export PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True PYTHONUNBUFFERED=1 NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
python3 -m pip install -q --no-deps --no-build-isolation -e . >"$OUT/install.log" 2>&1 || { cat "$OUT/install.log"; exit 1; }
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader | tee "$OUT/gpu.txt"
python3 -c "import torch, transformers; print('torch', torch.__version__, 'transformers', transformers.__version__)" | tee -a "$OUT/gpu.txt"
if [ "${SKIP_TESTS:-0}" != 1 ]; then
  timeout 300 python3 -m pytest -q -m cuda tests/ 2>&1 | tee "$OUT/pytest-cuda.log" | tail -25
fi
i=0
for cmd in "$@"; do
  i=$((i+1))
  echo "=== megatrain $cmd" | tee "$OUT/bench-$i.log"
  timeout "${BENCH_TIMEOUT:-400}" megatrain $cmd --output "$OUT/bench-$i.json" 2>&1 | tee -a "$OUT/bench-$i.log" | grep -v "^\[bench\] step\|^\[native\] step" | tail -20
done
