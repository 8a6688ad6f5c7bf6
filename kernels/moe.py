"""Routed experts for the live rows of a verification block (seed: "Prepare expert weights before
routing finishes"; docs/model.md forward and TP layout; docs/round.md act_quant).

Not on the product path until re-based to docs/model.md: it was built for the retired, guessed architecture (its
fused input stage reads the pre-norm residual tail's fp16 operand tiles of kernels/rmsnorm_residual.py, its finalize
and combine add into that residual stream, and its defaults were tuned at the retired widths), so fast/triton_ops.py
no longer dispatches it and the published MoE (no output norm between layers' residual adds, the sandwich norms
around it; 1536-wide experts, 192 rows a rank at TP 8 starting inside a 128-row scale block) runs its torch form.
Its tests hold it to its own references (`moe_ref` and friends, below); the figures below are the retired sizes'.

    out[r] = sum_j w[r, j] * Down_e( act_quant( silu(Gate_e x_r) * Up_e x_r ) ),   e = experts[r, j]

on this rank's slice I_r of every expert's intermediate dimension (Down is row-parallel: the caller
all-reduces `out`). At decode the work is a weight stream (a few rows against ~k..R*k experts'
E4M3 weights), so every launch is laid out to read each chosen expert's bytes once, spread over
the whole GPU. Four launches, no host sync, grids sized for the worst case (programs with nothing
to do exit at once), no atomics: eager runs and graph replays are bit-identical.

No grouping launch: a row's k experts are distinct, so the rows that chose expert e are exactly the
live rows r with e in experts[r, :], each at one slot j_r, and a program finds them itself. Gate/Up
and Down programs are indexed by pair p = r * k + j (P = R * k along that axis); program p takes
e = experts[p] and runs only if p's row is live and no earlier live pair (row-major) chose e, so each
distinct live expert has exactly one program (its first live pair) and an expert chosen only by
padding rows has none: its weights are never read. Its rows are the R rows in blocks of BLOCK_M from
the owner's block on, masked by live & "row r chose e", row r's pair being r * k + j_r: O(P) work a
program (the routing metadata is a few hundred bytes in L2), where the grouping launch this replaced
(an O(P^2) ranking in one program, 7.8 us a call on an H200) cost more than the finalize and combine
together. The fp32 routing input may be passed as is with `compute_dtype`: Gate/Up rounds it in
registers, which drops the caller's conversion launch.

1. Gate/Up, grid (pair, I_r tile of up to 128 channels, K split): the owner program of an expert
   reads its K range of the expert's Gate and Up tiles once for every row that chose it and writes
   fp32 partial products to `part` [SPLIT, P, 2, I_r] (row = pair). Distinct experts x I_r tiles
   alone are far too few programs to stream the weights at full bandwidth (~13 x 2 at full size:
   26 SMs busy), so H is split until they are about two per SM (`plan_split`); a split's K range is
   whole K tiles, so a tile never crosses a scale block.
2. Finalize, grid (P / ROWS pairs, I_r / GROUP): sums the splits in a fixed order (s = 0, 1, ...),
   applies SiLU and the product in fp32, and quantizes the tile with DeepSeek-V3's act_quant (per
   row and GROUP contiguous channels: s = max(amax, 1e-4) / 448, e4m3(h / s)) into `act` [P, I_r]
   E4M3 and `act_scale` [P, I_r / GROUP] fp32. The tile is one quantization group, so amax needs
   no second pass. Only live rows' pairs are touched.
3. Down, grid (pair, H tile): the owner program of an expert reads the expert's Down tile once for
   all the rows that chose it (the E4M3 activations as a [rows, I_r] operand of one dot per K tile),
   scales each K tile's partial product per row by that row's activation scale and per column by
   the weight block scale, and writes the fp32 per-pair result y [P, H].
4. Combine, grid (row, H tile): out[r] = sum_j w[r, j] * y[r * k + j] in slot order, cast to
   out_dtype. Padding rows read nothing and write exact zeros. With `residual` it also adds out to the
   residual stream and prepares the next RMSNorm (h, h * w, the tile's sum of h^2), so that the next
   layer's q/k/v projection takes that norm without a launch of its own (fp8_linear's `rms`; the kernel
   plan's `fused_input_norm`).

Every sum has the order it had with the grouping launch (splits in order, slots in order, one dot
per row and K tile), and a row's dot result does not depend on which other rows share its tile or
where in the tile it sits (the grouped form packed a segment's rows at the top), so the output is
bit-identical to that five-launch form: tests/test_kernel_moe.py keeps it as a reference and checks.

GROUP must equal Down's weight block along I (B1): then a K tile of Down lies in one activation
group and one weight block, so both scales factor out of the tile's dot product exactly as in
DeepSeek-V3's fp8_gemm. The wrapper rejects any other GROUP; I_r must be a multiple of GROUP.

E4M3 rounding is done explicitly (round half to even onto the E4M3 grid in fp32, then the bit
pattern assembled with integer ops) instead of a `.to(tl.float8e4nv)` cast: Triton 3.6's interpreter
rounds fp32 -> e4m3 wrongly at and near midpoints and drops the sign of -0, while the explicit form
is what torch and the GPU's `cvt.rn.satfinite` compute, so one path is bit-exact on both. The same
holds for fp32 x with compute_dtype bf16: on the GPU `.to(tl.bfloat16)` rounds to nearest even like
torch's `.to`, but the interpreter truncates (its "rtne" mode rounds half up without carry, and it
mangles subnormals), so x is rounded onto the bf16 grid with integer ops; the GPU then casts it
exactly and the interpreter, which computes in fp32 anyway, keeps it in fp32.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .device import FLOATS as _FLOATS, row_groups, sm_count as _sm_count
from .f16_operands import bf16_grid, f16_rows, tile_width
from .launch import launch_options, prefetch_lines, prefetch_rows, wait_for_inputs
from .moe_route import MAX_PAIRS, check_live, load_live

# Under TRITON_INTERPRET=1 (read when triton is imported) tl.dot on bf16 is wrong (GPU_FACTS.md): upcast.
INTERPRETED = bool(triton.knobs.runtime.interpret)
BLOCK_M = 16  # tl.dot's smallest M; a program's rows are the block's R rows (R <= 8 at decode), in blocks of it
# Gate/Up program tile: 128 channels x block_k of K. 128 x 128 with Down at 128 x 64 was the fastest on an H200
# at one TP8 rank's decode shape: 58.3 -> 54.8 us a call (`iquest bench tune`, bench/results/tune-h200-932ec08.*).
# Then 4 warps for Gate/Up (8 before) and a 2-deep pipeline for Down (Triton's default 3 before): 54.7 -> 48.6 us,
# the output bit-identical to the previous defaults' (bench/results/tune-h200-a788a79.*): launch settings
# that do not change any tile's dot or sum order.
# Then fp16 tensor-core operands (F16_OPERANDS, kernels/f16_operands.py) with a 3-deep Down pipeline: 48.6 -> 37.5 us,
# bit-identical again (bench/results/tune-h200-f16-ef1c46c.*). The E4M3 -> bf16 conversion had set Gate/Up's and
# Down's time (ncu: 34% of DRAM bandwidth; F2F and PRMT the top stalls), not the bytes.
GATE_UP_BLOCK_N = 128
GATE_UP_WARPS = 4
NUM_STAGES = 3  # Triton's default software pipelining depth, named so that `iquest bench tune` can sweep it
DOWN_WARPS = 4
DOWN_STAGES = 3
F16_OPERANDS = True
FP8_DOWN = False  # E4M3 operands straight into Down's tensor cores, a numerical change: moe(fp8_down=)
# Down's tile with fp8_down: 128 deep, 2 stages: 29.31 -> 28.07 us a MoE call against the fp16-operand default, the
# fastest of ten E4M3 settings (bench/results/tune-h200-fp8-a1380b4.*). moe()'s down_block_k/down_stages default to
# the form's own.
DOWN_BLOCK_K = 64
FP8_DOWN_BLOCK_K = 128
FP8_DOWN_STAGES = 2


def fp8_down_fits(down_block_n: int) -> bool:
    """Whether Down's tiles can be the E4M3 wgmma's row operand: >= 64 rows (its M)."""
    return down_block_n >= 64


def fp8_down_applies(fp8_down: bool, compute_dtype: torch.dtype, device: torch.device,
                     down_block_n: int = 128) -> bool:
    """Whether moe(fp8_down=True) takes the E4M3 wgmma: on the GPU (not the interpreter), for bf16/fp16 compute
    (fp32 compute keeps fp32 products), with tiles that fit it (`fp8_down_fits`)."""
    return (fp8_down and not INTERPRETED and device.type == "cuda" and compute_dtype != torch.float32
            and fp8_down_fits(down_block_n))


def down_tile(fp8_down: bool, block_k: int | None = None, stages: int | None = None) -> tuple[int, int]:
    """Down's (K tile cap, pipeline stages): the given ones, else the defaults measured for its operand form."""
    return (block_k if block_k is not None else FP8_DOWN_BLOCK_K if fp8_down else DOWN_BLOCK_K,
            stages if stages is not None else FP8_DOWN_STAGES if fp8_down else DOWN_STAGES)


FINALIZE_ROWS = 2  # pairs per finalize program: its loads are SPLIT x 2 x ROWS x GROUP fp32, spread widely
COMBINE_BLOCK = 256  # columns per combine program (k fp32 loads each): ~200 programs for 8 rows at H = 6144
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
def _expert_owner(experts_ptr, live_ptr, p, R, K_TOP: tl.constexpr, P_PAD: tl.constexpr,
                  LIVE_COUNT: tl.constexpr):
    """(e = experts[p], whether pair p's program handles e): p's row is live and no earlier live pair
    (q < p, row-major) chose e."""
    e = tl.load(experts_ptr + p)
    run = load_live(live_ptr, p // K_TOP, R, LIVE_COUNT)
    q = tl.arange(0, P_PAD)
    before = q < p
    same = before & (tl.load(experts_ptr + q, mask=before, other=-1) == e)
    same = same & load_live(live_ptr, q // K_TOP, R, LIVE_COUNT)
    return e, run & (tl.sum(same.to(tl.int32), axis=0) == 0)


@triton.jit
def _expert_rows(experts_ptr, live_ptr, e, m0, R, K_TOP: tl.constexpr, K_PAD: tl.constexpr,
                 BLOCK_M: tl.constexpr, LIVE_COUNT: tl.constexpr):
    """Rows m0 .. m0 + BLOCK_M - 1: (rows, their pair r * k + j_r with j_r the slot of e, mask of the
    live rows that chose e). A row's experts are distinct: at most one slot matches."""
    rows = m0 + tl.arange(0, BLOCK_M)
    j = tl.arange(0, K_PAD)
    ex = tl.load(experts_ptr + rows[:, None] * K_TOP + j[None, :],
                 mask=(rows < R)[:, None] & (j < K_TOP)[None, :], other=-1)
    hit = ex == e
    ok = (tl.sum(hit.to(tl.int32), axis=1) > 0) & load_live(live_ptr, rows, R, LIVE_COUNT)
    return rows, rows * K_TOP + tl.sum(tl.where(hit, j[None, :], 0), axis=1), ok


@triton.jit
def _moe_gate_up_kernel(
    x_ptr, xd_ptr, g_ptr, gs_ptr, u_ptr, us_ptr, experts_ptr, live_ptr, part_ptr, ran_ptr,
    R, H, I, P, stride_x, stride_xd, s_rows, s_cols, k_per_split,
    K_TOP: tl.constexpr, K_PAD: tl.constexpr, P_PAD: tl.constexpr, LIVE_COUNT: tl.constexpr,
    B0: tl.constexpr, B1: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
    ROUND_BF16: tl.constexpr, F32: tl.constexpr, PREC: tl.constexpr, STORE_RAN: tl.constexpr,
    PDL: tl.constexpr = False, F16: tl.constexpr = False, PRESCALED: tl.constexpr = False, TMA: tl.constexpr = False,
):
    wait_for_inputs(PDL)
    p = tl.program_id(0)
    tile = tl.program_id(1)
    split = tl.program_id(2)
    e, run = _expert_owner(experts_ptr, live_ptr, p, R, K_TOP, P_PAD, LIVE_COUNT)
    if STORE_RAN:  # tests only (`_moe_probed`): which pairs' programs did the work
        tl.store(ran_ptr + p, run.to(tl.int32), mask=(tile == 0) & (split == 0))
    # No pass unless this program owns e; one when R <= BLOCK_M (always at k = 8: R * k <= MAX_PAIRS). A live
    # row above the owner's that chose e would own it instead, so the passes start at the owner's row block.
    for m0 in range((p // K_TOP) // BLOCK_M * BLOCK_M, tl.where(run, R, 0), BLOCK_M):
        rows, pair, m_ok = _expert_rows(experts_ptr, live_ptr, e, m0, R, K_TOP, K_PAD, BLOCK_M, LIVE_COUNT)
        if tl.sum(m_ok.to(tl.int32), axis=0) > 0:  # a block of rows none of which chose e streams nothing
            n = tile * BLOCK_N + tl.arange(0, BLOCK_N)  # BLOCK_N divides I: always in range
            k_start = split * k_per_split  # a multiple of BLOCK_K, which divides B1
            k_end = tl.minimum(k_start + k_per_split, H)
            ex = e.to(tl.int64)
            if not TMA:  # with TMA, g_ptr and u_ptr are tensor descriptors of the [E, I, H] weights
                g_rows = g_ptr + ex * I * H + n[:, None] * H
                u_rows = u_ptr + ex * I * H + n[:, None] * H
            gs_row = gs_ptr + ex * s_rows * s_cols + (n // B0) * s_cols
            us_row = us_ptr + ex * s_rows * s_cols + (n // B0) * s_cols
            x_rows = x_ptr + rows[:, None] * stride_x
            xd_rows = xd_ptr + rows * stride_xd
            acc_g = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
            acc_u = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
            for k0 in range(k_start, k_end, BLOCK_K):
                kk = k0 + tl.arange(0, BLOCK_K)
                k_ok = kk < H
                x = tl.load(x_rows + kk[None, :], mask=m_ok[:, None] & k_ok[None, :], other=0.0)
                if PRESCALED:  # x is already the tile's fp16 operand (made by the norm), with its 2^-s per row
                    x_down = tl.load(xd_rows + k0 // BLOCK_K, mask=m_ok, other=1.0)
                elif ROUND_BF16:  # fp32 x, bf16 compute: onto the bf16 grid; F32 (interpreter) keeps it in fp32
                    x = bf16_grid(x)
                    if not F32 and not F16:
                        x = x.to(tl.bfloat16)  # exact
                if TMA:  # the copy engine fetches the tiles: no per-element addresses in the program
                    wg = g_ptr.load([e.to(tl.int32), tile * BLOCK_N, k0]).reshape(BLOCK_N, BLOCK_K)
                    wu = u_ptr.load([e.to(tl.int32), tile * BLOCK_N, k0]).reshape(BLOCK_N, BLOCK_K)
                else:
                    wg = tl.load(g_rows + kk[None, :], mask=k_ok[None, :], other=0.0)
                    wu = tl.load(u_rows + kk[None, :], mask=k_ok[None, :], other=0.0)
                sg = tl.load(gs_row + k0 // B1)[None, :]  # the tile lies in one K block
                su = tl.load(us_row + k0 // B1)[None, :]
                if F32:
                    x = x.to(tl.float32)
                    if PRESCALED:
                        x = x * x_down[:, None]  # the bf16 value again, exactly
                    wg = wg.to(tl.float32)
                    wu = wu.to(tl.float32)
                elif F16:  # x's rows scaled by powers of two into exact fp16 (kernels/f16_operands.py)
                    if not PRESCALED:
                        x, x_down = f16_rows(x.to(tl.float32))
                    sg = x_down[:, None] * sg  # exact: the scaled product rounds as the unscaled one did
                    su = x_down[:, None] * su
                    wg = wg.to(tl.float16)  # exact, one conversion per two weights
                    wu = wu.to(tl.float16)
                else:
                    wg = wg.to(x.dtype)  # exact
                    wu = wu.to(x.dtype)
                acc_g += tl.dot(x, tl.trans(wg), input_precision=PREC) * sg
                acc_u += tl.dot(x, tl.trans(wu), input_precision=PREC) * su
            dst = part_ptr + ((split * P + pair) * 2)[:, None] * I + n[None, :]
            tl.store(dst, acc_g, mask=m_ok[:, None])
            tl.store(dst + I, acc_u, mask=m_ok[:, None])


@triton.jit
def _split_sum(part_ptr, pair, n, ok, P, I, SPLIT: tl.constexpr):
    """Gate's and Up's fp32 partials of `pair`'s rows at channels n summed over the splits in the order s = 0, 1, ...
    (the sum must not depend on scheduling), and how many were added (compile-time; the probe stores it).
    Unrolled, so every split's loads issue at once."""
    src = part_ptr + (pair * 2)[:, None] * I + n[None, :]
    g = tl.zeros([pair.shape[0], n.shape[0]], tl.float32)
    u = tl.zeros([pair.shape[0], n.shape[0]], tl.float32)
    summed = 0
    for s in tl.static_range(SPLIT):
        g += tl.load(src + s * P * 2 * I, mask=ok[:, None], other=0.0)
        u += tl.load(src + s * P * 2 * I + I, mask=ok[:, None], other=0.0)
        summed += 1
    return g, u, summed


@triton.jit
def _act_store(g, u, pair, n0, ok, act_ptr, act_s_ptr, h_ptr, count_ptr, summed, I,
               GROUP: tl.constexpr, STORE_H: tl.constexpr):
    """SiLU(g) * u for `pair`'s rows at channels n0 .. n0 + width (whole act_quant groups), quantized per row and
    GROUP channels into `act` (E4M3 bits) and `act_scale`; stored where `ok`. STORE_H (tests only, `_moe_probed`)
    also stores the fp32 hidden and the splits summed."""
    ROWS: tl.constexpr = g.shape[0]
    WIDTH: tl.constexpr = g.shape[1]
    n = n0 + tl.arange(0, WIDTH)
    h = g * tl.sigmoid(g) * u
    q8, sc = _act_quant_tile(tl.reshape(h, [ROWS * (WIDTH // GROUP), GROUP]))  # one group per row, in order
    tl.store(act_ptr + pair[:, None] * I + n[None, :], tl.reshape(q8, [ROWS, WIDTH]), mask=ok[:, None])
    grp = n0 // GROUP + tl.arange(0, WIDTH // GROUP)
    tl.store(act_s_ptr + pair[:, None] * (I // GROUP) + grp[None, :], tl.reshape(sc, [ROWS, WIDTH // GROUP]),
             mask=ok[:, None])
    if STORE_H:
        tl.store(h_ptr + pair[:, None] * I + n[None, :], h, mask=ok[:, None])
        tl.store(count_ptr + pair, summed + 0 * pair, mask=ok & (n0 == 0))


@triton.jit
def _moe_finalize_kernel(
    part_ptr, live_ptr, act_ptr, act_s_ptr, h_ptr, count_ptr, R, P, I,
    K_TOP: tl.constexpr, LIVE_COUNT: tl.constexpr,
    SPLIT: tl.constexpr, GROUP: tl.constexpr, ROWS: tl.constexpr, STORE_H: tl.constexpr,
    PDL: tl.constexpr = False,
):
    wait_for_inputs(PDL)
    pair = tl.program_id(0) * ROWS + tl.arange(0, ROWS)
    tile = tl.program_id(1)
    in_range = pair < P
    ok = in_range & load_live(live_ptr, pair // K_TOP, R, LIVE_COUNT)  # padding rows' pairs stay unwritten
    # The loads do not wait for liveness (a padding pair reads its never-written partials, and nothing of it is
    # stored): they go out with the live mask's.
    g, u, summed = _split_sum(part_ptr, pair, tile * GROUP + tl.arange(0, GROUP), in_range, P, I, SPLIT)
    _act_store(g, u, pair, tile * GROUP, ok, act_ptr, act_s_ptr, h_ptr, count_ptr, summed, I, GROUP, STORE_H)


@triton.jit
def _moe_down_kernel(
    act_ptr, act_s_ptr, w_ptr, ws_ptr, experts_ptr, live_ptr, y_ptr, ran_ptr,
    R, H, I, s_rows, s_cols,
    K_TOP: tl.constexpr, K_PAD: tl.constexpr, P_PAD: tl.constexpr, LIVE_COUNT: tl.constexpr,
    B0: tl.constexpr, GROUP: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
    F32: tl.constexpr, STORE_RAN: tl.constexpr,
    PDL: tl.constexpr = False, F16: tl.constexpr = False, TMA: tl.constexpr = False, FP8: tl.constexpr = False,
    K_PAD_DOT: tl.constexpr = 0, EARLY: tl.constexpr = False, w_raw_ptr=None, LINE_ELEMS: tl.constexpr = 128,
    LINES: tl.constexpr = 2,
):
    p = tl.program_id(0)
    tile = tl.program_id(1)
    if EARLY:
        # The routing was written before Gate/Up was launched, two launches back at least, so it is complete before
        # any program of this kernel starts (kernels/launch.py): the owner and its weight tile are known before the
        # wait, and the tile's HBM reads (into L2) overlap the previous kernel instead of following it.
        e, run = _expert_owner(experts_ptr, live_ptr, p, R, K_TOP, P_PAD, LIVE_COUNT)
        if run:
            n = tl.minimum(tile * BLOCK_N + tl.arange(0, BLOCK_N), H - 1)  # clamp, do not mask (prefetch_l2)
            prefetch_rows(w_raw_ptr + e.to(tl.int64) * H * I + n * I, 0, I, LINE_ELEMS, LINES)
        wait_for_inputs(PDL)
    else:
        wait_for_inputs(PDL)
        e, run = _expert_owner(experts_ptr, live_ptr, p, R, K_TOP, P_PAD, LIVE_COUNT)
    if STORE_RAN:
        tl.store(ran_ptr + p, run.to(tl.int32), mask=tile == 0)

    for m0 in range((p // K_TOP) // BLOCK_M * BLOCK_M, tl.where(run, R, 0), BLOCK_M):  # as in Gate/Up
        rows, pair, m_ok = _expert_rows(experts_ptr, live_ptr, e, m0, R, K_TOP, K_PAD, BLOCK_M, LIVE_COUNT)
        if tl.sum(m_ok.to(tl.int32), axis=0) > 0:
            n = tile * BLOCK_N + tl.arange(0, BLOCK_N)
            n_ok = n < H
            ex = e.to(tl.int64)
            if not TMA:  # with TMA, w_ptr is a tensor descriptor of the [E, H, I] weight
                w_rows = w_ptr + ex * H * I + n[:, None] * I
            ws_row = ws_ptr + ex * s_rows * s_cols + (n // B0) * s_cols
            if FP8:  # transposed: the weight tile is wgmma's 64+ row operand, the rows its N (16)
                acc_t = tl.zeros([BLOCK_N, BLOCK_M], tl.float32)
            else:
                acc = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
            for k0 in range(0, I, BLOCK_K):  # BLOCK_K divides GROUP == B1: one group and scale block per tile
                if K_PAD_DOT > BLOCK_K:  # an E4M3 wgmma is >= 32 deep: the tile padded with zeros (small blocks only)
                    kk = k0 + tl.arange(0, K_PAD_DOT)
                    k_in = tl.arange(0, K_PAD_DOT) < BLOCK_K
                    a = tl.load(act_ptr + pair[:, None] * I + kk[None, :], mask=m_ok[:, None] & k_in[None, :],
                                other=0.0)
                    w = tl.load(w_rows + kk[None, :], mask=n_ok[:, None] & k_in[None, :], other=0.0)
                else:
                    kk = k0 + tl.arange(0, BLOCK_K)
                    a = tl.load(act_ptr + pair[:, None] * I + kk[None, :], mask=m_ok[:, None], other=0.0)
                    if TMA:
                        w = w_ptr.load([e.to(tl.int32), tile * BLOCK_N, k0]).reshape(BLOCK_N, BLOCK_K)
                    else:
                        w = tl.load(w_rows + kk[None, :], mask=n_ok[:, None], other=0.0)
                sa = tl.load(act_s_ptr + pair * (I // GROUP) + k0 // GROUP, mask=m_ok, other=0.0)
                sw = tl.load(ws_row + k0 // GROUP, mask=n_ok, other=0.0)
                if FP8:  # E4M3 x E4M3 on the tensor cores, no conversion: a numerical change (the MMA's own
                    # accumulation of a tile's products; docs/PERF.md), scaled and summed in fp32 per tile as below
                    acc_t += tl.dot(w, tl.trans(a)) * sa[None, :] * sw[:, None]
                else:
                    if F32:
                        part = tl.dot(a.to(tl.float32), tl.trans(w.to(tl.float32)), input_precision="ieee")
                    elif F16:  # E4M3 -> fp16 is exact too, in one conversion per two values instead of two steps
                        part = tl.dot(a.to(tl.float16), tl.trans(w.to(tl.float16)))
                    else:  # E4M3 -> bf16 is exact and so are the products; the dot accumulates in fp32
                        part = tl.dot(a.to(tl.bfloat16), tl.trans(w.to(tl.bfloat16)))
                    acc += part * sa[:, None] * sw[None, :]  # the act scale differs per row (pair)
            if FP8:
                tl.store(y_ptr + pair[None, :] * H + n[:, None], acc_t, mask=m_ok[None, :] & n_ok[:, None])
            else:
                tl.store(y_ptr + pair[:, None] * H + n[None, :], acc, mask=m_ok[:, None] & n_ok[None, :])


@triton.jit
def _combine_rows(y_ptr, weights_ptr, live_ptr, out_ptr, r, n, R, H, stride_o, K_TOP: tl.constexpr,
                  LIVE_COUNT: tl.constexpr):
    """out[r, n] = sum_j w[r, j] * y[r * k + j, n] in slot order, cast to out's dtype, for rows r < R. The loads do
    not wait for liveness (they go out with it): a padding row's pairs have no y (never computed), so its sum is
    garbage and replaced by exact zeros."""
    r_ok = r < R
    n_ok = n < H
    live = load_live(live_ptr, r, R, LIVE_COUNT) & r_ok
    acc = tl.zeros([r.shape[0], n.shape[0]], tl.float32)
    for j in tl.static_range(K_TOP):  # slot order, fixed
        w = tl.load(weights_ptr + r * K_TOP + j, mask=r_ok, other=0.0)
        acc += w[:, None] * tl.load(y_ptr + (r * K_TOP + j)[:, None] * H + n[None, :],
                                    mask=r_ok[:, None] & n_ok[None, :], other=0.0)
    acc = tl.where(live[:, None], acc, 0.0).to(out_ptr.dtype.element_ty)
    tl.store(out_ptr + r[:, None] * stride_o + n[None, :], acc, mask=r_ok[:, None] & n_ok[None, :])
    return acc


@triton.jit
def _moe_combine_kernel(
    y_ptr, weights_ptr, live_ptr, out_ptr, R, H, stride_o,
    K_TOP: tl.constexpr, BLOCK: tl.constexpr, LIVE_COUNT: tl.constexpr,
    PDL: tl.constexpr = False,
    res_ptr=None, h_ptr=None, sumsq_ptr=None, nw_ptr=None, g_ptr=None, stride_res=0, stride_h=0, stride_sumsq=0,
    RESIDUAL: tl.constexpr = False, EARLY: tl.constexpr = False,
):
    r = tl.program_id(0) + tl.arange(0, 1)
    n = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    ok = (r < R)[:, None] & (n < H)[None, :]
    if RESIDUAL:  # the next norm's weight is constant
        nw = tl.load(nw_ptr + n, mask=n < H, other=0.0).to(tl.float32)
    if RESIDUAL and EARLY:  # the stream was written by the post-attention norm, launches back (kernels/launch.py)
        x = tl.load(res_ptr + r[:, None] * stride_res + n[None, :], mask=ok, other=0.0)
    wait_for_inputs(PDL)
    if RESIDUAL and not EARLY:
        x = tl.load(res_ptr + r[:, None] * stride_res + n[None, :], mask=ok, other=0.0)
    o = _combine_rows(y_ptr, weights_ptr, live_ptr, out_ptr, r, n, R, H, stride_o, K_TOP, LIVE_COUNT)
    if RESIDUAL:
        # The next norm's add, as rmsnorm_residual does it (the sum rounded to the stream's dtype); the tile's share of
        # that norm's sum of squares; and h times the norm's weight, rounded to the stream's dtype: the consumer's
        # input, whose product it scales by each row's 1 / rms (fp8_linear's `rms`).
        h = _round_to(x.to(tl.float32) + o.to(tl.float32), h_ptr.dtype.element_ty)
        tl.store(h_ptr + r[:, None] * stride_h + n[None, :], h, mask=ok)
        hf = h.to(tl.float32)
        tl.store(sumsq_ptr + r * stride_sumsq + tl.program_id(1), tl.sum(hf * hf, axis=1), mask=r < R)
        tl.store(g_ptr + r[:, None] * stride_h + n[None, :], _round_to(hf * nw[None, :], g_ptr.dtype.element_ty),
                 mask=ok)


@triton.jit
def _round_to(v, dtype: tl.constexpr):
    """fp32 v rounded to `dtype` to nearest even, under the interpreter too (whose cast to bf16 truncates)."""
    if dtype == tl.bfloat16:
        v = bf16_grid(v)
    return v.to(dtype)


# ---- host wrappers ---------------------------------------------------------------------------------


def _check(cond: bool, message: str) -> None:
    if not cond:
        raise ValueError(f"moe: {message}")


def residual_buffers(stream: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The (h, g, sumsq) that `moe(residual=(stream, w, h, g, sumsq))` fills, for a stream [R, H]: h and g like it,
    sumsq fp32 [R, ceil(H / COMBINE_BLOCK)] (one sum of squares a combine tile)."""
    R, H = stream.shape
    sumsq = torch.empty((R, triton.cdiv(H, COMBINE_BLOCK)), dtype=torch.float32, device=stream.device)
    return torch.empty_like(stream), torch.empty_like(stream), sumsq


def _check_residual(residual, R: int, H: int, dev: torch.device) -> None:
    if residual is None:
        return
    stream, weight, h, g, sumsq = residual
    for name, t in (("stream", stream), ("h", h), ("g", g)):
        _check(tuple(t.shape) == (R, H) and t.dtype in _FLOATS and t.stride(1) == 1 and t.device == dev,
               f"residual's {name} must be a float [{R}, {H}] with unit stride on {dev}")
    _check(h.dtype == stream.dtype and g.dtype == stream.dtype and g.stride(0) == h.stride(0),
           f"residual's h and g must be in the stream's dtype ({stream.dtype}), with one row stride")
    _check(tuple(weight.shape) == (H,) and weight.dtype in _FLOATS and weight.is_contiguous() and weight.device == dev,
           f"residual's weight must be a contiguous float [{H}] on {dev}")
    tiles = triton.cdiv(H, COMBINE_BLOCK)
    _check(tuple(sumsq.shape) == (R, tiles) and sumsq.dtype == torch.float32 and sumsq.stride(1) == 1
           and sumsq.device == dev, f"residual's sumsq must be fp32 [{R}, {tiles}] with unit stride on {dev}")


def _residual_strides(residual) -> dict:
    if residual is None:
        return {}
    stream, weight, h, g, sumsq = residual
    return dict(res_ptr=stream, nw_ptr=weight, h_ptr=h, g_ptr=g, sumsq_ptr=sumsq, stride_res=stream.stride(0),
                stride_h=h.stride(0), stride_sumsq=sumsq.stride(0))


def _descriptor(w: torch.Tensor, tile: tuple[int, int]):
    """A tensor descriptor of the [E, rows, cols] E4M3 weight for [1, *tile] boxes (one expert's tile)."""
    from triton.tools.tensor_descriptor import TensorDescriptor

    _check(w.is_contiguous() and w.shape[-1] % 16 == 0 and w.data_ptr() % 16 == 0,
           f"tma needs contiguous weights with 16-byte aligned rows, got {tuple(w.shape)}")
    return TensorDescriptor.from_tensor(w, [1, *tile])


def tma_fits(*weights: torch.Tensor) -> bool:
    """Whether tensor descriptors can address these contiguous [E, rows, cols] weights: 16-byte aligned rows."""
    return all(w.shape[-1] % 16 == 0 and w.data_ptr() % 16 == 0 for w in weights)


def gate_up_k_tile(block: tuple[int, int], block_k: int = 128) -> int:
    """Gate/Up's K tile for weight blocks `block` (moe()'s block_k default): the width of f16_input's row tiles."""
    return _pow2_divisor(block[1], block_k)


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
    M, N = row_groups(x, group, "moe")
    q = torch.empty((M, N), dtype=torch.float8_e4m3fn, device=x.device)
    s = torch.empty((M, N // group), dtype=torch.float32, device=x.device)
    _act_quant_kernel[(triton.cdiv(M, 16), N // group)](x, q.view(torch.uint8), s, M, N, GROUP=group, BLOCK_M=16)
    return q, s


def gate_up_grid(P: int, E: int, k: int, H: int, I: int, block: tuple[int, int], block_k: int, gate_up_block_n: int,
                 split_k: int | None, sms: int) -> tuple[tuple[int, int, int], int, int, int]:
    """Gate/Up's launch: (grid (pairs, I tiles, K splits), channel tile bn, K tile bk, K columns per split)."""
    bn = _pow2_divisor(I, gate_up_block_n)  # partials need no whole group: the finalize quantizes
    bk = _pow2_divisor(block[1], block_k)
    split, k_per_split = plan_split(P, E, k, H, I, bn, bk, split_k, sms)
    return (P, I // bn, split), bn, bk, k_per_split


def expected_segments(pairs: int, experts: int, k: int) -> int:
    """Distinct experts to plan Gate/Up's K split for: a decode block's rows share most of their
    experts (13 for 6 rows at k = 8 on the full model; exactly k for one row). Guessing high is the
    cheap side: a few more segments only leave part of one wave of programs unused, while more
    programs than the GPU holds at once add a second wave whose few programs run on a nearly idle
    memory system."""
    return max(1, min(pairs, experts, 2 * k))


def plan_split(P: int, E: int, k: int, H: int, I: int, block_n: int, block_k: int, split_k: int | None,
               sms: int) -> tuple[int, int]:
    """Gate/Up's K split: (splits, K range per split). By default about two programs per SM, the
    most the GPU holds at once (GATE_UP_WARPS, ~128 registers a thread), for `expected_segments`
    segments x I_r / block_n tiles x splits (fp8_linear's rule); a K range is whole K tiles, so none
    crosses a scale block, and no split is empty."""
    k_tiles = triton.cdiv(H, block_k)
    if split_k is None:
        split_k = (2 * sms) // (expected_segments(P, E, k) * (I // block_n))
    k_per_split = triton.cdiv(k_tiles, max(1, min(split_k, k_tiles))) * block_k
    return triton.cdiv(H, k_per_split), k_per_split


def moe(x: torch.Tensor, experts: torch.Tensor, weights: torch.Tensor, live: torch.Tensor,
        gate: torch.Tensor, gate_scale: torch.Tensor, up: torch.Tensor, up_scale: torch.Tensor,
        down: torch.Tensor, down_scale: torch.Tensor, block: tuple[int, int] = (128, 128), group: int = 128,
        out_dtype: torch.dtype | None = None, *, out: torch.Tensor | None = None,
        compute_dtype: torch.dtype | None = None, block_k: int = 128, down_block_n: int = 128,
        down_block_k: int | None = None, split_k: int | None = None, gate_up_block_n: int = GATE_UP_BLOCK_N,
        gate_up_warps: int = GATE_UP_WARPS, gate_up_stages: int = NUM_STAGES, down_warps: int = DOWN_WARPS,
        down_stages: int | None = None, pdl: bool = False, f16: bool = F16_OPERANDS,
        f16_input: tuple[torch.Tensor, torch.Tensor] | None = None, tma: bool | None = None,
        fp8_down: bool = FP8_DOWN, early_down: bool = False,
        residual: tuple[torch.Tensor, ...] | None = None) -> torch.Tensor:
    """Routed-expert output [R, H] of x [R, H] (bf16/fp16/fp32) for rows chosen by `live` (bool [R]
    or an int count of leading live rows, on the device); padding rows get zeros.

    `compute_dtype` (default x.dtype) is the dtype Gate/Up reads x in: fp32 x with torch.bfloat16
    is rounded in registers (to nearest even, as x.to(torch.bfloat16)), so the result is bit-identical
    to passing x.to(torch.bfloat16) without that conversion's launch; out_dtype defaults to it.
    experts [R, k] int (valid ids < E: unchecked, that would sync), weights [R, k] fp32, R * k <=
    MAX_PAIRS; gate, up [E, I_r, H] and down [E, H, I_r] E4M3 with fp32 block scales for `block`;
    group == block[1]. `split_k` overrides the number of Gate/Up splits along H (default from the SM
    count; reduced so that no split is empty). `gate_up_block_n` (a power of two >= 16; the largest one
    dividing I_r up to it is used), `*_warps` and `*_stages` are the two weight-streaming kernels' launch
    settings, for `iquest bench tune`. `pdl`: programmatic dependent launch (kernels/launch.py). `f16`: the
    tensor cores take fp16 operands (E4M3 weights and activations exactly; bf16 x scaled per row and K tile by a
    power of two, kernels/f16_operands.py) instead of bf16; taken for bf16 compute on the GPU only (the
    interpreter computes in fp32, fp16 compute converts to fp16 already). `f16_input`: x's Gate/Up operand made
    ahead, (fp16 [R, H], 2^-s fp32 [R, H / t]) as `f16_operands.f16_rows_tiles(x rounded to bf16, t)` gives it
    with t = `gate_up_k_tile(block, block_k)` (the post-attention norm writes it: kernels/rmsnorm_residual.py);
    Gate/Up then reads it instead of x, the same operands (so the same bits) without every program rescaling x
    again; bf16 compute with the f16 path (or the interpreter) only. `tma`: Gate/Up and Down read their weight
    tiles through tensor descriptors (the Hopper copy engine) instead of per-element pointers; the same tiles, so
    the same bits; None (default): when the weights' rows are 16-byte multiples, as the descriptors need.
    `fp8_down`: Down multiplies its E4M3 activations and weights on the tensor cores as E4M3 (Hopper's wgmma, the
    weight tile as the 64+ row operand), without converting either; the products are exact but the MMA accumulates a
    tile's products in its own precision, so this is a numerical change (qualified: docs/PERF.md); taken on the GPU
    for bf16/fp16 compute with down_block_n >= 64 only (`fp8_down_applies`). `early_down` (with `pdl`): Down's
    programs read the routing and ask L2 for their expert's weight tile before the PDL wait (the routing was complete
    two launches earlier: kernels/launch.py), so the tile's reads overlap the finalize; a hint, the same bits.
    `residual` = (stream [R, H], w [H], h [R, H], g [R, H], sumsq [R, ceil(H / t)] fp32, t = COMBINE_BLOCK;
    `residual_buffers` makes the last three), w the next RMSNorm's weight: the combine also adds `out` to the
    residual stream, h = stream + out rounded to the stream's dtype (as rmsnorm_residual forms the next norm's
    input), and writes each row's sum of h^2 over each t columns and g = h * w rounded to that dtype. A consumer then
    takes the norm's product as g's product scaled by each row's 1 / rms (fp8_linear's `rms`), and the next norm's
    launch is gone. With `early_down` the stream is read before the PDL wait (the caller's post-attention norm wrote
    it launches earlier)."""
    probe = _PROBE
    _check(x.dim() == 2 and x.dtype in _FLOATS and x.stride(1) == 1, "x must be a float [R, H] with unit stride")
    R, H = x.shape
    compute_dtype = compute_dtype or x.dtype
    _check(compute_dtype == x.dtype or (x.dtype == torch.float32 and compute_dtype == torch.bfloat16),
           f"compute_dtype {compute_dtype} must be x's dtype ({x.dtype}), or bf16 for fp32 x")
    _check(experts.dim() == 2 and experts.shape[0] == R and experts.dtype in (torch.int32, torch.int64),
           f"experts must be int [{R}, k], got {experts.dtype} {tuple(experts.shape)}")
    k = experts.shape[1]
    P = R * k
    _check(1 <= P <= MAX_PAIRS, f"R * k = {P} pairs, at most {MAX_PAIRS}")
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
    out_dtype = out_dtype or compute_dtype
    _check(out_dtype in _FLOATS, f"out_dtype {out_dtype} must be bf16, fp16 or fp32")
    if out is None:
        out = torch.empty((R, H), dtype=out_dtype, device=x.device)
    _check(tuple(out.shape) == (R, H) and out.dtype == out_dtype and out.stride(1) == 1,
           f"out must be [{R}, {H}] {out_dtype} with unit stride")
    _check(down_block_n >= 16 and down_block_n & (down_block_n - 1) == 0,
           "down_block_n must be a power of two >= 16 (a dot operand)")
    _check(split_k is None or split_k >= 1, f"split_k must be >= 1, got {split_k}")
    _check(gate_up_block_n >= 16 and gate_up_block_n & (gate_up_block_n - 1) == 0,
           f"gate_up_block_n must be a power of two >= 16 (a dot operand), got {gate_up_block_n}")
    for name, w in (("gate_up_warps", gate_up_warps), ("down_warps", down_warps)):
        _check(w in (1, 2, 4, 8, 16), f"{name} must be 1, 2, 4, 8 or 16, got {w}")
    fp8_down = fp8_down_applies(fp8_down, compute_dtype, x.device, down_block_n)
    down_block_k, down_stages = down_tile(fp8_down, down_block_k, down_stages)
    for name, st in (("gate_up_stages", gate_up_stages), ("down_stages", down_stages)):
        _check(isinstance(st, int) and 1 <= st <= 8, f"{name} must be an int in 1..8, got {st}")

    experts = experts.contiguous()
    live_arg = live.view(torch.uint8) if live.dtype == torch.bool else live
    i_tiles = I // group
    grid, bn, bk, k_per_split = gate_up_grid(P, E, k, H, I, block, block_k, gate_up_block_n, split_k,
                                             _sm_count(x.device))
    split = grid[2]
    routing = dict(K_TOP=k, K_PAD=max(2, triton.next_power_of_2(k)), P_PAD=max(16, triton.next_power_of_2(P)),
                   LIVE_COUNT=count)

    dev = x.device
    part = torch.empty((split, P, 2, I), dtype=torch.float32, device=dev)
    act = torch.empty((P, I), dtype=torch.float8_e4m3fn, device=dev)
    act_scale = torch.empty((P, i_tiles), dtype=torch.float32, device=dev)
    y = torch.empty((P, H), dtype=torch.float32, device=dev)
    store_h = probe is not None
    hidden = torch.full((P, I), float("nan"), device=dev) if store_h else act_scale
    counts = torch.zeros(P, dtype=torch.int32, device=dev) if store_h else act_scale
    programs = torch.full((2, P), -1, dtype=torch.int32, device=dev) if store_h else act_scale
    f32 = INTERPRETED or compute_dtype == torch.float32
    f16 = f16 and not f32 and compute_dtype == torch.bfloat16  # fp16 compute converts E4M3 to fp16 already
    launch = launch_options(pdl, dev)
    x_in, xd_in = x, x  # xd_in: unused pointer unless prescaled
    if f16_input is not None:
        tile = tile_width(f16_input, R, H, dev, "moe: f16_input")
        _check(tile == bk, f"f16_input's tiles are {tile} wide; Gate/Up's K tile here is {bk}")
        x_in, xd_in = f16_input
        _check(compute_dtype == torch.bfloat16 and (f16 or f32),
               f"f16_input is Gate/Up's fp16 operand: it needs bf16 compute (got {compute_dtype}) with f16=True")
    _check_residual(residual, R, H, dev)

    early = bool(early_down and pdl and not INTERPRETED)  # without the wait there is nothing to run ahead of
    line_elems, lines = prefetch_lines(I, 1)

    down_bk = _pow2_divisor(group, down_block_k)
    down_k_pad = max(down_bk, 32) if fp8_down else down_bk  # an E4M3 wgmma is 32 deep
    g_arg, u_arg, d_arg = gate, up, down
    if tma is None:
        tma = tma_fits(gate, up, down)
    if tma:
        g_arg, u_arg = _descriptor(gate, (bn, bk)), _descriptor(up, (bn, bk))
    down_tma = tma and down_k_pad == down_bk  # a padded tile reads through masked pointers
    if down_tma:
        d_arg = _descriptor(down, (down_block_n, down_bk))
    _moe_gate_up_kernel[grid](
        x_in, xd_in, g_arg, gate_scale, u_arg, up_scale, experts, live_arg, part, programs[0], R, H, I, P,
        x_in.stride(0), xd_in.stride(0), gate_scale.shape[1], gate_scale.shape[2], k_per_split, **routing,
        B0=block[0], B1=block[1], BLOCK_M=BLOCK_M, BLOCK_N=bn, BLOCK_K=bk,
        ROUND_BF16=f16_input is None and compute_dtype != x.dtype, F32=f32, PREC="ieee" if f32 else "tf32",
        STORE_RAN=store_h, F16=f16, PRESCALED=f16_input is not None, TMA=tma, num_warps=gate_up_warps,
        num_stages=gate_up_stages, **launch)
    _moe_finalize_kernel[(triton.cdiv(P, FINALIZE_ROWS), i_tiles)](
        part, live_arg, act.view(torch.uint8), act_scale, hidden, counts, R, P, I, K_TOP=k, LIVE_COUNT=count,
        SPLIT=split, GROUP=group, ROWS=FINALIZE_ROWS, STORE_H=store_h, num_warps=4, **launch)
    _moe_down_kernel[(P, triton.cdiv(H, down_block_n))](
        act, act_scale, d_arg, down_scale, experts, live_arg, y, programs[1], R, H, I,
        down_scale.shape[1], down_scale.shape[2], **routing,
        B0=block[0], GROUP=group, BLOCK_M=BLOCK_M, BLOCK_N=down_block_n,
        BLOCK_K=down_bk, F32=INTERPRETED, STORE_RAN=store_h, num_warps=down_warps,
        num_stages=down_stages, F16=f16, TMA=down_tma, FP8=fp8_down, K_PAD_DOT=down_k_pad,
        EARLY=early, w_raw_ptr=down, LINE_ELEMS=line_elems, LINES=lines, **launch)
    _moe_combine_kernel[(R, triton.cdiv(H, COMBINE_BLOCK))](
        y, weights, live_arg, out, R, H, out.stride(0), K_TOP=k, BLOCK=COMBINE_BLOCK, LIVE_COUNT=count,
        num_warps=4, **_residual_strides(residual), RESIDUAL=residual is not None, EARLY=early, **launch)
    if store_h:
        probe.update(act=act, act_scale=act_scale, hidden=hidden, split=split, split_counts=counts, programs=programs,
                     fp8_down=fp8_down, early_down=early)
    return out


# ---- instrumentation, for tests only ---------------------------------------------------------------
_PROBE: dict | None = None  # set only inside `_moe_probed`


def _moe_probed(*args, **kwargs) -> tuple[torch.Tensor, dict]:
    """Tests only: `moe(*args, **kwargs)` with the kernels' instrumentation compiled in (their STORE_RAN / STORE_H
    stores, which the product's launches compile out), returning (out, probe). The probe holds the E4M3 `act` and
    its `act_scale`, the fp32 `hidden` before quantization (NaN where the finalize wrote nothing), the `split` used,
    `split_counts` [P] (splits the finalize summed per live pair, 0 elsewhere), `programs` [2, P] int32 (1 where pair
    p's Gate/Up, resp. Down, program did the work: the first live pair of each distinct expert), and whether
    `fp8_down` and `early_down` were taken (the negative controls read what their broken pieces did from it:
    tests/kernel_controls.py). Not thread-safe: the switch is module state, set for the one call."""
    global _PROBE
    probe: dict = {}
    _PROBE = probe
    try:
        out = moe(*args, **kwargs)
    finally:
        _PROBE = None
    return out, probe


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
