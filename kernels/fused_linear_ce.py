"""Fused LM head + cross-entropy: loss and both gradients, chunked over tokens.

Test: python -m pytest -q tests/triton/test_kernels.py -k cross_entropy     (CPU: runs under TRITON_INTERPRET=1)
Bench: python scripts/bench_kernels.py --only fused_linear_cross_entropy   (GPU)

The logits of a 7B model's head are [tokens, 152064]: 20 GB in fp32 for 32k tokens, the largest tensor of
the whole step if made at once. Here they exist one chunk of `chunk_tokens` rows at a time, so the peak is
one [chunk, V] buffer (1.2 GB in bf16 at 4096 tokens) plus the [V, H] fp32 weight gradient, whatever N is.

Per chunk (the three matmuls stay cuBLAS):
    logits = h @ W.T                      into one buffer reused by every chunk, in the input dtype
    Triton, one program per row:          online max/sum-exp in fp32 -> lse; loss_row = lse - logit[label];
                                          then the logits are overwritten IN PLACE by the gradient
                                          scale * (softmax - onehot) (zeros for ignored rows)
    grad_h[chunk]  = dlogits @ W          written straight into the output
    grad_W        += dlogits.T @ h        accumulated in fp32 (cuBLAS's out_dtype on CUDA: no rounding of
                                          the [V, H] partial to bf16 and no temporary for it)
The eager version (the reference below) holds the chunk's logits ~4 times over (the bf16 logits, their fp32
copy, log-softmax, its gradient) and a [V, H] gradient in the input dtype on top of the fp32 sum.

Labels are checked (and all-ignored chunks found, to skip their matmuls) with ONE host sync per call.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from . import run_with_fallback, wants_triton
from ._triton import next_power_of_2, tl, triton

KIND = "fused_linear_cross_entropy"
MAX_BLOCK_V = 4096  # vocab columns per step of the row loop: 16 fp32 per thread at 8 warps


def _check_inputs(hidden, weight, labels, chunk_tokens) -> None:
    if hidden.dim() != 2 or weight.dim() != 2 or hidden.shape[1] != weight.shape[1]:
        raise ValueError(f"fused_linear_cross_entropy: hidden {tuple(hidden.shape)} must be [N, H] and weight "
                         f"{tuple(weight.shape)} [V, H]")
    if hidden.dtype != weight.dtype:
        raise ValueError(f"fused_linear_cross_entropy: hidden {hidden.dtype} and weight {weight.dtype} differ")
    if labels.shape != (hidden.shape[0],) or labels.dtype != torch.int64:
        raise ValueError(f"fused_linear_cross_entropy: labels must be int64 [{hidden.shape[0]}], got "
                         f"{labels.dtype} {tuple(labels.shape)}")
    if not (hidden.device == weight.device == labels.device):
        raise ValueError(f"fused_linear_cross_entropy: hidden, weight and labels must share a device, got "
                         f"{hidden.device}, {weight.device}, {labels.device}")
    if chunk_tokens < 1:
        raise ValueError(f"fused_linear_cross_entropy: chunk_tokens must be >= 1, got {chunk_tokens}")


def _chunks(n: int, chunk_tokens: int) -> list[tuple[int, int]]:
    return [(start, min(start + chunk_tokens, n)) for start in range(0, n, chunk_tokens)]


def _plan_chunks(labels: torch.Tensor, vocab: int, ignore_index: int, chunk_tokens: int) -> list[int]:
    """Counted (non-ignored) tokens per chunk; raises on a label outside [0, vocab). One host sync."""
    counted = labels != ignore_index
    out_of_range = counted & ((labels < 0) | (labels >= vocab))
    per_chunk = [counted[a:b].sum() for a, b in _chunks(labels.shape[0], chunk_tokens)]
    stats = torch.stack([out_of_range.sum(), *per_chunk]).tolist() if per_chunk else [0]
    if stats[0]:
        raise ValueError(f"fused_linear_cross_entropy: {stats[0]} labels outside [0, {vocab}) that are not "
                         f"ignore_index={ignore_index}")
    return stats[1:]


def _check_grad_weight(weight, grad_weight) -> None:
    if grad_weight is not None and (grad_weight.shape != weight.shape or grad_weight.dtype != torch.float32
                                    or grad_weight.device != weight.device):
        raise ValueError(f"fused_linear_cross_entropy: grad_weight must be fp32 {tuple(weight.shape)} on "
                         f"{weight.device}, got {grad_weight.dtype} {tuple(grad_weight.shape)} on "
                         f"{grad_weight.device}")


def _outputs(hidden, weight, grad_weight=None):
    N, H = hidden.shape
    loss = torch.zeros((), dtype=torch.float32, device=hidden.device)
    grad_hidden = torch.zeros(N, H, dtype=hidden.dtype, device=hidden.device)
    if grad_weight is None:
        grad_weight = torch.zeros(weight.shape, dtype=torch.float32, device=weight.device)
    return loss, grad_hidden, grad_weight


# --- reference ---------------------------------------------------------------------------------------------

def _reference_chunked(hidden, weight, labels, counted_per_chunk, ignore_index, chunk_tokens, scale,
                       outputs=None, first_chunk: int = 0):
    """The chunk loop in plain PyTorch. `outputs` (loss, grad_hidden, grad_weight) are added to in place when
    given; chunks before `first_chunk` are skipped (the Triton path finished them before it failed)."""
    loss, grad_hidden, grad_weight = outputs if outputs is not None else _outputs(hidden, weight)
    w = weight.detach().requires_grad_()
    for index, ((start, end), counted) in enumerate(zip(_chunks(hidden.shape[0], chunk_tokens), counted_per_chunk)):
        if index < first_chunk or not counted:
            continue
        h = hidden[start:end].detach().requires_grad_()
        with torch.enable_grad():
            logits = h @ w.t()
            chunk_loss = scale * F.cross_entropy(logits.float(), labels[start:end], ignore_index=ignore_index,
                                                 reduction="sum")
        grad_h, grad_w = torch.autograd.grad(chunk_loss, (h, w))
        loss += chunk_loss.detach()
        grad_hidden[start:end] = grad_h
        grad_weight += grad_w
    return loss, grad_hidden, grad_weight


def fused_linear_cross_entropy_reference(hidden, weight, labels, *, ignore_index: int = -100,
                                         chunk_tokens: int = 4096, scale: float = 1.0, grad_weight=None):
    """Plain PyTorch, same contract as `fused_linear_cross_entropy`: per chunk a matmul,
    F.cross_entropy(reduction='sum') on fp32 logits, and autograd for the two gradients."""
    _check_inputs(hidden, weight, labels, chunk_tokens)
    _check_grad_weight(weight, grad_weight)
    counted = _plan_chunks(labels, weight.shape[0], ignore_index, chunk_tokens)
    return _reference_chunked(hidden, weight, labels, counted, ignore_index, chunk_tokens, scale,
                              _outputs(hidden, weight, grad_weight))


# --- Triton ------------------------------------------------------------------------------------------------

@triton.jit
def _softmax_minus_onehot_kernel(logits_ptr, row_stride, labels_ptr, row_loss_ptr, ignore_index, scale,
                                 V: tl.constexpr, BLOCK_V: tl.constexpr):
    # V is a compile-time constant: one variant per vocab size (one per model), and the row loops get
    # static bounds (Triton 3.6's interpreter can't loop to a runtime bound under NumPy >= 2.4).
    row = tl.program_id(0).to(tl.int64)
    row_ptr = logits_ptr + row * row_stride
    label = tl.load(labels_ptr + row)
    cols = tl.arange(0, BLOCK_V)
    if label == ignore_index:
        for start in range(0, V, BLOCK_V):
            tl.store(row_ptr + start + cols, tl.zeros([BLOCK_V], dtype=logits_ptr.dtype.element_ty),
                     mask=start + cols < V)
        tl.store(row_loss_ptr + row, 0.0)
    else:
        # Pass 1: online logsumexp in fp32. The first block (never empty) seeds the running max, so no -inf
        # arithmetic; masked lanes load -inf and add exp(-inf) = 0.
        x = tl.load(row_ptr + cols, mask=cols < V, other=float("-inf")).to(tl.float32)
        running_max = tl.max(x, axis=0)
        running_sum = tl.sum(tl.exp(x - running_max), axis=0)
        for start in range(BLOCK_V, V, BLOCK_V):
            x = tl.load(row_ptr + start + cols, mask=start + cols < V, other=float("-inf")).to(tl.float32)
            new_max = tl.maximum(running_max, tl.max(x, axis=0))
            running_sum = running_sum * tl.exp(running_max - new_max) + tl.sum(tl.exp(x - new_max), axis=0)
            running_max = new_max
        lse = running_max + tl.log(running_sum)
        target = tl.load(row_ptr + label).to(tl.float32)  # read before pass 2 overwrites it
        tl.store(row_loss_ptr + row, lse - target)
        # Pass 2: the logits become d(scale * loss)/d(logits) in place.
        for start in range(0, V, BLOCK_V):
            in_row = start + cols < V
            x = tl.load(row_ptr + start + cols, mask=in_row, other=0.0).to(tl.float32)
            grad = tl.exp(x - lse) * scale
            grad = tl.where(start + cols == label, grad - scale, grad)
            tl.store(row_ptr + start + cols, grad.to(logits_ptr.dtype.element_ty), mask=in_row)


def _softmax_minus_onehot_(logits, labels, row_loss, ignore_index: int, scale: float) -> None:
    """logits [n, V] (contiguous rows) -> scale * (softmax - onehot) in place; row_loss[n] <- unscaled CE."""
    n, V = logits.shape
    block = min(next_power_of_2(V), MAX_BLOCK_V)
    _softmax_minus_onehot_kernel[(n,)](logits, logits.stride(0), labels, row_loss, ignore_index, scale,
                                       V=V, BLOCK_V=block, num_warps=8 if block >= 2048 else 4)


_addmm_out_dtype_works: bool | None = None  # cuBLAS bf16 x bf16 -> fp32 accumulate (torch >= 2.8 on CUDA)


def _accumulate_fp32_(acc: torch.Tensor, a: torch.Tensor, b: torch.Tensor) -> None:
    """acc (fp32) += a @ b, keeping the product in fp32 where the library can."""
    global _addmm_out_dtype_works
    if a.dtype == torch.float32:
        acc.addmm_(a, b)
        return
    if acc.is_cuda and _addmm_out_dtype_works is not False:
        try:
            torch.addmm(acc, a, b, out_dtype=torch.float32, out=acc)
            _addmm_out_dtype_works = True
            return
        except (TypeError, RuntimeError, NotImplementedError):
            _addmm_out_dtype_works = False  # older torch: round the chunk's product, cost a [V, H] temporary
    acc.add_(a @ b)


def _fused_triton(hidden, weight, labels, counted_per_chunk, ignore_index, chunk_tokens, scale, outputs,
                  progress: list[int]):
    """The chunk loop with the Triton softmax kernel, adding into `outputs`. progress[0] counts the chunks
    whose every contribution is in `outputs`: if a kernel fails mid-loop, the reference resumes from there
    (a caller's grad_weight accumulator already holds the finished chunks: redoing them would count twice)."""
    loss, grad_hidden, grad_weight = outputs
    N, V = hidden.shape[0], weight.shape[0]
    if not any(counted_per_chunk):
        return outputs
    rows = min(chunk_tokens, N)
    logits_buffer = torch.empty(rows, V, dtype=hidden.dtype, device=hidden.device)
    row_loss_buffer = torch.empty(rows, dtype=torch.float32, device=hidden.device)
    labels = labels.contiguous()
    for index, ((start, end), counted) in enumerate(zip(_chunks(N, chunk_tokens), counted_per_chunk)):
        if counted:  # else grad_hidden rows stay zero, nothing to add to grad_weight
            h, logits, row_loss = hidden[start:end], logits_buffer[: end - start], row_loss_buffer[: end - start]
            torch.mm(h, weight.t(), out=logits)
            _softmax_minus_onehot_(logits, labels[start:end], row_loss, ignore_index, scale)
            torch.mm(logits, weight, out=grad_hidden[start:end])
            _accumulate_fp32_(grad_weight, logits.t(), h)
            loss.add_(row_loss.sum(), alpha=scale)
        progress[0] = index + 1
    return outputs


def fused_linear_cross_entropy(hidden: torch.Tensor, weight: torch.Tensor, labels: torch.Tensor, *,
                               ignore_index: int = -100, chunk_tokens: int = 4096, scale: float = 1.0,
                               grad_weight: torch.Tensor | None = None
                               ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """loss = scale * sum of CE(hidden @ weight.T, labels) over tokens whose label != ignore_index, and its
    gradients, for hidden [N, H], weight [V, H] (same dtype), labels int64 [N]. No autograd graph is made.

    Returns (loss: 0-dim fp32, grad_hidden: [N, H] in hidden's dtype, grad_weight: [V, H] fp32).
    `grad_weight`, when given (fp32 [V, H]), is the accumulator: the weight gradient is ADDED to it in place
    and it is what comes back, so several calls (micro-batches) share one [V, H] fp32 buffer, not one each.
    Triton where it applies (see kernels/), else the reference; same results within rounding.
    """
    _check_inputs(hidden, weight, labels, chunk_tokens)
    _check_grad_weight(weight, grad_weight)
    counted = _plan_chunks(labels, weight.shape[0], ignore_index, chunk_tokens)
    args = (hidden.detach(), weight.detach(), labels, counted, ignore_index, chunk_tokens, float(scale))
    outputs = _outputs(hidden, weight, grad_weight)
    if wants_triton(KIND, hidden, weight, labels):
        progress = [0]
        with torch.no_grad():
            return run_with_fallback(KIND, lambda: _fused_triton(*args, outputs, progress),
                                     lambda: _reference_chunked(*args, outputs, progress[0]))
    return _reference_chunked(*args, outputs)

