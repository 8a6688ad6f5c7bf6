"""bf16 activations as exact fp16 tensor-core operands, so that E4M3 weights convert to fp16 (docs/PERF.md, "fp16
operands").

Why: at decode the retired MoE kernel's Gate/Up and Down were weight streams whose cost on an H200 was the conversion
of every E4M3 weight for the tensor cores, not the bytes (ncu: 34% of DRAM bandwidth, the conversion's F2F and PRMT
30% of Gate/Up's instructions). The FP8 linears, whose tiles are narrow and latency-bound, were slower this way (the
row scale costs them more than the conversion saves: docs/PERF.md). Nor does the published model's Gate/Up read them:
on its product form they cut its K step's instructions by a quarter but not the round's time, and its registers cost
time at 38 experts (docs/PERF.md, "Decisions rejected"). No engine path reads these operands today; `bf16_grid` (the
interpreter's round-to-nearest-even) serves the MoE and the norms. E4M3 -> fp16 is one instruction per two weights
(`cvt.rn.f16x2.e4m3x2`) and exact; E4M3 -> bf16 goes through fp16 and then one conversion per weight. The other
operand must then be fp16 too, and a bf16 value is not always an fp16 one (fp16 has 3 more mantissa bits but 3
fewer exponent bits).

How: each row r of a K tile is multiplied by a power of two 2^s_r chosen from the row's largest |x| (put in
[2^14, 2^15)). Multiplying by a power of two is exact, and a bf16 value v (8 significant bits) is exact in
fp16 when 2^-17 <= |v * 2^s_r| < 2^16, so every element within 2^31 of its row's largest is exact; zeros are
too. The tile's dot product is then exactly 2^s_r times the bf16 one (both multiply exact E4M3 values and
accumulate in fp32), and the caller multiplies the partial product by 2^-s_r together with the weight block's
scale: the factor 2^-s_r * scale is exact, so the scaled product rounds to the same fp32 value as before.

What it changes: nothing, except for an element smaller than 2^-31 of its row tile's largest (rounded onto the
fp16 subnormal grid: an error below 2^-40 of the row's largest), and rows whose largest |x| is under 2^-112
(s is capped so that 2^-s_r stays a normal fp32 number). Activations span nothing like 2^31 inside 128
elements, so the kernels' results are the bf16 path's bits in practice; as a numerical change in principle, it
is measured by `iquest qualify` (docs/PERF.md) and tests/test_kernel_f16_operands.py shows both the exact case
and a row that is not.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .device import row_groups

TOP_EXPONENT = 14  # the row's largest |x| * 2^s lands in [2^14, 2^15): below fp16's largest finite (65504)
MIN_EXPONENT_FIELD = 15  # the largest |x|'s biased fp32 exponent is taken >= 15, so 2^s <= 2^126 and 2^-s >= 2^-126


@triton.jit
def bf16_grid(x):
    """fp32 x rounded to the nearest bf16 (ties to even; overflow to inf), still fp32: what torch's
    `.to(torch.bfloat16)` gives, on the GPU and under the interpreter alike (whose own cast truncates). NaN stays
    NaN."""
    bits = x.to(tl.int32, bitcast=True)
    bits = (bits + (0x7FFF + ((bits >> 16) & 1))) & -65536  # two's complement add = unsigned add on the pattern
    return tl.where(x != x, x, bits.to(tl.float32, bitcast=True))


@triton.jit
def row_pow2(x):
    """(2^s, 2^-s) per row of the fp32 tile x [M, K]: 2^s puts the row's largest |x| in [2^14, 2^15). From the
    exponent bits (no log2): biased exponent e of max|x| gives s = 14 - (e - 127); e is taken >= 15 (zero and tiny
    rows) so that both factors are normal numbers. NaN is left out of the max (it stays NaN); inf stays inf."""
    amax = tl.max(tl.where(x == x, tl.abs(x), 0.0), axis=1)  # NaN left out alike on the GPU and the interpreter
    e = tl.maximum((amax.to(tl.int32, bitcast=True) >> 23) & 0xFF, 15)
    up = ((268 - e) << 23).to(tl.float32, bitcast=True)  # biased exponent 127 + 14 - (e - 127)
    down = ((e - 14) << 23).to(tl.float32, bitcast=True)  # biased exponent 127 - (14 - (e - 127))
    return up, down


@triton.jit
def f16_rows(x):
    """(x * 2^s_r as fp16, 2^-s_r [M] fp32) for the fp32 tile x [M, K] holding bf16 values (see the module)."""
    up, down = row_pow2(x)
    return (x * up[:, None]).to(tl.float16), down


@triton.jit
def _f16_rows_kernel(x_ptr, y_ptr, d_ptr, M, K, BLOCK_M: tl.constexpr, BLOCK_K: tl.constexpr):
    m = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    kk = tl.program_id(1) * BLOCK_K + tl.arange(0, BLOCK_K)
    ok = (m < M)[:, None] & (kk < K)[None, :]
    x16, down = f16_rows(tl.load(x_ptr + m[:, None] * K + kk[None, :], mask=ok, other=0.0).to(tl.float32))
    tl.store(y_ptr + m[:, None] * K + kk[None, :], x16, mask=ok)
    tl.store(d_ptr + m * tl.num_programs(1) + tl.program_id(1), down, mask=m < M)


def f16_rows_tiles(x: torch.Tensor, block_k: int = 128) -> tuple[torch.Tensor, torch.Tensor]:
    """The kernels' conversion on its own, per [row, block_k tile]: (fp16 [M, K], 2^-s [M, K / block_k] fp32).
    x: contiguous bf16 or fp32 [M, K] (fp32 holding bf16 values, as the MoE's rounded input)."""
    M, K = row_groups(x, block_k, "f16_rows")
    y = torch.empty((M, K), dtype=torch.float16, device=x.device)
    d = torch.empty((M, K // block_k), dtype=torch.float32, device=x.device)
    _f16_rows_kernel[(triton.cdiv(M, 16), K // block_k)](x, y, d, M, K, BLOCK_M=16, BLOCK_K=block_k)
    return y, d


def f16_rows_tiles_ref(x: torch.Tensor, block_k: int = 128) -> tuple[torch.Tensor, torch.Tensor]:
    """Plain torch: the same powers of two from the same exponent bits."""
    M, K = x.shape
    t = x.float().reshape(M, K // block_k, block_k)
    amax = torch.where(t == t, t.abs(), 0).amax(-1)
    e = ((amax.view(torch.int32) >> 23) & 0xFF).clamp(min=MIN_EXPONENT_FIELD)
    up = ((127 + TOP_EXPONENT + 127 - e) << 23).view(torch.float32)
    down = ((e - TOP_EXPONENT) << 23).view(torch.float32)
    return (t * up[..., None]).to(torch.float16).reshape(M, K), down


def exact_in_f16(x: torch.Tensor, block_k: int = 128) -> torch.Tensor:
    """bool [M, K / block_k]: whether every element of the row tile survives the conversion exactly."""
    y, d = f16_rows_tiles_ref(x, block_k)
    M, K = x.shape
    back = y.float().reshape(M, K // block_k, block_k) * d[..., None]
    return (back == x.float().reshape(M, K // block_k, block_k)).all(-1)
