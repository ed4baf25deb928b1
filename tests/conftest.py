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
