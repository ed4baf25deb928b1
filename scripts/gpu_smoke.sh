#!/usr/bin/env bash
# Every GPU command the README and the recipes show, each shrunk to seconds, in one device call:
# train (bf16 / fp32 / bf16 masters, resident auto / 0 / N, DPO, GRPO), bench with and without engine.max_gpu_mem,
# packed rows, the preference and GRPO benches, the long-context path, mixture of experts, eval resident and
# streamed, export, `megatrain plan`, the low optimizer-state options and the disk tier, a vision-language model
# (train one example a row and packed, bench one a row and packed), and `--gpus 2` where two GPUs are present.
# The first row runs alone (it compiles the C++ AdamW); the rest run in three lanes at once (rows that read
# another's output share its lane), so a row's wall and a bench's figure include the other lanes' load: they say
# the path works, not how fast. Exit non-zero when any row fails; a summary table last.
# Usage (on the GPU machine, repository root): bash scripts/gpu_smoke.sh   Logs: $OUT/smoke (or ./gpu-logs).
set -u
OUT=${OUT:-gpu-logs}; LOGS="$OUT/smoke"; mkdir -p "$LOGS"
W=$(mktemp -d /tmp/megatrain-smoke.XXXX); mkdir -p "$W/tier"  # the disk tier row's folder
# Our own multi-GPU runs on this workplace's machines leave NVLink multicast off (its KINDS.md says why);
# users keep NCCL's defaults.
export PYTHONUNBUFFERED=1 NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
python3 -m pip install -q --no-deps --no-build-isolation -e . >"$LOGS/install.log" 2>&1 \
  || { tail -20 "$LOGS/install.log"; exit 1; }
GPUS=$(nvidia-smi -L 2>/dev/null | wc -l)
T0=$SECONDS

# row NAME TIMEOUT_S COMMAND...: run it, keep its log, note pass/fail, seconds and (for a bench) tokens/s, in the
# lane's rows file ($LANE: set by the lane that runs it).
LANE=0
row() {
  local name=$1 limit=$2; shift 2
  local log="$LOGS/$LANE-$name.log" t0=$SECONDS rc figure=""
  echo "=== $name: $*" | tee "$log"
  timeout "$limit" "$@" >>"$log" 2>&1; rc=$?
  if [ -f "$W/$name.json" ]; then
    figure=$(python3 -c "import json,sys; r=json.load(open(sys.argv[1])); r=r[0] if isinstance(r,list) else r; \
print(f\"{r.get('tokens_per_s',0):,.0f} tok/s\")" "$W/$name.json" 2>/dev/null)
  fi
  [ $rc -eq 0 ] || tail -5 "$log"
  printf '| %-28s | %-8s | %5ds | %s |\n' "$name" "$([ $rc -eq 0 ] && echo ok || echo "FAIL($rc)")" \
    $((SECONDS - t0)) "$figure" >>"$LOGS/rows-$LANE.txt"
}

TINY=recipes/tiny.yaml
STEPS="train.steps=2 eval.enabled=false logging.dashboard=plain"
BF16="engine.device=cuda model.dtype=bf16"
row train-bf16 240 megatrain train $TINY $BF16 $STEPS output_dir=$W/bf16
BENCH="--steps 2 --warmup 1"
# The lanes load the host: a probe timed now would be low, and the user's cache would keep it for later benches
# (a 7B bench after this script was predicted at 4x its step); the rows' probes go to a folder of their own.
MB="megatrain bench --probe-cache $W/probe"  # every bench row's command

lane1() {
  LANE=1
  row export 120 megatrain export $W/bf16/step_2 $W/bf16-export
  row eval-resident 240 megatrain eval $TINY eval.limit=4 eval.max_new_tokens=16 --model $W/bf16/final --mode resident \
    --output-dir $W/eval-r
  row train-fp32-compute 240 megatrain train $TINY engine.device=cuda $STEPS output_dir=$W/fp32
  row train-bf16-masters 240 megatrain train $TINY $BF16 train.master_weights=bf16 $STEPS output_dir=$W/bf16m
  row train-state-int8 240 megatrain train $TINY $BF16 train.master_weights=bf16 train.optimizer_state=int8 $STEPS \
    output_dir=$W/int8
  row train-state-bf16-resident 240 megatrain train $TINY $BF16 train.optimizer_state=bf16 engine.resident_layers=2 \
    $STEPS output_dir=$W/sbf16
  row train-resident-0 240 megatrain train $TINY $BF16 engine.resident_layers=0 $STEPS output_dir=$W/r0
  row train-resident-2 240 megatrain train $TINY $BF16 engine.resident_layers=2 $STEPS output_dir=$W/r2
  row train-dpo 240 megatrain train recipes/dpo-tiny.yaml engine.device=cuda $STEPS output_dir=$W/dpo
  row train-masters-stochastic 240 megatrain train $TINY $BF16 train.master_weights=bf16 train.master_rounding=stochastic \
    $STEPS output_dir=$W/sr
  row train-disk-tier 240 megatrain train $TINY $BF16 train.optimizer_state=int8 store.disk=$W/tier \
    store.disk_state=moments+masters $STEPS output_dir=$W/disk
}
lane2() {
  LANE=2
  row train-grpo 240 megatrain train recipes/grpo-tiny.yaml engine.device=cuda $STEPS output_dir=$W/grpo
  row eval-streamed 240 megatrain eval $TINY eval.limit=4 eval.max_new_tokens=16 --model preset:0.5b --mode streamed \
    --output-dir $W/eval-s
  row plan 300 megatrain plan $TINY engine.device=cuda --probe-cache $W/probe
  # The 3B preset: a 7B checkpoint (99 GiB) rightly fails the dry run on a 64 GiB disk (exit 3).
  row dry-run-3b 120 megatrain train recipes/qwen7b.yaml --dry-run model.path=null model.preset=3b
  row bench-0.5b-native 300 $MB --model 0.5b --seq 2048 --batch 4 $BENCH --baseline native \
    --output $W/bench-0.5b-native.json
  row bench-grpo 400 $MB recipes/grpo-7b.yaml --model 0.5b --steps 1 --warmup 0 \
    grpo.max_new_tokens=32 --output $W/bench-grpo.json
  # A vision-language model: the tiny Qwen2-VL recipe (tower streamed, bf16), then the bench's image rows
  # against the same model whole on the GPU.
  row train-vlm-tiny 240 megatrain train recipes/vlm-tiny.yaml $BF16 $STEPS output_dir=$W/vlm
  row train-vlm-packed 240 megatrain train recipes/vlm-tiny.yaml data.packing=true $BF16 $STEPS output_dir=$W/vlm-packed
  row bench-vlm-native 300 $MB --model qwen2-vl-tiny --seq 512 --batch 2 $BENCH --baseline native \
    --output $W/bench-vlm-native.json
  row bench-vlm-packed 300 $MB --model qwen2-vl-tiny --seq 512 --batch 2 data.packing=true bench.image_size=224 \
    bench.doc_len_mean=150 $BENCH --output $W/bench-vlm-packed.json
}
lane3() {
  LANE=3
  row bench-7b-24GiB 400 $MB --model 7b --layers 4 --seq 4096 --batch 8 engine.max_gpu_mem=24GiB $BENCH \
    --output $W/bench-7b-24GiB.json
  row bench-packed-0.5b 300 $MB --model 0.5b --seq 4096 --batch 4 data.packing=true bench.doc_lengths=data \
    $BENCH --output $W/bench-packed-0.5b.json
  row bench-dpo 400 $MB recipes/dpo-7b.yaml --model 0.5b --seq 2048 --batch 2 --steps 1 --warmup 1 \
    --output $W/bench-dpo.json
  row bench-long-32k 400 $MB --model 0.5b --seq 32k --batch 1 --steps 1 --output $W/bench-long-32k.json
  row bench-moe 400 $MB --model qwen3-30b-a3b --layers 2 --seq 2048 --batch 2 $BENCH \
    --output $W/bench-moe.json
}
lane1 & lane2 & lane3 &
wait
if [ "$GPUS" -ge 2 ]; then
  LANE=4
  row bench-gpus-2 400 $MB --gpus 2 --model 0.5b --seq 2048 --batch 2 $BENCH --output $W/bench-gpus-2.json
  row train-gpus-2 300 megatrain train $TINY --gpus 2 $STEPS output_dir=$W/dp
else
  printf '| %-28s | %-8s | %5s | %s |\n' gpus-2 skip - "one GPU on this machine" >>"$LOGS/rows-4.txt"
fi

{
  echo "GPU: $(nvidia-smi --query-gpu=name,memory.total --format=csv,noheader | head -1) x $GPUS;" \
    "$(python3 -c 'import torch, transformers; print("torch", torch.__version__, "transformers", transformers.__version__)')"
  echo "| row | result | wall | figure |"; echo "| --- | --- | --- | --- |"
  cat "$LOGS"/rows-*.txt
  echo "$(cat "$LOGS"/rows-*.txt | grep -c FAIL) of $(cat "$LOGS"/rows-*.txt | grep -vc skip) rows failed in $((SECONDS - T0)) s"
} | tee "$OUT/smoke-summary.md"
rm -rf "$W"
! grep -q FAIL "$LOGS"/rows-*.txt
