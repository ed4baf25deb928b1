"""The kernels/ folder as a package: with the repository root first on sys.path (pytest, `python -m` in a
checkout) the name `kernels` resolves without shadowing PyPI's package, and ours stays megatrain_cli.kernels.
Subprocesses: no Triton interpreter needed (tests/triton/test_kernels.py tests the kernels themselves)."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest


def test_repo_root_on_sys_path_does_not_shadow_pypi_kernels():
    """With the repository root first on sys.path (as under pytest or `python -m` in a checkout), `import
    kernels` is PyPI's package (transformers >= 5.25 imports it), never this folder; ours stays
    megatrain_cli.kernels."""
    import importlib.metadata

    try:
        importlib.metadata.version("kernels")
    except importlib.metadata.PackageNotFoundError:
        pytest.skip("PyPI's kernels package is not installed: nothing to shadow")
    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    code = ("import kernels, megatrain_cli.kernels as ours; "
            "print(hasattr(kernels, 'CUDAProperties'), hasattr(ours, 'load'), kernels is not ours)")
    out = subprocess.run([sys.executable, "-c", code], cwd=root, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert out.stdout.split() == ["True", "True", "True"]


def test_repo_root_on_sys_path_without_pypi_kernels_imports_this_folder():
    """Without PyPI's `kernels` (transformers < 5.25 machines, e.g. the H200's 5.17, which imports the name to
    probe for it and fails on any error), `import kernels` from a checkout still succeeds: this folder. The
    package is hidden from the hand-over's search (the only lookup with an explicit path list)."""
    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    code = ("import sys, importlib.machinery as m\n"
            "find = m.PathFinder.find_spec\n"
            "m.PathFinder.find_spec = lambda name, path=None, target=None: (\n"
            "    None if name == 'kernels' and path is not None else find(name, path, target))\n"
            f"sys.path.insert(0, {root!r}); import kernels; print(kernels.__file__)")
    out = subprocess.run([sys.executable, "-c", code], cwd=root, capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == os.path.join(root, "kernels", "__init__.py")
