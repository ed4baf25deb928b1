"""`triton` and `triton.language` for the kernel modules, or stand-ins when triton can't be imported.

Every kernel module imports `triton, tl` from here, never triton itself, so that it imports on a machine
without triton (CI's CPU runners) and its PyTorch reference stays usable there. The stand-in lets the
module body evaluate (`@triton.jit`, `BLOCK: tl.constexpr`) and raises the original ImportError the
moment anything tries to launch a kernel. The package's dispatch (`kernels.wants_triton`) checks
`IMPORT_ERROR` first, so in practice no launch is ever attempted without triton.

TRITON_INTERPRET=1 must be in the environment before this module is first imported: triton decides at
`@triton.jit` time whether a kernel is compiled or interpreted.
"""

from __future__ import annotations


class _TritonMissing:
    """Placeholder for both `triton` and `triton.language` when the import failed."""

    def __init__(self, error: BaseException):
        self._error = error

    def __getattr__(self, name: str):  # triton.jit, tl.constexpr, tl.float32, ... all resolve to self
        return self

    def __call__(self, *args, **kwargs):
        if len(args) == 1 and callable(args[0]) and not kwargs:  # `@triton.jit` on a kernel function
            return self
        if not args and kwargs:  # `@triton.jit(do_not_specialize=...)`: the decorator it makes
            return self
        self._raise()

    def __getitem__(self, grid):  # kernel[grid](...)
        return self._raise

    def _raise(self, *args, **kwargs):
        raise ImportError(f"triton is not importable: {self._error!r}") from self._error


try:
    import triton
    import triton.language as tl

    IMPORT_ERROR: BaseException | None = None
except Exception as error:  # not installed, or an install that fails to load (wrong CUDA, missing libs)
    IMPORT_ERROR = error
    triton = tl = _TritonMissing(error)  # type: ignore[assignment]


def next_power_of_2(n: int) -> int:
    """Triton blocks must be powers of two; plain Python so it also works with the stand-in."""
    return 1 << max(0, int(n) - 1).bit_length()


def cdiv(a: int, b: int) -> int:
    return -(-a // b)
