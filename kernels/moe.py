"""The routed experts of one rank (docs/model.md, "MoE" and "Tensor parallelism"), in the arithmetic of their torch
form (fast/torch_ops.py `TorchOps.moe`, mirrored here as `moe_torch`):

    out[r] = sum_j w[r, j] * fp32( Down_e( silu(Gate_e b_r) * Up_e b_r ) ),   e = experts[r, j]

Each expert's weights are block-FP8 (E4M3 `q`, fp32 block scales), this rank's slice of its intermediate dimension:
Gate/Up [E, I_r, H] and Down [E, H, I_r]. A slice need not start on a scale block's edge (at TP 8, 192 of 1536 rows:
every odd rank starts 64 rows into a 128-row block), so every weight element takes its scale from its global row and
column, `ExpertWeights.offset` being where the slice starts inside its first block. A K step that lies inside one
scale block (the TP 8 shards' offsets of 0 and 64, every Gate/Up step) loads one scale a row and broadcasts it; other
steps load one an element. Down is row-parallel: the caller all-reduces `out`.

Rounding points, as the torch form has them, for b in dtype T (bf16 in the engine; fp32 on CPU tests):
- a weight element is T(fp32(q) * scale) (Weight.dense's dequantization); with `MoESettings.gate_up_scale="product"`
  Gate/Up's weights are the exact E4M3 values and each K step's fp32 product is multiplied by the row's scale
  (`moe_torch(settings=...)` holds that form and `gate_up_split`'s);
- Gate b and Up b accumulate products in fp32 and round once to T; silu is computed in fp32 from that T value,
  x / (1 + exp(-x)), and rounded to T; silu * up is rounded to T;
- Down's product accumulates in fp32 and rounds once to T (with `MoESettings.down_scale="product"` over the exact
  E4M3 values, each K step's product, or each scale block's part of it, multiplied by the row's scale);
- the combine multiplies that value by w in fp32, rounded, and adds the k slots in slot order j = 0, 1, ... in fp32.
What cannot be reproduced is the order in which a matmul library accumulates a dot product's fp32 products; that is
the measured difference (tests/test_kernel_moe.py).

Three launches, grids from shapes alone, no host sync, no atomics (graph-capturable and deterministic):
1. Gate/Up, grid (pair p = r * k + j, I_r tile): program p owns expert e = experts[p] when p's row is live and no
   earlier live pair (row-major) chose e, so each distinct live expert is streamed once and an expert chosen only by
   padding rows never is. The owner computes its tile for every live row that chose e (row r at its slot j_r) and
   writes the hidden silu(g) * u (T values, held in fp32) to `hidden` [P, I_r] at pair r * k + j_r. With
   `MoESettings.gate_up_split` S > 1 the grid has a third axis: S programs an owner tile walk H in whole K steps,
   store fp32 partials and count their arrival on a counter (`gate_up_locks`, left zeroed); the last sums the S
   partials in split order (whichever arrives last) and forms the hidden. An atomic, but no result depends on the
   order of arrival.
2. Down, grid (pair, H tile): the same owners, y = T(Down_e hidden) into `y` [P, H]. Its programs read the routing
   before their PDL wait (written two launches back), and the owners ask L2 for their weight tiles there
   (`MoESettings.down_prefetch`), so Down's stream overlaps Gate/Up.
3. Combine, grid (row, H tile): the weighted sum over slots; padding rows write zeros and read nothing.
Launches 1 and 2 put the pair on their grid's slowest axis (`MoESettings.pair_major`, `_grid_item`): a pair's items
are dispatched together, and row 0's pairs, which own their experts, first.
A row's experts must be distinct (top-k routing makes them so): a program finds a row's slot of e by matching.

The engine leaves the combine to the op that reads the MoE's output: `expert_outputs` runs launches 1 and 2 and
returns the uncombined `ExpertOutputs`, and `combine_add_norm` (or the peer all-reduce, kernels/allreduce.py) sums the
slots as launch 3 does, rounds the sum to the compute dtype as the engine's cast after `moe` does, and goes on into
the layer's sandwich tail (kernels/rmsnorm.py's `sandwich_tail`): one launch where the combine, the cast and
`add_norm` were three, with the same bits.

At TP 1 the tail can end launch 2 itself (issue 52: one dependent step less a layer): `gate_up` (launch 1) then
`down_add_norm`, whose Down owners each count their arrival on one int32 counter (`locks`, left zeroed: an atomic,
but the result does not depend on the order of arrival) and whose grid ends in one tail program a row, which waits
for every arrival, sums its row's slots and runs the tail, as `combine_add_norm` would on `down`'s outputs
(`expert_outputs` is `down(gate_up(...))`).

Under the interpreter, roundings to bf16 go through integer ops (bf16_round.bf16_grid), since its own cast
truncates; the GPU's cast rounds to nearest even, as torch's does, and is used there.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import NamedTuple

import torch
import triton
import triton.language as tl
from triton.language.extra import libdevice

from .device import is_pow2
from .bf16_round import bf16_grid
from . import fp8_linear as fl, rmsnorm
from .launch import launch_options, prefetch_lines, prefetch_rows, wait_for_inputs
from .moe_route import MAX_PAIRS, check_live, load_live

# Under TRITON_INTERPRET=1 (read when triton is imported) tl.dot on bf16 operands is wrong: the interpreter's dots take
# fp32 operands holding the bf16 values, whose products are exact in fp32 all the same.
INTERPRETED = bool(triton.knobs.runtime.interpret)


class ExpertWeights(NamedTuple):
    """One projection of every expert, as this rank holds it."""

    q: torch.Tensor                   # [E, rows, cols] float8_e4m3fn
    scale: torch.Tensor               # fp32 [E, ceil((rows + o0) / b0), ceil((cols + o1) / b1)], (o0, o1) = offset
    block: tuple[int, int]            # the scale block (rows, cols)
    offset: tuple[int, int] = (0, 0)  # where q[:, 0, 0] sits inside its first scale block


class ExpertHidden(NamedTuple):
    """A block's chosen experts' hidden silu(Gate b) * Up b (`gate_up`, launch 1), with what Down needs to read it
    (`down`, `down_add_norm`)."""

    hidden: torch.Tensor     # [R * k, I_r] fp32 holding compute-dtype values: pair r * k + j is row r's slot j
    experts: torch.Tensor    # [R, k] int, contiguous
    live: torch.Tensor       # the live rows as the kernels take them: a uint8 mask [R], or an int count
    count: bool              # whether `live` is a count
    dtype: torch.dtype       # the compute dtype (b's)
    rows: int                # R
    k: int                   # slots a row
    H: int                   # the hidden size, Down's output columns


class ExpertOutputs(NamedTuple):
    """A block's chosen experts' outputs before their weighted combine (`expert_outputs`): the op that reads them sums
    them (`combine`, `combine_add_norm`, or the peer all-reduce)."""

    y: torch.Tensor          # [R * k, H] fp32 holding compute-dtype values: pair r * k + j is row r's slot j
    weights: torch.Tensor    # [R, k] fp32 routing weights
    live: torch.Tensor       # the live rows as the kernels take them: a uint8 mask [R], or an int count
    count: bool              # whether `live` is a count
    dtype: torch.dtype       # the compute dtype (b's): what the combined sum is rounded to

    @property
    def rows(self) -> int:
        return self.weights.shape[0]


@dataclass(frozen=True)
class MoESettings:
    """Launch choices; none changes a result but `gate_up_scale`, `gate_up_split` and `down_scale`, numerical forms
    (each the default only once the GPU has timed and qualified it; the torch form, fast/torch_ops.py, is the weight
    form). Why each value: docs/PERF.md ("Current state"; the tiles, warps and stages carried over from the retired
    kernel: "Launch configurations", "The MoE's kernels")."""

    block_m: int = 16           # rows a dot takes: tl.dot's smallest M, and R <= 8 at decode fits one block
    gate_up_block_n: int = 32   # I_r channels a Gate/Up program: divides a TP8 rank's 192; 6 programs an expert, not 3
    # The next five: the retired kernel's tune, carried over (docs/PERF.md, "Launch configurations")
    gate_up_block_k: int = 128  # H columns a Gate/Up step: 128 x 128 weight tiles were the fastest
    down_block_n: int = 128     # H columns a Down program (Down's tile: 128 x 64)
    down_block_k: int = 64      # I_r columns a Down step (Down's tile: 128 x 64)
    warps: int = 4              # Gate/Up and Down: 4 warps beat 8
    stages: int = 3             # software pipelining depth of Down's weight stream
    # Gate/Up's: at the published shape a program walks H in 24 steps with (stages - 1) x 12 KB in flight, and its
    # time a step is that depth's latency, not bytes (a call takes as long at 38 experts as at the prefilled routing).
    # Deeper is bit for bit the same and compiles without spill, but was not faster (docs/PERF.md, "Current state",
    # "Gate/Up's H split over programs")
    gate_up_stages: int = 3
    # Where Gate/Up applies the block scales. "weight": each weight element T(fp32(q) * scale), the torch form's
    # arithmetic. "product": each E4M3 tile taken exactly (every E4M3 value is a bf16) into the step's dot, and the
    # row's scale multiplying the step's fp32 product, as kernels/fp8_linear.py does: a numerical change (one rounding
    # a weight fewer, nearer the exact dequantization) that drops the per-element FMUL, so fewer instructions a step
    # (docs/PERF.md, "What Gate/Up's compiled step says"). "product" made the round faster (0.990x at the decode
    # routing, 0.923x at 38 experts) and passed qualification at TP 1 and TP 2 (docs/PERF.md, "Current state"). A
    # step crossing scale blocks (blocks narrower than the 16-column step, as small fixtures' 8) is a dot a block
    gate_up_scale: str = "product"
    # Gate/Up's H walked by this many programs an (expert, I_r tile), each over whole K steps, their fp32 partials
    # summed in split order by the last to arrive, which then rounds and forms silu(g) * u (`gate_up_locks`): a
    # numerical change (the sum's order). A program's K steps, not bytes, set Gate/Up's time at the published shape
    # (24 steps, the same time at both routings): 4 splits make them 6, on 4x the programs. Split 4 made the op and
    # the round faster and passed qualification at TP 1 (docs/PERF.md, "Current state", "Gate/Up's H split over
    # programs")
    gate_up_split: int = 4
    combine_block: int = 256    # columns a combine program: ~100 programs for 8 rows at H = 3072
    # Down's owners ask L2 for their expert's weight tile before the PDL wait, while Gate/Up still runs (a hint: the
    # same bits), as the retired kernels' `early` did (docs/PERF.md, "Reads of data written two launches back")
    down_prefetch: bool = True
    # Gate/Up's and Down's grids with the pair on the slowest axis (the GPU dispatches x fastest): a pair's items (its
    # I_r or H tiles and splits) are adjacent, and row 0's pairs, which own their experts, are dispatched first, not
    # in every (tile, split) group behind the padding and shared pairs' programs. The same items, so the same bits;
    # the round 0.9736x paired at the decode routing, 0.9919x at 38 experts (docs/PERF.md, "Current state")
    pair_major: bool = True
    # Where Down applies its block scales, as `gate_up_scale` for Gate/Up: "product" takes each E4M3 tile exactly into
    # the step's dot and multiplies the fp32 product by each row's scale (a step whose I_r columns cross scale blocks,
    # a shard starting inside one or blocks narrower than the step, is a dot a block). A numerical change: Down's
    # compiled K step drops its per-element multiply, 333 -> 278 instructions a warp; with `down_registers=128` the
    # round gained at both routings and passed qualification at TP 1 and TP 2 (docs/PERF.md, "Current state")
    down_scale: str = "product"
    # A register cap for plain Down's launches (Triton's `maxnreg`; None: the compiler's choice). The same code and
    # bits: the product form compiles to 142 registers, and to 128 with no spill under a cap of 128, as many as the
    # weight form's (`iquest bench sass`); uncapped, fewer of its programs fit an SM beside Gate/Up's, and at 38
    # experts the form lost in the round (docs/PERF.md, "Current state"). Not Down ending in the tail (`down_launch`)
    down_registers: int | None = 128


# ---- kernels ---------------------------------------------------------------------------------------


@triton.jit
def _round(v, BF16: tl.constexpr, INTERP: tl.constexpr = True):
    """fp32 v rounded to the compute dtype, kept in fp32 (an identity for fp32 compute). The GPU's conversion rounds
    to nearest even, as torch's does; the interpreter's truncates, so there the rounding is done in integer ops."""
    if BF16:
        if INTERP:
            v = bf16_grid(v)
        else:
            v = v.to(tl.bfloat16).to(tl.float32)
    return v


@triton.jit
def _silu(g, INTERP: tl.constexpr):
    """x / (1 + exp(-x)) in fp32 with IEEE division and an accurate exp (libdevice's on the GPU, not tl.exp's
    approximation; the interpreter's is numpy's and has no libdevice), as torch computes silu."""
    if INTERP:
        return tl.div_rn(g, 1.0 + tl.exp(-g))
    return tl.div_rn(g, 1.0 + libdevice.exp(-g))


@triton.jit
def _scale_ptrs(s_ptr, rows, cols, OFF0: tl.constexpr, OFF1: tl.constexpr, B0: tl.constexpr, B1: tl.constexpr,
                stride_r):
    """Pointers [rows, cols] to each weight element's scale: the block of its global row and column (the shard
    starts OFF0 rows and OFF1 columns into its first block)."""
    return s_ptr + ((rows + OFF0) // B0)[:, None] * stride_r + ((cols + OFF1) // B1)[None, :]


@triton.jit
def _row_scales(s_ptr, n, k0, n_ok, OFF0: tl.constexpr, OFF1: tl.constexpr, B0: tl.constexpr, B1: tl.constexpr,
                stride_r):
    """The scale [BLOCK_N] of each row n of a weight tile whose columns from k0 lie in one scale block."""
    return tl.load(s_ptr + ((n + OFF0) // B0) * stride_r + (k0 + OFF1) // B1, mask=n_ok, other=0.0)


@triton.jit
def _tile_scales(s_ptr, n, k0, K, n_ok, OFF0: tl.constexpr, OFF1: tl.constexpr, B0: tl.constexpr, B1: tl.constexpr,
                 stride_r, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    """The scales [BLOCK_N, BLOCK_K] of a weight tile of rows n and columns k0 .. k0 + BLOCK_K - 1 (of K). When every
    column of the tile lies in one scale block a row's scale is one load, broadcast (not BLOCK_K loads). Otherwise
    columns past K read nothing: their block may lie past the expert's scale grid, in the next expert's (a NaN there
    times the masked weight's 0 is NaN) or past the tensor. (One return: the GPU compiler types every return of a
    helper, a pruned branch's too.)"""
    if (OFF1 % BLOCK_K == 0) and (B1 % BLOCK_K == 0):
        row = _row_scales(s_ptr, n, k0, n_ok, OFF0, OFF1, B0, B1, stride_r)
        scales = tl.broadcast_to(row[:, None], (BLOCK_N, BLOCK_K))
    else:
        kk = k0 + tl.arange(0, BLOCK_K)
        ok = n_ok[:, None] & (kk < K)[None, :]
        scales = tl.load(_scale_ptrs(s_ptr, n, kk, OFF0, OFF1, B0, B1, stride_r), mask=ok, other=0.0)
    return scales


@triton.jit
def _dequant(q_ptrs, scales, ok, BF16: tl.constexpr, INTERP: tl.constexpr):
    """A weight tile as the torch form holds it: T(fp32(q) * scale), elementwise (fp32 holding T values)."""
    q = tl.load(q_ptrs, mask=ok, other=0.0).to(tl.float32)
    return _round(q * scales, BF16, INTERP)


@triton.jit
def _scaled_dot(a, q_ptrs, s_ptr, n, k0, n_ok, ok, OFF0: tl.constexpr, OFF1: tl.constexpr, B0: tl.constexpr,
                B1: tl.constexpr, stride_r, BF16: tl.constexpr, DOT_F32: tl.constexpr):
    """`gate_up_scale="product"` (and `down_scale`): a [M, K] @ (E4M3 tile [N, K])^T, the tile taken exactly (every
    E4M3 value is a bf16 and an fp32), in fp32, each column n then multiplied by its row's scale (the tile's columns
    lie in one block)."""
    w = tl.load(q_ptrs, mask=ok, other=0.0).to(tl.float32)
    return _dot(a, w, BF16, DOT_F32) * _row_scales(s_ptr, n, k0, n_ok, OFF0, OFF1, B0, B1, stride_r)[None, :]


@triton.jit
def _block_dots(a, q_ptrs, s_ptr, n, k0, K, n_ok, ok, OFF0: tl.constexpr, OFF1: tl.constexpr, B0: tl.constexpr,
                B1: tl.constexpr, stride_r, BLOCK_K: tl.constexpr, BF16: tl.constexpr, DOT_F32: tl.constexpr):
    """`_scaled_dot` for a K step (its columns from k0 of K) that may cross scale blocks: one dot where the step lies
    in one block, else a dot over the columns of each block it may touch ((BLOCK_K - 1) // B1 + 2 of them: a shard
    starting mid-block, or blocks narrower than the step), each times its block's row scales. A block's scales are
    read only where a column of the step lies in it."""
    if (OFF1 % BLOCK_K == 0) and (B1 % BLOCK_K == 0):
        d = _scaled_dot(a, q_ptrs, s_ptr, n, k0, n_ok, ok, OFF0, OFF1, B0, B1, stride_r, BF16, DOT_F32)
    else:
        kk = k0 + tl.arange(0, BLOCK_K)
        first = (k0 + OFF1) // B1 * B1 - OFF1  # the first column of the block holding k0
        end = tl.minimum(K, k0 + BLOCK_K)
        d = _scaled_dot(a, q_ptrs, s_ptr, n, k0, n_ok, ok & (kk < first + B1)[None, :], OFF0, OFF1, B0, B1,
                        stride_r, BF16, DOT_F32)
        for j in tl.static_range(1, (BLOCK_K - 1) // B1 + 2):
            kj = first + j * B1
            inside = (kk >= kj) & (kk < kj + B1)
            d += _scaled_dot(a, q_ptrs, s_ptr, n, kj, n_ok & (kj < end), ok & inside[None, :], OFF0, OFF1, B0, B1,
                             stride_r, BF16, DOT_F32)
    return d


@triton.jit
def _dot(a, w, BF16: tl.constexpr, DOT_F32: tl.constexpr):
    """a [M, K] @ w [N, K]^T in fp32: bf16 operands on the tensor cores (exact: the values are bf16), fp32 ones
    (IEEE, no tf32) for fp32 compute and under the interpreter."""
    if BF16 and not DOT_F32:
        return tl.dot(a.to(tl.bfloat16), tl.trans(w.to(tl.bfloat16)))
    return tl.dot(a, tl.trans(w), input_precision="ieee")


@triton.jit
def _grid_item(PAIR_MAJOR: tl.constexpr):
    """This program's (pair, tile, split) and the grid's tile count: the grid's axes (pair, tile, split), or with
    PAIR_MAJOR (split, tile, pair), which the GPU dispatches x fastest, so the pair is slowest
    (`MoESettings.pair_major`). That order of the axes compiles to the three-axis grid's registers and K steps."""
    if PAIR_MAJOR:
        p = tl.program_id(2)
        split = tl.program_id(0)
    else:
        p = tl.program_id(0)
        split = tl.program_id(2)
    return p, tl.program_id(1), split, tl.num_programs(1)


@triton.jit
def _expert_owner(experts_ptr, live_ptr, p, R, K_TOP: tl.constexpr, P_PAD: tl.constexpr,
                  LIVE_COUNT: tl.constexpr):
    """(e = experts[p], whether pair p's program handles e): p's row is live and no earlier live pair (q < p,
    row-major) chose e."""
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
    """Rows m0 .. m0 + BLOCK_M - 1: (their pair r * k + j_r with j_r the slot of e, mask of the live rows that chose
    e). A row's experts are distinct: at most one slot matches."""
    rows = m0 + tl.arange(0, BLOCK_M)
    j = tl.arange(0, K_PAD)
    ex = tl.load(experts_ptr + rows[:, None] * K_TOP + j[None, :],
                 mask=(rows < R)[:, None] & (j < K_TOP)[None, :], other=-1)
    hit = ex == e
    ok = (tl.sum(hit.to(tl.int32), axis=1) > 0) & load_live(live_ptr, rows, R, LIVE_COUNT)
    return rows * K_TOP + tl.sum(tl.where(hit, j[None, :], 0), axis=1), ok


@triton.jit
def _gate_up_kernel(
    b_ptr, g_ptr, gs_ptr, u_ptr, us_ptr, experts_ptr, live_ptr, h_ptr, part_ptr, lock_ptr,
    R, H, I, stride_b, gs_e, gs_r, us_e, us_r, k_per,
    G_OFF0: tl.constexpr, G_OFF1: tl.constexpr, U_OFF0: tl.constexpr, U_OFF1: tl.constexpr,
    B0: tl.constexpr, B1: tl.constexpr,
    K_TOP: tl.constexpr, K_PAD: tl.constexpr, P_PAD: tl.constexpr, LIVE_COUNT: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
    BF16: tl.constexpr, DOT_F32: tl.constexpr, INTERP: tl.constexpr, PDL: tl.constexpr = False,
    SCALE_PRODUCT: tl.constexpr = False, SPLIT: tl.constexpr = 1, PAIR_MAJOR: tl.constexpr = False,
):
    wait_for_inputs(PDL)
    p, tile, split, tiles = _grid_item(PAIR_MAJOR)
    k_lo = 0
    k_hi = H
    if SPLIT > 1:
        k_lo = split * k_per
        k_hi = tl.minimum(H, k_lo + k_per)
    e, run = _expert_owner(experts_ptr, live_ptr, p, R, K_TOP, P_PAD, LIVE_COUNT)
    # A live row above the owner's that chose e would own it instead, so the row blocks start at the owner's.
    for m0 in range((p // K_TOP) // BLOCK_M * BLOCK_M, tl.where(run, R, 0), BLOCK_M):
        pair, m_ok = _expert_rows(experts_ptr, live_ptr, e, m0, R, K_TOP, K_PAD, BLOCK_M, LIVE_COUNT)
        if tl.sum(m_ok.to(tl.int32), axis=0) > 0:  # a block of rows none of which chose e streams nothing
            rows = m0 + tl.arange(0, BLOCK_M)
            n = tile * BLOCK_N + tl.arange(0, BLOCK_N)
            n_ok = n < I
            ex = e.to(tl.int64)
            g_rows = g_ptr + ex * I * H + n[:, None] * H
            u_rows = u_ptr + ex * I * H + n[:, None] * H
            acc_g = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
            acc_u = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
            for k0 in range(k_lo, k_hi, BLOCK_K):
                kk = k0 + tl.arange(0, BLOCK_K)
                k_ok = kk < H
                w_ok = n_ok[:, None] & k_ok[None, :]
                x = tl.load(b_ptr + rows[:, None] * stride_b + kk[None, :], mask=m_ok[:, None] & k_ok[None, :],
                            other=0.0).to(tl.float32)
                if SCALE_PRODUCT:
                    acc_g += _block_dots(x, g_rows + kk[None, :], gs_ptr + ex * gs_e, n, k0, H, n_ok, w_ok, G_OFF0,
                                         G_OFF1, B0, B1, gs_r, BLOCK_K, BF16, DOT_F32)
                    acc_u += _block_dots(x, u_rows + kk[None, :], us_ptr + ex * us_e, n, k0, H, n_ok, w_ok, U_OFF0,
                                         U_OFF1, B0, B1, us_r, BLOCK_K, BF16, DOT_F32)
                else:
                    sg = _tile_scales(gs_ptr + ex * gs_e, n, k0, H, n_ok, G_OFF0, G_OFF1, B0, B1, gs_r, BLOCK_N,
                                      BLOCK_K)
                    su = _tile_scales(us_ptr + ex * us_e, n, k0, H, n_ok, U_OFF0, U_OFF1, B0, B1, us_r, BLOCK_N,
                                      BLOCK_K)
                    wg = _dequant(g_rows + kk[None, :], sg, w_ok, BF16, INTERP)
                    wu = _dequant(u_rows + kk[None, :], su, w_ok, BF16, INTERP)
                    acc_g += _dot(x, wg, BF16, DOT_F32)
                    acc_u += _dot(x, wu, BF16, DOT_F32)
            mask = m_ok[:, None] & n_ok[None, :]
            last = True
            if SPLIT > 1:
                lock = (p * tiles + tile) * tl.cdiv(R, BLOCK_M) + m0 // BLOCK_M
                last, acc_g, acc_u = _split_sums(acc_g, acc_u, part_ptr, lock_ptr + lock, pair, n, mask, split,
                                                 R * K_TOP, I, SPLIT, BLOCK_M, BLOCK_N)
            if last:
                g = _round(acc_g, BF16, INTERP)
                h = _round(_round(_silu(g, INTERP), BF16, INTERP) * _round(acc_u, BF16, INTERP), BF16, INTERP)
                tl.store(h_ptr + pair[:, None] * I + n[None, :], h, mask=mask)


@triton.jit
def _split_sums(acc_g, acc_u, part_ptr, lock, pair, n, mask, split, P, I, SPLIT: tl.constexpr, BLOCK_M: tl.constexpr,
                BLOCK_N: tl.constexpr):
    """`gate_up_split`, on the FP8 linear's split-K sum (kernels/fp8_linear.py `arrive_last`, `summed_partials`):
    this split's Gate and Up partials stored (parts [SPLIT, 2, P, I] fp32: rows pair and P + pair of a split's 2P);
    the last of the tile's splits to arrive gets (True, each summed in split order from +0.0, whichever arrives last)
    and re-arms the counter; the others (False, their own partials, unused)."""
    tl.store(part_ptr + (split * 2 * P + pair[:, None]) * I + n[None, :], acc_g, mask=mask)
    tl.store(part_ptr + (split * 2 * P + P + pair[:, None]) * I + n[None, :], acc_u, mask=mask)
    last = fl.arrive_last(lock, SPLIT)
    if last:
        acc_g = fl.summed_partials(part_ptr, pair, n, mask, 2 * P, I, SPLIT, BLOCK_M, BLOCK_N)
        acc_u = fl.summed_partials(part_ptr, P + pair, n, mask, 2 * P, I, SPLIT, BLOCK_M, BLOCK_N)
        tl.atomic_xchg(lock, 0)
    return last, acc_g, acc_u


@triton.jit
def _down_kernel(
    h_ptr, d_ptr, ds_ptr, experts_ptr, live_ptr, y_ptr,
    R, H, I, ds_e, ds_r,
    D_OFF0: tl.constexpr, D_OFF1: tl.constexpr, B0: tl.constexpr, B1: tl.constexpr,
    K_TOP: tl.constexpr, K_PAD: tl.constexpr, P_PAD: tl.constexpr, LIVE_COUNT: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
    BF16: tl.constexpr, DOT_F32: tl.constexpr, INTERP: tl.constexpr, PDL: tl.constexpr = False,
    PREFETCH: tl.constexpr = False, LINE_ELEMS: tl.constexpr = 128, LINES: tl.constexpr = 2,
    PAIR_MAJOR: tl.constexpr = False, SCALE_PRODUCT: tl.constexpr = False,
):
    p, tile, _, _ = _grid_item(PAIR_MAJOR)
    e, run = _expert_owner(experts_ptr, live_ptr, p, R, K_TOP, P_PAD, LIVE_COUNT)  # before the wait: `_early_tile`
    _early_tile(d_ptr, e, run, tile, H, I, BLOCK_N, PREFETCH, LINE_ELEMS, LINES)
    wait_for_inputs(PDL)
    _down_tiles(h_ptr, d_ptr, ds_ptr, experts_ptr, live_ptr, y_ptr, e, run, p, tile, R, H, I, ds_e, ds_r, D_OFF0,
                D_OFF1, B0, B1, K_TOP, K_PAD, LIVE_COUNT, BLOCK_M, BLOCK_N, BLOCK_K, BF16, DOT_F32, INTERP,
                SCALE_PRODUCT)


@triton.jit
def _early_tile(d_ptr, e, run, tile, H, I, BLOCK_N: tl.constexpr, PREFETCH: tl.constexpr,
                LINE_ELEMS: tl.constexpr, LINES: tl.constexpr):
    """Before Down's PDL wait. The routing read for (e, run) was written two launches back (the router's select, then
    Gate/Up), so it is complete here (kernels/launch.py); with PREFETCH the owner asks L2 for its expert's
    [BLOCK_N x I] weight tile, whose stream then overlaps Gate/Up's."""
    if PREFETCH:
        if run:
            n = tl.minimum(tile * BLOCK_N + tl.arange(0, BLOCK_N), H - 1)  # clamp, do not mask (prefetch_l2)
            prefetch_rows(d_ptr + e.to(tl.int64) * H * I + n.to(tl.int64) * I, 0, I, LINE_ELEMS, LINES)


@triton.jit
def _down_tiles(h_ptr, d_ptr, ds_ptr, experts_ptr, live_ptr, y_ptr, e, run, p, tile, R, H, I, ds_e, ds_r,
                D_OFF0: tl.constexpr, D_OFF1: tl.constexpr, B0: tl.constexpr, B1: tl.constexpr,
                K_TOP: tl.constexpr, K_PAD: tl.constexpr, LIVE_COUNT: tl.constexpr, BLOCK_M: tl.constexpr,
                BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, BF16: tl.constexpr, DOT_F32: tl.constexpr,
                INTERP: tl.constexpr, SCALE_PRODUCT: tl.constexpr = False):
    """Pair program p's Down outputs for H tile `tile`: expert e's rows (when p owns e) stored into y, rounded to the
    compute dtype. SCALE_PRODUCT: `MoESettings.down_scale="product"`."""
    for m0 in range((p // K_TOP) // BLOCK_M * BLOCK_M, tl.where(run, R, 0), BLOCK_M):  # as in Gate/Up
        pair, m_ok = _expert_rows(experts_ptr, live_ptr, e, m0, R, K_TOP, K_PAD, BLOCK_M, LIVE_COUNT)
        if tl.sum(m_ok.to(tl.int32), axis=0) > 0:
            n = tile * BLOCK_N + tl.arange(0, BLOCK_N)
            n_ok = n < H
            ex = e.to(tl.int64)
            w_rows = d_ptr + ex * H * I + n[:, None] * I
            acc = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
            for k0 in range(0, I, BLOCK_K):
                kk = k0 + tl.arange(0, BLOCK_K)
                k_ok = kk < I
                a = tl.load(h_ptr + pair[:, None] * I + kk[None, :], mask=m_ok[:, None] & k_ok[None, :], other=0.0)
                if SCALE_PRODUCT:
                    acc += _block_dots(a, w_rows + kk[None, :], ds_ptr + ex * ds_e, n, k0, I, n_ok,
                                       n_ok[:, None] & k_ok[None, :], D_OFF0, D_OFF1, B0, B1, ds_r, BLOCK_K, BF16,
                                       DOT_F32)
                else:
                    sw = _tile_scales(ds_ptr + ex * ds_e, n, k0, I, n_ok, D_OFF0, D_OFF1, B0, B1, ds_r, BLOCK_N,
                                      BLOCK_K)
                    w = _dequant(w_rows + kk[None, :], sw, n_ok[:, None] & k_ok[None, :], BF16, INTERP)
                    acc += _dot(a, w, BF16, DOT_F32)
            tl.store(y_ptr + pair[:, None] * H + n[None, :], _round(acc, BF16, INTERP),
                     mask=m_ok[:, None] & n_ok[None, :])


@triton.jit
def _combine_kernel(y_ptr, weights_ptr, live_ptr, out_ptr, R, H, stride_o,
                    K_TOP: tl.constexpr, BLOCK: tl.constexpr, LIVE_COUNT: tl.constexpr, PDL: tl.constexpr = False):
    """out[r] = sum_j w[r, j] * y[r * k + j] in slot order (launched without FMA contraction: each product rounds
    before its add, as torch's multiply and then sum). A padding row reads nothing and writes zeros."""
    wait_for_inputs(PDL)
    r = tl.program_id(0)
    n = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    n_ok = n < H
    live = load_live(live_ptr, r, R, LIVE_COUNT)
    acc = weighted_sum(y_ptr, weights_ptr, r, n, n_ok, live, H, K_TOP)
    tl.store(out_ptr + r * stride_o + n, tl.where(live, acc, 0.0), mask=n_ok)


@triton.jit
def weighted_sum(y_ptr, weights_ptr, r, n, n_ok, live, H, K_TOP: tl.constexpr, CG: tl.constexpr = False):
    """sum_j w[r, j] * y[r * k + j, n] over slots j = 0, 1, ...; a padding row reads nothing and sums to +0. Each
    product rounds before its add: every kernel calling it is built without FMA contraction. CG: y read past this
    SM's L1 (".cg"), where other programs of the same launch stored it."""
    acc = tl.zeros([n.shape[0]], tl.float32)
    for j in tl.static_range(K_TOP):
        w = tl.load(weights_ptr + r * K_TOP + j, mask=live, other=0.0)
        if CG:
            v = tl.load(y_ptr + (r * K_TOP + j) * H + n, mask=n_ok & live, other=0.0, cache_modifier=".cg")
        else:
            v = tl.load(y_ptr + (r * K_TOP + j) * H + n, mask=n_ok & live, other=0.0)
        acc += w * v
    return acc


@triton.jit
def _combine_add_norm_kernel(y_ptr, weights_ptr, live_ptr, r_ptr, yw_ptr, nw_ptr, sum_ptr, h_ptr, b_ptr, R, H, eps,
                             scale, stride_r, stride_sum, stride_h, stride_b, K_TOP: tl.constexpr,
                             LIVE_COUNT: tl.constexpr, BLOCK: tl.constexpr, Y_NORM: tl.constexpr,
                             SCALED: tl.constexpr, BF16: tl.constexpr, INTERP: tl.constexpr,
                             PDL: tl.constexpr = False):
    """One row: the combine (launch 3's sum, rounded to the compute dtype) into `sum`, then the sandwich tail on it."""
    i = tl.arange(0, BLOCK)
    m = i < H
    yw, nw = rmsnorm.tail_weights(yw_ptr, nw_ptr, i, m, Y_NORM)  # constants: read before the wait
    wait_for_inputs(PDL)
    r = tl.program_id(0)
    _row_tail(r, load_live(live_ptr, r, R, LIVE_COUNT), y_ptr, weights_ptr, r_ptr, yw, nw, sum_ptr, h_ptr, b_ptr, H,
              eps, scale, stride_r, stride_sum, stride_h, stride_b, K_TOP, BLOCK, Y_NORM, SCALED, BF16, INTERP, False)


@triton.jit
def _arrive(done_ptr, run):
    """An owner's arrival on the launch's counter, once every thread's outputs are stored (release); the other Down
    programs stored nothing and leave without one."""
    tl.debug_barrier()
    tl.atomic_add(done_ptr, 1, mask=run, sem="release")


@triton.jit
def _owners(experts_ptr, live_ptr, R, K_TOP: tl.constexpr, P_PAD: tl.constexpr, LIVE_COUNT: tl.constexpr,
            CHUNK: tl.constexpr):
    """How many pairs own their expert (`_expert_owner`'s test for every pair, CHUNK pairs at a time)."""
    P = R * K_TOP
    q = tl.arange(0, P_PAD)
    e_q = tl.load(experts_ptr + q, mask=q < P, other=-1)
    live_q = load_live(live_ptr, q // K_TOP, R, LIVE_COUNT) & (q < P)
    n = 0
    for p0 in range(0, P, CHUNK):
        p = p0 + tl.arange(0, CHUNK)
        e_p = tl.load(experts_ptr + p, mask=p < P, other=-1)
        live_p = load_live(live_ptr, p // K_TOP, R, LIVE_COUNT) & (p < P)
        before = (q[None, :] < p[:, None]) & live_q[None, :] & (e_q[None, :] == e_p[:, None])
        n += tl.sum((live_p & (tl.sum(before.to(tl.int32), axis=1) == 0)).to(tl.int32), axis=0)
    return n


@triton.jit
def _await_downs(done_ptr, target, INTERP: tl.constexpr, SPINS: tl.constexpr = 1 << 22):
    """Wait until all `target` owners have arrived (acquire: their outputs are then visible past L1); whether they
    did. The interpreter runs the programs in grid order, the tails last, so there every arrival is already in. On a
    GPU the wait gives up after SPINS polls (seconds, where a launch takes microseconds): a miscount fails loudly, in
    the tail's outputs, rather than hanging the device."""
    count = tl.atomic_add(done_ptr, 0, sem="acquire")
    if not INTERP:
        spins = 0
        while (count < target) & (spins < SPINS):
            count = tl.atomic_add(done_ptr, 0, sem="acquire")
            spins += 1
    return count >= target


@triton.jit
def _rearm(done_ptr, tails_ptr, target, tails):
    """The last of the launch's `tails` tail programs past its wait takes the `target` arrivals off the Down counter
    and zeroes the tails' own: the counters are left as found, and one arrival too many or too few is left showing."""
    last = tl.atomic_add(tails_ptr, 1, sem="acq_rel") == tails - 1
    tl.atomic_add(done_ptr, -target, mask=last, sem="relaxed")
    tl.atomic_xchg(tails_ptr, 0, mask=last, sem="relaxed")


@triton.jit
def _row_tail(r, live, y_ptr, weights_ptr, r_ptr, yw, nw, sum_ptr, h_ptr, b_ptr, H, eps, scale, stride_r, stride_sum,
              stride_h, stride_b, K_TOP: tl.constexpr, BLOCK: tl.constexpr, Y_NORM: tl.constexpr,
              SCALED: tl.constexpr, BF16: tl.constexpr, INTERP: tl.constexpr, CG: tl.constexpr):
    """Row r's combine (rounded to the compute dtype) into `sum`, then the sandwich tail with the norm weights yw, nw
    (`rmsnorm.tail_weights`); CG: y read past L1 (other programs of the launch stored it)."""
    RDT: tl.constexpr = h_ptr.dtype.element_ty
    DT: tl.constexpr = b_ptr.dtype.element_ty
    i = tl.arange(0, BLOCK)
    m = i < H
    s = _round(tl.where(live, weighted_sum(y_ptr, weights_ptr, r, i, m, live, H, K_TOP, CG), 0.0), BF16, INTERP)
    tl.store(sum_ptr + r * stride_sum + i, s.to(sum_ptr.dtype.element_ty), mask=m)
    res = tl.load(r_ptr + r * stride_r + i, mask=m, other=0.0).to(tl.float32)
    h, b = rmsnorm.sandwich_tail(res, s, yw, nw, eps, scale, H, Y_NORM, SCALED, RDT, DT)
    tl.store(h_ptr + r * stride_h + i, h.to(RDT), mask=m)
    tl.store(b_ptr + r * stride_b + i, b.to(DT), mask=m)


@triton.jit
def _down_add_norm_kernel(
    h_ptr, d_ptr, ds_ptr, experts_ptr, live_ptr, y_ptr, weights_ptr, lock_ptr, r_ptr, yw_ptr, nw_ptr, sum_ptr,
    ho_ptr, b_ptr,
    R, H, I, ds_e, ds_r, eps, scale, stride_r, stride_sum, stride_h, stride_b,
    D_OFF0: tl.constexpr, D_OFF1: tl.constexpr, B0: tl.constexpr, B1: tl.constexpr,
    K_TOP: tl.constexpr, K_PAD: tl.constexpr, P_PAD: tl.constexpr, LIVE_COUNT: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, BLOCK_H: tl.constexpr,
    Y_NORM: tl.constexpr, SCALED: tl.constexpr,
    BF16: tl.constexpr, DOT_F32: tl.constexpr, INTERP: tl.constexpr, PDL: tl.constexpr = False,
    PREFETCH: tl.constexpr = False, LINE_ELEMS: tl.constexpr = 128, LINES: tl.constexpr = 2,
    SCALE_PRODUCT: tl.constexpr = False,
):
    """A 1-D grid: `_down_kernel`'s programs (pair p, H tile) first, p fastest as in its 2-D grid, each owner
    arriving on the launch's counter lock_ptr[0] when done; then one tail program a row, which counts the owners,
    waits for all their arrivals and runs the row's tail (`_row_tail`). The tails run side by side, one a row,
    whatever the routing: where the last Down program to finish ran them, rows sharing their experts (decode's usual
    case) had one program run every row's tail in turn. A tail waits only for programs dispatched before it (a lower
    index), as split-K fix-ups do, so the few spinning tails never hold an SM a Down program needs. `y` holds the
    compute dtype (`down_add_norm`)."""
    pid = tl.program_id(0)
    P = R * K_TOP
    downs = P * tl.cdiv(H, BLOCK_N)
    p = pid % P
    e, run = _expert_owner(experts_ptr, live_ptr, p, R, K_TOP, P_PAD, LIVE_COUNT)  # before the wait: `_early_tile`
    run = run & (pid < downs)
    _early_tile(d_ptr, e, run, pid // P, H, I, BLOCK_N, PREFETCH, LINE_ELEMS, LINES)
    wait_for_inputs(PDL)
    if pid < downs:
        _down_tiles(h_ptr, d_ptr, ds_ptr, experts_ptr, live_ptr, y_ptr, e, run, p, pid // P, R, H, I, ds_e, ds_r,
                    D_OFF0, D_OFF1, B0, B1, K_TOP, K_PAD, LIVE_COUNT, BLOCK_M, BLOCK_N, BLOCK_K, BF16, DOT_F32,
                    INTERP, SCALE_PRODUCT)
        _arrive(lock_ptr, run)
    else:
        r = pid - downs
        i = tl.arange(0, BLOCK_H)
        yw, nw = rmsnorm.tail_weights(yw_ptr, nw_ptr, i, i < H, Y_NORM)  # constants: read while the Downs run
        arrivals = _owners(experts_ptr, live_ptr, R, K_TOP, P_PAD, LIVE_COUNT, BLOCK_M) * tl.cdiv(H, BLOCK_N)
        arrived = _await_downs(lock_ptr, arrivals, INTERP)
        _rearm(lock_ptr, lock_ptr + 1, arrivals, R)
        _row_tail(r, load_live(live_ptr, r, R, LIVE_COUNT), y_ptr, weights_ptr, r_ptr, yw, nw, sum_ptr, ho_ptr,
                  b_ptr, H, eps, scale, stride_r, stride_sum, stride_h, stride_b, K_TOP, BLOCK_H, Y_NORM, SCALED,
                  BF16, INTERP, True)
        if not arrived:
            nan = tl.full([BLOCK_H], float("nan"), tl.float32)
            tl.store(ho_ptr + r * stride_h + i, nan.to(ho_ptr.dtype.element_ty), mask=i < H)
            tl.store(b_ptr + r * stride_b + i, nan.to(b_ptr.dtype.element_ty), mask=i < H)


# ---- host side -------------------------------------------------------------------------------------


def _check(cond: bool, message: str) -> None:
    if not cond:
        raise ValueError(f"moe: {message}")


def _pow2_divisor(n: int) -> int:
    """The largest power of two dividing n."""
    return n & -n


def _check_weight(name: str, w: ExpertWeights, shape: tuple[int, int, int]) -> None:
    q, s, block, offset = w
    _check(q.dtype == torch.float8_e4m3fn and tuple(q.shape) == shape and q.is_contiguous(),
           f"{name}.q must be contiguous float8_e4m3fn {shape}, got {q.dtype} {tuple(q.shape)}")
    _check(len(block) == 2 and all(isinstance(v, int) and v >= 1 for v in block),
           f"{name}.block must be two positive ints, got {block}")
    _check(len(offset) == 2 and all(0 <= o < b for o, b in zip(offset, block)),
           f"{name}.offset {offset} must lie inside the first block {block}")
    expect = (shape[0], -(-(shape[1] + offset[0]) // block[0]), -(-(shape[2] + offset[1]) // block[1]))
    _check(s.dtype == torch.float32 and tuple(s.shape) == expect and s.stride(2) == 1,
           f"{name}.scale must be fp32 {expect} with unit column stride, got {s.dtype} {tuple(s.shape)}")


def _validate_gate_up(b: torch.Tensor, experts: torch.Tensor, gate: ExpertWeights,
                      up: ExpertWeights) -> tuple[int, int, int, int, int]:
    """(R, H, k, E, I) of launch 1's arguments, or ValueError."""
    _check(b.dim() == 2 and b.dtype in (torch.bfloat16, torch.float32) and b.stride(1) == 1,
           f"b must be a bf16 or fp32 [R, H] with unit stride, got {b.dtype} {tuple(b.shape)}")
    R, H = b.shape
    _check(experts.dim() == 2 and experts.shape[0] == R and experts.dtype in (torch.int32, torch.int64),
           f"experts must be int [{R}, k], got {experts.dtype} {tuple(experts.shape)}")
    k = experts.shape[1]
    _check(1 <= R * k <= MAX_PAIRS, f"R * k = {R * k} pairs, at most {MAX_PAIRS}")
    _check(gate.q.dim() == 3, f"gate.q must be [E, I_r, H], got {tuple(gate.q.shape)}")
    E, I = gate.q.shape[:2]
    _check_weight("gate", gate, (E, I, H))
    _check_weight("up", up, (E, I, H))
    _check(up.block == gate.block, f"up's block {up.block} differs from gate's {gate.block}")
    return R, H, k, E, I


def _validate(b: torch.Tensor, experts: torch.Tensor, gate: ExpertWeights, up: ExpertWeights,
              down: ExpertWeights) -> tuple[int, int, int, int]:
    """(R, H, k, I) of a call, or ValueError."""
    R, H, k, E, I = _validate_gate_up(b, experts, gate, up)
    _check_weight("down", down, (E, H, I))
    return R, H, k, I


def fits(b: torch.Tensor, experts: torch.Tensor, gate: ExpertWeights, up: ExpertWeights,
         down: ExpertWeights) -> bool:
    """Whether `moe` takes this call (else the engine runs the torch form): E4M3 weights with fp32 scales matching
    their shapes, blocks and offsets, bf16 or fp32 b, R * k <= MAX_PAIRS. Any I_r, H, block and offset is taken
    (tiles are masked, scales are looked up by global row and column), the mini model's 12-row shards of 32-row
    blocks included."""
    try:
        _validate(b, experts, gate, up, down)
    except ValueError:
        return False
    return True


def moe(b: torch.Tensor, experts: torch.Tensor, weights: torch.Tensor, live: torch.Tensor,
        gate: ExpertWeights, up: ExpertWeights, down: ExpertWeights, *, settings: MoESettings = MoESettings(),
        out: torch.Tensor | None = None, gate_up_locks: torch.Tensor | None = None, pdl: bool = False) -> torch.Tensor:
    """This rank's routed-expert output, fp32 [R, H] (into `out` when given), for b [R, H] (bf16, or fp32: then the
    whole form is fp32), experts int [R, k] (distinct within a row; ids of live rows < E, unchecked: that would
    sync), routing weights fp32 [R, k], live bool [R] (or one int count of leading live rows). Padding rows come out
    zero; their experts' weights and their routing weights are never read. `gate_up_locks`: `gate_up`'s `locks`.
    `pdl`: programmatic dependent launch (kernels/launch.py). `expert_outputs` then `combine`."""
    if out is not None and b.dim() == 2:  # refused before any launch
        _check_out(out, *b.shape, b.device)
    outputs = expert_outputs(b, experts, weights, live, gate, up, down, settings=settings, gate_up_locks=gate_up_locks,
                             pdl=pdl)
    return combine(outputs, out=out, settings=settings, pdl=pdl)


def expert_outputs(b: torch.Tensor, experts: torch.Tensor, weights: torch.Tensor, live: torch.Tensor,
                   gate: ExpertWeights, up: ExpertWeights, down: ExpertWeights, *,
                   settings: MoESettings = MoESettings(), gate_up_locks: torch.Tensor | None = None,
                   pdl: bool = False) -> ExpertOutputs:
    """`moe`'s launches 1 and 2 (arguments as `moe`'s): each live row's chosen experts' outputs, not yet combined.
    `down(gate_up(...), ...)`, every argument checked before launch 1."""
    R, H, k, I = _validate(b, experts, gate, up, down)
    _check_weights(weights, R, k)
    devices = {t.device for t in (b, experts, weights, *gate[:2], *up[:2], *down[:2])}
    _check(len(devices) == 1, f"tensors on several devices: {devices}")
    check_live(live, R, b.device)
    _check_settings(settings)
    hidden = gate_up(b, experts, live, gate, up, settings=settings, locks=gate_up_locks, pdl=pdl)
    return _down(hidden, weights, down, settings, pdl)


def gate_up_lock_count(rows: int, k: int, inter: int, settings: MoESettings = MoESettings()) -> int:
    """Counters `gate_up(locks=...)` needs under `settings.gate_up_split` > 1: one an (owner pair, I_r tile, row
    block); none without a split."""
    if settings.gate_up_split == 1:
        return 0
    return rows * k * triton.cdiv(inter, settings.gate_up_block_n) * triton.cdiv(rows, settings.block_m)


def _k_step(block_k: int, block: tuple[int, int]) -> int:
    """A K step: `block_k` cut to the scale block's width, so that a step lies inside one block and reads one scale a
    row (`_tile_scales`), but never under tl.dot's 16 columns."""
    return min(block_k, max(16, _pow2_divisor(block[1])))


def gate_up_k(block: tuple[int, int], settings: MoESettings = MoESettings()) -> int:
    """Gate/Up's K step, from `gate_up_block_k`."""
    return _k_step(settings.gate_up_block_k, block)


def down_k(block: tuple[int, int], settings: MoESettings = MoESettings()) -> int:
    """Down's K step, from `down_block_k`."""
    return _k_step(settings.down_block_k, block)


def down_launch(dtype: torch.dtype, s: MoESettings, tail: bool = False) -> dict:
    """Down's launch: its warps and stages, and its register cap where set (`MoESettings.down_registers`), which Down
    ending in the tail (`tail`, `down_add_norm`) does not take: it needs 144 registers and spills under 128."""
    capped = s.down_registers is not None and not tail
    return dict(_streams(dtype, s), **({"maxnreg": s.down_registers} if capped else {}))


def _split_width(H: int, block: tuple[int, int], settings: MoESettings) -> int:
    """The H columns a split walks: whole K steps (the last split's are fewer, or none)."""
    step = gate_up_k(block, settings)
    return triton.cdiv(triton.cdiv(H, settings.gate_up_split), step) * step


def gate_up_columns(H: int, block: tuple[int, int], settings: MoESettings = MoESettings()) -> list[tuple[int, int]]:
    """The H columns [lo, hi) each of `settings.gate_up_split` splits walks, in order."""
    per = _split_width(H, block, settings)
    return [(lo, min(H, lo + per)) for lo in range(0, per * settings.gate_up_split, per)]


def gate_up(b: torch.Tensor, experts: torch.Tensor, live: torch.Tensor, gate: ExpertWeights, up: ExpertWeights, *,
            settings: MoESettings = MoESettings(), locks: torch.Tensor | None = None,
            pdl: bool = False) -> ExpertHidden:
    """`moe`'s launch 1 (arguments as `moe`'s): each live row's chosen experts' hidden silu(Gate b) * Up b, for
    `down` or `down_add_norm`. `locks`: with `settings.gate_up_split` > 1, zeroed int32 counters
    (`gate_up_lock_count`), left zeroed (None: made here, zeroed, for this call)."""
    R, H, k, E, I = _validate_gate_up(b, experts, gate, up)
    devices = {t.device for t in (b, experts, *gate[:2], *up[:2])}
    _check(len(devices) == 1, f"tensors on several devices: {devices}")
    dev = b.device
    count = check_live(live, R, dev)
    s = settings
    _check_settings(s)
    experts = experts.contiguous()
    live_arg = live.view(torch.uint8) if live.dtype == torch.bool else live
    hidden = torch.empty((R * k, I), dtype=torch.float32, device=dev)  # T values; fp32 spares the interpreter's cast
    h = ExpertHidden(hidden, experts, live_arg, count, b.dtype, R, k, H)
    B0, B1 = gate.block
    step = gate_up_k(gate.block, s)
    parts = hidden
    if s.gate_up_split > 1:
        n_locks = gate_up_lock_count(R, k, I, s)
        if locks is None:
            locks = torch.zeros(n_locks, dtype=torch.int32, device=dev)
        _check(isinstance(locks, torch.Tensor) and locks.dtype == torch.int32 and locks.numel() >= n_locks
               and locks.is_contiguous() and locks.device == dev,
               f"locks must be {n_locks} contiguous zeroed int32 counters on {dev}")
        parts = torch.empty((s.gate_up_split, 2, R * k, I), dtype=torch.float32, device=dev)  # each read one written
    _gate_up_kernel[_grid(R * k, triton.cdiv(I, s.gate_up_block_n), s.gate_up_split, s.pair_major)](
        b, gate.q, gate.scale, up.q, up.scale, experts, live_arg, hidden, parts, locks if locks is not None else parts,
        R, H, I, b.stride(0), gate.scale.stride(0), gate.scale.stride(1), up.scale.stride(0), up.scale.stride(1),
        _split_width(H, gate.block, s),
        G_OFF0=gate.offset[0], G_OFF1=gate.offset[1], U_OFF0=up.offset[0], U_OFF1=up.offset[1], B0=B0, B1=B1,
        **_routing(h), BLOCK_M=s.block_m, BLOCK_N=s.gate_up_block_n, BLOCK_K=step, **_math(h),
        INTERP=INTERPRETED, SCALE_PRODUCT=s.gate_up_scale == "product", SPLIT=s.gate_up_split,
        PAIR_MAJOR=s.pair_major, **_streams(h.dtype, s, s.gate_up_stages),
        **launch_options(pdl, dev))
    return h


def down(h: ExpertHidden, weights: torch.Tensor, down_w: ExpertWeights, *, settings: MoESettings = MoESettings(),
         pdl: bool = False) -> ExpertOutputs:
    """`moe`'s launch 2: the Down projection of `gate_up`'s hidden (weights: the routing weights fp32 [R, k], carried
    for the combine; down_w: Down [E, H, I_r] as `moe`'s `down`), the rows' chosen experts' outputs not yet
    combined."""
    return _down(h, weights, down_w, settings, pdl)


def _down(h: ExpertHidden, weights: torch.Tensor, down_w: ExpertWeights, settings: MoESettings,
          pdl: bool) -> ExpertOutputs:
    down_k = _check_down(h, weights, down_w, settings)
    y = torch.empty((h.rows * h.k, h.H), dtype=torch.float32, device=h.hidden.device)
    _down_kernel[_grid(*_down_grid(h, settings), 1, settings.pair_major)](
        h.hidden, down_w.q, down_w.scale, h.experts, h.live, y, h.rows, h.H, h.hidden.shape[1],
        down_w.scale.stride(0), down_w.scale.stride(1), **_down_constexprs(h, down_w, settings, down_k, pdl),
        PAIR_MAJOR=settings.pair_major, **down_launch(h.dtype, settings), **launch_options(pdl, y.device))
    return ExpertOutputs(y, weights, h.live, h.count, h.dtype)


def _grid(pairs: int, tiles: int, splits: int, pair_major: bool) -> tuple[int, int, int]:
    """Gate/Up's or Down's launch grid (`_grid_item`): (pairs, tiles, splits), or the pair on the slowest axis."""
    return (splits, tiles, pairs) if pair_major else (pairs, tiles, splits)


def _down_grid(h: ExpertHidden, s: MoESettings) -> tuple[int, int]:
    """Launch 2's grid, plain or ending in the tail: a program a pair (the owners stream) and H tile."""
    return h.rows * h.k, triton.cdiv(h.H, s.down_block_n)


def _down_constexprs(h: ExpertHidden, down_w: ExpertWeights, s: MoESettings, down_k: int, pdl: bool) -> dict:
    """Launch 2's compile-time arguments (`_down_tiles`' and `_early_tile`'s), plain or ending in the tail. The
    prefetch only with PDL: without the wait there is nothing to run ahead of."""
    line_elems, lines = prefetch_lines(h.hidden.shape[1], down_w.q.element_size())
    return dict(D_OFF0=down_w.offset[0], D_OFF1=down_w.offset[1], B0=down_w.block[0], B1=down_w.block[1],
                **_routing(h), BLOCK_M=s.block_m, BLOCK_N=s.down_block_n, BLOCK_K=down_k, **_math(h),
                INTERP=INTERPRETED, PREFETCH=s.down_prefetch and pdl, LINE_ELEMS=line_elems, LINES=lines,
                SCALE_PRODUCT=s.down_scale == "product")


def lock_count(rows: int) -> int:
    """Counters `down_add_norm(locks=...)` needs for a block of `rows` rows: the Down programs' and the tails'."""
    return 2


def down_add_norm(h: ExpertHidden, weights: torch.Tensor, down_w: ExpertWeights, residual: torch.Tensor,
                  scale: float, y_norm: torch.Tensor | None, next_norm: torch.Tensor, eps: float, dtype: torch.dtype,
                  *, locks: torch.Tensor, y: torch.Tensor | None = None, settings: MoESettings = MoESettings(),
                  pdl: bool = False) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """`combine_add_norm(down(h, weights, down_w), residual, scale, y_norm, next_norm, eps, dtype)` in one launch:
    (the combined sum rounded to the compute dtype, h, b). Down's programs store the experts' outputs into `y` ([R * k,
    H] of the compute dtype, allocated when None: the values `down` stores in fp32 are on that grid, so the tail reads
    them exactly in half the bytes and registers), each owner arriving on a counter when done (`locks`:
    `lock_count(R)` zeroed contiguous int32 counters, left zeroed), and one tail program a row waits for every
    arrival, then sums the row's slots and runs the sandwich tail on it (a padding row's sum is +0). One dependent
    launch a MoE layer less than the pair (issue 52). TP 1 (or a rank slice), as `combine_add_norm`.

    Bits: Down's outputs are `down`'s, and the combine and the tail are `combine_add_norm`'s definitions
    (`weighted_sum`, `_round`, rmsnorm's `sandwich_tail`, built without FMA contraction as it is), so under the
    interpreter the three results equal the pair's bit for bit. On the GPU a row's norms sum their squares in this
    kernel's layout (Down's warps) rather than combine_add_norm's 8 warps, so a norm's fp32 result, and with it h
    (through the branch norm, when y_norm is given) and b, may differ from the pair's in the last bits (as
    kernels/qkv_rope_kv.py's fold does); the sum is the pair's bit for bit."""
    R, H = h.rows, h.H
    dev = h.hidden.device
    down_k = _check_down(h, weights, down_w, settings)
    if y is None:
        y = torch.empty((R * h.k, H), dtype=h.dtype, device=dev)
    _check(y.dtype == h.dtype and tuple(y.shape) == (R * h.k, H) and y.is_contiguous() and y.device == dev,
           f"y must be contiguous {h.dtype} [{R * h.k}, {H}] on {dev}")
    sum_ = torch.empty((R, H), dtype=h.dtype, device=dev)
    scale = rmsnorm.check_tail("moe", residual, sum_, scale, y_norm, next_norm, eps, dtype)
    _check(locks is not None and locks.dtype == torch.int32 and locks.is_contiguous() and locks.device == dev
           and locks.numel() >= lock_count(R), f"locks must be contiguous int32 on {dev} with at least "
           f"{lock_count(R)} counters (zeroed)")
    h_out = torch.empty((R, H), dtype=residual.dtype, device=dev)
    b = torch.empty((R, H), dtype=dtype, device=dev)
    s = settings
    # The combine and the tail round every product and sum as torch does, so the build has contraction off, as
    # combine_add_norm's (rmsnorm.compile_options; here at Down's warps). Down keeps its bits under it: its products
    # are tl.dot's, whose lowering emits its multiply-adds explicitly (the bf16 MMA; fp32's FMA loop), and its other
    # arithmetic, a dequantizing multiply and roundings, has no multiply feeding an add to contract. (On sm_90a
    # `_down_kernel`'s SASS at a TP8 rank's shape is the same instruction for instruction with contraction off, bf16
    # and fp32.)
    build = rmsnorm.compile_options(rmsnorm.RmsNormSettings(num_warps=s.warps))
    pairs, tiles = _down_grid(h, s)
    _down_add_norm_kernel[(pairs * tiles + R,)](
        h.hidden, down_w.q, down_w.scale, h.experts, h.live, y, weights, locks, residual,
        next_norm if y_norm is None else y_norm, next_norm, sum_, h_out, b, R, H, h.hidden.shape[1],
        down_w.scale.stride(0), down_w.scale.stride(1), float(eps), scale, residual.stride(0), sum_.stride(0),
        h_out.stride(0), b.stride(0), **_down_constexprs(h, down_w, s, down_k, pdl), BLOCK_H=triton.next_power_of_2(H),
        Y_NORM=y_norm is not None, SCALED=scale != 1.0, **dict(down_launch(h.dtype, s, tail=True), **build),
        **launch_options(pdl, dev))
    return sum_, h_out, b


def _routing(h: ExpertHidden) -> dict:
    P = h.rows * h.k
    return dict(K_TOP=h.k, K_PAD=max(2, triton.next_power_of_2(h.k)), P_PAD=max(16, triton.next_power_of_2(P)),
                LIVE_COUNT=h.count)


def _math(h: ExpertHidden) -> dict:
    return dict(BF16=h.dtype == torch.bfloat16, DOT_F32=INTERPRETED or h.dtype == torch.float32)


def _streams(dtype: torch.dtype, s: MoESettings, stages: int | None = None) -> dict:
    # fp32 tiles are twice bf16's: three stages of them overrun a Hopper SM's 227 KB of shared memory
    return dict(num_warps=s.warps, num_stages=(stages or s.stages) if dtype == torch.bfloat16 else 1)


def _check_weights(weights: torch.Tensor, R: int, k: int) -> None:
    _check(weights.dtype == torch.float32 and tuple(weights.shape) == (R, k) and weights.is_contiguous(),
           f"weights must be contiguous fp32 [{R}, {k}]")


def _check_down(h: ExpertHidden, weights: torch.Tensor, down_w: ExpertWeights, settings: MoESettings) -> int:
    """Refuse launch 2's arguments; its K step."""
    _check(down_w.q.dim() == 3, f"down.q must be [E, H, I_r], got {tuple(down_w.q.shape)}")
    _check_weight("down", down_w, (down_w.q.shape[0], h.H, h.hidden.shape[1]))
    _check_weights(weights, h.rows, h.k)
    devices = {t.device for t in (h.hidden, weights, *down_w[:2])}
    _check(len(devices) == 1, f"tensors on several devices: {devices}")
    _check_settings(settings)
    return down_k(down_w.block, settings)


def combine(o: ExpertOutputs, *, out: torch.Tensor | None = None, settings: MoESettings = MoESettings(),
            pdl: bool = False) -> torch.Tensor:
    """`moe`'s launch 3: the rows' weighted sums over their slots, fp32 [R, H] (into `out` when given)."""
    R, H = o.rows, o.y.shape[1]
    dev = o.y.device
    if out is None:
        out = torch.empty((R, H), dtype=torch.float32, device=dev)
    _check_out(out, R, H, dev)
    _check_settings(settings)
    k = o.weights.shape[1]
    _combine_kernel[(R, triton.cdiv(H, settings.combine_block))](
        o.y, o.weights, o.live, out, R, H, out.stride(0), K_TOP=k, BLOCK=settings.combine_block, LIVE_COUNT=o.count,
        num_warps=4, enable_fp_fusion=False, **launch_options(pdl, dev))
    return out


def combine_add_norm(o: ExpertOutputs, residual: torch.Tensor, scale: float, y_norm: torch.Tensor | None,
                     next_norm: torch.Tensor, eps: float, dtype: torch.dtype, *,
                     pdl: bool = False) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(the combined sum rounded to the compute dtype, h, b) in one launch: `combine`, the cast to `o.dtype`, then
    kernels/rmsnorm.py's `add_norm(residual, sum, scale, y_norm, next_norm, eps, dtype)`, with their bits. TP 1 (or
    a rank slice): at TP > 1 the sum is reduced over ranks first (kernels/allreduce.py takes `ExpertOutputs`)."""
    R, H = o.rows, o.y.shape[1]
    sum_ = torch.empty((R, H), dtype=o.dtype, device=o.y.device)
    scale = rmsnorm.check_tail("combine_add_norm", residual, sum_, scale, y_norm, next_norm, eps, dtype)
    h = torch.empty((R, H), dtype=residual.dtype, device=residual.device)
    b = torch.empty((R, H), dtype=dtype, device=residual.device)
    if R:
        _combine_add_norm_kernel[(R,)](
            o.y, o.weights, o.live, residual, next_norm if y_norm is None else y_norm, next_norm, sum_, h, b, R, H,
            float(eps), scale, residual.stride(0), sum_.stride(0), h.stride(0), b.stride(0),
            K_TOP=o.weights.shape[1], LIVE_COUNT=o.count, BLOCK=triton.next_power_of_2(H), Y_NORM=y_norm is not None,
            SCALED=scale != 1.0, BF16=o.dtype == torch.bfloat16, INTERP=INTERPRETED,
            **rmsnorm.compile_options(rmsnorm.RmsNormSettings()), **launch_options(pdl, residual.device))
    return sum_, h, b


def _check_out(out: torch.Tensor, R: int, H: int, device: torch.device) -> None:
    _check(tuple(out.shape) == (R, H) and out.dtype == torch.float32 and out.stride(1) == 1 and out.device == device,
           f"out must be fp32 [{R}, {H}] with unit stride on {device}")


def _check_settings(s: MoESettings) -> None:
    for name in ("block_m", "gate_up_block_n", "gate_up_block_k", "down_block_n", "down_block_k", "combine_block"):
        v = getattr(s, name)
        _check(is_pow2(v, 16), f"settings.{name} must be a power of two >= 16 (a dot operand), got {v}")
    for name in ("stages", "gate_up_stages"):
        _check(1 <= getattr(s, name) <= 8, f"settings.{name} must be 1 to 8, got {getattr(s, name)}")
    _check(s.gate_up_scale in ("weight", "product"),
           f"settings.gate_up_scale must be 'weight' or 'product', got {s.gate_up_scale!r}")
    _check(isinstance(s.gate_up_split, int) and 1 <= s.gate_up_split <= 16,
           f"settings.gate_up_split must be an int from 1 to 16, got {s.gate_up_split!r}")
    _check(isinstance(s.pair_major, bool), f"settings.pair_major must be a bool, got {s.pair_major!r}")
    _check(s.down_registers is None or (isinstance(s.down_registers, int) and not isinstance(s.down_registers, bool)
                                        and 24 <= s.down_registers <= 255 and s.down_registers % 8 == 0),
           f"settings.down_registers must be None or a multiple of 8 from 24 to 255, got {s.down_registers!r}")
    _check(s.down_scale in ("weight", "product"),
           f"settings.down_scale must be 'weight' or 'product', got {s.down_scale!r}")


# ---- the torch form --------------------------------------------------------------------------------


def moe_torch(b: torch.Tensor, experts: torch.Tensor, weights: torch.Tensor, gate: ExpertWeights,
              up: ExpertWeights, down: ExpertWeights, settings: MoESettings = MoESettings()) -> torch.Tensor:
    """TorchOps.moe's arithmetic in plain torch (every row, padding rows included, as it computes them): the chosen
    experts' weights dequantized to b's dtype as Weight.select does, bf16 einsums, the weighted sum in fp32.
    The numerical forms of `settings` (MoESettings): `gate_up_scale="product"`, Gate b and Up b as fp32 sums over
    the column scale blocks of (b's block times the exact E4M3 block) times each row's scale; `gate_up_split`, each
    split's columns (`gate_up_columns`) summed in fp32 apart, the splits then added in order; either rounded once
    to b's dtype; `down_scale="product"`, Down's output as Gate/Up's product form, rounded once to b's dtype."""
    from ..reference.fp8 import expand_scales

    def codes(w: ExpertWeights) -> torch.Tensor:
        return w.q.view(torch.uint8)[experts].view(w.q.dtype).to(torch.float32)

    def select(w: ExpertWeights) -> torch.Tensor:
        q = codes(w)
        return (q * expand_scales(w.scale[experts], tuple(q.shape[-2:]), w.block, w.offset)).to(b.dtype)

    def product(w: ExpertWeights, x: torch.Tensor, lo: int, hi: int, eq: str) -> torch.Tensor:
        """fp32 [R, k, N] over the weight's columns [lo, hi): each column block's exact product of x's block and the
        E4M3 block, times each row's scale, summed over the blocks."""
        q, (b0, b1), (o0, o1) = codes(w), w.block, w.offset
        rows = (torch.arange(q.shape[-2], device=q.device) + o0) // b0
        scale = w.scale[experts][:, :, rows]  # [R, k, N, column blocks]
        total = torch.zeros(q.shape[:-1], dtype=torch.float32, device=q.device)
        for j in range((lo + o1) // b1, (hi - 1 + o1) // b1 + 1):
            c0, c1 = max(lo, j * b1 - o1), min(hi, (j + 1) * b1 - o1)
            total += torch.einsum(eq, x[..., c0:c1].float(), q[..., c0:c1]) * scale[..., j]
        return total

    def projection(w: ExpertWeights) -> torch.Tensor:  # Gate b or Up b in b's dtype
        if settings.gate_up_split == 1 and settings.gate_up_scale == "weight":
            return torch.einsum("rh,rkih->rki", b, select(w))
        dense = select(w).float() if settings.gate_up_scale == "weight" else None
        total = torch.zeros((*experts.shape, w.q.shape[1]), dtype=torch.float32, device=b.device)  # as the kernel's
        for lo, hi in gate_up_columns(b.shape[1], w.block, settings):
            if settings.gate_up_scale == "weight":
                total += torch.einsum("rh,rkih->rki", b[:, lo:hi].float(), dense[..., lo:hi])
            else:
                total += product(w, b, lo, hi, "rh,rkih->rki")
        return total.to(b.dtype)

    hidden = torch.nn.functional.silu(projection(gate)) * projection(up)
    if settings.down_scale == "weight":
        y = torch.einsum("rki,rkhi->rkh", hidden, select(down))
    else:
        y = product(down, hidden, 0, hidden.shape[-1], "rki,rkhi->rkh").to(b.dtype)
    return (y.float() * weights[..., None]).sum(dim=1)
