"""exp and log as torch rounds them, for kernels whose results are compared with their torch forms: CUDA's libdevice
(expf, logf: what torch calls on the GPU) there, and the interpreter's NumPy functions under TRITON_INTERPRET (it has
no libdevice). `LIBDEVICE` is a constexpr, so each build holds one of the two."""

from __future__ import annotations

import triton
import triton.language as tl
from triton.language.extra import libdevice

INTERPRETED = bool(triton.knobs.runtime.interpret)


@triton.jit
def exp(x, LIBDEVICE: tl.constexpr):
    if LIBDEVICE:
        return libdevice.exp(x)
    else:
        return tl.exp(x)


@triton.jit
def log(x, LIBDEVICE: tl.constexpr):
    if LIBDEVICE:
        return libdevice.log(x)
    else:
        return tl.log(x)
