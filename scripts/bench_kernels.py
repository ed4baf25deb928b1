"""Benchmark the Triton kernels (kernels/) against eager PyTorch and torch.compile, at 7B (Qwen2.5-7B) shapes.

Run on a GPU:  python scripts/bench_kernels.py --out bench-kernels.json [--only rope,swiglu] [--no-compile]

For each kernel and variant (triton | torch | torch.compile of the torch reference): the median time over
--reps of forward and of forward+backward (CUDA events), and the peak memory that one forward+backward adds
to what was allocated before it (torch.cuda.max_memory_allocated delta, inputs excluded, the gradients it
produces included). `check` is max|out - torch out| / max|torch out| of the forward, a sanity check only
(the tests in tests/triton/test_kernels.py are the correctness check). A Triton kernel that failed and fell back to
the reference is reported as such, never timed as Triton.

Shapes: tokens = 8 x 4096, hidden 3584, intermediate 18944, vocab 152064, 28 q heads / 4 kv heads of 128.
Budget: expected 1-2 minutes on an H200, most of it torch.compile with a cold cache; compile variants are
skipped once --budget-s has passed (the output says so). The CE variants include the unchunked reference
(~60 GB of logits and their fp32 copies) to show what chunking saves.

The CE "check" compares losses; "fell back" means the Triton path was NOT measured.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
import warnings

import torch
import torch.nn.functional as F

from megatrain_cli import kernels
from megatrain_cli.kernels import fused_linear_ce

BATCH, SEQ, HIDDEN, INTER, VOCAB, Q_HEADS, KV_HEADS, HEAD_DIM = 8, 4096, 3584, 18944, 152064, 28, 4, 128
TOKENS = BATCH * SEQ
CE_CHUNK = 4096
DTYPE = torch.bfloat16
DEVICE = "cuda"


def cuda_ms(fn, reps: int) -> float:
    """Median milliseconds of fn() over reps, each timed alone with CUDA events."""
    times = []
    for _ in range(reps):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        torch.cuda.synchronize()
        times.append(start.elapsed_time(end))
    return statistics.median(times)


def peak_mib(fn) -> float:
    """MiB that one fn() adds at its peak over what was allocated before it."""
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    base = torch.cuda.memory_allocated()
    fn()
    torch.cuda.synchronize()
    return (torch.cuda.max_memory_allocated() - base) / 2**20


# --- cases: (forward on inputs, inputs that want grads, other inputs) -----------------------------------------

def rms_norm_case():
    x = torch.randn(TOKENS, HIDDEN, device=DEVICE, dtype=DTYPE)
    w = 1 + 0.1 * torch.randn(HIDDEN, device=DEVICE, dtype=DTYPE)
    return {"triton": kernels.load("rms_norm"), "torch": kernels.load_reference("rms_norm")}, (x, w), ()


def swiglu_case():
    gate = torch.randn(TOKENS, INTER, device=DEVICE, dtype=DTYPE)
    up = torch.randn(TOKENS, INTER, device=DEVICE, dtype=DTYPE)
    return {"triton": kernels.load("swiglu"), "torch": kernels.load_reference("swiglu")}, (gate, up), ()


def rope_case():
    # q/k as HF makes them: projections [B, T, heads, D] viewed as [B, heads, T, D]
    q = torch.randn(BATCH, SEQ, Q_HEADS, HEAD_DIM, device=DEVICE, dtype=DTYPE).transpose(1, 2)
    k = torch.randn(BATCH, SEQ, KV_HEADS, HEAD_DIM, device=DEVICE, dtype=DTYPE).transpose(1, 2)
    inv_freq = 1.0 / (1e6 ** (torch.arange(0, HEAD_DIM, 2, device=DEVICE, dtype=torch.float32) / HEAD_DIM))
    freqs = torch.arange(SEQ, device=DEVICE, dtype=torch.float32)[:, None] * inv_freq
    emb = torch.cat((freqs, freqs), dim=-1).expand(BATCH, SEQ, HEAD_DIM)
    cos, sin = emb.cos().to(DTYPE), emb.sin().to(DTYPE)
    return ({"triton": kernels.load("rope"), "torch": kernels.load_reference("rope")}, (q, k), (cos, sin))


def run_forward_backward(fn, grad_inputs, other_inputs, grads_out):
    leaves = [t.detach().requires_grad_() for t in grad_inputs]
    out = fn(*leaves, *other_inputs)
    outs = out if isinstance(out, tuple) else (out,)
    torch.autograd.backward(outs, grads_out)
    return outs


def bench_elementwise(name, case, reps, compile_ok, rows):
    variants, grad_inputs, other = case()
    with torch.no_grad():
        ref_out = variants["torch"](*grad_inputs, *other)
    ref_outs = ref_out if isinstance(ref_out, tuple) else (ref_out,)
    grads_out = [torch.randn_like(o) for o in ref_outs]
    if compile_ok():
        variants["torch.compile"] = torch.compile(variants["torch"], dynamic=False)
    for variant, fn in variants.items():
        row = {"kernel": name, "variant": variant}
        try:
            with warnings.catch_warnings(record=True) as caught:
                warnings.simplefilter("always")
                started = time.perf_counter()
                run_forward_backward(fn, grad_inputs, other, grads_out)  # warm-up: compiles
                torch.cuda.synchronize()
                row["warmup_s"] = round(time.perf_counter() - started, 2)
                with torch.no_grad():
                    out = fn(*grad_inputs, *other)
                outs = out if isinstance(out, tuple) else (out,)
                row["check"] = max(((a.float() - b.float()).abs().max() / b.float().abs().max()).item()
                                   for a, b in zip(outs, ref_outs))
                del out, outs
                with torch.no_grad():
                    row["fwd_ms"] = cuda_ms(lambda: fn(*grad_inputs, *other), reps)
                row["fwd_bwd_ms"] = cuda_ms(lambda: run_forward_backward(fn, grad_inputs, other, grads_out), reps)
                row["peak_mib"] = peak_mib(lambda: run_forward_backward(fn, grad_inputs, other, grads_out))
            row["fell_back"] = any("Triton failed" in str(w.message) for w in caught)
        except Exception as error:  # noqa: BLE001 - one failing variant must not lose the others' numbers
            row["error"] = f"{type(error).__name__}: {error}"[:300]
        rows.append(row)
        print_row(row)
    del variants, grad_inputs, other, ref_outs, grads_out
    torch.cuda.empty_cache()


def bench_cross_entropy(reps, compile_ok, rows):
    hidden = torch.randn(TOKENS, HIDDEN, device=DEVICE, dtype=DTYPE)
    weight = 0.02 * torch.randn(VOCAB, HIDDEN, device=DEVICE, dtype=DTYPE)
    labels = torch.randint(0, VOCAB, (TOKENS,), device=DEVICE)
    labels[::5] = -100
    scale = 1.0 / TOKENS
    fused = kernels.load("fused_linear_cross_entropy")
    reference = kernels.load_reference("fused_linear_cross_entropy")
    variants = {
        "torch": lambda: reference(hidden, weight, labels, chunk_tokens=CE_CHUNK, scale=scale),
        "triton": lambda: fused(hidden, weight, labels, chunk_tokens=CE_CHUNK, scale=scale),
        # what the chunking avoids: all [tokens, vocab] logits at once (~60 GB here)
        "torch (unchunked)": lambda: reference(hidden, weight, labels, chunk_tokens=TOKENS, scale=scale),
    }
    if compile_ok():
        variants["torch.compile"] = compiled_cross_entropy(hidden, weight, labels, scale)
    ref_loss = None
    for variant, fn in variants.items():
        row = {"kernel": "fused_linear_cross_entropy", "variant": variant}
        try:
            with warnings.catch_warnings(record=True) as caught:
                warnings.simplefilter("always")
                started = time.perf_counter()
                loss = fn()[0].item()
                row["warmup_s"] = round(time.perf_counter() - started, 2)
                ref_loss = loss if ref_loss is None else ref_loss  # "torch" runs first
                row["check"] = abs(loss - ref_loss) / abs(ref_loss)
                row["fwd_bwd_ms"] = cuda_ms(fn, reps)  # loss and both gradients in one call: no forward alone
                row["peak_mib"] = peak_mib(fn)
            row["fell_back"] = any("Triton failed" in str(w.message) for w in caught)
        except Exception as error:  # noqa: BLE001 - one failing variant must not lose the others' numbers
            row["error"] = f"{type(error).__name__}: {error}"[:300]
        rows.append(row)
        print_row(row)
        torch.cuda.empty_cache()


def compiled_cross_entropy(hidden, weight, labels, scale):
    """The reference's chunk loop with its per-chunk loss (matmul + fp32 cross-entropy) under torch.compile;
    autograd runs the compiled backward."""
    @torch.compile(dynamic=False)
    def chunk_loss(h, w, lab):
        return scale * F.cross_entropy((h @ w.t()).float(), lab, ignore_index=-100, reduction="sum")

    def run():
        loss = torch.zeros((), device=DEVICE)
        grad_hidden = torch.empty_like(hidden)
        grad_weight = torch.zeros(weight.shape, device=DEVICE, dtype=torch.float32)
        w = weight.detach().requires_grad_()
        for start in range(0, TOKENS, CE_CHUNK):
            h = hidden[start:start + CE_CHUNK].detach().requires_grad_()
            chunk = chunk_loss(h, w, labels[start:start + CE_CHUNK])
            gh, gw = torch.autograd.grad(chunk, (h, w))
            loss += chunk.detach()
            grad_hidden[start:start + CE_CHUNK] = gh
            grad_weight += gw
        return loss, grad_hidden, grad_weight
    return run


# --- report --------------------------------------------------------------------------------------------------

HEADER = f"{'kernel':<28}{'variant':<19}{'fwd ms':>9}{'fwd+bwd ms':>12}{'peak MiB':>10}{'check':>10}{'warmup s':>10}"


def print_row(row):
    def num(key, fmt):
        width = int(fmt.split(".")[0])
        return format(row[key], fmt) if key in row else "-".rjust(width)
    note = " FELL BACK TO TORCH" if row.get("fell_back") else ""
    note += f" ERROR {row['error']}" if "error" in row else ""
    print(f"{row['kernel']:<28}{row['variant']:<19}{num('fwd_ms', '9.3f')}{num('fwd_bwd_ms', '12.3f')}"
          f"{num('peak_mib', '10.0f')}{num('check', '10.1e')}{num('warmup_s', '10.1f')}{note}", flush=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--out", default="bench-kernels.json", help="where the JSON results go")
    parser.add_argument("--only", default="rms_norm,swiglu,rope,fused_linear_cross_entropy",
                        help="comma-separated kernels")
    parser.add_argument("--reps", type=int, default=10, help="timed repetitions (median; CE uses half)")
    parser.add_argument("--no-compile", action="store_true", help="skip the torch.compile variants")
    parser.add_argument("--budget-s", type=float, default=90.0,
                        help="no new torch.compile variant is started after this many seconds")
    args = parser.parse_args()
    if not torch.cuda.is_available():
        raise SystemExit("bench_kernels needs a CUDA GPU")
    if not kernels.available():
        raise SystemExit(f"triton is not usable here: {kernels.triton_import_error()!r}")

    began = time.perf_counter()
    skipped_compile = []

    def compile_ok(name):
        def ok():
            if args.no_compile:
                return False
            if time.perf_counter() - began > args.budget_s:
                skipped_compile.append(name)
                return False
            return True
        return ok

    import triton
    print(f"{torch.cuda.get_device_name()}  torch {torch.__version__}  triton {triton.__version__}  "
          f"tokens {TOKENS}  hidden {HIDDEN}  inter {INTER}  vocab {VOCAB}  heads {Q_HEADS}/{KV_HEADS}x{HEAD_DIM}")
    print(HEADER)
    rows: list[dict] = []
    wanted = [k.strip() for k in args.only.split(",") if k.strip()]
    cases = {"rms_norm": rms_norm_case, "swiglu": swiglu_case, "rope": rope_case}
    for name in wanted:
        if name in cases:
            bench_elementwise(name, cases[name], args.reps, compile_ok(name), rows)
        elif name == "fused_linear_cross_entropy":
            bench_cross_entropy(max(3, args.reps // 2), compile_ok(name), rows)
        else:
            raise SystemExit(f"unknown kernel {name!r}")
    elapsed = time.perf_counter() - began
    if skipped_compile:
        print(f"torch.compile skipped (past --budget-s {args.budget_s:.0f}): {', '.join(skipped_compile)}")
    print(f"total {elapsed:.0f} s")
    result = {
        "device": torch.cuda.get_device_name(), "torch": torch.__version__, "triton": triton.__version__,
        "dtype": str(DTYPE), "shapes": {"tokens": TOKENS, "batch": BATCH, "seq": SEQ, "hidden": HIDDEN,
                                        "intermediate": INTER, "vocab": VOCAB, "q_heads": Q_HEADS,
                                        "kv_heads": KV_HEADS, "head_dim": HEAD_DIM, "ce_chunk_tokens": CE_CHUNK},
        "reps": args.reps, "seconds": round(elapsed, 1), "compile_skipped": skipped_compile,
        # whether grad_weight accumulated in fp32 inside cuBLAS (torch's addmm out_dtype) or via a bf16 temporary
        "ce_addmm_out_dtype": fused_linear_ce._addmm_out_dtype_works, "results": rows,
    }
    with open(args.out, "w") as f:
        json.dump(result, f, indent=2)
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
