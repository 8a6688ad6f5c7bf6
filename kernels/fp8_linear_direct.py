"""`fp8_linear(direct=...)`: the FP8 linear's preloading form for decode rows (M <= 8 a row block) with its operands
loaded straight into the tensor cores' registers (Triton's Gluon dialect): no shared memory, no barriers.

Why. In the Triton kernel (kernels/fp8_linear.py) every K tile's weights and x rows go from their load layout through
shared memory into the MMA's operand layout behind barriers, one tile after another: in the captured round each of a
program's six tiles costs ~0.5 us in series after the PDL wait (docs/PERF.md, `graph-trace --stamps`). Triton's
frontend does not let a kernel choose its layouts; Gluon does.

The product is taken as (W x^T)^T: the weight is the `mma.sync.m16n8k16` A operand (16 output columns a warp) and
x^T the B operand, whose 8 columns are the block's rows, so no MMA row is padding. A thread's A fragment of a 128-wide
K tile is 32 bytes of each of two weight rows, at K offsets 16s + 8h + 2q + e (s the K step, q its lane's quarter);
`direct_weight` stores each tile's columns in that order, k' = 32q + 4s + 2h + e, once, when the engine is built, so
a thread loads them with two 16-byte loads a row. Loaded as [n, q, 32] and relabelled by a reshape and a permute,
they are the fragments in W's own K order, so the MMAs take W's and x's values at the same K as the Triton kernel's.

The same arithmetic as the Triton kernel's preloading path: each tile's product from zero over its eight K steps in
order, scaled by its block scale and added to the sum in tile order; the rows' 1 / rms reduced in the layout Triton
gives it there; the split-K partials, their in-launch sum and the stores as there. Whether the tensor cores give the
same bits with the operands exchanged is the GPU test's to show (tests/test_kernel_fp8_linear_direct.py). GPU only
(Gluon has no interpreter); bf16 or fp16 x; 128-wide K tiles, whole preloaded splits: `fp8_linear` checks that.
"""

from __future__ import annotations

import torch
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.ampere import mma_v2

BLOCK_K = gl.constexpr(128)  # the K tile the fragment order is laid out for (a weight scale block at 128 x 128)
ROWS = gl.constexpr(8)  # x rows a program takes: the MMA's N
WARP_N = gl.constexpr(16)  # output columns a warp computes: the MMA's M


def direct_weight(w: torch.Tensor) -> torch.Tensor:
    """W [N, K] E4M3 with each 128-wide K tile's columns in the MMA fragments' order (see the module): column
    k' = 32q + 4s + 2h + e of a tile holds W's column 16s + 8h + 2q + e. A copy, made once; K % 128 == 0."""
    if w.dim() != 2 or w.shape[1] % BLOCK_K.value:
        raise ValueError(f"direct_weight: W must be [N, K] with K a multiple of {BLOCK_K.value}, got {tuple(w.shape)}")
    n, k = w.shape
    # W's tile columns as (s, h, q, e), row-major; the direct order is (q, s, h, e)
    t = w.view(torch.uint8).reshape(n, k // BLOCK_K.value, 8, 2, 4, 2)
    return t.permute(0, 1, 4, 2, 3, 5).reshape(n, k).contiguous().view(w.dtype)


def load_layout(warps: int) -> gl.DistributedLinearLayout:
    """Where each byte of a program's [WARP_N * warps, 4, 32] slab of a direct-ordered weight tile lives: a thread
    (lane 4g + q) holds the 32 contiguous bytes (q's quarter) of rows g and g + 8 of its warp's 16."""
    return gl.DistributedLinearLayout(
        reg_bases=[[0, 0, 1], [0, 0, 2], [0, 0, 4], [0, 0, 8], [0, 0, 16], [8, 0, 0]],
        lane_bases=[[0, 1, 0], [0, 2, 0], [1, 0, 0], [2, 0, 0], [4, 0, 0]],
        warp_bases=[[WARP_N.value << i, 0, 0] for i in range(warps.bit_length() - 1)],
        block_bases=[], shape=[WARP_N.value * warps, 4, 32])


@gluon.jit
def _wait_for_inputs(PDL: gl.constexpr):
    """kernels/launch.wait_for_inputs in Gluon: the same two PTX instructions in the same order per `Pdl`."""
    if PDL == 2:  # Pdl.CASCADE
        gl.inline_asm_elementwise("griddepcontrol.launch_dependents; // $0", "=r", [], dtype=gl.int32,
                                  is_pure=False, pack=1)
        gl.inline_asm_elementwise("griddepcontrol.wait; // $0", "=r", [], dtype=gl.int32, is_pure=False, pack=1)
    elif PDL:
        gl.inline_asm_elementwise("griddepcontrol.wait; // $0", "=r", [], dtype=gl.int32, is_pure=False, pack=1)
        gl.inline_asm_elementwise("griddepcontrol.launch_dependents; // $0", "=r", [], dtype=gl.int32,
                                  is_pure=False, pack=1)


@gluon.jit
def _tile_product(acc, w, x, s, w_op: gl.constexpr, mma: gl.constexpr):
    """acc + (W_tile x_tile^T) * s: w the tile's loaded [n, 4, 32] slab, relabelled into W's K order (no data moves),
    converted exactly to x's dtype; the product from zero over its K steps, scaled by the tile's block scale per
    output column."""
    n: gl.constexpr = w.shape[0]
    w = w.reshape(n, 4, 8, 2, 2).permute(0, 2, 3, 1, 4).reshape(n, 4 * 32)
    w = gl.convert_layout(w.to(x.dtype), w_op)
    return acc + mma_v2(w, x, gl.zeros(acc.shape, gl.float32, layout=mma)) * s[:, None]


@gluon.jit
def _fp8_linear_direct_kernel(
    x_ptr, w_ptr, s_ptr, y_ptr, part_ptr, lock_ptr,
    M, N, K, stride_xm, stride_ym, scale_cols, k_per_split, splits,
    B0: gl.constexpr, B1: gl.constexpr, WARPS: gl.constexpr, W_LOAD: gl.constexpr,
    SPLIT: gl.constexpr, SERIAL: gl.constexpr, PRELOAD: gl.constexpr, PDL: gl.constexpr = False,
    sumsq_ptr=None, stride_sumsq=0, norm_tiles=0, eps=0.0, NORM: gl.constexpr = 0,
    REVERSED: gl.constexpr = False,  # True: negative control only (tests): the tiles summed last to first
):
    BLOCK_N: gl.constexpr = WARP_N * WARPS
    TILE_K: gl.constexpr = BLOCK_K
    mma: gl.constexpr = gl.NVMMADistributedLayout(version=[2, 0], warps_per_cta=[WARPS, 1], instr_shape=[16, 8])
    w_op: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=mma, k_width=2)
    x_op: gl.constexpr = gl.DotOperandLayout(operand_index=1, parent=mma, k_width=2)
    cols: gl.constexpr = gl.SliceLayout(1, mma)  # output columns n: the product's rows
    rows: gl.constexpr = gl.SliceLayout(0, mma)  # x's rows m: the product's columns
    pid_n = gl.program_id(0)
    pid_k = gl.program_id(1)
    pid_m = gl.program_id(2)
    k_start = pid_k * k_per_split

    nw = pid_n * BLOCK_N + gl.arange(0, BLOCK_N, layout=gl.SliceLayout(1, gl.SliceLayout(2, W_LOAD)))
    qw = gl.arange(0, 4, layout=gl.SliceLayout(0, gl.SliceLayout(2, W_LOAD)))
    cw = gl.arange(0, 32, layout=gl.SliceLayout(0, gl.SliceLayout(1, W_LOAD)))
    w_off = gl.minimum(nw, N - 1)[:, None, None] * K + qw[None, :, None] * 32 + cw[None, None, :]
    n = pid_n * BLOCK_N + gl.arange(0, BLOCK_N, layout=cols)
    n_ok = n < N
    ws = ()
    ss = ()
    for t in gl.static_range(PRELOAD):  # the constant weight and its scales, before the wait
        k0 = k_start + t * TILE_K
        ws = ws + (gl.load(w_ptr + k0 + w_off),)  # rows past N read row N - 1: their columns are never stored
        ss = ss + (gl.load(s_ptr + (n // B0) * scale_cols + k0 // B1, mask=n_ok, other=0.0),)
    _wait_for_inputs(PDL)

    kx = gl.arange(0, TILE_K, layout=gl.SliceLayout(1, x_op))
    mx = pid_m * ROWS + gl.arange(0, ROWS, layout=gl.SliceLayout(0, x_op))
    xs = ()
    for u in gl.static_range(PRELOAD):  # x^T's fragments: every tile's load issued before the first product
        k0 = k_start + u * TILE_K
        xs = xs + (gl.load(x_ptr + mx[None, :] * stride_xm + (k0 + kx)[:, None], mask=(mx < M)[None, :],
                           other=0.0),)
    acc = gl.zeros([BLOCK_N, ROWS], gl.float32, layout=mma)
    for i in gl.static_range(PRELOAD):
        if REVERSED:
            acc = _tile_product(acc, ws[PRELOAD - 1 - i], xs[PRELOAD - 1 - i], ss[PRELOAD - 1 - i], w_op, mma)
        else:
            acc = _tile_product(acc, ws[i], xs[i], ss[i], w_op, mma)

    m = pid_m * ROWS + gl.arange(0, ROWS, layout=rows)
    m_ok = m < M
    if NORM > 0:
        # The rows' 1 / rms as kernels/fp8_linear._inv_rms computes it, reduced in the layout Triton gives it there
        # (sizePerThread [1, 4], threadsPerWarp [4, 8] over the sums): the same tree, so the same sums.
        red: gl.constexpr = gl.BlockedLayout(size_per_thread=[1, 4], threads_per_warp=[4, 8],
                                             warps_per_cta=[WARPS, 1], order=[1, 0])
        mr = pid_m * ROWS + gl.arange(0, ROWS, layout=gl.SliceLayout(1, red))
        tr = gl.arange(0, NORM, layout=gl.SliceLayout(0, red))
        part = gl.load(sumsq_ptr + mr[:, None] * stride_sumsq + tr[None, :],
                       mask=(mr < M)[:, None] & (tr < norm_tiles)[None, :], other=0.0)
        inv = 1.0 / gl.sqrt(gl.sum(part, axis=1) / K + eps)
        acc = acc * gl.convert_layout(inv, rows)[None, :]
    mask = n_ok[:, None] & m_ok[None, :]
    if SPLIT:
        gl.store(part_ptr + (pid_k * M + m[None, :]) * N + n[:, None], acc, mask=mask)
        if SERIAL:  # the tile's last split to arrive sums the partials in split order (fp8_linear's SERIAL)
            gl.thread_barrier()  # every thread's partial stored before the release below
            lock = lock_ptr + pid_m * gl.num_programs(0) + pid_n
            if gl.atomic_add(lock, 1, sem="acq_rel") == splits - 1:
                total = gl.zeros([BLOCK_N, ROWS], gl.float32, layout=mma)
                for sk in range(0, splits):
                    total += gl.load(part_ptr + (sk * M + m[None, :]) * N + n[:, None], mask=mask, other=0.0,
                                     cache_modifier=".cg")
                gl.store(y_ptr + m[None, :] * stride_ym + n[:, None], total.to(y_ptr.dtype.element_ty), mask=mask)
                gl.atomic_xchg(lock, 0)
    else:
        gl.store(y_ptr + m[None, :] * stride_ym + n[:, None], acc.to(y_ptr.dtype.element_ty), mask=mask)


def launch(grid, x, direct, scale, out, part, locks, M, N, K, stride_x, stride_y, scale_cols, k_per_split, splits,
           block, warps, split, serial, tiles, norm_args, launch_kw, reversed_tiles=False) -> None:
    """The kernel's launch for `fp8_linear(direct=...)`, which checks the arguments."""
    _fp8_linear_direct_kernel[grid](
        x, direct, scale, out, part, locks, M, N, K, stride_x, stride_y, scale_cols, k_per_split, splits,
        B0=block[0], B1=block[1], WARPS=warps, W_LOAD=load_layout(warps), SPLIT=split, SERIAL=serial, PRELOAD=tiles,
        REVERSED=reversed_tiles, **norm_args, num_warps=warps, **launch_kw)
