"""Triton kernels, installed as `megatrain_cli.kernels` (see pyproject's package-dir).

One module per kernel, each with the Triton kernel(s), a plain PyTorch reference, an autograd.Function
and a public function that works on plain tensors:

    rms_norm(x, weight, eps)                       kernels/rmsnorm.py
    swiglu(gate, up)                               kernels/swiglu.py
    apply_rope(q, k, cos, sin)                     kernels/rope.py
    fused_linear_cross_entropy(hidden, weight, labels, ...)   kernels/fused_linear_ce.py

Outside the registry: adamw_state_update (kernels/adamw_state.py), AdamW over bf16 / int8 moments, whose
reference is megatrain_cli/optim/state_adamw.py's torch path; optim/state_fused.py dispatches to it and
uses the fallback record below under the kind "adamw_state".

The public functions take the Triton path for CUDA tensors (and CPU tensors under TRITON_INTERPRET=1)
and the reference otherwise. If Triton can't be imported or a kernel fails to compile or launch, that
kind falls back to its reference for the rest of the process with exactly one warning: slower, never
silently wrong. `load(kind)` hands the engine those public functions by name.

This file imports neither triton nor the kernel modules, so the package imports fine without triton.
Tests: `python -m pytest -q tests/triton/test_kernels.py`; benchmarks on a GPU: `python scripts/bench_kernels.py`.
"""

from __future__ import annotations

import importlib
import importlib.machinery
import importlib.util
import os
import sys
import warnings
from typing import Callable

if __name__ == "kernels":
    # Imported by its folder name: the repository root is on sys.path (pytest, `python -m megatrain_cli` or
    # torchrun in a checkout), so this folder shadows PyPI's `kernels`, which transformers >= 5.25 imports.
    # Hand the name to that package (a path search without the root); our code is megatrain_cli.kernels.
    _root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    _spec = importlib.machinery.PathFinder.find_spec(
        __name__, [p for p in sys.path if os.path.abspath(p or os.curdir) != _root])
    if _spec is not None:  # none installed: this folder may stand in (transformers < 5.25 imports it to probe)
        _real = importlib.util.module_from_spec(_spec)
        sys.modules[__name__] = _real  # the import system returns what sys.modules holds once this file ran
        _spec.loader.exec_module(_real)

import torch  # noqa: E402 (after the hand-over above)

# kind -> (module, public function, reference function)
KINDS: dict[str, tuple[str, str, str]] = {
    "rms_norm": ("rmsnorm", "rms_norm", "rms_norm_reference"),
    "swiglu": ("swiglu", "swiglu", "swiglu_reference"),
    "rope": ("rope", "apply_rope", "apply_rope_reference"),
    "fused_linear_cross_entropy": ("fused_linear_ce", "fused_linear_cross_entropy",
                                   "fused_linear_cross_entropy_reference"),
}

# kind -> the error that made it fall back (key "triton" when the import itself failed). Module state on
# purpose: once a kernel failed, every later call goes straight to the reference without retrying.
_fallen_back: dict[str, BaseException] = {}


def interpreting() -> bool:
    """TRITON_INTERPRET=1: Triton runs kernels in Python on CPU tensors (tests only: very slow)."""
    return os.environ.get("TRITON_INTERPRET") == "1"


def triton_import_error() -> BaseException | None:
    """None when triton imports; imports it (once) on first call."""
    from . import _triton
    return _triton.IMPORT_ERROR


def available() -> bool:
    """Triton importable and something to run it on: a CUDA device, or the interpreter."""
    return triton_import_error() is None and (torch.cuda.is_available() or interpreting())


def wants_triton(kind: str, *tensors: torch.Tensor) -> bool:
    """Whether `kind` should take the Triton path for these tensors.

    CPU tensors without the interpreter go to the reference quietly (that is the normal CPU path). CUDA
    tensors with triton missing go there with one warning for all kinds together; a kind whose kernel
    failed before goes there without a new one (it warned when it failed).
    """
    if kind in _fallen_back:
        return False
    on_triton_device = all(t.is_cuda or (interpreting() and t.device.type == "cpu") for t in tensors)
    if not on_triton_device:
        return False
    error = triton_import_error()
    if error is not None:
        _fall_back("triton", error, "every kernel")
        _fallen_back[kind] = error
        return False
    return True


def run_with_fallback(kind: str, triton_call: Callable[[], object], reference_call: Callable[[], object]):
    """triton_call(); if it raises (compile error, out of resources, bad driver), warn once for `kind`,
    remember it, and return reference_call() instead. Out-of-memory is not a Triton failure: re-raised.

    Callers validate shapes before this, so a caller's mistake raises rather than disabling the kernel.
    """
    if kind not in _fallen_back:
        try:
            return triton_call()
        except torch.cuda.OutOfMemoryError:
            raise
        except Exception as error:  # noqa: BLE001 - any Triton failure means: use the reference
            _fall_back(kind, error, kind)
    return reference_call()


def _fall_back(key: str, error: BaseException, what: str) -> None:
    if key in _fallen_back:
        return
    _fallen_back[key] = error
    warnings.warn(f"megatrain kernels: Triton failed ({type(error).__name__}: {error}); {what} uses the "
                  f"PyTorch reference from now on (correct, slower).", RuntimeWarning, stacklevel=3)


def _module(kind: str):
    if kind not in KINDS:
        raise KeyError(f"unknown kernel {kind!r}; known: {', '.join(KINDS)}")
    return importlib.import_module(f".{KINDS[kind][0]}", __name__)


def load(kind: str) -> Callable:
    """The public function of a kernel: Triton where it applies, the reference otherwise (see above)."""
    return getattr(_module(kind), KINDS[kind][1])


def load_reference(kind: str) -> Callable:
    """The plain PyTorch version of a kernel, same signature as `load(kind)`."""
    return getattr(_module(kind), KINDS[kind][2])


def reference_vjp(reference: Callable, inputs: tuple[torch.Tensor, ...], grad_output: torch.Tensor,
                  *args) -> tuple[torch.Tensor, ...]:
    """Gradients of reference(*inputs, *args) against `inputs` by autograd: the backward fallback of the
    autograd.Functions, used only when a Triton backward kernel failed."""
    with torch.enable_grad():
        leaves = tuple(t.detach().requires_grad_() for t in inputs)
        out = reference(*leaves, *args)
        return torch.autograd.grad(out, leaves, grad_output)
