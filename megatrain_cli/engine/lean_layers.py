"""Long-context building blocks inside one decoder layer: a sequence-chunked MLP, a memory-lean RMSNorm,
and the choice of SDPA backend.

Why the MLP. At T tokens a SwiGLU MLP's autograd keeps four [T, intermediate] tensors (gate out, act
out, up out, their product). For a 7B model at 512K tokens each is 19.9 GB, so the MLP alone would
keep ~80 GB for one layer. `ChunkedMLP` keeps only its input x (already alive: it is the norm's output)
and the weights (by reference: through `WeightRedirect` they are saved as (tile, offset) markers, not storage).
Its backward walks the sequence in chunks of `chunk_tokens`, recomputes each chunk's gate/up/act with
autograd and accumulates the weight gradients chunk by chunk, so only one chunk's intermediates are
ever alive. Cost: gate and up run once more per token in backward (2 extra GEMMs on top of the 9 of
an MLP forward+backward, ~+20% MLP FLOPs), plus fp32 accumulators for the three weight gradients
(3 x intermediate x hidden x 4 bytes, 815 MB for 7B) while one layer's backward runs.

Why the norm. HF's RMSNorm upcasts its bf16 input to fp32 and autograd keeps that copy, the
normalised bf16 tensor and the output: 8 bytes per element where 2 would do. `LeanRMSNorm` keeps the
input and the fp32 1/rms per row (4 bytes per token) and redoes the elementwise math in backward.
For 7B at 512K that is 18.8 GB less per layer graph (five checkpoints' worth). Optional: the plan in
plan/lean_terms.py says what it saves.

Both install on a *template* (a meta-device HF decoder layer) by replacing one submodule's `forward`
with a function that reads the weights from the module at call time. `torch.func.functional_call`
swaps the streamed weights into those attributes for the duration of the call, so the bound device
views are what reach the autograd Functions, and their `save_for_backward` goes through whatever
saved_tensors_hooks are active (the engine's `WeightRedirect`).
"""

from __future__ import annotations

import contextlib
import types
from typing import Callable

import torch
import torch.nn.functional as F
from torch import nn
from torch.autograd.function import once_differentiable

# ---------------------------------------------------------------------------------------------- MLP


def _gated(x: torch.Tensor, gate_w, up_w, gate_b, up_b, act: Callable) -> torch.Tensor:
    """act(gate(x)) * up(x): the [n, intermediate] tensor the down projection reads."""
    return act(F.linear(x, gate_w, gate_b)) * F.linear(x, up_w, up_b)


class ChunkedMLP(torch.autograd.Function):
    """down(act(gate(x)) * up(x)) over sequence chunks; saves x and the weights, nothing [T, inter]."""

    @staticmethod
    def forward(ctx, x, gate_w, up_w, down_w, gate_b, up_b, down_b, act, chunk_tokens):
        rows = x.reshape(-1, x.shape[-1])
        out = torch.empty(rows.shape[0], down_w.shape[0], dtype=x.dtype, device=x.device)
        for lo in range(0, rows.shape[0], chunk_tokens):
            hi = min(lo + chunk_tokens, rows.shape[0])
            out[lo:hi] = F.linear(_gated(rows[lo:hi], gate_w, up_w, gate_b, up_b, act), down_w, down_b)
        ctx.save_for_backward(x, gate_w, up_w, down_w, gate_b, up_b, down_b)
        ctx.act, ctx.chunk_tokens = act, chunk_tokens
        return out.view(*x.shape[:-1], down_w.shape[0])

    @staticmethod
    @once_differentiable
    def backward(ctx, grad_out):
        x, gate_w, up_w, down_w, gate_b, up_b, down_b = ctx.saved_tensors
        need = ctx.needs_input_grad[:7]  # x, gate_w, up_w, down_w, gate_b, up_b, down_b
        rows = x.reshape(-1, x.shape[-1])
        g_rows = grad_out.reshape(-1, grad_out.shape[-1]).to(x.dtype)
        d_rows = torch.empty_like(rows) if need[0] else None
        # Weight gradients are sums over every token: accumulate the per-chunk partial sums in fp32 so a
        # bf16 run rounds once at the end, as one unchunked GEMM would, not once per chunk.
        acc_dtype = torch.promote_types(gate_w.dtype, torch.float32)
        params = (gate_w, up_w, down_w, gate_b, up_b, down_b)
        acc = [torch.zeros(p.shape, dtype=acc_dtype, device=p.device) if (p is not None and n) else None
               for p, n in zip(params, need[1:])]
        # The recompute graph differentiates only what is asked for (a frozen weight costs no GEMM).
        leaves = [p.detach().requires_grad_(n) if p is not None else None for p, n in zip(params, need[1:])]
        lg_w, lu_w, _, lg_b, lu_b, _ = leaves
        # Inputs slot 0 (x) and 1, 2, 4, 5 (gate/up weight and bias) are in the recomputed graph.
        wanted = [i for i in (0, 1, 2, 4, 5) if need[i]]
        for lo in range(0, rows.shape[0], ctx.chunk_tokens):
            hi = min(lo + ctx.chunk_tokens, rows.shape[0])
            x_t = rows[lo:hi].detach().requires_grad_(need[0])
            g_t = g_rows[lo:hi]
            with torch.enable_grad():
                h_t = _gated(x_t, lg_w, lu_w, lg_b, lu_b, ctx.act)
            # The down projection by hand: its forward output is not needed again, only dh and dW_down.
            if acc[2] is not None:
                acc[2].add_(g_t.t() @ h_t.detach())
            if not wanted:
                continue
            dh_t = g_t @ down_w
            inputs = [x_t if i == 0 else leaves[i - 1] for i in wanted]
            grads = torch.autograd.grad(h_t, inputs, dh_t)
            del h_t, dh_t
            for i, g in zip(wanted, grads):
                if i == 0:
                    d_rows[lo:hi] = g
                else:
                    acc[i - 1].add_(g)
        if acc[5] is not None:
            acc[5].add_(g_rows.sum(0, dtype=acc_dtype))
        grads_w = [a.to(p.dtype) if a is not None else None for a, p in zip(acc, params)]
        d_x = d_rows.view_as(x) if d_rows is not None else None
        return (d_x, *grads_w, None, None)


def chunked_mlp(x: torch.Tensor, gate_w, up_w, down_w, act: Callable, chunk_tokens: int,
              gate_b=None, up_b=None, down_b=None) -> torch.Tensor:
    """Functional entry: an HF SwiGLU MLP over `x` [..., hidden], chunked over its tokens."""
    if chunk_tokens < 1:
        raise ValueError(f"chunk_tokens must be >= 1, got {chunk_tokens}")
    return ChunkedMLP.apply(x, gate_w, up_w, down_w, gate_b, up_b, down_b, act, chunk_tokens)


def _chunked_mlp_forward(self: nn.Module, x: torch.Tensor) -> torch.Tensor:
    # Read the weights now, not at install time: functional_call has bound the streamed views.
    if x.numel() // x.shape[-1] <= self.megatrain_chunk_tokens:
        # One chunk would be the whole sequence: the plain forward is the same memory, minus the recompute.
        return type(self).forward(self, x)
    return chunked_mlp(x, self.gate_proj.weight, self.up_proj.weight, self.down_proj.weight, self.act_fn,
                     self.megatrain_chunk_tokens, self.gate_proj.bias, self.up_proj.bias, self.down_proj.bias)


def chunk_mlp(layer: nn.Module, chunk_tokens: int) -> nn.Module:
    """Make `layer.mlp` (an HF gate/up/down MLP) run chunked over `chunk_tokens`; returns the layer.

    Idempotent (a second call only changes the chunk size). Works on meta-device templates: nothing
    is allocated, the weights are read at call time.
    """
    mlp = layer.mlp
    for part in ("gate_proj", "up_proj", "down_proj", "act_fn"):
        if not hasattr(mlp, part):
            raise TypeError(f"{type(mlp).__name__} has no {part}: not a gated (SwiGLU) MLP, cannot chunk it")
    if chunk_tokens < 1:
        raise ValueError(f"chunk_tokens must be >= 1, got {chunk_tokens}")
    mlp.megatrain_chunk_tokens = int(chunk_tokens)
    mlp.forward = types.MethodType(_chunked_mlp_forward, mlp)
    return layer


def mlp_chunk_tokens(layer: nn.Module) -> int | None:
    """The chunk size installed on `layer.mlp`, or None when it runs unchunked."""
    return getattr(layer.mlp, "megatrain_chunk_tokens", None)


# ---------------------------------------------------------------------------------------------- RMSNorm

def plain_function(func):
    """The function itself where HF wrapped it in a hub-kernel module (transformers >= 5.25 with the `kernels`
    package installed: an nn.Module whose forward calls the closed-over `func`); anything else as it is."""
    forward = getattr(type(func), "forward", None) if isinstance(func, nn.Module) else None
    cells = dict(zip(forward.__code__.co_freevars, forward.__closure__ or ())) if forward is not None else {}
    return cells["func"].cell_contents if "func" in cells else func


def same_code(func, reference) -> bool:
    """Whether two functions compile to the same code (HF's "Copied from" families share a function's
    body under their own names): what lets a replacement written for one stand in for the other."""
    a, b = getattr(plain_function(func), "__code__", None), getattr(plain_function(reference), "__code__", None)
    return a is not None and b is not None and (a.co_code, a.co_names) == (b.co_code, b.co_names)


def is_plain_rmsnorm(module: nn.Module) -> bool:
    """An RMSNorm computing exactly Llama's weight * normalise(x) (not Gemma's 1 + weight, not OLMo 2's
    multiply-then-cast): the norms the lean norm and the Triton kernel may replace."""
    from transformers.models.llama.modeling_llama import LlamaRMSNorm

    return hasattr(module, "variance_epsilon") and same_code(type(module).forward, LlamaRMSNorm.forward)


# fp32 temporaries of the lean norm are made this many rows at a time: 16384 x 3584 x 4 B = 235 MB.
NORM_ROWS_PER_CHUNK = 16384


class LeanRMSNorm(torch.autograd.Function):
    """weight * (x_fp32 * rsqrt(mean(x_fp32^2) + eps)).to(x.dtype), HF's exact forward; saves x + 1/rms.

    Forward and backward walk the rows in chunks, so their fp32 temporaries are one chunk, not [T, H]
    (HF's norm upcasts the whole input: 4 bytes/element at once, 7.5 GB per tensor at 512K for 7B).
    """

    @staticmethod
    def forward(ctx, x, weight, eps):
        rows = x.reshape(-1, x.shape[-1])
        out = torch.empty_like(rows, dtype=torch.promote_types(weight.dtype, x.dtype))
        rstd = torch.empty(rows.shape[0], 1, dtype=torch.float32, device=x.device)
        for lo in range(0, rows.shape[0], NORM_ROWS_PER_CHUNK):
            x32 = rows[lo:lo + NORM_ROWS_PER_CHUNK].float()
            r = torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + eps)
            rstd[lo:lo + NORM_ROWS_PER_CHUNK] = r
            out[lo:lo + NORM_ROWS_PER_CHUNK] = weight * (x32 * r).to(x.dtype)
        ctx.save_for_backward(x, weight, rstd)
        return out.view(*x.shape[:-1], out.shape[-1])

    @staticmethod
    @once_differentiable
    def backward(ctx, grad_out):
        x, weight, rstd = ctx.saved_tensors
        rows, g_rows = x.reshape(-1, x.shape[-1]), grad_out.reshape(-1, x.shape[-1])
        want_x, want_w = ctx.needs_input_grad[:2]
        d_x = torch.empty_like(rows) if want_x else None
        d_w = torch.zeros(weight.shape, dtype=torch.float32, device=weight.device) if want_w else None
        for lo in range(0, rows.shape[0], NORM_ROWS_PER_CHUNK):
            hi = lo + NORM_ROWS_PER_CHUNK
            r = rstd[lo:hi]
            normed = rows[lo:hi].float() * r
            g = g_rows[lo:hi]
            if want_w:  # the forward multiplied weight by the normalised rows *after* the cast
                d_w.add_((g.float() * normed.to(x.dtype).float()).sum(0))
            if want_x:
                # d/dx of x * r(x), r = (mean x^2 + eps)^-1/2:  r * (gw - x_hat * mean(gw * x_hat))
                gw = (g * weight).float()
                d_x[lo:hi] = r * (gw - normed * (gw * normed).mean(-1, keepdim=True))
        return (d_x.view_as(x) if want_x else None, d_w.to(weight.dtype) if want_w else None, None)


def _lean_norm_forward(self: nn.Module, x: torch.Tensor) -> torch.Tensor:
    return LeanRMSNorm.apply(x, self.weight, self.variance_epsilon)


def slim_norms(layer: nn.Module) -> int:
    """Make every plain RMSNorm inside `layer` (a decoder layer or the final-norm template) keep its
    input and 4 bytes per row instead of an fp32 copy + a normalised copy; returns how many."""
    count = 0
    for module in layer.modules():
        if is_plain_rmsnorm(module):
            module.forward = types.MethodType(_lean_norm_forward, module)
            count += 1
    return count


# ---------------------------------------------------------------------------------------------- SDPA

_BACKEND_NAMES = {"flash": "FLASH_ATTENTION", "cudnn": "CUDNN_ATTENTION", "efficient": "EFFICIENT_ATTENTION",
                  "math": "MATH"}
SDPA_BACKENDS = ("auto", *_BACKEND_NAMES)  # what sdpa_backend_context (and the recipe's engine.sdpa) accepts


def best_sdpa_backends(device: torch.device | None = None) -> list:
    """SDPA backends to try, fastest first, for causal attention without a mask on this CUDA device.

    Hopper and newer: cuDNN first (faster than PyTorch's FlashAttention-2 there), then flash. Older
    GPUs: flash first. Memory-efficient attention last. Never MATH: it materialises [T, T] scores,
    which at long context is an out-of-memory error in disguise (512K^2 bf16 is 512 GiB per head);
    with MATH absent an unsupported input fails loudly ("No available kernel") instead.
    Returns [] off CUDA (leave torch's choice alone).
    """
    try:
        from torch.nn.attention import SDPBackend
    except ImportError:
        return []
    if not torch.cuda.is_available() or (device is not None and torch.device(device).type != "cuda"):
        return []
    major, _ = torch.cuda.get_device_capability(device)
    if major >= 9:
        return [SDPBackend.CUDNN_ATTENTION, SDPBackend.FLASH_ATTENTION, SDPBackend.EFFICIENT_ATTENTION]
    return [SDPBackend.FLASH_ATTENTION, SDPBackend.EFFICIENT_ATTENTION]


def sdpa_backend_context(kind: str = "auto", device: torch.device | None = None):
    """A context manager restricting SDPA to `kind`: 'auto' (best_sdpa_backends, in that order),
    'flash', 'cudnn', 'efficient' or 'math'. A no-op where torch.nn.attention.sdpa_kernel is missing,
    and for 'auto' off CUDA. The setting is process-wide while the context is open (torch keeps it
    in global flags), so open it around the whole step, on the compute thread.
    """
    try:
        from torch.nn.attention import SDPBackend, sdpa_kernel
    except ImportError:
        return contextlib.nullcontext()
    if kind == "auto":
        backends = best_sdpa_backends(device)
        if not backends:
            return contextlib.nullcontext()
        try:
            return sdpa_kernel(backends, set_priority=True)
        except TypeError:  # torch < 2.6: no priority order, the set alone
            return sdpa_kernel(backends)
    if kind not in _BACKEND_NAMES:
        raise ValueError(f"unknown SDPA backend {kind!r}; one of auto, {', '.join(_BACKEND_NAMES)}")
    return sdpa_kernel([getattr(SDPBackend, _BACKEND_NAMES[kind])])
