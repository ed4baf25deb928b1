"""The fused state kernel's PTX for sm_90, compiled without a GPU (triton's frontend, LLVM and ptxas run on the
CPU) with the options its launch passes (adamw_state.LAUNCH_OPTIONS): no fused multiply-add, no
flush-to-zero, division and sqrt the correctly rounded instructions. What bit-identity with torch's separate
kernels rests on (kernels/adamw_state.py), checked where the interpreter, which computes in numpy, cannot.

In a subprocess: this session's triton runs kernels interpreted (tests/conftest.py), and an interpreted
kernel cannot be compiled.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
import textwrap

import pytest

pytest.importorskip("triton")

COMPILE = textwrap.dedent("""
    import sys, triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource
    from megatrain_cli.kernels import adamw_state as a
    int8 = sys.argv[1] == "int8"
    sig = {"master_ptr": "*i16", "grad_ptr": "*i16", "m_ptr": "*u8" if int8 else "*i16", "v_ptr": "*u8" if int8 else "*i16",
           "m_exp_ptr": "*i8", "v_exp_ptr": "*i8", "clip_ptr": "*fp32", "bc2s_ptr": "*fp32", "n": "i32",
           "decay_numel": "i32", "origin": "i64", "key_m": "i64", "key_v": "i32", "key_p": "i64",
           **{k: "fp32" for k in ("w1", "beta2", "c2", "eps", "neg_step", "decay")}}
    consts = dict(INT8=int8, MASTER_BF16=True, GRAD_BF16=True, SR_MASTER=True, SCALED=True, BLOCKS=a.BLOCKS, BLOCK=a.BLOCK)
    sig.update({k: "constexpr" for k in consts})
    k = triton.compile(ASTSource(fn=a._adamw_state_kernel, signature=sig, constexprs=consts),
                       target=GPUTarget("cuda", 90, 32), options=a.LAUNCH_OPTIONS)
    sys.stdout.write(k.asm["ptx"])
""")


@pytest.mark.parametrize("moments", ["bf16", "int8"])
def test_ptx_has_no_fma_no_ftz_and_exact_div_sqrt(moments):
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    run = subprocess.run([sys.executable, "-c", COMPILE, moments], capture_output=True, text=True, env=env, timeout=300)
    if run.returncode != 0 and "ptxas" in run.stderr and "not found" in run.stderr.lower():
        pytest.skip(f"no ptxas here: {run.stderr[-300:]}")
    assert run.returncode == 0, run.stderr[-2000:]
    ops = re.findall(r"^\s*((?:fma|mad|div|sqrt|mul|add|sub|rcp)\.[a-z0-9.]*f32)", run.stdout, re.M)
    assert ops, "no fp32 arithmetic found: the PTX was not read"
    assert not [op for op in ops if op.startswith(("fma", "mad", "rcp")) or ".ftz" in op or ".approx" in op]
    assert "div.rn.f32" in ops and "sqrt.rn.f32" in ops
    assert all(".rn." in op for op in ops)  # explicit rounding: ptxas may not contract a mul into an add
