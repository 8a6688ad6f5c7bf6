"""fp32 values rounded to bf16 inside a kernel, the same on the GPU and under Triton's interpreter, whose own bf16
cast truncates where torch's `.to(torch.bfloat16)` rounds to nearest even (the MoE's and the norms' roundings)."""

from __future__ import annotations

import triton
import triton.language as tl


@triton.jit
def bf16_grid(x):
    """fp32 x rounded to the nearest bf16 (ties to even; overflow to inf), still fp32: what torch's
    `.to(torch.bfloat16)` gives, on the GPU and under the interpreter alike (whose own cast truncates). NaN stays
    NaN."""
    bits = x.to(tl.int32, bitcast=True)
    bits = (bits + (0x7FFF + ((bits >> 16) & 1))) & -65536  # two's complement add = unsigned add on the pattern
    return tl.where(x != x, x, bits.to(tl.float32, bitcast=True))
