"""`moe(gate_up_direct=True)`: the MoE's Gate/Up at decode with each expert's weights loaded straight into the
registers of the tensor cores' operands (Triton's Gluon dialect), never staged through shared memory between warps.

Why. Gate/Up is the round's largest stream (12 experts' Gate and Up slices a layer, ~38 MB at one TP8 rank) and its
Triton kernel streams them at ~2.3 TB/s, two thirds of what a flat read of the same bytes reaches (docs/PERF.md,
`stream-probe`): each program pipelines 128 x 128 tiles through shared memory behind CTA barriers, and its programs
(two a SM at most, 96 KB in flight each) are unevenly spread. Here a program is small (16 channels of Gate and of Up,
one K split, 2 warps) and issues every one of its weight loads (24 KB at the full model) at once, as 16-byte loads,
as soon as it knows its expert.

No copy of the weights (the experts are most of the model: one in the fragments' order, as the direct linear's
`direct_weight`, would not fit). A thread loads 16 contiguous bytes of a row at a time; the move into the MMA's A
fragment order happens inside its warp (`gl.convert_layout`: a 512-byte shared-memory transpose behind warp-level
syncs only, checked in the SASS by tests/test_kernel_moe_gate_up_direct.py), on the E4M3 bytes, before their exact
conversion to fp16.

The product is taken as (W x^T)^T, as in kernels/fp8_linear_direct.py: the weight tile is the `mma.sync.m16n8k16` A
operand (16 channels) and the block's 8 rows the B operand. The same arithmetic as the Triton kernel
(kernels/moe.py, `_moe_gate_up_kernel` with f16 operands and `f16_input`): x's fp16 operand tiles as the norm made
them, the same K split (so the same partials for the finalize), each tile's product from zero over its eight K steps
in order, scaled by 2^-s_row x the weight block's scale and added to the split's sum in tile order (an FMA); two
warps split a program's tiles (tile 2j + g at step j) and their products are added in tile order as in the direct
linear. So the same bits, which the GPU tests check against the Triton kernel. GPU only (Gluon has no interpreter);
`applies` says which calls it takes.
"""

from __future__ import annotations

import torch
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.ampere import mma_v2

from .fp8_linear_direct import _add_groups, _wait_for_inputs, groups_for
from .device import sm_count
from .launch import launch_with_carveout

BLOCK_K = gl.constexpr(128)  # the K tile (one weight scale block at 128 x 128; x's operand tiles are this wide)
ROWS = gl.constexpr(8)  # the block's rows: the MMA's N (a decode block of up to 8 rows)
WARP_N = gl.constexpr(16)  # Gate's (and Up's) channels a program computes: the MMA's M
MAX_STEPS = 4  # K tiles a warp may hold, Gate's and Up's (8 KB, 64 registers a thread at 4)


def load_layout(groups: int) -> gl.DistributedLinearLayout:
    """Where each byte of a program's [groups, 16, 128] E4M3 weight tiles lives as loaded: warp g takes group g's
    tile; lane 4l + q holds bytes 16q .. 16q + 15 and 64 + 16q .. 64 + 16q + 15 of rows l and l + 8 (16-byte loads,
    a warp's first load covering 64 contiguous bytes of 8 rows)."""
    return gl.DistributedLinearLayout(
        reg_bases=[[0, 0, 1], [0, 0, 2], [0, 0, 4], [0, 0, 8], [0, 8, 0], [0, 0, 64]],
        lane_bases=[[0, 0, 16], [0, 0, 32], [0, 1, 0], [0, 2, 0], [0, 4, 0]],
        warp_bases=[[1 << i, 0, 0] for i in range(groups.bit_length() - 1)],
        block_bases=[], shape=[groups, WARP_N.value, BLOCK_K.value])


def tiles_per_split(k_per_split: int) -> int:
    """K tiles in one split of `k_per_split` columns (the Triton kernel's split, `moe.gate_up_grid`)."""
    return k_per_split // BLOCK_K.value


def applies(x16: torch.Tensor, R: int, H: int, I: int, block: tuple[int, int], k_per_split: int) -> bool:
    """Whether the direct kernel takes a Gate/Up call: on the GPU (compiled), x's fp16 operand tiles given
    (`moe(f16_input=)`), at most 8 rows, 128 x 128 weight blocks, whole 128-wide K tiles, I_r whole 16-channel groups,
    and K splits of whole tiles, at most MAX_STEPS a warp (two warps where the tiles pair up, else one)."""
    return x16.is_cuda and x16.dtype == torch.float16 and fits(R, H, I, block, k_per_split)


def fits(R: int, H: int, I: int, block: tuple[int, int], k_per_split: int) -> bool:
    """`applies`' shape rules alone."""
    tiles = tiles_per_split(k_per_split)
    return (R <= ROWS.value and tuple(block) == (128, 128) and H % BLOCK_K.value == 0
            and k_per_split % BLOCK_K.value == 0 and I % WARP_N.value == 0
            and 1 <= tiles and tiles // groups_for(tiles) <= MAX_STEPS)


@gluon.jit
def _live(live_ptr, rows, R, LIVE_COUNT: gl.constexpr):
    """kernels/moe_route.load_live in Gluon: liveness of `rows` (a mask [R], or rows < a device count)."""
    if LIVE_COUNT:
        return rows < gl.load(live_ptr).to(gl.int32)
    return gl.load(live_ptr + rows, mask=rows < R, other=0) != 0


@gluon.jit
def _products(w8, x, sg, xd, mma: gl.constexpr, sums: gl.constexpr):
    """One step's G tiles, one a warp: the loaded E4M3 bytes [G, 16, 128] moved into the A fragments inside each warp,
    converted exactly to fp16 and multiplied by x^T's fragments from zero; returned with each product's scale
    2^-s_row x the weight block's, both [16, 8, G] in `sums` (each thread holding the G groups)."""
    w = gl.convert_layout(w8, gl.DotOperandLayout(operand_index=0, parent=mma, k_width=4)).to(gl.float16)
    p = mma_v2(w, x, gl.zeros([w8.shape[0], w8.shape[1], x.shape[2]], gl.float32, layout=mma))
    p = gl.convert_layout(p.permute(1, 2, 0), sums)
    s = xd[None, :, :] * sg[:, None, :]  # exact: a power of two times the block scale, as the Triton kernel's
    p, s = gl.broadcast(p, s)
    return p, s


@gluon.jit
def _owners(experts_ptr, live_ptr, R, P, K_TOP: gl.constexpr, P_PAD: gl.constexpr, LIVE_COUNT: gl.constexpr,
            DEDUP: gl.constexpr, sq: gl.constexpr):
    """The block's distinct live experts, as kernels/moe._expert_owner assigns them: pair q owns its expert when its
    row is live and (DEDUP) no earlier live pair chose it. Returns (pairs q, their experts, owns, owners before q),
    [P_PAD] each (in SliceLayout(1, sq)), and the number of owners."""
    q = gl.arange(0, P_PAD, layout=gl.SliceLayout(1, sq))
    c = gl.arange(0, P_PAD, layout=gl.SliceLayout(0, sq))
    eq = gl.load(experts_ptr + q, mask=q < P, other=-1)
    own = _live(live_ptr, q // K_TOP, R, LIVE_COUNT) & (q < P)
    earlier = c[None, :] < q[:, None]
    if DEDUP:
        ec = gl.load(experts_ptr + c, mask=c < P, other=-1)
        lc = _live(live_ptr, c // K_TOP, R, LIVE_COUNT) & (c < P)
        own = own & (gl.sum((earlier & (ec[None, :] == eq[:, None]) & lc[None, :]).to(gl.int32), axis=1) == 0)
    rank = gl.sum((earlier & gl.convert_layout(own, gl.SliceLayout(0, sq))[None, :]).to(gl.int32), axis=1)
    return q, eq, own, rank, gl.sum(own.to(gl.int32), axis=0)


@gluon.jit
def _moe_gate_up_direct_kernel(
    x_ptr, xd_ptr, g_ptr, gs_ptr, u_ptr, us_ptr, experts_ptr, live_ptr, part_ptr, ran_ptr,
    R, H, I, P, stride_x, stride_xd, s_rows, s_cols, k_per_split, splits,
    K_TOP: gl.constexpr, K_PAD: gl.constexpr, P_PAD: gl.constexpr, LIVE_COUNT: gl.constexpr, DEDUP: gl.constexpr,
    B0: gl.constexpr, B1: gl.constexpr, G: gl.constexpr, W_LOAD: gl.constexpr, TILES: gl.constexpr,
    STORE_RAN: gl.constexpr, PDL: gl.constexpr = False,
    REVERSED: gl.constexpr = False,  # True: negative control only (tests): each split's tiles summed last to first
):
    # A fixed grid (programs resident at once) working through the items (distinct expert d, 16 channels, K split),
    # d fastest: no program is spent on a pair whose expert another pair owns.
    STEPS: gl.constexpr = TILES // G
    mma: gl.constexpr = gl.NVMMADistributedLayout(version=[2, 0], warps_per_cta=[G, 1, 1], instr_shape=[1, 16, 8])
    x_op: gl.constexpr = gl.DotOperandLayout(operand_index=1, parent=mma, k_width=4)
    sums: gl.constexpr = gl.BlockedLayout(size_per_thread=[1, 1, G], threads_per_warp=[8, 4, 1],
                                          warps_per_cta=[G, 1, 1], order=[2, 1, 0])
    acc_l: gl.constexpr = gl.SliceLayout(2, sums)
    sq: gl.constexpr = gl.BlockedLayout(size_per_thread=[1, 4], threads_per_warp=[4, 8], warps_per_cta=[G, 1],
                                        order=[1, 0])
    route: gl.constexpr = gl.BlockedLayout(size_per_thread=[1, 1], threads_per_warp=[4, 8], warps_per_cta=[G, 1],
                                           order=[1, 0])
    _wait_for_inputs(PDL)

    # The routing, one L2 round trip: every pair's expert and liveness, and the block's [rows, k] matrix
    rr = gl.arange(0, ROWS, layout=gl.SliceLayout(1, route))
    jj = gl.arange(0, K_PAD, layout=gl.SliceLayout(0, route))
    chosen = gl.load(experts_ptr + rr[:, None] * K_TOP + jj[None, :], mask=(rr < R)[:, None] & (jj < K_TOP)[None, :],
                     other=-1)
    row_live = _live(live_ptr, rr, R, LIVE_COUNT)
    q, eq, own, rank, owners = _owners(experts_ptr, live_ptr, R, P, K_TOP, P_PAD, LIVE_COUNT, DEDUP, sq)
    if STORE_RAN:  # debug: which pairs' experts were streamed (by whichever programs)
        gl.store(ran_ptr + q, own.to(gl.int32), mask=(q < P) & (gl.program_id(0) == 0))

    channel_groups = I // WARP_N
    gw = gl.arange(0, G, layout=gl.SliceLayout(1, gl.SliceLayout(2, W_LOAD)))
    nw = gl.arange(0, WARP_N, layout=gl.SliceLayout(0, gl.SliceLayout(2, W_LOAD)))
    cw = gl.arange(0, BLOCK_K, layout=gl.SliceLayout(0, gl.SliceLayout(1, W_LOAD)))
    gs_ = gl.arange(0, G, layout=gl.SliceLayout(0, gl.SliceLayout(1, sums)))
    ns = gl.arange(0, WARP_N, layout=gl.SliceLayout(1, gl.SliceLayout(1, sums)))
    x_ld: gl.constexpr = gl.BlockedLayout(size_per_thread=[1, 8, 1], threads_per_warp=[1, 4, 8],
                                          warps_per_cta=[G, 1, 1], order=[1, 2, 0])
    gx = gl.arange(0, G, layout=gl.SliceLayout(1, gl.SliceLayout(2, x_ld)))
    kx = gl.arange(0, BLOCK_K, layout=gl.SliceLayout(0, gl.SliceLayout(2, x_ld)))
    mx = gl.arange(0, ROWS, layout=gl.SliceLayout(0, gl.SliceLayout(1, x_ld)))
    md = gl.arange(0, ROWS, layout=gl.SliceLayout(1, gl.SliceLayout(0, sums)))
    gd = gl.arange(0, G, layout=gl.SliceLayout(0, gl.SliceLayout(0, sums)))
    for item in range(gl.program_id(0), owners * channel_groups * splits, gl.num_programs(0)):
        d = item % owners
        tile = (item // owners) % channel_groups
        split = item // (owners * channel_groups)
        e = gl.sum(gl.where(own & (rank == d), eq, 0), axis=0)
        k_start = split * k_per_split
        ex = e.to(gl.int64)
        # Gate's and Up's tiles (tile t = j * G + g at step j), their block scales, x^T's operand tiles (fp16, 16-byte
        # loads) and their 2^-s: all issued at once. Rows that did not choose e are multiplied and never stored.
        n0 = tile * WARP_N
        w_off = k_start + gw[:, None, None] * BLOCK_K + (n0 + nw)[None, :, None] * H + cw[None, None, :]
        s_off = ((n0 + ns) // B0)[:, None] * s_cols + ((k_start + gs_ * BLOCK_K) // B1)[None, :]
        g_e = g_ptr + ex * I * H
        u_e = u_ptr + ex * I * H
        gs_e = gs_ptr + ex * s_rows * s_cols
        us_e = us_ptr + ex * s_rows * s_cols
        x_off = mx[None, None, :] * stride_x + k_start + (gx * BLOCK_K)[:, None, None] + kx[None, :, None]
        d_off = md[:, None] * stride_xd + k_start // BLOCK_K + gd[None, :]
        wg = ()
        wu = ()
        for j in gl.static_range(STEPS):
            wg = wg + (gl.load(g_e + w_off + j * G * BLOCK_K),)
            wu = wu + (gl.load(u_e + w_off + j * G * BLOCK_K),)
        sg = ()
        su = ()
        xs = ()
        xds = ()
        for j in gl.static_range(STEPS):
            sg = sg + (gl.load(gs_e + s_off + (j * G * BLOCK_K) // B1),)
            su = su + (gl.load(us_e + s_off + (j * G * BLOCK_K) // B1),)
            xs = xs + (gl.load(x_ptr + x_off + j * G * BLOCK_K, mask=(mx < R)[None, None, :], other=0.0),)
            xds = xds + (gl.load(xd_ptr + d_off + j * G, mask=(md < R)[:, None], other=1.0),)

        # The rows that chose e (a row's experts are distinct: at most one slot matches) and their pairs
        hit = chosen == e
        m_ok = (gl.sum(hit.to(gl.int32), axis=1) > 0) & row_live
        pair = rr * K_TOP + gl.sum(gl.where(hit, jj[None, :], 0), axis=1)

        pg = ()
        pu = ()
        for j in gl.static_range(STEPS):
            xj = gl.convert_layout(xs[j], x_op)
            pg = pg + (_products(wg[j], xj, sg[j], xds[j], mma, sums),)
            pu = pu + (_products(wu[j], xj, su[j], xds[j], mma, sums),)
        acc_g = gl.zeros([WARP_N, ROWS], gl.float32, layout=acc_l)
        acc_u = gl.zeros([WARP_N, ROWS], gl.float32, layout=acc_l)
        for i in gl.static_range(STEPS):
            if REVERSED:
                acc_g = _add_groups(acc_g, pg[STEPS - 1 - i][0], pg[STEPS - 1 - i][1], G, True, acc_l)
                acc_u = _add_groups(acc_u, pu[STEPS - 1 - i][0], pu[STEPS - 1 - i][1], G, True, acc_l)
            else:
                acc_g = _add_groups(acc_g, pg[i][0], pg[i][1], G, False, acc_l)
                acc_u = _add_groups(acc_u, pu[i][0], pu[i][1], G, False, acc_l)

        n = n0 + gl.arange(0, WARP_N, layout=gl.SliceLayout(1, acc_l))
        pair = gl.convert_layout(pair, gl.SliceLayout(0, acc_l))
        m_ok = gl.convert_layout(m_ok, gl.SliceLayout(0, acc_l))
        dst = part_ptr + ((split * P + pair) * 2)[None, :] * I + n[:, None]
        mask = m_ok[None, :] & (n < I)[:, None]
        gl.store(dst, acc_g, mask=mask)
        gl.store(dst + I, acc_u, mask=mask)


# The kernel's preferred shared-memory carveout (percent of an SM's most): 0, the least shared memory (1 KB a program)
# and the most L1, as the direct linear's (kernels/fp8_linear_direct.CARVEOUT), whose o_proj slowed a kernel two
# launches later under the driver's choice. Measured against the driver's choice in docs/PERF.md.
CARVEOUT = 0


def launch(x16, xd, gate, gate_scale, up, up_scale, experts, live_arg, part, ran, R, H, I, P, k_per_split, split,
           block, routing: dict, store_ran: bool, launch_kw: dict, segments: int, reversed_tiles: bool = False,
           carveout: int = CARVEOUT, per_sm: int | None = None) -> None:
    """The kernel's launch for `moe(gate_up_direct=True)`, which checks the arguments and that `applies`: by default
    one program an item for `segments` distinct experts (moe.expected_segments; the hardware then schedules the
    items as programs finish, and a block with more experts loops), else `per_sm` programs a SM working through
    the items (distinct expert, 16 channels, K split); `carveout` as `launch.launch_with_carveout` takes it (-1: the
    driver's)."""
    tiles = tiles_per_split(k_per_split)
    g = groups_for(tiles)
    args = (x16, xd, gate, gate_scale, up, up_scale, experts, live_arg, part, ran, R, H, I, P, x16.stride(0),
            xd.stride(0), gate_scale.shape[1], gate_scale.shape[2], k_per_split, split)
    kw = dict(**routing, B0=block[0], B1=block[1], G=g, W_LOAD=load_layout(g), TILES=tiles, STORE_RAN=store_ran,
              REVERSED=reversed_tiles, num_warps=g, **launch_kw)
    programs = segments * (I // WARP_N.value) * split if per_sm is None else per_sm * sm_count(x16.device)
    launch_with_carveout(_moe_gate_up_direct_kernel, (programs,), args, kw, carveout)
