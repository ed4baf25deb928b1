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

# Tokenisation cache (megatrain_cli/data/token_cache.py): one fresh directory per test session, so
# no test depends on what an earlier run left in ~/.cache.
if "MEGATRAIN_CACHE" not in os.environ:
    import tempfile

    os.environ["MEGATRAIN_CACHE"] = tempfile.mkdtemp(prefix="megatrain-test-cache-")
