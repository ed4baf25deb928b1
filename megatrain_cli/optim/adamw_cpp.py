"""A C++ (OpenMP) host AdamW kernel, adamw_cpp.cpp, compiled at first use (torch.utils.cpp_extension.load).

Entry points over contiguous flat sections of a tile, each ONE pass over the state:

  adamw_update   torch's fused CPU AdamW (ADAMW mode, as torch._fused_adamw_) reading the gradient
                 in its own dtype: a bf16 gradient is widened in registers instead of through an
                 fp32 scratch buffer (saves ~8 of ~34 bytes/param of host memory traffic). Same
                 math and the same fp32 operations in the same order as torch's kernel (scalars
                 computed in double, then rounded to fp32 as torch does; the m update is a lerp
                 with an FMA), so results are bit-identical to torch._fused_adamw_ for fp32
                 gradients and to "widen, then torch._fused_adamw_" for bf16 ones (tests check it).
                 Unlike torch's kernel it never writes the gradient back (torch stores grad/scale
                 into the gradient when a grad_scale is given).
  adamw_correct  HostAdamW.correct's algebra in one pass: turn an update done with clip coefficient
                 1 into the update with coefficient c. The new moments are built from the stored
                 ones and the gradient as update(c) sees it (g / fp32(1/c)); the weight swaps the
                 old Adam step (recomputed bit-identically from the stored m, v) for the new one.
                 Exact to fp32 rounding (about one ulp), like the torch path.
  adamw_weights  the update's weights only: m and v are computed in registers as adamw_update
  adamw_moments  computes them, the weight from them, and only the weight is stored (reads p, m, v,
                 g: 14 bytes/param with a bf16 gradient, writes 4, against the update's 26 in all).
                 adamw_moments then stores the same m and v (reads m, v, g, writes m, v). Together
                 bit-identical to adamw_update (the same expressions, the same vector/tail split); apart,
                 the weights the next forward needs are ready after the smaller pass, and the moments
                 pass runs later, off the critical path (worker.py: deferred moments).
  adamw_state_update  one AdamW step over a tile whose moments are bf16 or int8 (train.optimizer_state):
                 adamw_state.cpp, the arithmetic of optim/state_adamw.py bit for bit (not torch's fused
                 kernel's: there is no torch kernel for these formats to match).
  adamw_weights_emit  adamw_weights over a piece of a section, also storing the new weights' bf16 cast
                 (round to nearest even, as torch's cast) into a second buffer: the packer applies a
                 clipped step's update as it reads the tile and writes the result straight into pinned
                 staging (reads p, m, v, g; writes p and 2 bytes of bf16: 20 bytes/param against 18 for
                 the weights pass plus 6 for the packer's separate cast; optim/worker.py: update on read).

Weights: fp32 masters, or bf16 ones (train.master_weights: bf16): every entry point but adamw_correct
takes either. A bf16 weight is widened in registers, updated with the same fp32 operations, and stored
rounded to nearest even (as torch's cast): bit-identical to "widen, torch._fused_adamw_, copy back"
(HostAdamW's torch path). The fp32 instantiation is the code that ran before, unchanged.
With train.master_rounding=stochastic a bf16 weight is stored rounded stochastically instead (`key_p` >= 0:
store/moments.stochastic_bf16's bits, element i of the passed section being element `first` + i of the
whole tile; rounding.h holds the hash both C++ files use), and the weights' bf16 copy of
adamw_weights_emit is the stored master itself.

Vector code: AVX2 + FMA, chosen at run time (__builtin_cpu_supports) through per-function target
attributes, so the cached build never assumes the CPU it was built on (no -march=native); other
CPUs run the same math in scalar C++. -ffp-contract=off keeps the compiler from fusing multiplies
and adds by itself; the FMAs are explicit, where torch's build has them: the lerp of m (torch's
vec::fmadd), and the v update, which torch's compiler contracts as fma(c2*g, g, v*b2) in its vector
loop and as fma(v, b2, c2*g*g) in its scalar tail (the last numel % 8 elements; so the torch
2.13.0+cpu and 2.14.1+cu130 wheels do, AVX512 and AVX2 kernels alike). Bit-identity with torch
therefore depends on how torch's binary was compiled: tests/optim/test_adamw_cpp.py checks it on the
installed torch. (torch's DEFAULT-capability kernel, for CPUs without AVX2, has no FMAs: there the
two differ by an ulp or so.) Threads: at::parallel_for over cache-line-aligned
blocks, i.e. torch's own OpenMP pool and thread count (at::get_num_threads(), also right from a
worker thread). The extension links torch's bundled libgomp where there is one, so the process
keeps a single OpenMP runtime. Every entry point releases the GIL while it runs, as torch's ops do
(the optimizer worker thread must not stall the training thread).
"""

from __future__ import annotations

import glob
import hashlib
import os
import threading
import time

import torch

SOURCE = os.path.join(os.path.dirname(os.path.abspath(__file__)), "adamw_cpp.cpp")
STATE_SOURCE = os.path.join(os.path.dirname(SOURCE), "adamw_state.cpp")  # bf16 / int8 moments
ROUNDING = os.path.join(os.path.dirname(SOURCE), "rounding.h")  # stochastic rounding, included by both


def _name() -> str:
    """The extension's name, with a hash of its sources: builds of other versions (other checkouts on the
    machine) live in other cache directories instead of rebuilding, and racing to load, one another's."""
    h = hashlib.sha256()
    for path in (SOURCE, STATE_SOURCE, ROUNDING):
        with open(path, "rb") as f:
            h.update(f.read())
    return f"megatrain_host_adamw_{h.hexdigest()[:12]}"


_NAME = _name()  # train/host_kernel.py finds the build's lock by it
_lock = threading.Lock()
_module = None
_error: Exception | None = None
compile_seconds: float | None = None  # wall time of the load (a compile, or a load from the cache)
_TAIL = 0  # set on load: torch_tail_width()


def _gomp_flags() -> list[str]:
    """Link the OpenMP runtime torch itself uses (one runtime, one thread pool, in the process)."""
    bundled = sorted(glob.glob(os.path.join(os.path.dirname(torch.__file__), "lib", "libgomp*.so*")))
    if bundled:
        return [bundled[0], f"-Wl,-rpath,{os.path.dirname(bundled[0])}"]
    return ["-lgomp"]


def load():
    """The compiled module (compiling it the first time in this environment); raises if it cannot."""
    global _module, _error, compile_seconds, _TAIL
    with _lock:
        if _module is not None:
            return _module
        if _error is not None:
            raise RuntimeError(f"host AdamW kernel unavailable: {_error}") from _error
        from torch.utils.cpp_extension import load as load_extension

        t0 = time.perf_counter()
        try:
            _module = load_extension(
                name=_NAME, sources=[SOURCE, STATE_SOURCE],
                extra_cflags=["-O3", "-fopenmp", "-ffp-contract=off", "-fno-math-errno"],
                extra_ldflags=_gomp_flags(), verbose=False)
        except Exception as e:  # compiler missing, ninja missing, build error
            _error = e
            raise RuntimeError(f"host AdamW kernel unavailable: {e}") from e
        compile_seconds = time.perf_counter() - t0
        _TAIL = torch_tail_width()
        return _module


def torch_tail_width() -> int:
    """torch's fused AdamW runs the last numel % 8 elements of a call through scalar code whose v
    update its build contracts to a different FMA than its vector code does (with AVX512's 16 lanes
    the compiler vectorises the first 8 of a tail of 8..15 like the main loop, so 8 either way).
    The update mirrors it, for bit-identity."""
    return 8


def update(master, grad, exp_avg, exp_avg_sq, *, step: float, lr: float, beta1: float, beta2: float,
           eps: float, weight_decay: float, clip: float = 1.0, key_p: int = -1, first: int = 0) -> None:
    """One AdamW step over one flat section, in place (as torch._fused_adamw_ with
    grad_scale = 1/clip, but the gradient is read, never written, and may be bf16). key_p >= 0: a bf16
    master rounded stochastically (the module docstring)."""
    load().adamw_update(master, grad, exp_avg, exp_avg_sq, float(step), float(lr), float(beta1),
                        float(beta2), float(eps), float(weight_decay), float(clip), _TAIL, int(key_p), int(first))


def update_weights(master, grad, exp_avg, exp_avg_sq, *, step: float, lr: float, beta1: float, beta2: float,
                   eps: float, weight_decay: float, clip: float = 1.0, key_p: int = -1, first: int = 0) -> None:
    """The weights `update` would write, from the moments it would write (which are not stored)."""
    load().adamw_weights(master, grad, exp_avg, exp_avg_sq, float(step), float(lr), float(beta1),
                         float(beta2), float(eps), float(weight_decay), float(clip), _TAIL, int(key_p), int(first))


def update_weights_emit(master, grad, exp_avg, exp_avg_sq, out, *, step: float, lr: float, beta1: float,
                        beta2: float, eps: float, weight_decay: float, clip: float, section_offset: int,
                        section_numel: int, key_p: int = -1, first: int = 0) -> None:
    """`update_weights` over a piece of one flat section that starts `section_offset` elements into it,
    also storing the new weights' bf16 cast (round to nearest even, as torch's) in `out`. Pieces of a
    section, each updated once, give `update_weights` of the whole section bit for bit: the last
    section_numel % 8 elements of the section take torch's scalar-tail formula wherever the piece falls."""
    module = load()  # sets _TAIL
    tail_start = section_numel - section_numel % _TAIL if _TAIL else section_numel
    vec = min(master.numel(), max(0, tail_start - section_offset))
    module.adamw_weights_emit(master, grad, exp_avg, exp_avg_sq, out, float(step), float(lr), float(beta1),
                              float(beta2), float(eps), float(weight_decay), float(clip), vec, int(key_p), int(first))


def update_moments(master, grad, exp_avg, exp_avg_sq, *, beta1: float, beta2: float, clip: float = 1.0) -> None:
    """The moments `update` would write (after update_weights, before anything else touches them)."""
    load().adamw_moments(master, grad, exp_avg, exp_avg_sq, float(beta1), float(beta2), float(clip), _TAIL)


def update_state(master, grad, exp_avg, exp_avg_sq, exp_avg_exp, exp_avg_sq_exp, *, step: float, lr: float,
                 beta1: float, beta2: float, eps: float, weight_decay: float, clip: float, decay_numel: int,
                 origin: int, key_m: int, key_v: int, key_p: int = -1) -> None:
    """One AdamW step over a whole tile whose moments are bf16 or int8 (adamw_state.cpp; the arithmetic of
    optim/state_adamw.py, bit for bit): weight decay on the leading `decay_numel` elements; key_p >= 0: a
    bf16 master rounded stochastically."""
    load().adamw_state_update(master, grad, exp_avg, exp_avg_sq, exp_avg_exp, exp_avg_sq_exp, float(step), float(lr),
                              float(beta1), float(beta2), float(eps), float(weight_decay), float(clip),
                              int(decay_numel), int(origin), int(key_m), int(key_v), int(key_p))


def correct(master, grad, exp_avg, exp_avg_sq, *, step: float, lr: float, beta1: float, beta2: float,
            eps: float, clip: float) -> None:
    """Turn the section's last update (clip 1, this lr, state step `step`) into the one with `clip`."""
    load().adamw_correct(master, grad, exp_avg, exp_avg_sq, float(step), float(lr), float(beta1),
                         float(beta2), float(eps), float(clip))


def available() -> bool:
    try:
        load()
        return True
    except RuntimeError:
        return False
