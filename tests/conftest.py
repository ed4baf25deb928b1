"""Session-wide test setup.

Without a GPU, Triton kernels are tested under Triton's interpreter, which reads TRITON_INTERPRET
when triton is first imported. Any test module that builds an HF model can import triton
indirectly, and a module-level setting in the kernel tests would then come too late (they skip
with a message). Setting it here, before any test module is imported, makes the suite independent
of file order.
"""

import os

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

# Tokenisation cache (megatrain_cli/data/token_cache.py, under the user's cache directory): one fresh
# directory per test session, so no test depends on what an earlier run left in ~/.cache.
# torch's extension build cache (the C++ host AdamW) also follows XDG_CACHE_HOME: it stays where it was,
# so a session does not recompile what the last one built.
import tempfile

from torch.utils.cpp_extension import get_default_build_root

os.environ.setdefault("TORCH_EXTENSIONS_DIR", get_default_build_root())
os.environ["XDG_CACHE_HOME"] = tempfile.mkdtemp(prefix="megatrain-test-cache-")


def pytest_sessionstart(session):
    """A compile lock left by a killed compile makes every in-process load of the C++ AdamW wait forever
    (the product's runs refuse it through train/host_kernel.prepare, naming the file to delete). A test
    session is ours, and a compile takes about a minute, so a lock older than STALE_S is removed here,
    with a line saying so: CI shares the build cache with earlier runs that may have been killed."""
    import sys

    from megatrain_cli.train import host_kernel

    lock = host_kernel.compile_lock()
    if lock.exists() and host_kernel.lock_age(lock) > host_kernel.STALE_S:
        print(f"tests: removing the stale compile lock {lock} ({host_kernel.lock_age(lock) / 60:.0f} min old)",
              file=sys.stderr)
        lock.unlink(missing_ok=True)


def pytest_collection_modifyitems(config, items):
    """A test skipped for want of a GPU must carry the `cuda` mark: the device runs `pytest -m cuda`, so an
    unmarked one runs nowhere (two did, session 13). Checked at collection, every run, on the CPU too."""
    import pytest

    unmarked = [item.nodeid for item in items if item.get_closest_marker("cuda") is None and any(
        "NVIDIA GPU" in str(m.kwargs.get("reason", "")) for m in item.iter_markers("skipif"))]
    if unmarked:
        raise pytest.UsageError("tests that need a GPU but lack @pytest.mark.cuda (the device's `pytest -m cuda` "
                                "would never run them): " + ", ".join(unmarked[:5]))
