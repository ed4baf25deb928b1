"""DeepSpeed ZeRO-3 Offload training a random-init preset on one GPU: `megatrain bench --baseline deepspeed`.

A script, run in a process of its own (deepspeed.bench_deepspeed starts it, watches its host
memory and kills it before the machine runs out):

    python -m megatrain_cli.bench.deepspeed_child --model 3b --seq 4096 --batch 8 --steps 3 --warmup 1 \
        --out result.json

What runs is the strongest standard DeepSpeed setup for a model whose training state does not fit
on the GPU: ZeRO stage 3 with the bf16 parameters AND the fp32 master weights, gradients and Adam
moments offloaded to pinned CPU memory, DeepSpeedCPUAdam doing the update on the host, overlap_comm,
contiguous gradients, HF gradient checkpointing and SDPA attention. The model is built directly
partitioned under deepspeed.zero.Init, so the host never holds a second full copy of it. The tokens
are exactly those of loop.synthetic_batch (step s uses seed s * 97), and the FLOPs are counted as
short.bench_native counts them, so the rows compare like for like.

Output: one JSON object with the fields of result.BenchResult (name='deepspeed'), written to --out
only when every step ran. Progress goes to stdout, one flushed line per step.

Exit codes: 0 done; 3 deepspeed is not installed; 4 deepspeed is installed but does not import;
1 anything else (the traceback is on stderr).
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import shutil
import socket
import sys
import time

EXIT_OK = 0
EXIT_NO_DEEPSPEED = 3
EXIT_DEEPSPEED_BROKEN = 4

# ---------------------------------------------------------------- the ZeRO-3 knobs, sized for 7B
# Sizes are in parameter ELEMENTS, as DeepSpeed counts them. For the 7B preset (hidden 3584, MLP
# 18944) one decoder layer is ~233 M elements (467 MB in bf16), its largest matrix 68 M; the
# embedding and the LM head are 545 M each. The H200 has ~140 GB, so GPU-side buffers of a few GB
# cost nothing, and the values below lean towards fewer, larger transfers: what favours DeepSpeed.
#
# reduce_bucket_size: gradients are collected in a GPU bucket of this many elements and then moved
#   to the fp32 gradient partition in pinned host memory (with one GPU there is nothing to reduce;
#   the bucket is the unit of the device-to-host copy). 2e8 is ~ one 7B layer: each flush is a
#   ~400 MB copy, and with overlap_comm two buckets (0.8 GB) alternate so the copy of one overlaps
#   the backward filling the other. (HF's "auto", hidden^2 = 12.8 M, would mean ~20 small flushes
#   per layer.) A gradient larger than the bucket (the 545 M embedding) is reduced on its own.
REDUCE_BUCKET_SIZE = 200_000_000
# stage3_prefetch_bucket_size: how many elements ZeRO-3 fetches ahead of use (host -> GPU, from the
#   pinned bf16 partitions). 5e8 ~ two 7B layers: the next layer's weights (~9 ms over PCIe 5 at
#   ~50 GB/s) are in flight well before the current layer's ~25 ms of compute ends.
PREFETCH_BUCKET_SIZE = 500_000_000
# stage3_param_persistence_threshold: parameters with fewer elements stay resident on the GPU and
#   are never fetched. 1e6 keeps every norm weight and bias (<= 3584 elements) resident, which
#   removes hundreds of tiny latency-bound fetches per step, and keeps every matrix streamed (the
#   smallest 7B matrix, k_proj 3584 x 512, is 1.8 M; on 3B the 0.5 M k/v projections stay resident,
#   ~75 MB of GPU memory, which only helps DeepSpeed).
PARAM_PERSISTENCE_THRESHOLD = 1_000_000
# stage3_max_live_parameters: the most elements gathered on the GPU at once before released ones
#   must go. 1e9 (~4 7B layers, 2 GB bf16) covers a layer being recomputed + its backward + the
#   prefetched next one, without ever throttling the prefetch above.
MAX_LIVE_PARAMETERS = 1_000_000_000
# stage3_max_reuse_distance: a released parameter is kept if it is needed again within this many
#   elements. Under checkpointing a layer's recompute is followed at once by its backward, so 1e9
#   keeps the weights on the GPU between the two instead of fetching them twice.
MAX_REUSE_DISTANCE = 1_000_000_000


def ds_config(batch: int) -> dict:
    """The DeepSpeed config (0.19.x schema) of this baseline, for one process on one GPU."""
    return {
        "train_micro_batch_size_per_gpu": batch,
        "gradient_accumulation_steps": 1,
        "train_batch_size": batch,  # = micro batch x grad accum x world size (1)
        "gradient_clipping": 1.0,
        "bf16": {"enabled": True},
        "zero_optimization": {
            "stage": 3,
            "offload_param": {"device": "cpu", "pin_memory": True},
            "offload_optimizer": {"device": "cpu", "pin_memory": True},
            "overlap_comm": True,
            "contiguous_gradients": True,
            "reduce_bucket_size": REDUCE_BUCKET_SIZE,
            "stage3_prefetch_bucket_size": PREFETCH_BUCKET_SIZE,
            "stage3_param_persistence_threshold": PARAM_PERSISTENCE_THRESHOLD,
            "stage3_max_live_parameters": MAX_LIVE_PARAMETERS,
            "stage3_max_reuse_distance": MAX_REUSE_DISTANCE,
        },
        "steps_per_print": 1 << 30,  # we print our own lines
        "wall_clock_breakdown": False,
    }


def config_summary(cfg: dict) -> str:
    z = cfg["zero_optimization"]
    return (f"ZeRO-3, offload_param=cpu(pin={z['offload_param']['pin_memory']}), "
            f"offload_optimizer=cpu(pin={z['offload_optimizer']['pin_memory']}), DeepSpeedCPUAdam (fp32 states), "
            f"overlap_comm={z['overlap_comm']}, contiguous_gradients={z['contiguous_gradients']}, "
            f"reduce_bucket={z['reduce_bucket_size']:.0e}, prefetch_bucket={z['stage3_prefetch_bucket_size']:.0e}, "
            f"persistence<{z['stage3_param_persistence_threshold']:.0e}, "
            f"max_live={z['stage3_max_live_parameters']:.0e}, max_reuse={z['stage3_max_reuse_distance']:.0e}, "
            f"bf16, gradient_clipping={cfg['gradient_clipping']}")


# ---------------------------------------------------------------- helpers
def log(msg: str) -> None:
    print(f"[deepspeed] {msg}", flush=True)


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def rss_bytes() -> tuple[int, int]:
    """(VmRSS, VmHWM) of this process in bytes."""
    rss = hwm = 0
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                rss = int(line.split()[1]) * 1024
            elif line.startswith("VmHWM:"):
                hwm = int(line.split()[1]) * 1024
    return rss, hwm


def synthetic_ids(vocab: int, batch: int, seq: int, seed: int):
    """The token ids of loop.synthetic_batch (labels are a copy of them); kept here so this script
    does not import the engine (tests check the two agree)."""
    import torch

    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, vocab, (batch, seq), generator=g)


def prefer_oom_kill() -> None:
    """Ask the kernel's OOM killer to take this process (and what it spawns) first, not the parent."""
    try:
        with open("/proc/self/oom_score_adj", "w") as f:
            f.write("1000")
    except OSError:
        pass


def ensure_ninja_on_path() -> None:
    """torch JIT-builds cpu_adam with the `ninja` it finds on PATH. Where there is none, use the one
    the `ninja` wheel brings (with `pip install --target DIR` it lands in DIR/bin, off PATH)."""
    if shutil.which("ninja"):
        return
    try:
        import ninja
    except ImportError:
        return
    for d in (getattr(ninja, "BIN_DIR", ""), os.path.join(os.path.dirname(os.path.dirname(ninja.__file__)), "bin")):
        if d and os.access(os.path.join(d, "ninja"), os.X_OK):
            os.environ["PATH"] = d + os.pathsep + os.environ.get("PATH", "")
            return


def check_deepspeed() -> int:
    """EXIT_OK when deepspeed imports; else the exit code to leave with, having said why."""
    if importlib.util.find_spec("deepspeed") is None:
        print("deepspeed is not installed", file=sys.stderr, flush=True)
        return EXIT_NO_DEEPSPEED
    try:
        import deepspeed  # noqa: F401
    except Exception as e:  # installed, but broken: a missing dependency, a torch mismatch
        print(f"deepspeed is installed but failed to import: {type(e).__name__}: {e}", file=sys.stderr, flush=True)
        return EXIT_DEEPSPEED_BROKEN
    return EXIT_OK


def init_weights_gathered(model, std: float) -> None:
    """The initialisation HF gives these models (normal(0, initializer_range) matrices and embeddings,
    zero biases, unit norm weights), applied module by module to the gathered ZeRO-3 parameters.

    Needed because HF does not know about our zero.Init context: its own init runs on the already
    partitioned (empty) tensors and changes nothing, leaving torch's defaults, e.g. N(0, 1)
    embeddings, which as a tied LM head give huge logits, overflowing bf16 gradients and so steps
    DeepSpeed would skip (and time as fast)."""
    import deepspeed
    import torch

    with torch.no_grad():
        for module in model.modules():
            params = list(module.named_parameters(recurse=False))
            if not params:
                continue
            with deepspeed.zero.GatheredParameters([p for _, p in params], modifier_rank=0):
                for name, p in params:
                    if p.dim() >= 2:
                        p.normal_(0.0, std)
                    elif name.endswith("bias"):
                        p.zero_()
                    else:
                        p.fill_(1.0)


def restore_rope_fp32(model) -> int:
    """Recompute RoPE inverse frequencies in fp32; returns how many buffers were fixed.

    zero.Init casts every floating tensor made inside it to bf16, torch.arange(..., dtype=float)
    included, so inv_freq comes out bf16 (later transformers versions guard against this, 5.17 does
    not). bench_native and our engine keep it in fp32; so do we (DeepSpeed leaves fp32 buffers be)."""
    import torch

    fixed = 0
    for module in model.modules():
        inv = getattr(module, "inv_freq", None)
        compute = getattr(module, "compute_default_rope_parameters", None)
        if (not isinstance(inv, torch.Tensor) or inv.dtype == torch.float32 or compute is None
                or getattr(module, "rope_type", "default") != "default"):
            continue
        fresh = compute(module.config)[0].to(device=inv.device, dtype=torch.float32)
        if fresh.shape != inv.shape:
            continue
        module.inv_freq = fresh
        if isinstance(getattr(module, "original_inv_freq", None), torch.Tensor):
            module.original_inv_freq = fresh.clone()
        fixed += 1
    return fixed


# ---------------------------------------------------------------- the run
def run(args) -> dict:
    import torch

    # One process, one GPU: the environment torch.distributed's env:// init reads.
    os.environ.update(RANK="0", WORLD_SIZE="1", LOCAL_RANK="0", LOCAL_WORLD_SIZE="1",
                      MASTER_ADDR="127.0.0.1", MASTER_PORT=str(free_port()))
    cuda = torch.cuda.is_available()
    if cuda:
        torch.cuda.set_device(0)
        # cpu_adam is JIT-built at first use; building for this GPU only is much faster.
        major, minor = torch.cuda.get_device_capability(0)
        os.environ.setdefault("TORCH_CUDA_ARCH_LIST", f"{major}.{minor}")
    else:
        log("WARNING: no CUDA device; running on the CPU (a dry run of the code path, not a benchmark)")
    ensure_ninja_on_path()

    import deepspeed
    from deepspeed.ops.adam import DeepSpeedCPUAdam
    from transformers import AutoModelForCausalLM

    from megatrain_cli.metrics.flops import model_flops
    from megatrain_cli.presets import PRESETS

    p = PRESETS[args.model]
    config = p.hf_config(vocab_size=p.vocab_size or 1024, max_position_embeddings=max(args.seq, 4096))
    cfg = ds_config(args.batch)
    log(f"deepspeed {deepspeed.__version__}, torch {torch.__version__}; {config_summary(cfg)}")

    deepspeed.init_distributed()
    # Import the model's module (and torch._dynamo, which transformers' masking utilities pull in)
    # BEFORE zero.Init: inside it torch.Tensor.__new__ is patched, and importing torch._dynamo there
    # fails ("Signature mismatch between ... new_tensor and tensor_pynew").
    import torch._dynamo  # noqa: F401
    import transformers

    getattr(transformers, config.architectures[0])
    t0 = time.perf_counter()
    torch.manual_seed(0)
    # Built straight into ZeRO-3 partitions: each module's weights are made on the GPU, then moved to
    # their pinned host partition as soon as the module's __init__ returns.
    with deepspeed.zero.Init(config_dict_or_path=cfg, remote_device="cpu", pin_memory=True):
        model = AutoModelForCausalLM.from_config(config, attn_implementation="sdpa", dtype=torch.bfloat16)
    init_weights_gathered(model, getattr(config, "initializer_range", 0.02))
    restore_rope_fp32(model)
    model.config.use_cache = False
    model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": args.reentrant})
    model.train()
    n_params = sum(getattr(q, "ds_numel", q.numel()) for q in model.parameters())
    emb_w = model.get_input_embeddings().weight
    emb = getattr(emb_w, "ds_numel", emb_w.numel())
    rss, _ = rss_bytes()
    log(f"model built under zero.Init: {n_params / 1e9:.2f} B params, {time.perf_counter() - t0:.1f} s, "
        f"host RSS {rss / 2**30:.1f} GiB")

    t0 = time.perf_counter()
    optimizer = DeepSpeedCPUAdam(model.parameters(), lr=1e-5, betas=(0.9, 0.999), eps=1e-8, weight_decay=0.0,
                                 adamw_mode=True)
    log(f"DeepSpeedCPUAdam ready (JIT build if first use): {time.perf_counter() - t0:.1f} s")
    t0 = time.perf_counter()
    engine, _, _, _ = deepspeed.initialize(model=model, optimizer=optimizer, config=cfg)
    rss, _ = rss_bytes()
    buffers = sorted({str(b.dtype).replace("torch.", "") for b in engine.module.buffers()})
    log(f"deepspeed.initialize: {time.perf_counter() - t0:.1f} s, host RSS {rss / 2**30:.1f} GiB, "
        f"buffer dtypes {buffers}")

    dev = engine.device
    sync = (lambda: torch.cuda.synchronize(dev)) if cuda else (lambda: None)
    if cuda:
        torch.cuda.reset_peak_memory_stats(dev)
    losses, t_timed = [], None
    for s in range(args.warmup + args.steps):
        if s == args.warmup:
            sync()
            t_timed = time.perf_counter()
        t_s = time.perf_counter()
        ids = synthetic_ids(config.vocab_size, args.batch, args.seq, seed=s * 97)
        ids = ids.to(dev)
        out = engine(input_ids=ids, labels=ids.clone())
        engine.backward(out.loss)
        engine.step()
        losses.append(float(out.loss.detach()))
        rss, _ = rss_bytes()
        log(f"step {s}{' (warm-up)' if s < args.warmup else ''}: loss {losses[-1]:.4f} "
            f"{time.perf_counter() - t_s:.2f} s, host RSS {rss / 2**30:.1f} GiB")
    sync()
    wall = time.perf_counter() - t_timed
    step_time = wall / args.steps
    tokens = args.batch * args.seq
    matmul = n_params - emb + (emb if config.tie_word_embeddings else 0)
    flops = model_flops(matmul, tokens, args.batch, args.seq, config.hidden_size, config.num_hidden_layers)
    skipped = getattr(engine, "skipped_steps", 0)
    rss, hwm = rss_bytes()
    notes = (f"DeepSpeed {deepspeed.__version__} {config_summary(cfg)}; HF gradient checkpointing "
             f"(use_reentrant={args.reentrant}), sdpa; built under zero.Init(remote_device=cpu, pin_memory=True)")
    if skipped:
        notes += f"; WARNING: DeepSpeed skipped {skipped} step(s) (gradient overflow)"
    return dict(
        name="deepspeed", model=args.model, batch=args.batch, seq=args.seq, steps=args.steps,
        step_time_s=step_time, tokens_per_s=tokens / step_time, model_tflops=flops / step_time / 1e12,
        executed_tflops=flops * 4 / 3 / step_time / 1e12,
        peak_device_bytes=torch.cuda.max_memory_allocated(dev) if cuda else 0,
        host_rss_bytes=rss, host_peak_rss_bytes=hwm,
        bytes_per_param=0.0, h2d_gbps=None, d2h_gbps=None, overlap=None, split={},
        losses=losses, notes=notes)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m megatrain_cli.bench.deepspeed_child", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="3b", help="a preset name (megatrain_cli/presets.py)")
    ap.add_argument("--seq", type=int, default=4096)
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--steps", type=int, default=3, help="timed steps")
    ap.add_argument("--warmup", type=int, default=1, help="untimed steps first")
    ap.add_argument("--out", required=True, help="where to write the result JSON")
    ap.add_argument("--reentrant", action="store_true",
                    help="reentrant activation checkpointing (HF's default is non-reentrant)")
    args = ap.parse_args(argv)
    if args.steps < 1 or args.warmup < 0:
        ap.error("--steps must be >= 1 and --warmup >= 0")
    prefer_oom_kill()
    code = check_deepspeed()  # before torch/transformers: a missing deepspeed is reported in a second
    if code != EXIT_OK:
        return code
    result = run(args)
    tmp = args.out + ".tmp"
    with open(tmp, "w") as f:
        json.dump(result, f, indent=2)
    os.replace(tmp, args.out)
    log(f"done: {result['tokens_per_s']:.0f} tokens/s, {result['step_time_s']:.2f} s/step -> {args.out}")
    return EXIT_OK


if __name__ == "__main__":
    sys.exit(main())
