"""Routed experts for the live rows of a verification block (seed: "Prepare expert weights before
routing finishes"; MODEL.md forward and TP layout; ROUND.md act_quant).

    out[r] = sum_j w[r, j] * Down_e( act_quant( silu(Gate_e x_r) * Up_e x_r ) ),   e = experts[r, j]

on this rank's slice I_r of every expert's intermediate dimension (Down is row-parallel: the caller
all-reduces `out`). Three launches, no host sync, grids sized for the worst case:

1. `moe_group` (moe_route.py): drop padding rows' pairs, sort the live (row, slot) pairs by expert,
   one segment per distinct expert.
2. Gate/Up: a program per (segment, I_r tile of GROUP channels) reads that expert's Gate and Up
   tiles once for every row that chose it, applies SiLU and the product in fp32, and quantizes the
   tile with DeepSeek-V3's act_quant (per row and GROUP contiguous channels: s = max(amax, 1e-4) /
   448, e4m3(h / s)) into `act` [P, I_r] E4M3 and `act_scale` [P, I_r / GROUP] fp32, row = pair.
   The tile is one quantization group, so amax needs no second pass. Unused segments have length 0.
3. Down: a program per (row, H tile) handles the row's k experts in parallel (a [k, BLOCK_N,
   BLOCK_K] weight tile, each slot's E4M3 activations as a GEMV), scales each slot by its
   activation scale, weight block scale and routing weight, and sums the slots in a fixed order.
   Padding rows load no weights and write zeros.

GROUP must equal Down's weight block along I (B1): then a K tile of Down lies in one activation
group and one weight block, so both scales factor out of the tile's dot product exactly as in
DeepSeek-V3's fp8_gemm. The wrapper rejects any other GROUP; I_r must be a multiple of GROUP.

E4M3 rounding is done explicitly (round half to even onto the E4M3 grid in fp32, then the bit
pattern assembled with integer ops) instead of a `.to(tl.float8e4nv)` cast: Triton 3.6's interpreter
rounds fp32 -> e4m3 wrongly at and near midpoints and drops the sign of -0, while the explicit form
is what torch and the GPU's `cvt.rn.satfinite` compute, so one path is bit-exact on both.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .moe_route import check_live, load_live, moe_group

# Under TRITON_INTERPRET=1 (read when triton is imported) tl.dot on bf16 is wrong (GPU_FACTS.md): upcast.
INTERPRETED = bool(triton.knobs.runtime.interpret)
BLOCK_M = 16  # tl.dot's smallest M; a segment holds the rows that chose one expert (<= R)
E4M3_MAX = tl.constexpr(448.0)


@triton.jit
def _e4m3_bits(y):
    """E4M3 encoding (uint8) of fp32 |y| <= ~448, rounded to nearest, ties to even, sign kept (-0 too)."""
    bits = y.to(tl.int32, bitcast=True)
    exp = tl.maximum(((bits >> 23) & 0xFF) - 127, -6)  # E4M3's subnormal spacing is 2^-9 below 2^-6
    ulp = ((exp - 3 + 127) << 23).to(tl.float32, bitcast=True)  # 3 mantissa bits
    r = tl.abs(y) / ulp  # exact (power of two); r <= 16
    r = (r + 12582912.0) - 12582912.0  # 1.5 * 2^23: fp32 addition rounds r to an integer, ties to even
    a = tl.minimum(r * ulp, E4M3_MAX)  # |y| on the E4M3 grid (a carry moves it to the next binade)
    a_bits = a.to(tl.int32, bitcast=True)
    a_exp = ((a_bits >> 23) & 0xFF) - 127
    code = tl.where(a_exp >= -6, ((a_exp + 7) << 3) | ((a_bits >> 20) & 7), (a * 512.0).to(tl.int32))
    return tl.where(bits < 0, code | 0x80, code).to(tl.uint8)


@triton.jit
def _act_quant_tile(h):
    """act_quant of a [rows, GROUP] fp32 tile (one group per row): (E4M3 bit patterns as uint8, fp32
    scales [rows]). The kernels store the bits into a uint8 view of the E4M3 tensor."""
    s = tl.maximum(tl.max(tl.abs(h), axis=1), 1e-4) / E4M3_MAX
    return _e4m3_bits(h / s[:, None]), s


@triton.jit
def _act_quant_kernel(x_ptr, q_ptr, s_ptr, M, N, GROUP: tl.constexpr, BLOCK_M: tl.constexpr):
    m = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    g = tl.program_id(1)
    c = g * GROUP + tl.arange(0, GROUP)
    ok = m[:, None] < M
    q, s = _act_quant_tile(tl.load(x_ptr + m[:, None] * N + c[None, :], mask=ok, other=0.0).to(tl.float32))
    tl.store(q_ptr + m[:, None] * N + c[None, :], q, mask=ok)
    tl.store(s_ptr + m * (N // GROUP) + g, s, mask=m < M)


@triton.jit
def _moe_gate_up_kernel(
    x_ptr, g_ptr, gs_ptr, u_ptr, us_ptr, order_ptr, seg_e_ptr, seg_start_ptr, seg_len_ptr,
    act_ptr, act_s_ptr, h_ptr, H, I, K_TOP, stride_x, s_rows, s_cols,
    B0: tl.constexpr, B1: tl.constexpr, GROUP: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_K: tl.constexpr,
    F32: tl.constexpr, PREC: tl.constexpr, STORE_H: tl.constexpr,
):
    seg = tl.program_id(0)
    tile = tl.program_id(1)
    e = tl.load(seg_e_ptr + seg).to(tl.int64)
    start = tl.load(seg_start_ptr + seg)
    length = tl.load(seg_len_ptr + seg)  # 0 for unused segments: nothing below runs
    n = tile * GROUP + tl.arange(0, GROUP)  # I % GROUP == 0: always in range
    g_rows = g_ptr + e * I * H + n[:, None] * H
    u_rows = u_ptr + e * I * H + n[:, None] * H
    gs_row = gs_ptr + e * s_rows * s_cols + (n // B0) * s_cols
    us_row = us_ptr + e * s_rows * s_cols + (n // B0) * s_cols

    for m0 in range(0, length, BLOCK_M):  # one pass when the segment fits BLOCK_M rows
        mi = m0 + tl.arange(0, BLOCK_M)
        m_ok = mi < length
        pair = tl.load(order_ptr + start + mi, mask=m_ok, other=0)
        x_rows = x_ptr + (pair // K_TOP)[:, None] * stride_x
        acc_g = tl.zeros([BLOCK_M, GROUP], tl.float32)
        acc_u = tl.zeros([BLOCK_M, GROUP], tl.float32)
        for k0 in range(0, H, BLOCK_K):
            kk = k0 + tl.arange(0, BLOCK_K)
            k_ok = kk < H
            x = tl.load(x_rows + kk[None, :], mask=m_ok[:, None] & k_ok[None, :], other=0.0)
            wg = tl.load(g_rows + kk[None, :], mask=k_ok[None, :], other=0.0)
            wu = tl.load(u_rows + kk[None, :], mask=k_ok[None, :], other=0.0)
            sg = tl.load(gs_row + k0 // B1)  # the tile lies in one K block
            su = tl.load(us_row + k0 // B1)
            if F32:
                x = x.to(tl.float32)
                wg = wg.to(tl.float32)
                wu = wu.to(tl.float32)
            else:
                wg = wg.to(x.dtype)  # exact
                wu = wu.to(x.dtype)
            acc_g += tl.dot(x, tl.trans(wg), input_precision=PREC) * sg[None, :]
            acc_u += tl.dot(x, tl.trans(wu), input_precision=PREC) * su[None, :]
        h = acc_g * tl.sigmoid(acc_g) * acc_u
        q, s = _act_quant_tile(h)
        ok = m_ok[:, None]
        tl.store(act_ptr + pair[:, None] * I + n[None, :], q, mask=ok)
        tl.store(act_s_ptr + pair * (I // GROUP) + tile, s, mask=m_ok)
        if STORE_H:
            tl.store(h_ptr + pair[:, None] * I + n[None, :], h, mask=ok)


@triton.jit
def _moe_down_kernel(
    act_ptr, act_s_ptr, w_ptr, ws_ptr, experts_ptr, weights_ptr, live_ptr, out_ptr,
    R, H, I, K_TOP, stride_o, s_rows, s_cols,
    B0: tl.constexpr, GROUP: tl.constexpr, KS: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
    LIVE_COUNT: tl.constexpr,
):
    r = tl.program_id(0)
    n = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    n_ok = n < H
    j = tl.arange(0, KS)
    live = load_live(live_ptr, r + j * 0, R, LIVE_COUNT)
    j_ok = (j < K_TOP) & live  # a padding row masks every load: it reads no weights
    pair = r * K_TOP + j
    e = tl.load(experts_ptr + pair, mask=j_ok, other=0).to(tl.int64)
    w_route = tl.load(weights_ptr + pair, mask=j_ok, other=0.0)
    w_rows = w_ptr + e[:, None, None] * H * I + n[None, :, None] * I  # [KS, BLOCK_N, 1]
    ws_row = ws_ptr + e[:, None] * s_rows * s_cols + (n[None, :] // B0) * s_cols  # [KS, BLOCK_N]
    w_ok = j_ok[:, None, None] & n_ok[None, :, None]
    acc = tl.zeros([KS, BLOCK_N], tl.float32)
    for k0 in range(0, I, BLOCK_K):  # BLOCK_K divides GROUP == B1: one scale block per tile
        kk = k0 + tl.arange(0, BLOCK_K)
        a = tl.load(act_ptr + pair[:, None] * I + kk[None, :], mask=j_ok[:, None], other=0.0).to(tl.float32)
        w = tl.load(w_rows + kk[None, None, :], mask=w_ok, other=0.0).to(tl.float32)
        part = tl.sum(w * a[:, None, :], axis=2)  # [KS, BLOCK_N]: every slot's GEMV at once
        sa = tl.load(act_s_ptr + pair * (I // GROUP) + k0 // GROUP, mask=j_ok, other=0.0)
        sw = tl.load(ws_row + k0 // GROUP, mask=j_ok[:, None] & n_ok[None, :], other=0.0)
        acc += part * sa[:, None] * sw
    y = tl.sum(acc * w_route[:, None], axis=0)
    tl.store(out_ptr + r * stride_o + n, y.to(out_ptr.dtype.element_ty), mask=n_ok)


# ---- host wrappers ---------------------------------------------------------------------------------
_FLOATS = (torch.bfloat16, torch.float16, torch.float32)


def _check(cond: bool, message: str) -> None:
    if not cond:
        raise ValueError(f"moe: {message}")


def _pow2_divisor(b: int, cap: int) -> int:
    """Largest power of two <= cap dividing b (a K tile must not cross a scale block)."""
    bk = cap
    while bk >= 16 and b % bk:
        bk //= 2
    _check(bk >= 16, f"block {b} has no power-of-two divisor >= 16")
    return bk


def _check_weight(name: str, q: torch.Tensor, s: torch.Tensor, shape: tuple[int, int, int], block) -> None:
    _check(q.dtype == torch.float8_e4m3fn and tuple(q.shape) == shape and q.is_contiguous(),
           f"{name} must be contiguous float8_e4m3fn {shape}, got {q.dtype} {tuple(q.shape)}")
    expect = (shape[0], triton.cdiv(shape[1], block[0]), triton.cdiv(shape[2], block[1]))
    _check(s.dtype == torch.float32 and tuple(s.shape) == expect and s.is_contiguous(),
           f"{name} scale must be contiguous fp32 {expect}, got {s.dtype} {tuple(s.shape)}")


def act_quant(x: torch.Tensor, group: int = 128) -> tuple[torch.Tensor, torch.Tensor]:
    """The kernels' act_quant on its own: x [M, N] float -> (E4M3 [M, N], fp32 scales [M, N / group])."""
    _check(x.dim() == 2 and x.is_contiguous() and x.dtype in _FLOATS, "x must be a contiguous float [M, N]")
    M, N = x.shape
    _check(group >= 16 and group & (group - 1) == 0 and N % group == 0,
           f"group {group} must be a power of two >= 16 dividing {N}")
    q = torch.empty((M, N), dtype=torch.float8_e4m3fn, device=x.device)
    s = torch.empty((M, N // group), dtype=torch.float32, device=x.device)
    _act_quant_kernel[(triton.cdiv(M, 16), N // group)](x, q.view(torch.uint8), s, M, N, GROUP=group, BLOCK_M=16)
    return q, s


def moe(x: torch.Tensor, experts: torch.Tensor, weights: torch.Tensor, live: torch.Tensor,
        gate: torch.Tensor, gate_scale: torch.Tensor, up: torch.Tensor, up_scale: torch.Tensor,
        down: torch.Tensor, down_scale: torch.Tensor, block: tuple[int, int] = (128, 128), group: int = 128,
        out_dtype: torch.dtype | None = None, *, out: torch.Tensor | None = None, block_k: int = 128,
        down_block_n: int = 32, down_block_k: int = 64, debug: dict | None = None) -> torch.Tensor:
    """Routed-expert output [R, H] of x [R, H] (bf16/fp16/fp32) for rows chosen by `live` (bool [R]
    or an int count of leading live rows, on the device); padding rows get zeros.

    experts [R, k] int (valid ids < E: unchecked, that would sync), weights [R, k] fp32; gate, up
    [E, I_r, H] and down [E, H, I_r] E4M3 with fp32 block scales for `block`; group == block[1].
    `debug`, when a dict, receives the groups, `act`, `act_scale` and the fp32 `hidden` before
    quantization (tests only: it adds a store)."""
    _check(x.dim() == 2 and x.dtype in _FLOATS and x.stride(1) == 1, "x must be a float [R, H] with unit stride")
    R, H = x.shape
    _check(experts.dim() == 2 and experts.shape[0] == R, f"experts must be [{R}, k], got {tuple(experts.shape)}")
    k = experts.shape[1]
    _check(weights.dtype == torch.float32 and tuple(weights.shape) == (R, k) and weights.is_contiguous(),
           f"weights must be contiguous fp32 [{R}, {k}]")
    E, I = gate.shape[0], gate.shape[1]
    _check_weight("gate", gate, gate_scale, (E, I, H), block)
    _check_weight("up", up, up_scale, (E, I, H), block)
    _check_weight("down", down, down_scale, (E, H, I), block)
    _check(group == block[1], f"group {group} must equal the weight block along I ({block[1]}): "
                              "a Down K tile must lie in one activation group and one weight block")
    _check(group >= 16 and group & (group - 1) == 0 and I % group == 0,
           f"group {group} must be a power of two >= 16 dividing I_r = {I}")
    devices = {t.device for t in (x, experts, weights, gate, gate_scale, up, up_scale, down, down_scale)}
    _check(len(devices) == 1, f"tensors on several devices: {devices}")
    count = check_live(live, R, x.device)
    out_dtype = out_dtype or x.dtype
    _check(out_dtype in _FLOATS, f"out_dtype {out_dtype} must be bf16, fp16 or fp32")
    if out is None:
        out = torch.empty((R, H), dtype=out_dtype, device=x.device)
    _check(tuple(out.shape) == (R, H) and out.dtype == out_dtype and out.stride(1) == 1,
           f"out must be [{R}, {H}] {out_dtype} with unit stride")
    _check(down_block_n >= 1 and down_block_n & (down_block_n - 1) == 0, "down_block_n must be a power of two")

    experts = experts.contiguous()
    groups = moe_group(experts, live)
    P = R * k
    act = torch.empty((P, I), dtype=torch.float8_e4m3fn, device=x.device)
    act_scale = torch.empty((P, I // group), dtype=torch.float32, device=x.device)
    hidden = torch.full((P, I), float("nan"), device=x.device) if debug is not None else act_scale
    f32 = INTERPRETED or x.dtype == torch.float32
    s_rows, s_cols = gate_scale.shape[1], gate_scale.shape[2]
    _moe_gate_up_kernel[(P, I // group)](
        x, gate, gate_scale, up, up_scale, *groups, act.view(torch.uint8), act_scale, hidden, H, I, k, x.stride(0),
        s_rows, s_cols,
        B0=block[0], B1=block[1], GROUP=group, BLOCK_M=BLOCK_M, BLOCK_K=_pow2_divisor(block[1], block_k),
        F32=f32, PREC="ieee" if f32 else "tf32", STORE_H=debug is not None, num_warps=8)
    live_arg = live.view(torch.uint8) if live.dtype == torch.bool else live
    _moe_down_kernel[(R, triton.cdiv(H, down_block_n))](
        act, act_scale, down, down_scale, experts, weights, live_arg, out, R, H, I, k, out.stride(0),
        down_scale.shape[1], down_scale.shape[2], B0=block[0], GROUP=group, KS=max(2, triton.next_power_of_2(k)),
        BLOCK_N=down_block_n, BLOCK_K=_pow2_divisor(group, down_block_k), LIVE_COUNT=count, num_warps=8)
    if debug is not None:
        debug.update(groups=groups, act=act, act_scale=act_scale, hidden=hidden)
    return out


# ---- reference -------------------------------------------------------------------------------------
def moe_ref(x, experts, weights, live, gate, gate_scale, up, up_scale, down, down_scale,
            block=(128, 128), group: int = 128, quantize_act: bool = True, dtype=torch.float64) -> torch.Tensor:
    """Plain torch in `dtype`: per live (row, slot) h = silu(Gate x) * Up x from dequantized weights,
    act_quant(h) (reference/fp8.py) when `quantize_act`, Down, routing weights; padding rows 0."""
    from ..reference.fp8 import act_quant as act_quant_ref, dequantize

    R, H = x.shape
    mask = live if live.dtype == torch.bool else torch.arange(R, device=x.device) < live.reshape(())
    out = torch.zeros((R, H), dtype=dtype, device=x.device)
    for r in range(R):
        if not bool(mask[r]):
            continue  # padding rows never touch expert weights
        for j in range(experts.shape[1]):
            e = int(experts[r, j])
            xr = x[r].to(dtype)
            g = dequantize(gate[e], gate_scale[e], block, dtype) @ xr
            u = dequantize(up[e], up_scale[e], block, dtype) @ xr
            h = (torch.nn.functional.silu(g) * u).float()  # the kernels quantize fp32 h
            if quantize_act:
                q, s = act_quant_ref(h[None], group)
                h = (q.float().unflatten(-1, (-1, group)) * s[..., None]).flatten(-2)[0]
            out[r] += float(weights[r, j]) * (dequantize(down[e], down_scale[e], block, dtype) @ h.to(dtype))
    return out
