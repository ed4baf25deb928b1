#!/usr/bin/env bash
# The same `megatrain bench` command on two source trees in one GPU-machine call, one after the other
# (each installed apart into its own site dir, so neither sees the other's package): the before/after
# check of a change that must not move the speed.
# Usage (on the GPU machine): bash scripts/bench_two_trees.sh OLD_TREE NEW_TREE [bench args...]
# Logs and JSON go to $OUT (or ./gpu-logs): before.log/.json, after.log/.json.
set -u
old=$1 new=$2; shift 2
OUT=${OUT:-gpu-logs}; mkdir -p "$OUT"
export PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True PYTHONUNBUFFERED=1
for side in before after; do
  tree=$old; [ "$side" = after ] && tree=$new
  site=/tmp/megatrain-$side
  python3 -m pip install -q --no-deps --no-build-isolation --target "$site" "$tree" >"$OUT/install-$side.log" 2>&1 \
    || { tail -20 "$OUT/install-$side.log"; exit 1; }
  echo "=== $side: megatrain bench $* ($tree)" | tee "$OUT/$side.log"
  (cd /tmp && PYTHONPATH="$site" timeout "${BENCH_TIMEOUT:-290}" python3 -m megatrain_cli bench "$@" --output "$OUT/$side.json") \
    >>"$OUT/$side.log" 2>&1
  grep -v "^\[bench\] step" "$OUT/$side.log" | tail -8
done
