"""Put the Triton kernels (megatrain_cli.kernels) into the engine's HF layer templates (issue #8).

`install_kernels(template, kinds)` swaps rms_norm, swiglu and rope into one template by replacing a
submodule's `forward` (that template only) with one that reads the weights at call time, so the saved-tensor
redirect still applies; rope goes through a process-wide dispatcher that only patched templates reach. What
is swapped when, and the precedence over lean_layers.py: docs/architecture.md, "Kernels".
"""

from __future__ import annotations

import contextvars
import functools
import inspect
import sys
import types
import warnings
from typing import Callable, Iterable

import torch
from torch import nn

from megatrain_cli.engine import lean_layers

LAYER_KINDS = ("rms_norm", "swiglu", "rope")  # what install_kernels can put into a template
KERNEL_CHOICES = ("auto", "torch", "triton")  # the recipe's engine.kernels

_SILU_ACTS = ("silu", "swish")
_ROPE_NAME = "apply_rotary_pos_emb"


def resolve(choice: str, device: torch.device) -> str:
    """'auto'/'torch'/'triton' -> 'torch' or 'triton' for this device.

    'auto' is Triton on CUDA and PyTorch elsewhere. An explicit 'triton' off CUDA runs the kernels only
    under Triton's interpreter (TRITON_INTERPRET=1, tests); otherwise it warns and takes the PyTorch path.
    """
    if choice not in KERNEL_CHOICES:
        raise ValueError(f"unknown kernels choice {choice!r}; one of {', '.join(KERNEL_CHOICES)}")
    on_cuda = torch.device(device).type == "cuda"
    if choice == "auto":
        return "triton" if on_cuda else "torch"
    if choice == "triton" and not on_cuda:
        from megatrain_cli import kernels

        if not kernels.interpreting():
            warnings.warn(f"kernels='triton' needs a CUDA device (or TRITON_INTERPRET=1); on {device} the "
                          f"engine uses the PyTorch path", RuntimeWarning, stacklevel=3)
            return "torch"
    return choice


def _kernel(kind: str) -> Callable:
    from megatrain_cli import kernels

    return kernels.load(kind)


def fused_cross_entropy() -> Callable:
    """kernels.fused_linear_cross_entropy (Triton where it applies, the reference otherwise)."""
    return _kernel("fused_linear_cross_entropy")


# ---------------------------------------------------------------------------------------------- RMSNorm

def _is_plain_rmsnorm(module: nn.Module) -> bool:
    return lean_layers.is_plain_rmsnorm(module)


def _is_lean(module: nn.Module) -> bool:
    forward = module.__dict__.get("forward")
    return getattr(forward, "__func__", None) is lean_layers._lean_norm_forward


def _kernel_norm_forward(self: nn.Module, x: torch.Tensor) -> torch.Tensor:
    if self.megatrain_lean:
        from megatrain_cli import kernels

        if not kernels.wants_triton("rms_norm", x, self.weight):  # the kernel's public function would run
            return lean_layers.LeanRMSNorm.apply(x, self.weight, self.variance_epsilon)  # HF's graph: stay lean
    return self.megatrain_rms_norm(x, self.weight, self.variance_epsilon)


# ---------------------------------------------------------------------------------------------- SwiGLU

def _is_silu_mlp(mlp: nn.Module) -> bool:
    if not all(hasattr(mlp, part) for part in ("gate_proj", "up_proj", "down_proj", "act_fn")):
        return False
    act = getattr(getattr(mlp, "config", None), "hidden_act", None)
    is_silu_module = isinstance(mlp.act_fn, nn.SiLU) or type(mlp.act_fn).__name__ == "SiLUActivation"
    return act in _SILU_ACTS and is_silu_module


def _swiglu_mlp_forward(self: nn.Module, x: torch.Tensor) -> torch.Tensor:
    return self.down_proj(self.megatrain_swiglu(self.gate_proj(x), self.up_proj(x)))


# ---------------------------------------------------------------------------------------------- RoPE

# The apply_rope the current (patched) attention forward wants, or None: HF's own function runs.
_ACTIVE_ROPE: contextvars.ContextVar[Callable | None] = contextvars.ContextVar("megatrain_rope", default=None)


def _rope_dispatcher(original: Callable) -> Callable:
    @functools.wraps(original)
    def apply_rotary_pos_emb(q, k, cos, sin, *args, **kwargs):
        rope = _ACTIVE_ROPE.get()
        # Only HF's plain call (4-D q/k, cos/sin per position) goes to the kernel; anything else is HF's.
        if rope is None or args or kwargs or q.dim() != 4 or k.dim() != 4 or cos.dim() != 3:
            return original(q, k, cos, sin, *args, **kwargs)
        return rope(q, k, cos, sin)

    apply_rotary_pos_emb.megatrain_original = original
    return apply_rotary_pos_emb


def _rope_module(attn: nn.Module):
    """The modeling module whose global apply_rotary_pos_emb HF's attention forward calls, or None."""
    forward = inspect.unwrap(type(attn).forward)  # past deprecate_kwarg & co
    if _ROPE_NAME not in getattr(getattr(forward, "__code__", None), "co_names", ()):
        return None
    module = sys.modules.get(forward.__module__)
    if module is None or forward.__globals__ is not vars(module) or not callable(getattr(module, _ROPE_NAME, None)):
        return None
    from transformers.models.llama import modeling_llama

    # The kernel is Llama's full-width rotate-half RoPE: a family whose function differs (Phi-3's partial
    # rotary, OLMo 2's casts, an interleaved layout) keeps its own.
    def unwrapped(f):  # past our own dispatcher, if one is installed there already
        return getattr(f, "megatrain_original", f)

    if not lean_layers.same_code(unwrapped(getattr(module, _ROPE_NAME)), unwrapped(modeling_llama.apply_rotary_pos_emb)):
        return None
    return module


def _install_rope_dispatcher(module) -> None:
    current = getattr(module, _ROPE_NAME)
    if not hasattr(current, "megatrain_original"):  # once per modeling module
        setattr(module, _ROPE_NAME, _rope_dispatcher(current))


def _rope_attention_forward(self: nn.Module, *args, **kwargs):
    token = _ACTIVE_ROPE.set(self.megatrain_rope)
    try:
        return type(self).forward(self, *args, **kwargs)
    finally:
        _ACTIVE_ROPE.reset(token)


# ---------------------------------------------------------------------------------------------- install

def _replace_forward(module: nn.Module, forward: Callable) -> None:
    if "megatrain_kernel_previous" not in module.__dict__:  # keep what was there first (lean, or nothing)
        module.megatrain_kernel_previous = module.__dict__.get("forward")
    module.forward = types.MethodType(forward, module)


def install_kernels(template: nn.Module, kinds: Iterable[str] = LAYER_KINDS) -> dict[str, int]:
    """Route `template`'s (a decoder layer's, or the final-norm template's) RMSNorms, SwiGLU and RoPE
    through the kernels named in `kinds`; returns how many modules each kind went into (0 where it does
    not apply: no MLP in a norm template, a non-SiLU activation, a chunked MLP, a forward without RoPE).
    Idempotent. Nothing is allocated: the templates are on the meta device and the weights read at call time.
    """
    kinds = set(kinds)
    unknown = kinds - set(LAYER_KINDS)
    if unknown:
        raise ValueError(f"unknown layer kernels {sorted(unknown)}; known: {', '.join(LAYER_KINDS)}")
    counts = {kind: 0 for kind in LAYER_KINDS}
    if "rms_norm" in kinds:
        rms_norm = _kernel("rms_norm")
        for module in template.modules():
            if _is_plain_rmsnorm(module):
                if _is_lean(module):  # slim_norms ran (before us, or after an earlier install): stay lean
                    module.megatrain_lean = True
                    module.megatrain_kernel_previous = module.__dict__["forward"]
                elif "megatrain_lean" not in module.__dict__:
                    module.megatrain_lean = False
                module.megatrain_rms_norm = rms_norm
                _replace_forward(module, _kernel_norm_forward)
                counts["rms_norm"] += 1
    mlp = getattr(template, "mlp", None)
    if "swiglu" in kinds and mlp is not None and _is_silu_mlp(mlp) and lean_layers.mlp_chunk_tokens(template) is None:
        mlp.megatrain_swiglu = _kernel("swiglu")
        _replace_forward(mlp, _swiglu_mlp_forward)
        counts["swiglu"] += 1
    attn = getattr(template, "self_attn", None)
    if "rope" in kinds and attn is not None:
        module = _rope_module(attn)
        if module is not None:
            _install_rope_dispatcher(module)
            attn.megatrain_rope = _kernel("rope")
            _replace_forward(attn, _rope_attention_forward)
            counts["rope"] += 1
    return counts


def uninstall_kernels(template: nn.Module) -> None:
    """Undo install_kernels on `template` (whatever forward each module had before comes back)."""
    for module in template.modules():
        if "megatrain_kernel_previous" not in module.__dict__:
            continue
        previous = module.__dict__.pop("megatrain_kernel_previous")
        if previous is None:
            module.__dict__.pop("forward", None)
        else:
            module.forward = previous
        for name in ("megatrain_lean", "megatrain_rms_norm", "megatrain_swiglu", "megatrain_rope"):
            module.__dict__.pop(name, None)


def installed_kernels(template: nn.Module) -> dict[str, int]:
    """What install_kernels put into `template` and is still there (tests, logging)."""
    counts = {kind: 0 for kind in LAYER_KINDS}
    for module in template.modules():
        func = getattr(module.__dict__.get("forward"), "__func__", None)
        if func is _kernel_norm_forward:
            counts["rms_norm"] += 1
        elif func is _swiglu_mlp_forward:
            counts["swiglu"] += 1
        elif func is _rope_attention_forward:
            counts["rope"] += 1
    return counts
